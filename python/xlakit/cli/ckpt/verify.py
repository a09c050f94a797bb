"""`xlakit ckpt verify`: every checksum of a checkpoint, streamed with a progress bar; a manager's every step."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from xlakit.cli.ckpt.common import OK, DIFFERENT, NOTHING, size, emit, about, url_kind
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError


class _Bar:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, done: int, total: int, label: str) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  [{bar:<30}] {frac:4.0%} {size(done)} / {size(total)}  {label[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r" + " " * 110 + "\r")
        sys.stderr.flush()


def cmd_verify(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import objstore
    from xlakit.checkpoint.inspect import describe, integrity

    if objstore.is_url(args.path):
        return _verify_url(args)
    path = Path(args.path)
    try:
        with about(path):
            kind = describe.kind_of(path)
            if kind.kind == describe.FOLDER and not kind.unfinished:
                raise CheckpointFormatError(f"{path} is not a checkpoint: {kind.note}")
            kind, ranges = integrity.plan(path)
            if not ranges:
                return _nothing_committed(args, path)
            checked = _check_with_progress(ranges)
    except integrity.NothingToVerify as e:
        emit(args, {"path": str(path), "status": "no-checksums", "message": str(e)}, [str(e)])
        return NOTHING
    except CheckpointCorruptError as e:
        emit(args, {"path": str(path), "status": "damaged", "tensor": getattr(e, "tensor", None),
                     "message": str(e)}, [f"DAMAGED: {e}"])
        return DIFFERENT
    emit(args, {"path": str(path), "kind": kind.kind, "status": "ok", "checksums": len(ranges), "bytes": checked},
          [f"OK: {path} ({kind.kind}): {len(ranges)} checksum(s) over {size(checked)} match"])
    return OK


def _verify_url(args: argparse.Namespace) -> int:
    """A checkpoint on object storage: every object of its newest committed generation read whole and
    verified (a file's and each shard's records as `xlakit.load` reads them; DCP files against the
    commit record); a step's checkpoint; every committed step of a manager URL."""
    from xlakit.checkpoint.inspect import bucket_describe
    from xlakit.checkpoint.multirank import bucket_replicas
    from xlakit.checkpoint.stepstore import step_folders
    from xlakit.checkpoint.core.options import LoadOptions

    try:
        found = bucket_describe.kind_of(args.path)
        if found.kind == bucket_describe.MANAGER:
            return _verify_manager_url(args, step_folders.folder_at(args.path).scan())
        kind, checked = bucket_replicas.verify(found.url, LoadOptions())
    except CheckpointCorruptError as e:
        emit(args, {"path": args.path, "status": "damaged", "tensor": getattr(e, "tensor", None),
                     "message": str(e)}, [f"DAMAGED: {e}"])
        return DIFFERENT
    emit(args, {"path": found.url, "kind": url_kind(kind), "status": "ok", "bytes": checked},
          [f"OK: {found.url} ({url_kind(kind)} on object storage): every checksum over {size(checked)} "
           f"matches"])
    return OK


def _verify_manager_url(args: argparse.Namespace, found) -> int:
    """A manager URL: every committed step's checkpoint verified; a damaged step record is a finding,
    and a URL with no committed step has nothing to verify (never "OK")."""
    from xlakit.checkpoint.stepstore import steps
    from xlakit.checkpoint.core.options import LoadOptions
    from xlakit.checkpoint.multirank import bucket_replicas

    url = args.path.rstrip("/")
    if found.damaged:
        step, why = min(found.damaged.items())
        message = f"step {step} of {url} is not a step: its {steps.STEP_RECORD} is damaged ({why})"
        emit(args, {"path": url, "status": "damaged", "step": step, "message": message}, [f"DAMAGED: {message}"])
        return DIFFERENT
    if not found.committed:
        message = (f"{url} holds no committed step, so there is nothing to verify"
                   + (f"; step(s) {', '.join(map(str, sorted(found.pending)))} never committed (interrupted "
                      f"saves)" if found.pending else "") + f". `xlakit ckpt ls {url}` lists what it holds.")
        emit(args, {"path": url, "status": "no-committed-step", "interrupted": sorted(found.pending),
                     "message": message}, [message])
        return NOTHING
    total = 0
    for step, chosen in sorted(found.committed.items()):
        try:
            _, checked = bucket_replicas.verify(str(chosen.checkpoint), LoadOptions())
        except CheckpointCorruptError as e:
            emit(args, {"path": url, "status": "damaged", "step": step, "tensor": getattr(e, "tensor", None),
                         "message": str(e)}, [f"DAMAGED: step {step}: {e}"])
            return DIFFERENT
        total += checked
    emit(args, {"path": url, "kind": "manager", "status": "ok", "steps": sorted(found.committed), "bytes": total},
          [f"OK: {url} (manager on object storage): {len(found.committed)} committed step(s), every checksum "
           f"over {size(total)} matches"])
    return OK


def _check_with_progress(ranges: list) -> int:
    from xlakit.checkpoint.inspect import integrity

    bar = _Bar() if sys.stderr.isatty() else None
    try:
        return integrity.check(ranges, bar)
    finally:
        if bar is not None:
            bar.close()


def _nothing_committed(args: argparse.Namespace, path: Path) -> int:
    """A manager folder without a committed step: nothing was verified, so never "OK"."""
    from xlakit.checkpoint.stepstore import steps

    pending = sorted(steps.scan(path).pending)
    message = (f"{path} holds no committed step, so there is nothing to verify"
               + (f"; step(s) {', '.join(map(str, pending))} never committed (interrupted saves)" if pending else "")
               + f". `xlakit ckpt ls {path}` lists them.")
    emit(args, {"path": str(path), "status": "no-committed-step", "interrupted": pending, "message": message},
          [message])
    return NOTHING
