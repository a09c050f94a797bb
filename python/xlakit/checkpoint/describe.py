"""What a checkpoint path is and what it holds, from metadata only (no tensor data is read).

`kind_of` tells the kinds apart: an xlakit file (a torch zip with xlakit's
checksum record), a plain `torch.save` file, a sharded or DCP folder (by the
format of its commit record), a manager step folder, a manager folder. The
tensor listing of a file comes from torch's weights-only unpickler over a
memory map (`mmap=True`): shapes, dtypes and storages, without touching the
data; for a DCP folder from DCP's metadata file.
"""

from __future__ import annotations

import errno
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xlakit.checkpoint import archive, folders, steps
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointIncompleteError

XLAKIT_FILE, TORCH_FILE, SHARDED, DCP, STEP, MANAGER, FOLDER = (
    "xlakit-file", "torch-file", "sharded", "dcp", "step", "manager", "folder")
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # torch.save's legacy (pre-zip) format starts with a pickle


@dataclass(frozen=True)
class Kind:
    """What `path` is; `record` is its commit record (folders) or step record (step folders)."""

    kind: str
    path: Path
    record: dict | None = None
    note: str = ""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    storage: int  # tensors with the same number share one storage
    shared_with: list[str]


def kind_of(path: Path) -> Kind:
    """Tell what `path` is; raises when it is missing or no checkpoint of any kind."""
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, f"no such file or folder: {path}", str(path))
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(4)
        if head == _ZIP_MAGIC:
            try:
                archive.read_index(str(path))
            except CheckpointFormatError as e:
                if "no xlakit checksums" in str(e):
                    return Kind(TORCH_FILE, path, note="a torch.save file: no xlakit checksums")
                raise
            return Kind(XLAKIT_FILE, path)
        if head[:1] == _PICKLE_MAGIC:
            return Kind(TORCH_FILE, path, note="torch.save's legacy (pre-zip) format: no xlakit checksums")
        raise CheckpointFormatError(f"{path} is not a checkpoint: neither a torch zip archive nor a legacy "
                                    f"torch.save pickle (it starts with {head!r})")
    record = folders.read_json_record(path)
    if record is not None:
        if record.get("format") == folders.SHARDED_FORMAT:
            return Kind(SHARDED, path, record)
        if record.get("format") == folders.DCP_FORMAT:
            return Kind(DCP, path, record)
        raise CheckpointFormatError(f"{path / folders.COMMIT_RECORD} has format {record.get('format')!r}; "
                                    f"this xlakit knows {folders.SHARDED_FORMAT!r} and {folders.DCP_FORMAT!r}")
    try:
        step = steps.read_record(path)
    except ValueError as e:
        raise CheckpointCorruptError(f"{path / steps.STEP_RECORD} is not a step record ({e})") from e
    if step is not None:
        return Kind(STEP, path, step)
    found = steps.scan(path)
    if found.committed or found.pending or found.trash:
        return Kind(MANAGER, path)
    return Kind(FOLDER, path, note=folders.describe_folder(path))


def step_checkpoint(kind: Kind) -> Kind:
    """The checkpoint inside a committed step folder."""
    problem = steps.commit_problem(kind.path, kind.record)
    if problem is not None:
        raise CheckpointIncompleteError(f"{kind.path}: step {kind.record['step']} is not committed: {problem}")
    return kind_of(kind.path / kind.record["checkpoint"])


def load_mapped(path: Path) -> Any:
    """A file's state with tensors mapped from the file (their data is not read); weights-only."""
    from xlakit import checkpoint

    with open(path, "rb") as f:
        zipped = f.read(4) == _ZIP_MAGIC  # torch maps only its zip format
    return checkpoint.load(path, verify=False, mmap=zipped)


def flatten(value: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, other values) of a nested state, named by their paths (`model/layers.0.weight`)."""
    import torch

    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, torch.Tensor):
            tensors[path] = v
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(item, f"{path}/{k}" if path else str(k))
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, f"{path}/{i}" if path else str(i))
        else:
            values[path or "(state)"] = v

    try:
        walk(value, prefix)
    finally:
        del walk  # a closure that calls itself is a cycle: it would hold the tensors until a gc
    return tensors, values


def tensor_infos(tensors: dict[str, Any]) -> list[TensorInfo]:
    """Each tensor with dtype, shape, bytes, and the tensors sharing its storage."""
    by_storage: dict[int, list[str]] = {}
    ids: dict[str, int] = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else -len(ids) - 1
        sid = ids.setdefault(f"#{key}", len(ids))
        by_storage.setdefault(sid, []).append(name)
        ids[name] = sid
    return [TensorInfo(name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size(),
                       ids[name], [n for n in by_storage[ids[name]] if n != name])
            for name, t in tensors.items()]


def jsonable(value: Any) -> Any:
    """A non-tensor value as JSON can show it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)


def describe_file(path: Path, kind: Kind) -> dict:
    tensors, values = flatten(load_mapped(path))
    meta = archive.read_index(str(path))[0] if kind.kind == XLAKIT_FILE else None
    return {"path": str(path), "kind": kind.kind, "bytes": path.stat().st_size,
            "format_version": meta["version"] if meta else None, "checksums": meta is not None,
            "checksum_count": _checksum_count(meta), "note": kind.note,
            "tensors": [asdict(t) for t in tensor_infos(tensors)],
            "values": {k: jsonable(v) for k, v in values.items()}}


def _checksum_count(meta: dict | None) -> int:
    """Records the index checks: the pickle, the structure record (if any), every storage."""
    if meta is None:
        return 0
    return 1 + ("structure" in meta) + sum(1 for _ in archive.iter_checks(meta))


def describe_dcp(path: Path, record: dict) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    tensors, values = [], []
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            nbytes = item.size.numel() * _itemsize(item.properties.dtype)
            tensors.append({"name": fqn, "dtype": str(item.properties.dtype).removeprefix("torch."),
                            "shape": list(item.size), "bytes": nbytes, "chunks": len(item.chunks)})
        else:
            values.append(fqn)
    return {"path": str(path), "kind": DCP, "commit": record, "tensors": tensors,
            "values": values, "bytes": sum(f["nbytes"] for f in record["files"].values())}


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
