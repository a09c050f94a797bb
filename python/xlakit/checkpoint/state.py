"""Plan a save: walk the nested state, name its tensors, find their storages, refuse what cannot be saved.

A tensor's name is its path in the state (`model/layers.0.weight`,
`optimizer/state/3/exp_avg`); every error and checksum refers to it.

The plan is storage-faithful, as `torch.save` is: tensors that share a
storage (tied weights, views, `state_dict()`'s detached copies of one
parameter) point at one storage, written once, and come back sharing it; a
view keeps its offset and strides into its storage, and a stride-0 `expand`
stays the few bytes it really holds. XLA tensors have no storage in torch's
sense: each distinct XLA tensor (by torch_xla's tensor id, which detached
copies share) is one storage of its own, copied to the host contiguously.

Everything that cannot round-trip through `torch.load(weights_only=True)` is
refused here, naming its path, before a byte is written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from xlakit.errors import CheckpointSerializationError

_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_TORCH_VALUES = (torch.dtype, torch.Size, torch.device)
_CONTAINERS = (dict, list, tuple, set)  # a frozenset is refused: torch.load(weights_only=True) rejects it


@dataclass
class StorageEntry:
    """One storage to write: `tensor` is what travels to the host (its bytes, in order).

    For a storage-backed tensor (CPU, CUDA) `tensor` is a uint8 view of the whole
    storage on its device; for an XLA tensor, the tensor itself.
    """

    index: int
    path: str  # the first tensor found on it, for messages
    tensor: torch.Tensor
    paths: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return str(self.index)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def device_type(self) -> str:
        return self.tensor.device.type


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the state: its storage and where it sits in it (in elements)."""

    path: str
    tensor: torch.Tensor
    storage: StorageEntry
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Plan:
    """The state's tensors (by object id, for the pickler) and its storages in write order."""

    tensors: dict[int, TensorRef]
    storages: list[StorageEntry]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages)


def _child(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


def refuse(path: str, value: object, why: str) -> CheckpointSerializationError:
    where = path or "the state itself"
    err = CheckpointSerializationError(
        f"cannot save {where}: it is a {type(value).__module__}.{type(value).__qualname__}; {why}")
    err.add_note("A weights-only checkpoint holds dense tensors, numbers, strings, bools, None, "
                 "torch dtypes/sizes/devices and dicts, lists and tuples of them. Save an "
                 "object's state_dict() (or a plain dict of its fields) instead of the object.")
    return err


def _check_tensor(path: str, t: torch.Tensor) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise refuse(path, t, "tensor subclasses other than nn.Parameter cannot be saved weights-only")
    if t.device.type == "meta":
        raise refuse(path, t, "it is on the meta device and holds no data")
    if t.layout != torch.strided:
        raise refuse(path, t, f"its layout is {t.layout}; only dense (strided) tensors are saved")
    if t.is_quantized:
        raise refuse(path, t, f"it is quantized ({t.dtype}); save t.int_repr() with its scale and "
                              f"zero point, or t.dequantize()")
    if t.is_nested:
        raise refuse(path, t, "nested tensors are not saved; save t.unbind() as a list")


def _walk(value: object, path: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        _check_tensor(path, value)
        if id(value) not in seen:
            seen.add(id(value))
            yield path, value
        return
    if isinstance(value, _SCALARS) or isinstance(value, _TORCH_VALUES):
        return
    if type(value) is frozenset:
        raise refuse(path, value, "torch.load(weights_only=True) cannot read a frozenset back; "
                                  "save it as a set, list or tuple")
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise refuse(path, value, "named tuples are not loadable with weights_only=True")
    if isinstance(value, dict):
        if type(value) not in (dict, OrderedDict):
            raise refuse(path, value, "only dict and OrderedDict mappings load weights-only")
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise refuse(_child(path, repr(key)), key, "dict keys must be strings or numbers")
            yield from _walk(item, _child(path, key), seen)
        return
    if isinstance(value, _CONTAINERS):
        if type(value) not in _CONTAINERS:
            raise refuse(path, value, "subclasses of list/tuple/set do not load weights-only")
        for i, item in enumerate(value):
            yield from _walk(item, _child(path, i), seen)
        return
    raise refuse(path, value, "it is not a tensor, number, string or container")


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over every byte of `t`'s storage, on its device (no copy)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),))


def _xla_id(t: torch.Tensor) -> int:
    import torch_xla

    return torch_xla._XLAC._xla_get_tensor_id(t)


def plan(state: object) -> Plan:
    """Every tensor of `state` and the storages they live on; raises on what cannot be saved."""
    tensors: dict[int, TensorRef] = {}
    storages: list[StorageEntry] = []
    by_key: dict[tuple, StorageEntry] = {}
    dtypes: dict[int, tuple[torch.dtype, str]] = {}
    for path, t in _walk(state, "", set()):
        if t.device.type == "xla":
            if t.is_conj() or t.is_neg():
                t_data = t.resolve_conj().resolve_neg()
            else:
                t_data = t
            key = ("xla", _xla_id(t_data))
            entry = by_key.get(key)
            if entry is None:
                entry = by_key[key] = StorageEntry(len(storages), path, t_data.detach())
                storages.append(entry)
            entry.paths.append(path)
            tensors[id(t)] = TensorRef(path, t, entry, 0, tuple(t.shape),
                                       _contiguous_stride(tuple(t.shape)), t.dtype)
            continue
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage._cdata)
        entry = by_key.get(key)
        if entry is None:
            entry = by_key[key] = StorageEntry(len(storages), path, _whole_storage(t))
            storages.append(entry)
            dtypes[entry.index] = (t.dtype, path)
        elif dtypes[entry.index][0] != t.dtype:
            first_dtype, first_path = dtypes[entry.index]
            raise refuse(path, t, f"it shares its storage with {first_path!r} but views it as "
                                  f"{t.dtype} instead of {first_dtype}; torch.load cannot restore "
                                  f"that (save a .clone() of one of them)")
        entry.paths.append(path)
        tensors[id(t)] = TensorRef(path, t, entry, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                   t.dtype)
    return Plan(tensors, storages)


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(size):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))
