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
import io
import json
import pickle
import secrets
import struct
import sys
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch
import xxhash

from xlakit.checkpoint.state import Plan, StorageEntry, TensorRef
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointSerializationError

ARCHIVE = "archive"
CHECKSUMS_RECORD = "xlakit/checksums.json"
FORMAT = "xlakit-checkpoint"
FORMAT_VERSION = 2  # 1: storages keyed by tensor, no offsets; 2: shared storages, offsets, paths
HASH = "xxh3_64"
ALIGNMENT = 64
CHUNK_BYTES = 1 << 20
_PICKLE_PROTOCOL = 2  # torch.save's default; the weights-only unpickler expects it
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
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


# -- the pickle -------------------------------------------------------------------------------

class _StorageRef:
    """Stands for one storage in the pickle; persistent_id turns it into a record key."""

    def __init__(self, entry: StorageEntry, dtype: torch.dtype, legacy: object | None):
        self.entry, self.dtype, self.legacy = entry, dtype, legacy


class _PlainTensor:
    """A Parameter's data, pickled as a plain tensor inside `_rebuild_parameter`."""

    def __init__(self, ref: TensorRef):
        self.ref = ref


class _MetadataPickler(pickle.Pickler):
    def __init__(self, file: BinaryIO, plan: Plan):
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self._plan = plan
        self._legacy = torch.storage._dtype_to_storage_type_map()

    def persistent_id(self, obj):
        if not isinstance(obj, _StorageRef):
            return None
        e = obj.entry
        if obj.legacy is not None:  # a typed storage, as torch.save writes for the common dtypes
            itemsize = torch.empty((), dtype=obj.dtype).element_size()
            return ("storage", obj.legacy, e.key, "cpu", e.nbytes // itemsize)
        return ("storage", torch.UntypedStorage, e.key, "cpu", e.nbytes)

    def _rebuild(self, ref: TensorRef, requires_grad: bool):
        legacy_name = self._legacy.get(ref.dtype)
        metadata = torch._utils.get_tensor_metadata(ref.tensor) if ref.tensor.device.type != "xla" else {}
        if legacy_name is not None:
            args = (_StorageRef(ref.storage, ref.dtype, getattr(torch, legacy_name)), ref.offset,
                    ref.size, ref.stride, requires_grad, OrderedDict())
            return torch._utils._rebuild_tensor_v2, args + ((metadata,) if metadata else ())
        storage = _StorageRef(ref.storage, ref.dtype, None)
        return (torch._utils._rebuild_tensor_v3,
                (storage, ref.offset, ref.size, ref.stride, requires_grad, OrderedDict(), ref.dtype)
                + ((metadata,) if metadata else ()))

    def reducer_override(self, obj):
        if isinstance(obj, _PlainTensor):
            return self._rebuild(obj.ref, False)
        if isinstance(obj, torch.Tensor):
            ref = self._plan.tensors[id(obj)]
            if isinstance(obj, torch.nn.Parameter):
                return (torch._utils._rebuild_parameter,
                        (_PlainTensor(ref), obj.requires_grad, OrderedDict()))
            return self._rebuild(ref, obj.requires_grad)
        return NotImplemented


def _check_weights_only(data: bytes) -> None:
    """Refuse, before anything is written, a pickle that torch.load(weights_only=True) rejects."""
    from torch import _weights_only_unpickler

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = lambda saved_id: torch.UntypedStorage(0)
    try:
        unpickler.load()
    except pickle.UnpicklingError as e:
        err = CheckpointSerializationError(
            f"the state cannot be loaded back with torch.load(weights_only=True): {e}")
        err.add_note("Save plain containers of tensors and numbers (state_dict()s), not objects.")
        raise err from None
    except Exception:  # noqa: BLE001 - rebuilding against empty storages fails; the globals passed
        pass


def pickle_state(state: object, plan: Plan) -> bytes:
    buf = io.BytesIO()
    try:
        _MetadataPickler(buf, plan).dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise CheckpointSerializationError(f"the state cannot be pickled: {e}") from e
    data = buf.getvalue()
    _check_weights_only(data)
    return data


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
        offset = self._begin(name)
        self._put(data)
        self._end(len(data), zlib.crc32(data) if self._crc else 0)
        return offset, digest(data)

    def write_header(self, pickled: bytes) -> None:
        offset, pickle_digest = self._small("data.pkl", pickled)
        self._pickle = {"nbytes": len(pickled), "offset": offset, HASH: pickle_digest}
        for name, value in ((".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()),
                            ("byteorder", sys.byteorder.encode())):
            self._small(name, value)

    def write_storage(self, entry: StorageEntry, view: memoryview,
                      on_chunk: Callable[[int], None] = lambda n: None) -> None:
        """Write one storage's bytes; each chunk is copied once, then hashed and written.

        `on_chunk(nbytes)` runs after each chunk (progress; it may raise to stop).
        """
        offset = self._begin(f"data/{entry.key}")
        hasher, crc, buf = xxhash.xxh3_64(), 0, memoryview(self._buffer)
        n = len(view)
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
        index = {"format": FORMAT, "version": FORMAT_VERSION, "hash": HASH,
                 "pickle": self._pickle, "storages": self._storages}
        self._small(CHECKSUMS_RECORD, json.dumps(index, sort_keys=True).encode())
        self._small("version", _TORCH_FILE_VERSION)
        self._small(".data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
        self._central_directory()

    def _central_directory(self) -> None:
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
                              min(size, _U32), min(start, _U32), 0))


# -- reading the index ------------------------------------------------------------------------

@dataclass(frozen=True)
class StorageCheck:
    key: str
    path: str
    nbytes: int
    expected: str
    offset: int | None  # known from the index (version 2), else looked up in the zip


def read_index(path: str) -> tuple[dict, torch._C.PyTorchFileReader]:
    """The checksum record (index) of `path`, with an open reader; raises on a broken archive."""
    try:
        reader = torch._C.PyTorchFileReader(path)
    except RuntimeError as e:
        raise CheckpointCorruptError(
            f"{path} is not a readable checkpoint archive ({e}); the file is truncated or "
            f"corrupted. Load the previous checkpoint.") from e
    if not reader.has_record(CHECKSUMS_RECORD):
        err = CheckpointFormatError(
            f"{path} has no xlakit checksums (record {CHECKSUMS_RECORD!r}): it was not written "
            f"by xlakit.save, so its integrity cannot be verified")
        err.add_note("Load it with xlakit.load(path, verify=False) or torch.load(path, "
                     "weights_only=True) if you trust it.")
        raise err
    try:
        meta = json.loads(bytes(reader.get_record(CHECKSUMS_RECORD)))
        if meta.get("format") != FORMAT or meta.get("hash") != HASH:
            raise ValueError(f"unknown format {meta.get('format')!r}/{meta.get('hash')!r}")
        version = meta.get("version")
        if not isinstance(version, int):
            raise ValueError(f"format version {version!r} is not a number")
    except (ValueError, RuntimeError) as e:
        raise CheckpointCorruptError(f"{path}: the checksum record is unreadable ({e})") from e
    if version > FORMAT_VERSION:
        err = CheckpointFormatError(
            f"{path} was written in xlakit checkpoint format version {version}; this xlakit "
            f"understands versions up to {FORMAT_VERSION}")
        err.add_note("Upgrade xlakit to load it, or read it with torch.load(path, weights_only=True) "
                     "without verification.")
        raise err
    return meta, reader


def iter_checks(meta: dict) -> Iterator[StorageCheck]:
    for key, rec in meta["storages"].items():
        path = rec["paths"][0] if "paths" in rec else rec["path"]
        yield StorageCheck(key, path, int(rec["nbytes"]), rec[HASH], rec.get("offset"))


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
