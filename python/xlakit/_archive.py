"""The checkpoint file: torch.save's zip archive, written as a stream, plus checksums.

The layout is exactly what `torch.load(path, weights_only=True)` reads
(`data.pkl`, `.format_version`, `.storage_alignment`, `byteorder`,
`data/<key>`), so a checkpoint never needs xlakit to be read. Unlike
`torch.save`, the pickle is written first from tensor *metadata* only (every
tensor as a contiguous storage of its own), and each storage is written when
its bytes reach the host: memory stays bounded by one transfer batch. The
extra record `xlakit/checksums.json`, which torch.load ignores, holds an
xxh3-64 digest of the pickle and of every storage, keyed by tensor path.
"""

from __future__ import annotations

import ctypes
import io
import json
import mmap
import pickle
import sys
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch
import xxhash

from xlakit._tree import TensorEntry
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointSerializationError

CHECKSUMS_RECORD = "xlakit/checksums.json"
FORMAT = "xlakit-checkpoint"
FORMAT_VERSION = 1
HASH = "xxh3_64"
_PICKLE_PROTOCOL = 2  # torch.save's default; the weights-only unpickler expects it
_ALIGNMENT = 64


def digest(view: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(view)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype)."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(size):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


class _StorageRef:
    """Stands for one storage in the pickle; persistent_id turns it into a record key."""

    def __init__(self, entry: TensorEntry, legacy_type: object | None):
        self.entry = entry
        self.legacy_type = legacy_type


class _PlainTensor:
    """A Parameter's data, pickled as a plain tensor inside `_rebuild_parameter`."""

    def __init__(self, entry: TensorEntry):
        self.entry = entry


class _MetadataPickler(pickle.Pickler):
    def __init__(self, file: BinaryIO, entries: list[TensorEntry]):
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self._by_id = {id(e.tensor): e for e in entries}
        self._legacy = torch.storage._dtype_to_storage_type_map()

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            e = obj.entry
            if obj.legacy_type is not None:
                return ("storage", obj.legacy_type, str(e.index), "cpu", e.tensor.numel())
            return ("storage", torch.UntypedStorage, str(e.index), "cpu", e.nbytes)
        return None

    def _rebuild(self, entry: TensorEntry, requires_grad: bool):
        t = entry.tensor
        legacy_name = self._legacy.get(t.dtype)
        stride = _contiguous_stride(t.shape)
        if legacy_name is not None:
            ref = _StorageRef(entry, getattr(torch, legacy_name))
            return (torch._utils._rebuild_tensor_v2,
                    (ref, 0, tuple(t.shape), stride, requires_grad, OrderedDict()))
        ref = _StorageRef(entry, None)
        return (torch._utils._rebuild_tensor_v3,
                (ref, 0, tuple(t.shape), stride, requires_grad, OrderedDict(), t.dtype))

    def reducer_override(self, obj):
        if isinstance(obj, _PlainTensor):
            return self._rebuild(obj.entry, False)
        if isinstance(obj, torch.Tensor):
            entry = self._by_id[id(obj)]
            if isinstance(obj, torch.nn.Parameter):
                return (torch._utils._rebuild_parameter,
                        (_PlainTensor(entry), obj.requires_grad, OrderedDict()))
            return self._rebuild(entry, obj.requires_grad)
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
    except Exception:  # noqa: BLE001 - rebuilding against empty storages may fail; the globals passed
        pass


def pickle_state(state: object, entries: list[TensorEntry]) -> bytes:
    buf = io.BytesIO()
    try:
        _MetadataPickler(buf, entries).dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise CheckpointSerializationError(f"the state cannot be pickled: {e}") from e
    data = buf.getvalue()
    _check_weights_only(data)
    return data


class _Sink:
    """The file as torch's zip writer sees it; inert once the save is abandoned.

    torch's writer finishes the archive from its destructor when it was not
    finished explicitly; writing then into a closed file would abort the
    process, so after `close()` every write is dropped.
    """

    def __init__(self, file: BinaryIO):
        self._file: BinaryIO | None = file

    def write(self, data) -> int:
        if self._file is None:
            return len(data)
        return self._file.write(data)

    def close(self) -> None:
        self._file = None


class ArchiveWriter:
    """Streams one checkpoint archive into an open binary file.

    Use as a context manager: on an error the archive is abandoned without
    another byte reaching the file.
    """

    def __init__(self, file: BinaryIO, *, compute_crc32: bool):
        self._sink = _Sink(file)
        self._zip = torch._C.PyTorchFileWriter(self._sink, compute_crc32, _ALIGNMENT)
        self._finished = False
        self._checksums: dict[str, dict] = {}
        self._pickle = {}

    def write_header(self, pickled: bytes) -> None:
        self._pickle = {"nbytes": len(pickled), HASH: digest(pickled)}
        self._zip.write_record("data.pkl", pickled, len(pickled))
        for name, value in ((".format_version", "1"), (".storage_alignment", str(_ALIGNMENT)),
                            ("byteorder", sys.byteorder)):
            self._zip.write_record(name, value, len(value))

    def write_tensor(self, entry: TensorEntry, host: torch.Tensor) -> None:
        """Write one storage from a contiguous CPU tensor holding `entry`'s values."""
        view = tensor_bytes(host)
        self._checksums[str(entry.index)] = {
            "path": entry.path, "nbytes": len(view), "dtype": str(host.dtype).removeprefix("torch."),
            "shape": list(host.shape), HASH: digest(view)}
        # A storage aliasing exactly these bytes: zero-copy, whatever the tensor's offset.
        data = torch.frombuffer(view, dtype=torch.uint8).untyped_storage() if len(view) else b""
        self._zip.write_record(f"data/{entry.index}", data, len(view))

    def finish(self) -> None:
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "hash": HASH,
                "pickle": self._pickle, "storages": self._checksums}
        blob = json.dumps(meta, sort_keys=True).encode()
        self._zip.write_record(CHECKSUMS_RECORD, blob, len(blob))
        self._zip.write_end_of_file()
        self._finished = True

    def __enter__(self) -> "ArchiveWriter":
        return self

    def __exit__(self, *exc) -> None:
        if self._finished:
            return
        # Abandoned: finalise now, into the inert sink, so that torch's destructor
        # does not (a C++ exception there would abort the process).
        self._sink.close()
        try:
            self._zip.write_end_of_file()
        except RuntimeError:
            pass  # the writer's position check fails after a failed write; nothing reaches the file


@dataclass(frozen=True)
class StorageCheck:
    key: str
    path: str
    nbytes: int
    expected: str


def read_checksums(path: str) -> tuple[dict, torch._C.PyTorchFileReader]:
    """The checksum record of `path`, with the open reader; raises on a broken archive."""
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
    except (ValueError, RuntimeError) as e:
        raise CheckpointCorruptError(f"{path}: the checksum record is unreadable ({e})") from e
    return meta, reader


def iter_checks(meta: dict) -> Iterator[StorageCheck]:
    for key, rec in meta["storages"].items():
        yield StorageCheck(key, rec["path"], int(rec["nbytes"]), rec[HASH])


def verify_record(mapped: mmap.mmap, reader, name: str, nbytes: int, expected: str,
                  what: str, path: str, tensor: str | None) -> None:
    try:
        offset = reader.get_record_offset(name)
    except RuntimeError as e:
        raise CheckpointCorruptError(f"{path}: {what} is missing from the archive ({e})",
                                     tensor=tensor) from e
    if offset + nbytes > len(mapped):
        raise CheckpointCorruptError(
            f"{path}: {what} should hold {nbytes} bytes at offset {offset}, but the file ends at "
            f"{len(mapped)}: the file is truncated", tensor=tensor)
    actual = digest(memoryview(mapped)[offset:offset + nbytes])
    if actual != expected:
        raise CheckpointCorruptError(
            f"{path}: {what} is corrupt: its {HASH} is {actual}, the checkpoint recorded {expected}",
            tensor=tensor)
