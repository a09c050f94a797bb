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

import sys

from collections import OrderedDict
from dataclasses import dataclass

import torch

from xlakit.errors import CheckpointSerializationError

_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_TORCH_VALUES = (torch.dtype, torch.Size, torch.device)
_CONTAINERS = (dict, list, tuple, set)  # a frozenset is refused: torch.load(weights_only=True) rejects it


class StorageEntry:
    """One storage to write.

    For a storage-backed tensor (CPU, CUDA) `storage` is its untyped storage, and
    `tensor` a uint8 view of all of it on its device (made when first asked for:
    the CPU path reads the storage's bytes directly); for an XLA tensor, `tensor`
    is the tensor itself. Either way `tensor` is what travels to the host, its
    bytes in order.
    """

    __slots__ = ("index", "path", "paths", "nbytes", "device_type", "storage", "_tensor")

    def __init__(self, index: int, path: str, tensor: torch.Tensor | None = None,
                 paths: list[str] | None = None, *, storage: torch.UntypedStorage | None = None,
                 device_type: str | None = None):
        self.index = index
        self.path = path  # the first tensor found on it, for messages
        self.paths = [] if paths is None else paths
        self.storage = storage
        self._tensor = tensor
        if tensor is not None:
            self.nbytes = tensor.numel() * tensor.element_size()
            self.device_type = tensor.device.type
        else:
            self.nbytes = storage.nbytes()
            self.device_type = device_type or storage.device.type

    @property
    def key(self) -> str:
        return str(self.index)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = _whole_storage(self.storage)
        return self._tensor

    def __repr__(self) -> str:
        return f"StorageEntry({self.index}, {self.path!r}, {self.nbytes} bytes on {self.device_type})"


class TensorRef:
    """One tensor of the state: its storage and where it sits in it (in elements)."""

    __slots__ = ("path", "tensor", "storage", "offset", "size", "stride", "dtype")

    def __init__(self, path: str, tensor: torch.Tensor, storage: StorageEntry, offset: int,
                 size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype):
        self.path, self.tensor, self.storage = path, tensor, storage
        self.offset, self.size, self.stride, self.dtype = offset, size, stride, dtype


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


def _whole_storage(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over every byte of `storage`, on its device (no copy)."""
    # The stride given explicitly: TorchTPU's set_ refuses sizes without strides.
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _xla_id(t: torch.Tensor) -> int:
    import torch_xla

    return torch_xla._XLAC._xla_get_tensor_id(t)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


class _Planner:
    """Walks the state once: every tensor (first occurrence, by object) and the storage it lives on.

    A plain recursive walk over lists, not a generator: with 100,000 tensors the
    per-tensor work is what a save of many small tensors costs.
    """

    def __init__(self) -> None:
        self.tensors: dict[int, TensorRef] = {}
        self.storages: list[StorageEntry] = []
        self.by_key: dict[object, StorageEntry] = {}
        self.dtypes: dict[int, tuple[torch.dtype, str]] = {}

    def walk(self, value: object, path: str) -> None:
        t = type(value)
        if t in _PLAIN:
            if id(value) not in self.tensors:
                self.add(path, value)
            return
        if t is dict or t is OrderedDict:
            for key, item in value.items():
                if not isinstance(key, _SCALARS):
                    raise refuse(_child(path, repr(key)), key, "dict keys must be strings or numbers")
                it = type(item)
                if it in _PLAIN or not (it is str or it is int or it is float or it is bool or item is None):
                    self.walk(item, f"{path}/{key}" if path else str(key))
            return
        if t is list or t is tuple or t is set:
            if t is tuple and hasattr(value, "_fields"):
                raise refuse(path, value, "named tuples are not loadable with weights_only=True")
            for i, item in enumerate(value):
                self.walk(item, f"{path}/{i}" if path else str(i))
            return
        self.check_other(value, path)

    def check_other(self, value: object, path: str) -> None:
        """Everything but a plain tensor, dict, list, tuple or set: allowed leaves, or refused."""
        if isinstance(value, torch.Tensor):
            _check_tensor(path, value)  # a subclass: refused there
        if isinstance(value, _SCALARS) or isinstance(value, _TORCH_VALUES):
            return
        if type(value) is frozenset:
            raise refuse(path, value, "torch.load(weights_only=True) cannot read a frozenset back; "
                                      "save it as a set, list or tuple")
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            raise refuse(path, value, "named tuples are not loadable with weights_only=True")
        if isinstance(value, dict):
            raise refuse(path, value, "only dict and OrderedDict mappings load weights-only")
        if isinstance(value, _CONTAINERS):
            raise refuse(path, value, "subclasses of list/tuple/set do not load weights-only")
        raise refuse(path, value, "it is not a tensor, number, string or container")

    def add(self, path: str, t: torch.Tensor) -> None:
        if t.layout is not _STRIDED or t.is_quantized or t.is_nested or t.is_meta:
            _check_tensor(path, t)
        if t.is_xla:
            self.add_xla(path, t)
            return
        storage = t.untyped_storage()
        key = storage._cdata  # the StorageImpl: one per storage, whatever its device
        entry = self.by_key.get(key)
        dtype = t.dtype
        if entry is None:
            entry = self.by_key[key] = StorageEntry(len(self.storages), path, storage=storage,
                                                    device_type="cpu" if t.is_cpu else t.device.type)
            self.storages.append(entry)
            self.dtypes[entry.index] = (dtype, path)
        elif self.dtypes[entry.index][0] != dtype:
            first_dtype, first_path = self.dtypes[entry.index]
            raise refuse(path, t, f"it shares its storage with {first_path!r} but views it as "
                                  f"{dtype} instead of {first_dtype}; torch.load cannot restore "
                                  f"that (save a .clone() of one of them)")
        entry.paths.append(path)
        self.tensors[id(t)] = TensorRef(path, t, entry, t.storage_offset(), tuple(t.shape), t.stride(), dtype)

    def add_xla(self, path: str, t: torch.Tensor) -> None:
        t_data = t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t
        key = ("xla", _xla_id(t_data))
        entry = self.by_key.get(key)
        if entry is None:
            entry = self.by_key[key] = StorageEntry(len(self.storages), path, t_data.detach())
            self.storages.append(entry)
        entry.paths.append(path)
        self.tensors[id(t)] = TensorRef(path, t, entry, 0, tuple(t.shape), _contiguous_stride(tuple(t.shape)),
                                        t.dtype)


def plan(state: object) -> Plan:
    """Every tensor of `state` and the storages they live on; raises on what cannot be saved."""
    planner = _Planner()
    try:
        planner.walk(state, "")
    except RecursionError:
        raise refuse("", state, f"it holds a container inside itself (a cycle), or nests containers deeper than "
                                f"Python's recursion limit ({sys.getrecursionlimit()}); save a tree of them") from None
    return Plan(planner.tensors, planner.storages)


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(size):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))
