"""A read-only, seekable file over one stored object, for the readers written for local files.

`loading.RecordReader` (and through it `load` and `restore`) reads records
with `seek` + `readinto`: here a small read fills a read-ahead window with one
ranged request, and a large one (a tensor's storage) is fetched straight into
its destination buffer in `CHUNK_BYTES` ranges, `PARALLEL` at a time. The
bytes land in the same buffers a local read would fill, and are hashed there
by the same code: verification is identical on disk and in a bucket. Every
request is bounded by what is left of the operation's deadline.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from xlakit.checkpoint.objstore.client import Location, Store

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation

CHUNK_BYTES = 8 << 20
PARALLEL = 4
_AHEAD = 4 << 20


class ObjectFile(io.RawIOBase):
    """`loc` (of `size` bytes) as a read-only binary file."""

    def __init__(self, store: Store, op: "Operation", loc: Location, size: int):
        super().__init__()
        self.store, self.op, self.loc, self.size = store, op, loc, size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        dst = memoryview(buffer).cast("B")
        n = max(min(len(dst), self.size - self.pos), 0)
        if n == 0:
            return 0
        self.op.object = self.loc.url
        try:
            if n <= _AHEAD:
                data = self.store.get(self.op, self.loc, self.pos, self.pos + n)
                dst[:len(data)] = data
                got = len(data)
            else:
                got = self.store.get_into(self.op, self.loc, self.pos, dst[:n], chunk_bytes=CHUNK_BYTES,
                                          parallel=PARALLEL)
        except FileNotFoundError as e:  # removed under the read: newer saves overtook it
            parent, _, name = self.loc.url.rpartition("/")
            raise gone_error(parent, name) from e
        self.op.object = None
        self.pos += got
        return got


def gone_error(checkpoint: str, name: str) -> Exception:
    """A data object a commit record names, gone while that record was being read."""
    from xlakit.errors import CheckpointIncompleteError

    err = CheckpointIncompleteError(f"{checkpoint}: the object {name} named by the commit record being read "
                                    f"is gone")
    err.add_note("Newer saves replaced this checkpoint twice while it was read (each save keeps the previous "
                 "generation only); load it again. If no save ran, the object was deleted by hand.")
    return err
