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
from typing import BinaryIO

import torch
import xxhash

from xlakit.checkpoint.state import StorageEntry
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
_SMALL_RECORD = 64 << 10  # storages up to this size are copied whole and written in one call
_TORCH_FILE_VERSION = b"3\n"
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_FLAGS = 0x0808  # data descriptor follows the data; UTF-8 names (as torch's writer)


def digest(view: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(view)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype)."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(bytearray())  # writable like the others: a restore reads into it
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


# -- the zip ----------------------------------------------------------------------------------

@dataclass
class _Record:
    name: bytes
    header_offset: int
    size: int
    crc: int


class ArchiveWriter:
    """Streams one checkpoint archive into an open binary file; `finish()` completes it.

    A writer that is never finished leaves an incomplete file, which the caller
    discards (it is always a temporary file).
    """

    def __init__(self, file: BinaryIO, *, compute_crc32: bool):
        self._file = file
        self._crc = compute_crc32
        self._pos = 0
        self._records: list[_Record] = []
        self._buffer = bytearray(CHUNK_BYTES)
        self._pickle: dict = {}
        self._structure: dict = {}
        self._storages: dict[str, dict] = {}

    def _put(self, data) -> None:
        self._file.write(data)
        self._pos += len(data)

    def _begin(self, name: str) -> int:
        """Write a local header whose data starts 64-byte aligned; the data's offset."""
        raw = f"{ARCHIVE}/{name}".encode()
        pad = -(self._pos + 30 + len(raw) + 4) % ALIGNMENT
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        self._records.append(_Record(raw, self._pos, 0, 0))
        self._put(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(raw),
                              len(extra)) + raw + extra)
        return self._pos

    def _end(self, size: int, crc: int) -> None:
        rec = self._records[-1]
        rec.size, rec.crc = size, crc
        if size >= _U32:
            self._put(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
        else:
            self._put(struct.pack("<IIII", 0x08074B50, crc, size, size))

    def _small(self, name: str, data: bytes) -> tuple[int, str]:
        """A record from bytes already private to the writer, in one write."""
        raw = f"{ARCHIVE}/{name}".encode()
        header_at = self._pos
        pad = -(header_at + 30 + len(raw) + 4) % ALIGNMENT
        crc = zlib.crc32(data) if self._crc else 0
        n = len(data)
        self._records.append(_Record(raw, header_at, n, crc))
        descriptor = (struct.pack("<IIQQ", 0x08074B50, crc, n, n) if n >= _U32
                      else struct.pack("<IIII", 0x08074B50, crc, n, n))
        self._put(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(raw), 4 + pad)
                  + raw + b"FB" + struct.pack("<H", pad) + b"Z" * pad + data + descriptor)
        return header_at + 30 + len(raw) + 4 + pad, digest(data)

    def write_header(self, pickled: bytes, structure: bytes) -> None:
        """The pickle (for torch.load), torch's format records, the structure (for xlakit)."""
        offset, pickle_digest = self._small("data.pkl", pickled)
        self._pickle = {"nbytes": len(pickled), "offset": offset, HASH: pickle_digest}
        for name, value in ((".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()),
                            ("byteorder", sys.byteorder.encode())):
            self._small(name, value)
        offset, structure_digest = self._small(STRUCTURE_RECORD, structure)
        self._structure = {"nbytes": len(structure), "offset": offset, HASH: structure_digest}

    def write_storage(self, entry: StorageEntry, view: memoryview,
                      on_chunk: Callable[[int], None] = lambda n: None) -> None:
        """Write one storage's bytes; each chunk is copied once, then hashed and written.

        `on_chunk(nbytes)` runs after each chunk (progress; it may raise to stop).
        """
        n = len(view)
        if n <= _SMALL_RECORD:  # header, bytes and descriptor in one write; the bytes copied once
            data = bytes(view)
            offset, storage_digest = self._small(f"data/{entry.key}", data)
            self._storages[entry.key] = {"nbytes": n, "offset": offset, HASH: storage_digest,
                                         "paths": entry.paths}
            on_chunk(n)
            return
        offset = self._begin(f"data/{entry.key}")
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
        self._end(n, crc)
        self._storages[entry.key] = {"nbytes": n, "offset": offset, HASH: hasher.hexdigest(),
                                     "paths": entry.paths}

    def finish(self) -> None:
        # Storages as columns, in key order (key i at row i): parsed several times faster
        # than one object per storage, which matters with 100,000 tensors.
        rows = [self._storages[k] for k in sorted(self._storages, key=int)]
        columns = {name: [r[name] for r in rows] for name in ("offset", "nbytes", HASH)}
        columns["path"] = [r["paths"][0] for r in rows]
        columns["more_paths"] = {str(i): r["paths"][1:] for i, r in enumerate(rows) if len(r["paths"]) > 1}
        index = {"format": FORMAT, "version": FORMAT_VERSION, "hash": HASH, "pickle": self._pickle,
                 "structure": self._structure, "storages": columns}
        blob = json.dumps(index, sort_keys=True).encode()
        offset, _ = self._small(CHECKSUMS_RECORD, blob)
        self._small("version", _TORCH_FILE_VERSION)
        self._small(".data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
        self._central_directory(f"{_INDEX_POINTER}{offset}:{len(blob)}".encode())

    def _central_directory(self, comment: bytes) -> None:
        start = self._pos
        for r in self._records:
            big = [v for v in (r.size, r.size, r.header_offset) if v >= _U32]
            extra = struct.pack("<HH", 1, 8 * len(big)) + b"".join(struct.pack("<Q", v) for v in big) \
                if big else b""
            size32 = _U32 if r.size >= _U32 else r.size
            off32 = _U32 if r.header_offset >= _U32 else r.header_offset
            self._put(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, _FLAGS, 0, 0, 0, r.crc,
                                  size32, size32, len(r.name), len(extra), 0, 0, 0, 0, off32)
                      + r.name + extra)
        size, count, end = self._pos - start, len(self._records), self._pos
        self._put(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, count, count, size, start))
        self._put(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        self._put(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, _U16), min(count, _U16),
                              min(size, _U32), min(start, _U32), len(comment)) + comment)


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
    return parse_index(bytes(reader.get_record(CHECKSUMS_RECORD)), path), reader


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
