"""The checkpoint file: torch.save's zip archive, written by xlakit as a stream, with an index.

The layout is exactly what `torch.load(path, weights_only=True)` reads
(`archive/data.pkl`, `.format_version`, `.storage_alignment`, `byteorder`,
`data/<key>`, `version`), so a checkpoint never needs xlakit to be read.
Unlike `torch.save`, the pickle is written first, from tensor *metadata* only
(`state.Plan`), and each storage is written when its bytes reach the host:
memory stays bounded by one transfer batch.

xlakit writes the zip itself (stored, 64-byte aligned records, data
descriptors and zip64 end records, as torch's writer does) so that every
storage is **hashed from the very bytes written**: each chunk is first copied
into a private buffer, then hashed (xxh3-64, and CRC32 when asked) and written
from that buffer. A thread changing a tensor during the save can give torn
values, never a file whose checksums disagree with its bytes.

The extra record `xlakit/checksums.json` (torch.load ignores it) is the index:
the format version, and for the pickle and every storage its size, data offset
in the file, digest and the tensor paths that use it.
"""

from __future__ import annotations

import ctypes
import json
import secrets
import struct
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import xxhash

from xlakit.checkpoint.format import zip_structure
from xlakit.checkpoint.format.state import StorageEntry
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError

ARCHIVE = "archive"
CHECKSUMS_RECORD = "xlakit/checksums.json"  # the index
STRUCTURE_RECORD = "xlakit/structure.json"
_INDEX_POINTER = "xlakit-index:"  # the zip comment: where the index's bytes are
FORMAT = "xlakit-checkpoint"
FORMAT_VERSION = 2  # 1: storages keyed by tensor, no offsets; 2: shared storages, offsets, paths
HASH = "xxh3_64"
ALIGNMENT = 64
CHUNK_BYTES = 1 << 20
SMALL_RECORD = 64 << 10  # storages up to this size are copied whole and written in one call
_TORCH_FILE_VERSION = b"3\n"
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_FLAGS = 0x0808  # data descriptor follows the data; UTF-8 names (as torch's writer)


_hexdigest = xxhash.xxh3_64_hexdigest
_string_at = ctypes.string_at


def digest(view: memoryview | bytes) -> str:
    return _hexdigest(view)


def host_view(host, nbytes: int) -> memoryview:
    """A zero-copy byte view of the first `nbytes` bytes of a contiguous CPU tensor or storage."""
    if nbytes == 0:
        return memoryview(bytearray())  # writable like the others: a restore reads into it
    return memoryview((ctypes.c_ubyte * nbytes).from_address(host.data_ptr())).cast("B")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype)."""
    return host_view(tensor, tensor.numel() * tensor.element_size())


def host_copy(host, nbytes: int) -> bytes:
    """A private copy of the first `nbytes` bytes of a contiguous CPU tensor or storage (one C call)."""
    return ctypes.string_at(host.data_ptr(), nbytes) if nbytes else b""


# -- the zip ----------------------------------------------------------------------------------

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
# The extra field that pads a local header so the data starts 64-byte aligned, by padding length.
_PAD_FIELDS = [b"FB" + struct.pack("<H", n) + b"Z" * n for n in range(ALIGNMENT)]


class ArchiveWriter:
    """Streams one checkpoint archive into an open binary file; `finish()` completes it.

    A writer that is never finished leaves an incomplete file, which the caller
    discards (it is always a temporary file).
    """

    def __init__(self, file: BinaryIO, *, compute_crc32: bool):
        self._file = file
        self._crc = compute_crc32
        self._pos = 0
        self._records: list[tuple[bytes, int, int, int]] = []  # name, header offset, size, crc32
        self._buffer = bytearray(CHUNK_BYTES)
        self._pickle: dict = {}
        self._structure: dict = {}
        # The storages written, as columns in write order (the index wants them by key).
        self._keys: list[int] = []
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._digests: list[str] = []
        self._paths: list[list[str]] = []
        self._heads: dict[tuple[int, int], tuple[bytes, bytes]] = {}  # local headers by name length, padding

    def _put(self, data) -> None:
        self._file.write(data)
        self._pos += len(data)

    def _local_header(self, raw: bytes) -> bytes:
        """A local header whose data starts 64-byte aligned; the record is registered."""
        pad = -(self._pos + 30 + len(raw) + 4) % ALIGNMENT
        return _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(raw), 4 + pad) + raw + _PAD_FIELDS[pad]

    def _small(self, name: str, data: bytes) -> tuple[int, str]:
        """A record from bytes already private to the writer, in one write; (data offset, digest)."""
        raw = f"{ARCHIVE}/{name}".encode()
        header_at = self._pos
        head = self._local_header(raw)
        crc = zlib.crc32(data) if self._crc else 0
        n = len(data)
        self._records.append((raw, header_at, n, crc))
        descriptor = (_DESCRIPTOR64.pack(0x08074B50, crc, n, n) if n >= _U32
                      else _DESCRIPTOR.pack(0x08074B50, crc, n, n))
        self._put(head + data + descriptor)
        return header_at + len(head), digest(data)

    def write_header(self, pickled: bytes, structure: bytes) -> None:
        """The pickle (for torch.load), torch's format records, the structure (for xlakit)."""
        offset, pickle_digest = self._small("data.pkl", pickled)
        self._pickle = {"nbytes": len(pickled), "offset": offset, HASH: pickle_digest}
        for name, value in ((".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()),
                            ("byteorder", sys.byteorder.encode())):
            self._small(name, value)
        offset, structure_digest = self._small(STRUCTURE_RECORD, structure)
        self._structure = {"nbytes": len(structure), "offset": offset, HASH: structure_digest}

    def write_small_storage(self, entry: StorageEntry, data: bytes) -> None:
        """One storage of at most `SMALL_RECORD` bytes, from a private copy of them (`host_copy`)."""
        offset, storage_digest = self._small(f"data/{entry.index}", data)
        self._row(entry, offset, len(data), storage_digest)

    def _row(self, entry: StorageEntry, offset: int, nbytes: int, storage_digest: str) -> None:
        self._keys.append(entry.index)
        self._offsets.append(offset)
        self._sizes.append(nbytes)
        self._digests.append(storage_digest)
        self._paths.append(entry.paths)

    def write_small_storages(self, entries: list[StorageEntry], hosts: list,
                             on_chunk: Callable[[int, str], None]) -> None:
        """Storages of at most `SMALL_RECORD` bytes each, from contiguous CPU tensors or storages.

        Each is copied once into a private bytes object (one C call), hashed from it and written
        from it, header, data and descriptor together; `on_chunk(nbytes, path)` runs after every
        `CHUNK_BYTES` or so (progress; it may raise to stop). The hot path of a save of many small
        tensors, hence the locals.
        """
        write, records, crc32 = self._file.write, self._records.append, self._crc
        keys, offsets, sizes, digests, paths = (self._keys.append, self._offsets.append, self._sizes.append,
                                                self._digests.append, self._paths.append)
        heads, pos, pending = self._heads, self._pos, 0
        for entry, host in zip(entries, hosts):
            n = entry.nbytes
            data = _string_at(host.data_ptr(), n) if n else b""
            raw = b"archive/data/%d" % entry.index
            pad = -(pos + 34 + len(raw)) % ALIGNMENT
            head = heads.get((len(raw), pad))
            if head is None:
                head = heads[len(raw), pad] = (_LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(raw),
                                                           4 + pad), _PAD_FIELDS[pad])
            crc = zlib.crc32(data) if crc32 else 0
            chunk = b"".join((head[0], raw, head[1], data, _DESCRIPTOR.pack(0x08074B50, crc, n, n)))
            write(chunk)
            records((raw, pos, n, crc))
            keys(entry.index)
            offsets(pos + 34 + len(raw) + pad)
            sizes(n)
            digests(_hexdigest(data))
            paths(entry.paths)
            pos += len(chunk)
            pending += n
            if pending >= CHUNK_BYTES:
                self._pos = pos
                on_chunk(pending, entry.path)
                pending = 0
        self._pos = pos
        if pending:
            on_chunk(pending, entries[-1].path)

    def write_storage(self, entry: StorageEntry, view: memoryview,
                      on_chunk: Callable[[int], None] = lambda n: None) -> None:
        """Write one storage's bytes; each chunk is copied once, then hashed and written.

        `on_chunk(nbytes)` runs after each chunk (progress; it may raise to stop).
        """
        n = len(view)
        if n <= SMALL_RECORD:  # header, bytes and descriptor in one write; the bytes copied once
            self.write_small_storage(entry, bytes(view))
            on_chunk(n)
            return
        raw = f"{ARCHIVE}/data/{entry.index}".encode()
        header_at = self._pos
        head = self._local_header(raw)
        self._put(head)
        offset = self._pos
        hasher, crc, buf = xxhash.xxh3_64(), 0, memoryview(self._buffer)
        for start in range(0, n, CHUNK_BYTES):
            m = min(CHUNK_BYTES, n - start)
            buf[:m] = view[start:start + m]
            chunk = buf[:m]
            hasher.update(chunk)
            if self._crc:
                crc = zlib.crc32(chunk, crc)
            self._put(chunk)
            on_chunk(m)
        self._records.append((raw, header_at, n, crc))
        self._put(_DESCRIPTOR64.pack(0x08074B50, crc, n, n) if n >= _U32
                  else _DESCRIPTOR.pack(0x08074B50, crc, n, n))
        self._row(entry, offset, n, hasher.hexdigest())

    def finish(self) -> None:
        # Storages as columns, in key order (key i at row i): parsed several times faster
        # than one object per storage, which matters with 100,000 tensors.
        keys = self._keys
        if keys != list(range(len(keys))):  # written in another order than their keys (device groups)
            order = sorted(range(len(keys)), key=keys.__getitem__)
            for name in ("_keys", "_offsets", "_sizes", "_digests", "_paths"):
                column = getattr(self, name)
                setattr(self, name, [column[i] for i in order])
        columns = {"offset": self._offsets, "nbytes": self._sizes, HASH: self._digests,
                   "path": [p[0] for p in self._paths],
                   "more_paths": {str(i): p[1:] for i, p in enumerate(self._paths) if len(p) > 1}}
        index = {"format": FORMAT, "version": FORMAT_VERSION, "hash": HASH, "pickle": self._pickle,
                 "structure": self._structure, "storages": columns}
        blob = json.dumps(index, sort_keys=True).encode()
        offset, _ = self._small(CHECKSUMS_RECORD, blob)
        self._small("version", _TORCH_FILE_VERSION)
        self._small(".data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
        self._central_directory(f"{_INDEX_POINTER}{offset}:{len(blob)}".encode())

    def _central_directory(self, comment: bytes) -> None:
        start = self._pos
        pack = _CENTRAL.pack
        parts = [pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset) + name
                 if size < _U32 and offset < _U32 else _central_zip64(name, offset, size, crc)
                 for name, offset, size, crc in self._records]
        self._put(b"".join(parts))
        size, count, end = self._pos - start, len(self._records), self._pos
        self._put(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, count, count, size, start))
        self._put(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        self._put(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, _U16), min(count, _U16),
                              min(size, _U32), min(start, _U32), len(comment)) + comment)


def _central_zip64(name: bytes, offset: int, size: int, crc: int) -> bytes:
    """A central directory entry whose size or offset needs zip64's extra field."""
    big = [v for v in (size, size, offset) if v >= _U32]
    extra = struct.pack("<HH", 1, 8 * len(big)) + b"".join(struct.pack("<Q", v) for v in big)
    return _CENTRAL.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, min(size, _U32), min(size, _U32), len(name),
                         len(extra), 0, 0, 0, 0, min(offset, _U32)) + name + extra


# -- reading the index ------------------------------------------------------------------------

def locate_index(f: BinaryIO, size: int) -> tuple[int, int] | None:
    """(offset, nbytes) of the index from the zip comment xlakit writes; None where there is none."""
    tail_len = min(size, 22 + 64)
    f.seek(size - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return None
    comment_len = struct.unpack_from("<H", tail, at + 20)[0]
    comment = tail[at + 22:at + 22 + comment_len]
    if len(comment) != comment_len or not comment.startswith(_INDEX_POINTER.encode()):
        return None
    try:
        offset, nbytes = (int(x) for x in comment[len(_INDEX_POINTER):].split(b":"))
    except ValueError:
        return None
    return (offset, nbytes) if 0 <= offset and 0 < nbytes and offset + nbytes <= size else None


def parse_index(blob: bytes, path: str) -> dict:
    """The index record, checked for its format and version."""
    try:
        meta = json.loads(blob)
        if meta.get("format") != FORMAT or meta.get("hash") != HASH:
            raise ValueError(f"unknown format {meta.get('format')!r}/{meta.get('hash')!r}")
        version = meta.get("version")
        if not isinstance(version, int):
            raise ValueError(f"format version {version!r} is not a number")
        if version == 2:
            _check_columns(meta)
    except (ValueError, RuntimeError, AttributeError) as e:
        raise CheckpointCorruptError(f"{path}: the checksum record is unreadable ({e})") from e
    if version > FORMAT_VERSION:
        err = CheckpointFormatError(
            f"{path} was written in xlakit checkpoint format version {version}; this xlakit "
            f"understands versions up to {FORMAT_VERSION}")
        err.add_note("Upgrade xlakit to load it, or read it with torch.load(path, weights_only=True) "
                     "without verification.")
        raise err
    return meta


def _check_columns(meta: dict) -> None:
    """Version 2's records and storage columns have the fields and types readers use."""
    def record(name: str, v: object) -> None:
        if not (isinstance(v, dict) and _count(v.get("offset")) and _count(v.get("nbytes"))
                and isinstance(v.get(HASH), str)):
            raise ValueError(f"its {name} entry is malformed")

    record("pickle", meta.get("pickle"))
    if "structure" in meta:
        record("structure", meta["structure"])
    cols = meta.get("storages")
    if not isinstance(cols, dict):
        raise ValueError("it has no storage columns")
    columns = [cols.get(k) for k in ("offset", "nbytes", HASH, "path")]
    if not all(isinstance(c, list) for c in columns) or len({len(c) for c in columns}) != 1:
        raise ValueError("its storage columns are missing or of different lengths")
    offsets, sizes, digests, paths = columns
    if not (all(map(_count, offsets)) and all(map(_count, sizes))
            and all(isinstance(x, str) for x in digests) and all(isinstance(x, str) for x in paths)):
        raise ValueError("its storage columns hold values of the wrong type")


def _count(v: object) -> bool:
    return type(v) is int and v >= 0


@dataclass(frozen=True)
class StorageCheck:
    key: str
    path: str  # the first tensor on the storage, for messages
    nbytes: int
    expected: str
    offset: int | None  # known from the index (version 2), else looked up in the zip


# The fix for a file without checksums; callers that take options another way (the Lightning
# plugin) find this note among an error's notes and say it their way.
NO_CHECKSUMS_NOTE = ("If you trust it, read it without verification: xlakit.load(path, verify=False), "
                     "xlakit.restore(path, template, verify=False), or torch.load(path, weights_only=True).")


def read_index(path: str) -> tuple[dict, torch._C.PyTorchFileReader]:
    """The checksum record (index) of `path`, with an open reader; raises on a broken archive."""
    try:
        reader = torch._C.PyTorchFileReader(path)
    except RuntimeError as e:
        if is_legacy_torch_file(path):
            raise legacy_format_error(path) from e
        raise CheckpointCorruptError(
            f"{path} is not a readable checkpoint archive ({e}); the file is truncated or "
            f"corrupted. Load the previous checkpoint.") from e
    if not reader.has_record(CHECKSUMS_RECORD):
        err = CheckpointFormatError(
            f"{path} has no xlakit checksums (record {CHECKSUMS_RECORD!r}): it was not written "
            f"by xlakit.save, so its integrity cannot be verified")
        err.add_note(NO_CHECKSUMS_NOTE)
        raise err
    try:
        blob = bytes(reader.get_record(CHECKSUMS_RECORD))
    except RuntimeError:  # its local header damaged: named as for any other record (an I/O error is no damage)
        zip_structure.check(Path(path))
        raise
    return parse_index(blob, path), reader


def is_zip(path) -> bool:
    """A file that starts like a zip archive (torch.save's format since 1.6)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def is_legacy_torch_file(path) -> bool:
    """A file in torch.save's pre-1.6 format (`_use_new_zipfile_serialization=False`): a pickle."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"\x80\x02"  # pickle protocol 2; an archive starts with "PK"
    except OSError:
        return False


def legacy_format_error(path) -> CheckpointFormatError:
    err = CheckpointFormatError(f"{path} is a torch.save file in the legacy format (not a zip archive): "
                                f"it has no xlakit checksums and cannot be memory-mapped")
    err.add_note(NO_CHECKSUMS_NOTE)
    err.add_note("xlakit.save(torch.load(...), path) gives a verifiable copy.")
    return err


def iter_checks(meta: dict) -> Iterator[StorageCheck]:
    """Every storage of an index: version 2 stores them as columns, version 1 as one object each."""
    storages = meta["storages"]
    if isinstance(storages.get("offset"), list):  # row i is storage key i
        for row, (offset, nbytes, digest_, path) in enumerate(zip(
                storages["offset"], storages["nbytes"], storages[HASH], storages["path"])):
            yield StorageCheck(str(row), path, int(nbytes), digest_, int(offset))
        return
    for key, rec in storages.items():
        yield StorageCheck(key, rec["path"], int(rec["nbytes"]), rec[HASH], rec.get("offset"))


def record_offset(reader, name: str, path: str, what: str, tensor: str | None) -> int:
    try:
        return reader.get_record_offset(name)
    except RuntimeError as e:
        raise CheckpointCorruptError(f"{path}: {what} is missing from the archive ({e})",
                                     tensor=tensor) from e


def check_digest(mapped, offset: int, nbytes: int, expected: str, what: str, path: str,
                 tensor: str | None) -> None:
    """The `nbytes` bytes of `mapped` (the whole file) at `offset` must hash to `expected`."""
    if offset + nbytes > len(mapped):
        raise CheckpointCorruptError(
            f"{path}: {what} should hold {nbytes} bytes at offset {offset}, but the file ends at "
            f"{len(mapped)}: the file is truncated", tensor=tensor)
    with memoryview(mapped) as whole, whole[offset:offset + nbytes] as view:
        actual = digest(view)
    if actual != expected:
        raise CheckpointCorruptError(
            f"{path}: {what} is corrupt: its {HASH} is {actual}, the checkpoint recorded {expected}",
            tensor=tensor)
