"""What a checkpoint path is and what it holds, from metadata only (no tensor data is read).

`kind_of` tells the kinds apart: an xlakit file (a torch zip with xlakit's
checksum record), a plain `torch.save` file, a sharded, replica-parallel or DCP
folder (by the format of its commit record), a manager step folder, a manager folder. The
tensor listing of a file comes from torch's weights-only unpickler over a
memory map (`mmap=True`): shapes, dtypes and storages, without touching the
data; for a DCP folder from DCP's metadata file.

`flatten` names each tensor and value by its path (`model/layers.0.weight`).
Those names are not enough to tell two states apart (a list and a dict keyed
"0" give the same names), so `routes` gives each name the containers and key
types that lead to it; and a state in which two entries get the same name
(`{"a/b": x, "a": {"b": y}}`) is refused rather than shown with one missing.
"""

from __future__ import annotations

import errno
import io
import math
import pickle
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xlakit.checkpoint.format import archive, folders
from xlakit.checkpoint.stepstore import steps
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointIncompleteError, XlakitError

XLAKIT_FILE, TORCH_FILE, SHARDED, REPLICATED, DCP, STEP, MANAGER, FOLDER = (
    "xlakit-file", "torch-file", "sharded", "replicated", "dcp", "step", "manager", "folder")
KIND_NAMES = {XLAKIT_FILE: "an xlakit checkpoint file", TORCH_FILE: "a torch.save file",
              SHARDED: "a sharded checkpoint folder", DCP: "a torch.distributed.checkpoint folder",
              REPLICATED: "a replica-parallel replicated checkpoint folder",
              STEP: "one step of a manager folder", MANAGER: "a manager folder",
              FOLDER: "a folder holding no checkpoint"}
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"  # torch.save's legacy (pre-zip) format starts with a pickle


@dataclass(frozen=True)
class Kind:
    """What `path` is; `record` is its commit record (folders) or step record (step folders)."""

    kind: str
    path: Path
    record: dict | None = None
    note: str = ""
    unfinished: bool = False  # a folder holding the files of a save that never committed


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
        _refuse_safetensors(path)
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
        if record.get("format") == folders.REPLICATED_FORMAT:
            return Kind(REPLICATED, path, record)
        raise CheckpointFormatError(f"{path / folders.COMMIT_RECORD} has format {record.get('format')!r}; "
                                    f"this xlakit knows {folders.SHARDED_FORMAT!r}, {folders.REPLICATED_FORMAT!r} "
                                    f"and {folders.DCP_FORMAT!r}")
    try:
        step = steps.read_record(path)
    except CheckpointCorruptError as e:
        e.add_note(steps.damage_note(path))
        raise
    if step is not None:
        return Kind(STEP, path, step)
    found = steps.scan(path)
    if found.committed or found.pending or found.damaged or found.trash or found.locked:
        return Kind(MANAGER, path)
    return Kind(FOLDER, path, note=folders.describe_folder(path), unfinished=_holds_save_files(path))


def _holds_save_files(folder: Path) -> bool:
    """Whether a folder without a commit record holds what a DCP, sharded or replica-parallel save writes."""
    return any(p.name == ".metadata" or p.suffix == ".distcp" or p.name.startswith(("shard-", "share-"))
               for p in folder.iterdir())


def _refuse_safetensors(path: Path) -> None:
    """Refuse a safetensors file by its header: 8 bytes of little-endian JSON length, then `{`.

    Checked before anything else: its first byte can be 0x80, which would pass for a pickle.
    """
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return
    (header_bytes,) = struct.unpack("<Q", head[:8])
    if header_bytes <= path.stat().st_size - 8:
        raise CheckpointFormatError(
            f"{path} is a safetensors file (a {header_bytes}-byte JSON header), not a checkpoint that "
            f"`xlakit ckpt` reads (xlakit.save, torch.save, sharded and DCP folders); read it with "
            f"safetensors.torch.load_file")


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
    try:
        return checkpoint.load(path, verify=False, mmap=zipped)
    except (XlakitError, OSError) as e:
        if isinstance(e.__cause__, pickle.UnpicklingError):
            raise _pickled_code_refused(path, e.__cause__) from e
        raise
    except Exception as e:  # torch's unpickler meets damage with any error (IndexError, AssertionError, ...)
        raise CheckpointCorruptError(f"{path} cannot be read: torch's unpickler failed with "
                                     f"{type(e).__name__}: {str(e)[:200]}; the file is damaged or was "
                                     f"not written by torch.save") from e


def _pickled_code_refused(path: Path, cause: pickle.UnpicklingError) -> CheckpointFormatError:
    """The refusal of a weights-only load, without torch's advice to retry running pickled code."""
    from xlakit.checkpoint.format import pickled

    reason = next((line.strip() for line in str(cause).splitlines() if "Unsupported" in line), "")
    return CheckpointFormatError(f"{path} holds pickled objects other than tensors, numbers, strings and "
                                 f"containers; `xlakit ckpt` never runs pickled code, so it cannot read "
                                 f"this file{': ' + reason.split('. ')[0] if reason else ''}"
                                 f"{pickled.naming_refused(cause)}")


def flatten(value: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, other values) of a nested state, named by their paths (`model/layers.0.weight`).

    Empty containers are values. Raises `CheckpointFormatError` when two entries get the same name.
    """
    tensors, values, _ = flatten_routed(value, prefix)
    return tensors, values


def flatten_routed(value: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """`flatten`'s (tensors, values), and each name's route: the containers and keys that lead to
    it, e.g. `['layers'][0]` for a list and `['layers']['0']` for a dict (states with the same
    names can differ there)."""
    import torch

    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    routes: dict[str, str] = {}

    def leaf(name: str, route: str, v: Any) -> None:
        if name in routes:
            raise CheckpointFormatError(
                f"two entries of the state have the same name {name!r} ({routes[name]} and {route}): a key "
                f"holds '/', the separator of names, or a key is both a number and a string; rename the "
                f"key so that every tensor and value has a name of its own")
        routes[name] = route
        (tensors if isinstance(v, torch.Tensor) else values)[name] = v

    _walk(value, prefix, leaf)
    return tensors, values, routes


def tensor_count(value: Any) -> int:
    import torch

    count = 0

    def leaf(name: str, route: str, v: Any) -> None:
        nonlocal count
        count += isinstance(v, torch.Tensor)

    _walk(value, "", leaf)
    return count


def _walk(value: Any, prefix: str, leaf: Callable[[str, str, Any], None]) -> None:
    """Call `leaf(name, route, value)` for every tensor, value and empty container of a state."""
    import torch

    pending = [(value, prefix, "")]
    while pending:  # a stack, not a recursive closure: that would be a cycle holding every tensor
        v, name, route = pending.pop()
        if isinstance(v, (dict, list, tuple)) and len(v) and not isinstance(v, torch.Tensor):
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in reversed(list(items)):
                step = f"[{k!r}]" if isinstance(v, dict) else f"[{k}]" if isinstance(v, list) else f"({k})"
                pending.append((item, f"{name}/{k}" if name else str(k), route + step))
        else:
            leaf(name or "(state)", route or "(state)", v)


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


def json_safe(value: Any) -> Any:
    """`value` with each float that is not finite as a string: JSON has no NaN nor Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


_REPR_CHARS = 160


def jsonable(value: Any, *, whole: bool = False) -> Any:
    """A non-tensor value as JSON can show it; an object's repr shortened unless `whole` (a converted
    file's metadata keeps it all)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v, whole=whole) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, whole=whole) for k, v in value.items()}
    if isinstance(value, io.BytesIO):  # its bytes, not its address
        data = value.getvalue()
        return f"io.BytesIO({data!r})" if len(data) <= 64 else f"io.BytesIO({len(data)} bytes)"
    shown = repr(value)  # an object the user allowed (`--allow-global`): a numpy array of 624 numbers
    return shown if whole or len(shown) <= _REPR_CHARS else f"{shown[:_REPR_CHARS]}... ({len(shown)} characters)"


def describe_file(path: Path, kind: Kind) -> dict:
    tensors, values = flatten(load_mapped(path))
    meta = archive.read_index(str(path))[0] if kind.kind == XLAKIT_FILE else None
    return {"path": str(path), "kind": kind.kind, "bytes": path.stat().st_size,
            "format_version": meta["version"] if meta else None, "checksums": meta is not None,
            "checksum_count": _checksum_count(meta), "note": kind.note,
            "tensors": [asdict(t) for t in tensor_infos(tensors)],
            "values": {k: jsonable(v) for k, v in values.items()}}


def replicated_state(path: Path, record: dict, load: Callable[[Path], Any] = load_mapped) -> Any:
    """The whole state of a replica-parallel folder: every share its commit `record` names, read by
    `load` (mapped, by default: no data read) and put back together."""
    from xlakit.checkpoint.multirank import replicas

    return replicas.assemble({e["rank"]: load(path / e["file"]) for e in record["shares"]})


def describe_replicated(path: Path, record: dict) -> dict:
    """A replica-parallel folder: its format and version, each share (rank, file, bytes), the whole state."""
    tensors, values = flatten(replicated_state(path, record))
    shares = [{"rank": e["rank"], "file": e["file"], "bytes": e["bytes"]} for e in record["shares"]]
    return {"path": str(path), "kind": REPLICATED, "format": record["format"], "version": record["version"],
            "world": record["world"], "writer_rank": record["writer_rank"], "id": record["id"],
            "commit": record, "shares": shares, "bytes": sum(e["bytes"] for e in shares),
            "tensors": [asdict(t) for t in tensor_infos(tensors)], "values": {k: jsonable(v) for k, v in values.items()}}


def _checksum_count(meta: dict | None) -> int:
    """Records the index checks: the pickle, the structure record (if any), every storage."""
    if meta is None:
        return 0
    return 1 + ("structure" in meta) + sum(1 for _ in archive.iter_checks(meta))


def describe_dcp(path: Path, record: dict) -> dict:
    from xlakit.checkpoint.format import dcp_metadata

    tensors, values = dcp_entries(dcp_metadata.folder_reader(path).read_metadata())
    return {"path": str(path), "kind": DCP, "commit": record, "tensors": tensors,
            "values": values, "bytes": sum(f["nbytes"] for f in record["files"].values())}


def dcp_entries(metadata: Any) -> tuple[list[dict], list[str]]:
    """A DCP checkpoint's tensors (name, dtype, shape, bytes, chunks) and other values, from its metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, values = [], []
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            nbytes = item.size.numel() * _itemsize(item.properties.dtype)
            tensors.append({"name": fqn, "dtype": str(item.properties.dtype).removeprefix("torch."),
                            "shape": list(item.size), "bytes": nbytes, "chunks": len(item.chunks)})
        else:
            values.append(fqn)
    return tensors, values


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
