"""Loading one checkpoint file: verify every checksum, then read it weights-only.

Nothing here runs pickled code: the structure is read with torch's
weights-only unpickler. Verification checks the pickle and every storage
against the index (`archive.read_index`), naming the tensor whose bytes
differ, before anything is returned.
"""

from __future__ import annotations

import mmap
import pickle
from pathlib import Path
from typing import Any

import torch

from xlakit.checkpoint import archive
from xlakit.checkpoint.operation import Operation, Watch
from xlakit.checkpoint.options import LoadOptions
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError

NOTHING_CHANGED = "nothing on disk was changed"


def load_file(final: Path, opts: LoadOptions) -> Any:
    """Load and verify one checkpoint file in this process."""
    if not final.is_file():
        raise FileNotFoundError(2, f"no checkpoint at {final}", str(final))
    op = Operation("load", final, Watch.of(opts), bytes_total=final.stat().st_size,
                   untouched=NOTHING_CHANGED)
    return op.run(lambda op: read_file(op, final, opts))


def read_file(op: Operation, path: Path, opts: LoadOptions) -> Any:
    """Verify (if asked) and read `path` as part of `op`."""
    if opts.verify:
        op.enter("verify")
        verify_file(path, op)
    op.enter("read")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=opts.mmap)
    except pickle.UnpicklingError as e:
        err = CheckpointFormatError(f"{path} holds pickled objects that a weights-only load refuses "
                                    f"to run: {str(e).splitlines()[0]}")
        err.add_note("xlakit.load never executes pickled code. If you trust the file, load it with "
                     "torch.load(path, weights_only=False).")
        raise err from e
    except (RuntimeError, ValueError, KeyError, EOFError) as e:
        # The checked records were intact; damage elsewhere (names, headers) surfaces here.
        raise CheckpointCorruptError(f"{path}: the archive is damaged outside the checksummed "
                                     f"records and torch.load failed: {type(e).__name__}: {e}") from e


def verify_file(path: Path, op: Operation | None = None) -> dict:
    """Check the pickle and every storage of `path` against its index; the index."""
    meta, reader = archive.read_index(str(path))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        pk = meta["pickle"]
        # Offsets from the zip itself, the ones torch.load will read.
        offset = archive.record_offset(reader, "data.pkl", str(path), "the pickle", None)
        archive.check_digest(mapped, offset, pk["nbytes"], pk[archive.HASH],
                             "the pickled structure (data.pkl)", str(path), None)
        for check in archive.iter_checks(meta):
            if op is not None:
                op.enter("verify", check.path)
            offset = archive.record_offset(reader, f"data/{check.key}", str(path),
                                           f"tensor {check.path!r}", check.path)
            archive.check_digest(mapped, offset, check.nbytes, check.expected,
                                 f"tensor {check.path!r}", str(path), check.path)
            if op is not None:
                op.advance(check.nbytes)
    return meta
