"""What a load read: bytes and requests, counted where the bytes come in (a file, an object store).

A load promises one pass: every byte of a checkpoint read at most once. That
promise is checked by counting, not by reading the code: each operation owns
a `LoadStats` (`Operation.stats`), and the two places a checkpoint's bytes
enter the process add to it: `CountedFile` (a local file, every `readinto`
and `read` one request) and `objstore.reader.ObjectFile` (every ranged
request to the store). `collecting()` adds up every operation started while
it is active (`xlakit ckpt verify --json` shows the total; tests compare it
with the size of what was loaded).
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_collectors: list["LoadStats"] = []


@dataclass
class LoadStats:
    """Bytes read and read requests (a file's read calls, an object store's ranged requests)."""

    bytes_read: int = 0
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, requests: int = 1) -> None:
        self._count(nbytes, requests)
        if _collectors:
            with _lock:
                for c in _collectors:
                    c._count(nbytes, requests)

    def _count(self, nbytes: int, requests: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.requests += requests

    def as_dict(self) -> dict:
        return {"bytes": self.bytes_read, "requests": self.requests}


def counted(op: Any, result: T, nbytes: int, requests: int) -> T:
    """`result` of a read that brought in `nbytes` in `requests`, counted in `op`'s stats (the object
    store's reads; the compile cache's tier runs them under operations of its own, which keep none)."""
    stats = getattr(op, "stats", None)
    if stats is not None:
        stats.add(nbytes, requests)
    return result


@contextlib.contextmanager
def collecting() -> Iterator[LoadStats]:
    """The total of every `LoadStats.add` in this process while the block runs."""
    total = LoadStats()
    with _lock:
        _collectors.append(total)
    try:
        yield total
    finally:
        with _lock:
            _collectors.remove(total)


class CountedFile(io.RawIOBase):
    """A local file opened for reading, unbuffered, whose reads are counted in `stats`."""

    def __init__(self, path, stats: LoadStats):
        super().__init__()
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self.stats = stats

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def fileno(self) -> int:
        return self._f.fileno()

    def readinto(self, buffer) -> int:
        n = self._f.readinto(buffer) or 0
        self.stats.add(n)
        return n

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self.stats.add(len(data))
        return data

    def close(self) -> None:
        self._f.close()
        super().close()
