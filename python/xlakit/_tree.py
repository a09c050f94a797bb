"""Walk a nested training state: find its tensors, name them, refuse what cannot be saved.

A tensor's name is its path in the state (`model/layers.0.weight`,
`optimizer/state/3/exp_avg`); every error and checksum refers to it. The walk
follows the order the pickler will (insertion order of dicts, then sequence
order) so the n-th unique tensor found is the n-th storage written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from xlakit.errors import CheckpointSerializationError

_SCALARS = (str, bytes, int, float, bool, complex, type(None))
_TORCH_VALUES = (torch.dtype, torch.Size, torch.device)
_CONTAINERS = (dict, list, tuple, set, frozenset)


@dataclass
class TensorEntry:
    """One tensor of the state: where it is, what it is, how many bytes it holds."""

    index: int
    path: str
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def device_type(self) -> str:
        return self.tensor.device.type


def _child(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


def _refuse(path: str, value: object, why: str) -> CheckpointSerializationError:
    where = path or "the state itself"
    err = CheckpointSerializationError(
        f"cannot save {where}: it is a {type(value).__module__}.{type(value).__qualname__}; {why}")
    err.add_note("A weights-only checkpoint holds tensors, numbers, strings, bools, None, "
                 "torch dtypes/sizes/devices and dicts, lists and tuples of them. Save an "
                 "object's state_dict() (or a plain dict of its fields) instead of the object.")
    return err


def _walk(value: object, path: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise _refuse(path, value, "tensor subclasses other than nn.Parameter cannot be saved "
                                       "weights-only")
        if value.device.type == "meta":
            raise _refuse(path, value, "it is on the meta device and holds no data")
        if value.layout != torch.strided:
            raise _refuse(path, value, f"its layout is {value.layout}; only dense tensors are saved")
        if id(value) not in seen:
            seen.add(id(value))
            yield path, value
        return
    if isinstance(value, _SCALARS) or isinstance(value, _TORCH_VALUES):
        return
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise _refuse(path, value, "named tuples are not loadable with weights_only=True")
    if isinstance(value, dict):
        if type(value) not in (dict, OrderedDict):
            raise _refuse(path, value, "only dict and OrderedDict mappings load weights-only")
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise _refuse(_child(path, repr(key)), key, "dict keys must be strings or numbers")
            yield from _walk(item, _child(path, key), seen)
        return
    if isinstance(value, _CONTAINERS):
        if type(value) not in _CONTAINERS:
            raise _refuse(path, value, "subclasses of list/tuple/set do not load weights-only")
        for i, item in enumerate(value):
            yield from _walk(item, _child(path, i), seen)
        return
    raise _refuse(path, value, "it is not a tensor, number, string or container")


def collect(state: object) -> list[TensorEntry]:
    """The unique tensors of `state` in pickling order; raises on unsaveable objects."""
    seen: set[int] = set()
    return [TensorEntry(i, p, t) for i, (p, t) in enumerate(_walk(state, "", seen))]

