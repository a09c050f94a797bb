"""Loading one checkpoint file: each record read once, into its destination, and hashed there.

xlakit's own files are read without the zip reader and without unpickling:
the zip comment points at the index (`archive.locate_index`), the index lists
every storage's offset, size and digest, and the structure record
(`structure.py`) says how tensors sit on those storages. Each storage is read
straight into the buffer that becomes it (small neighbouring records through
one read window) and hashed from that buffer, so verification costs no second
pass over the file, and nothing in a file can run code.

Plain torch.save files, files of earlier xlakit versions and `mmap=True` go
through `torch.load(weights_only=True)`; with `verify` the xlakit checksums
are checked first, over a memory map of the file (every page read once,
before any tensor maps the file), and the load maps the same pages (without
`mmap=True`, each storage is then copied off the map: the file is still read
once).
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import pickle
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch
import xxhash

from xlakit.checkpoint.format import archive, pickled, structure
from xlakit.checkpoint.core.load_stats import CountedFile
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.workers import collection_paused
from xlakit.checkpoint.core.options import LoadOptions
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError

log = logging.getLogger("xlakit")

NOTHING_CHANGED = "nothing on disk was changed"
SMALL = 64 << 10  # records below this are read through the window
_WINDOW = 4 << 20
_GAP = 512  # the most bytes between two records a window reads over: zip headers and descriptors
_from_buffer = torch.UntypedStorage.from_buffer
_hexdigest = xxhash.xxh3_64_hexdigest  # archive.digest, without a Python call around it
_memmove = ctypes.memmove


CheckIndex = Callable[[dict], None]  # raises when an index is not the one expected (a folder's part)


def load_file(final: Path, opts: LoadOptions, check_index: CheckIndex | None = None) -> Any:
    """Load and verify one checkpoint file in this process."""
    if not final.is_file():
        raise FileNotFoundError(2, f"no checkpoint at {final}", str(final))
    op = Operation("load", final, Watch.of(opts), bytes_total=final.stat().st_size,
                   untouched=NOTHING_CHANGED)
    with collection_paused():
        return op.run(lambda op: read_file(op, final, opts, check_index))


def read_file(op: Operation, path: Path, opts: LoadOptions, check_index: CheckIndex | None = None) -> Any:
    """Verify (if asked) and read `path` as part of `op`; with `verify`, `check_index(index)` first
    (a part of a folder checkpoint: the index the commit record names), on the index read for the load."""
    if not opts.mmap:
        with CountedFile(path, op.stats) as f:
            found = open_index(f, path)
            if found is not None:
                if opts.verify and check_index is not None:
                    check_index(found)
                return read_records(op, f, path, found, opts.verify)
    if opts.verify:
        op.enter("verify")
        meta = verify_file(path, op)
        if check_index is not None:
            check_index(meta)
    op.enter("read")
    return load_after_check(path, checked=opts.verify, mmap_=opts.mmap)


def load_after_check(path: Path, *, checked: bool, mmap_: bool) -> Any:
    """torch.load of a file without an index; `checked`: `verify_file` has just brought every record
    in through a memory map, so a load without `mmap_` maps the same pages and copies each storage
    off them (`off_the_map`) instead of reading the file a second time."""
    if checked and not mmap_:
        return off_the_map(torch_load(path, True))
    return torch_load(path, mmap_)


def off_the_map(state: Any) -> Any:
    """`state` (as `torch.load(mmap=True)` returns it) with each storage copied into host memory of
    its own, once per storage, the tensors (views and shared storages as they were) moved onto the
    copies in place: as `mmap=False` would have read it, without holding the file."""
    copies: dict[int, torch.UntypedStorage] = {}
    seen: set[int] = set()
    todo = [state]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            mapped = obj.untyped_storage()
            copy = copies.get(mapped._cdata)
            if copy is None:
                copy = copies[mapped._cdata] = torch.UntypedStorage(mapped.nbytes())
                copy.copy_(mapped)
            with torch.no_grad():
                obj.set_(copy, obj.storage_offset(), obj.size(), obj.stride())
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
    return state


def open_index(f: BinaryIO, path: Path, size: int | None = None) -> dict | None:
    """The index of an xlakit file with a structure record; None for any other file.

    `size` is the file's, where `f` has no descriptor (an object in a bucket)."""
    size = os.fstat(f.fileno()).st_size if size is None else size
    located = archive.locate_index(f, size)
    if located is None:
        return None
    offset, nbytes = located
    index = archive.parse_index(_pread(f, offset, nbytes, path, "the index"), str(path))
    return index if "structure" in index else None


def _pread(f: BinaryIO, offset: int, nbytes: int, path: Path, what: str) -> bytes:
    f.seek(offset)
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise CheckpointCorruptError(f"{path}: {what} should hold {nbytes} bytes at offset {offset}, "
                                     f"but the file ends early: the file is truncated")
    return data


def storage_view(storage: torch.UntypedStorage) -> memoryview:
    """A writable byte view of a CPU storage's memory."""
    n = storage.nbytes()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(storage.data_ptr())).cast("B")


class RecordReader:
    """Reads records of one file, each byte once; small neighbours come through one read window.

    The window reads ahead only over what the load will use: told the records it will read
    (`expect`), a window that starts at one of them runs on over the small ones that follow it
    (with only zip headers between) and stops before anything else, a large record (read straight
    into its buffer) or one the load skips. Without that plan a window is one record.
    """

    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path
        self._window = bytearray(_WINDOW)
        self._view = memoryview(self._window)
        self._start = self._end = 0
        self._address: int | None = None  # of the window, once asked for
        self._starts: list[int] = []  # the small records the load reads, by offset
        self._ends: list[int] = []

    def expect(self, extents: Iterable[tuple[int, int]]) -> None:
        """The records (offset, nbytes) the load reads from here on."""
        small = sorted((o, o + n) for o, n in extents if 0 < n < SMALL)
        self._starts = [o for o, _ in small]
        self._ends = [e for _, e in small]

    def read_into(self, offset: int, dst: memoryview, what: str, tensor: str | None) -> None:
        """Fill `dst` with the `len(dst)` bytes at `offset`."""
        n = len(dst)
        if n < SMALL:
            at = self.window(offset, n, what, tensor)
            dst[:] = self._view[at:at + n]
            return
        self.f.seek(offset)
        done = 0
        while done < n:
            got = self.f.readinto(dst[done:])
            if not got:
                raise self._truncated(offset, n, what, tensor)
            done += got

    def window(self, offset: int, n: int, what: str, tensor: str | None) -> int:
        """Where the `n` (< 64 KiB) bytes at `offset` start in the window, reading it if needed."""
        if not (self._start <= offset and offset + n <= self._end):
            end = self._ahead(offset, offset + n)
            self.f.seek(offset)
            got = self.f.readinto(self._view[:end - offset]) or 0
            self._start, self._end = offset, offset + got
            if offset + n > self._end:
                raise self._truncated(offset, n, what, tensor)
        return offset - self._start

    def _ahead(self, offset: int, end: int) -> int:
        """Where a window from `offset` (a record ending at `end`) stops: after the expected small
        records that follow, each at most `_GAP` after the last, all within `_WINDOW`."""
        starts, ends = self._starts, self._ends
        i = bisect.bisect_left(starts, offset)
        if i == len(starts) or starts[i] != offset:
            return end
        limit, j = offset + _WINDOW, i + 1
        while j < len(starts) and starts[j] - end <= _GAP and ends[j] <= limit:
            end = ends[j]
            j += 1
        return max(end, ends[i])

    def read_small_to(self, offset: int, n: int, address: int, tensor: str, expected: str | None,
                      row: int) -> None:
        """Copy the `n` (0 < n < SMALL) bytes at `offset` (record `data/<row>`) to memory at `address`
        (a template tensor's); with `expected`, the bytes as read (those copied) are checked."""
        at = offset - self._start
        if at < 0 or offset + n > self._end:
            at = self.window(offset, n, f"tensor {tensor!r}", tensor)
        if self._address is None:
            self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._window))
        _memmove(address, self._address + at, n)
        if expected is not None and _hexdigest(self._view[at:at + n]) != expected:
            dst = memoryview((ctypes.c_ubyte * n).from_address(address)).cast("B")
            check_record(self.path, dst, expected, f"tensor {tensor!r}", f"data/{row}", tensor)

    def storage(self, record: str, offset: int, n: int, tensor: str, expected: str | None
                ) -> torch.UntypedStorage:
        """A new storage holding record `record`; with `expected`, its bytes as read are checked."""
        if 0 < n < SMALL:  # the hot path with many small tensors: one C call to copy, one to hash
            at = offset - self._start
            if at < 0 or offset + n > self._end:
                at = self.window(offset, n, f"tensor {tensor!r}", tensor)
            storage = _from_buffer(self._window, "native", count=n, offset=at, dtype=torch.uint8)
            if expected is not None and _hexdigest(self._view[at:at + n]) != expected:
                check_record(self.path, storage_view(storage), expected, f"tensor {tensor!r}", record, tensor)
            return storage
        storage = torch.UntypedStorage(n)
        view = storage_view(storage)
        self.read_into(offset, view, f"tensor {tensor!r}", tensor)
        if expected is not None:
            check_record(self.path, view, expected, f"tensor {tensor!r}", record, tensor)
        return storage

    def _truncated(self, offset: int, n: int, what: str, tensor: str | None) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.path}: {what} should hold {n} bytes at offset {offset}, "
                                      f"but the file ends early: the file is truncated", tensor=tensor)


def check_record(path: Path, data: memoryview, expected: str, what: str, name: str,
                 tensor: str | None) -> None:
    """The digest of bytes as read must be the one recorded, or the file is damaged.

    Before calling a file corrupt, the record's place is confirmed against the zip's own
    central directory: should the index point elsewhere, the record is read again (into
    `data`) from where the zip says it is, so an index error never makes a good file bad.
    """
    actual = archive.digest(data)
    if actual == expected:
        return
    try:
        _, reader = archive.read_index(str(path))
        offset = archive.record_offset(reader, name, str(path), what, tensor)
    except (CheckpointCorruptError, CheckpointFormatError):
        offset = None
    if offset is not None:
        with open(path, "rb", buffering=0) as f:
            RecordReader(f, path).read_into(offset, data, what, tensor)
        if archive.digest(data) == expected:
            log.warning("xlakit: %s: the index points at another place for %s than the zip does; "
                        "read it from the zip's place", path, what)
            return
    raise CheckpointCorruptError(
        f"{path}: {what} is corrupt: its {archive.HASH} is {actual}, the checkpoint recorded {expected}",
        tensor=tensor)


def read_storages(op: Operation, reader: RecordReader, index: dict, rows: list[int],
                  verify: bool) -> dict[int, torch.UntypedStorage]:
    """The storages of index rows `rows`, each read once into its own buffer and hashed there."""
    cols = index["storages"]
    offsets, sizes, digests, paths = cols["offset"], cols["nbytes"], cols[archive.HASH], cols["path"]
    out: dict[int, torch.UntypedStorage] = {}
    pending = 0
    for row in sorted(rows, key=offsets.__getitem__):
        n = sizes[row]
        name = paths[row]
        if n >= SMALL:
            op.enter("read", name)
        out[row] = reader.storage(f"data/{row}", offsets[row], n, name, digests[row] if verify else None)
        pending += n
        if pending >= SMALL:
            op.advance(pending)
            pending = 0
    op.advance(pending)
    return out


def header_extents(index: dict, verify: bool) -> list[tuple[int, int]]:
    """The records `read_structure` reads: the structure, and verifying, the pickle."""
    records = [index["pickle"], index["structure"]] if verify else [index["structure"]]
    return [(r["offset"], r["nbytes"]) for r in records]


def read_structure(op: Operation, reader: RecordReader, index: dict, verify: bool) -> bytes:
    """The structure record; and, verifying, the pickle's digest too (torch.load reads it)."""
    path = reader.path
    if verify:
        op.enter("verify")
        pk = index["pickle"]
        pickled = memoryview(bytearray(pk["nbytes"]))  # read only to check it: torch.load needs it
        reader.read_into(pk["offset"], pickled, "the pickled structure (data.pkl)", None)
        check_record(path, pickled, pk[archive.HASH], "the pickled structure (data.pkl)", "data.pkl", None)
    st = index["structure"]
    data = memoryview(bytearray(st["nbytes"]))
    reader.read_into(st["offset"], data, "the structure record", None)
    if verify:
        check_record(path, data, st[archive.HASH], "the structure record", archive.STRUCTURE_RECORD, None)
    return bytes(data)


def read_records(op: Operation, f: BinaryIO, path: Path, index: dict, verify: bool) -> Any:
    """The whole state of an xlakit file, on the CPU."""
    reader = RecordReader(f, path)
    cols = index["storages"]
    reader.expect([*header_extents(index, verify), *zip(cols["offset"], cols["nbytes"])])
    layout = read_structure(op, reader, index, verify)
    storages = read_storages(op, reader, index, range(len(cols["offset"])), verify)
    op.enter("build")
    return structure.decode(layout, structure.materialize, str(path), storages=storages)


def torch_load(path: Path | BinaryIO, mmap_: bool, *, name: str | None = None) -> Any:
    """torch.load, weights-only, with xlakit's errors (`name`: what a file object is called in them)."""
    name = name or str(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap_)
    except pickle.UnpicklingError as e:
        err = CheckpointFormatError(f"{name} holds pickled objects that a weights-only load refuses "
                                    f"to run{pickled.naming_refused(e)}; nothing of it was run")
        err.add_note("xlakit.load never executes pickled code. If you trust the file, load it with "
                     "torch.load(path, weights_only=False).")
        raise err from e
    except (RuntimeError, ValueError, KeyError, EOFError) as e:
        if isinstance(path, Path) and archive.is_legacy_torch_file(path):
            raise archive.legacy_format_error(path) from e
        # The checked records were intact; damage elsewhere (names, headers) surfaces here.
        raise CheckpointCorruptError(f"{name}: the archive is damaged outside the checksummed "
                                     f"records and torch.load failed: {type(e).__name__}: {e}") from e


def verify_file(path: Path, op: Operation | None = None) -> dict:
    """Check the pickle and every storage of `path` against its index; the index.

    Hashed over a memory map: the pages it brings in are the ones `torch.load(mmap=True)` then
    maps, so they count as the load's reads (`op.stats`), once."""
    meta, reader = archive.read_index(str(path))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        pk = meta["pickle"]
        # Offsets from the zip itself, the ones torch.load will read.
        offset = archive.record_offset(reader, "data.pkl", str(path), "the pickle", None)
        archive.check_digest(mapped, offset, pk["nbytes"], pk[archive.HASH],
                             "the pickled structure (data.pkl)", str(path), None)
        if op is not None:
            op.stats.add(pk["nbytes"])
        for check in archive.iter_checks(meta):
            if op is not None:
                op.enter("verify", check.path)
            offset = archive.record_offset(reader, f"data/{check.key}", str(path),
                                           f"tensor {check.path!r}", check.path)
            archive.check_digest(mapped, offset, check.nbytes, check.expected,
                                 f"tensor {check.path!r}", str(path), check.path)
            if op is not None:
                op.advance(check.nbytes)
                op.stats.add(check.nbytes)
    return meta
