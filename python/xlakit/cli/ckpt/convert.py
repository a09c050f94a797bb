"""`xlakit ckpt convert`: a checkpoint of any kind written as one safetensors or xlakit file (or bucket checkpoint)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


from xlakit.cli.ckpt.common import OK, size, emit, about, read_state
from xlakit.errors import CheckpointSerializationError


def cmd_convert(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import objstore

    if objstore.is_url(args.out):
        _check_url_target(args)
    else:
        out = Path(args.out)
        if os.path.lexists(out) and not args.force:  # a dangling link too: exists() follows it
            raise FileExistsError(17, f"{out} exists; pass --force to replace it", str(out))
    with about(args.path):
        state, kind = read_state(args.path, with_kind=True)
    with about(args.out):
        result = _write(state, args.out, args.to)
    emit(args, {"source": args.path, "source_kind": kind, "to": args.to, "out": str(args.out), **result},
          [f"wrote {args.out} ({args.to}): {result['tensors']} tensor(s), {size(result['bytes'])}"])
    return OK


def _check_url_target(args: argparse.Namespace) -> None:
    """`convert --to xlakit gs://...`: a new checkpoint in the bucket (replacing one only with --force)."""
    from xlakit.checkpoint.inspect import bucket_describe

    if args.to != "xlakit":
        raise ValueError(f"{args.out}: convert writes {args.to} to a local file; to a bucket it writes an xlakit "
                         f"checkpoint (--to xlakit), which loads and verifies there")
    bucket_describe.check_target(args.out, args.force)


def _write(state: Any, out: str, to: str) -> dict:
    from xlakit.checkpoint import objstore
    from xlakit.checkpoint.inspect import describe, tensors

    if to == "safetensors":
        return tensors.write_safetensors(state, Path(out))  # refuses a state whose names collide
    from xlakit import checkpoint

    try:
        checkpoint.save(state, out)  # keeps the state's structure: names cannot collide here
    except CheckpointSerializationError as e:  # a value read through --allow-global
        e.add_note("An xlakit file holds only those, so that it loads weights-only without --allow-global; "
                   "`--to safetensors` keeps such a value as text in its metadata, or turn it into a tensor "
                   "in Python (torch.from_numpy) and xlakit.save that.")
        raise
    if objstore.is_url(out):
        from xlakit.checkpoint.inspect import bucket_describe

        nbytes = sum(e["nbytes"] for e in bucket_describe.kind_of(out).record["objects"].values())
    else:
        nbytes = Path(out).stat().st_size
    return {"tensors": describe.tensor_count(state), "bytes": nbytes}
