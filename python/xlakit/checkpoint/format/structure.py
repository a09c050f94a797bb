"""The state's structure as JSON: what xlakit's own reader rebuilds instead of unpickling.

The pickle in a checkpoint is for `torch.load`; xlakit reads the same state
from this record instead, which needs no unpickler at all (nothing in a file
can run code) and is several times faster on states with many tensors: JSON
is parsed in C and each tensor is one `set_` on its storage.

Every node is a JSON scalar (null, bool, int, float, string) or a tagged list:
`["d", [[k, v], ...]]` dict, `"o"` OrderedDict (a third item holds its attributes,
like `state_dict()`'s `_metadata`), `"l"` list, `"u"` tuple,
`"s"` set, `"f"` frozenset, `["b", base64]` bytes, `["c", re, im]` complex,
`["dt", name]` dtype, `["z", dims]` Size, `["dv", name]` device, `["r", n]`
the n-th tensor or mutable container again (shared references stay shared), and
`["t", storage, offset, dtype, flags, *size, *stride]` a tensor: `storage` is
its row in the index, `dtype` an entry of the root's dtype table, `flags` a
bit mask (requires_grad, Parameter, conj, neg). The root is
`{"dtypes": [...], "state": node}`. The plan (`state.plan`) has already
refused everything else.

Floats keep their bits as torch.load keeps them: JSON round-trips every float
but a NaN, which it writes as `NaN` and reads back as the canonical one. When
the state holds a NaN with other bits (a payload, the sign, a signalling NaN),
the root gains `"nan_bits"`: the 64 bits of every NaN, as 16 hex digits, in the
order the NaNs appear in the document. Readers before it ignore the key and
read canonical NaNs, as they always did; the format version is unchanged.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from xlakit.checkpoint.format.state import Plan
from xlakit.errors import CheckpointCorruptError

_CONTAINER_TAGS = {dict: "d", OrderedDict: "o", list: "l", tuple: "u", set: "s", frozenset: "f"}
_MUTABLE = (dict, OrderedDict, list, set)
_NAN_BITS = "nan_bits"
_CANONICAL_NAN = "7ff8000000000000"  # what JSON's NaN reads back as


def _float_bits(v: float) -> str:
    return struct.pack(">d", v).hex()


def _float_of(bits: str) -> float:
    return struct.unpack(">d", bytes.fromhex(bits))[0]


REQUIRES_GRAD, PARAMETER, CONJ, NEG = 1, 2, 4, 8


class TensorSpec:
    """A tensor of the checkpoint as the structure describes it (no data).

    Made by `decode` with the record's arguments, so it is its own tensor function.
    """

    __slots__ = ("storage", "offset", "size", "stride", "dtype", "flags")

    def __init__(self, storage: int, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                 dtype: torch.dtype, flags: int):
        self.storage = storage  # the storage's row in the index
        self.offset, self.size, self.stride, self.dtype, self.flags = offset, size, stride, dtype, flags

    requires_grad = property(lambda self: bool(self.flags & REQUIRES_GRAD))
    parameter = property(lambda self: bool(self.flags & PARAMETER))
    conj = property(lambda self: bool(self.flags & CONJ))
    neg = property(lambda self: bool(self.flags & NEG))

    @property
    def contiguous(self) -> bool:
        expected = 1
        for n, stride in zip(reversed(self.size), reversed(self.stride)):
            if n > 1 and stride != expected:
                return False
            expected *= max(n, 1)
        return True

    def __repr__(self) -> str:
        return (f"TensorSpec(storage={self.storage}, offset={self.offset}, size={self.size}, "
                f"stride={self.stride}, dtype={self.dtype}, flags={self.flags})")


def encode(state: object, plan: Plan) -> bytes:
    """The structure of `state` (already planned) as compact JSON bytes."""
    memo: dict[int, int] = {}
    dtypes: dict[torch.dtype, int] = {}
    nans: list[str] = []  # the bits of every NaN, in document order

    def flt(v: float) -> float:
        if v != v:
            nans.append(_float_bits(v))
        return v

    tensors = plan.tensors

    def enc(v: object) -> object:
        t = type(v)
        if v is None or t is bool or t is str or t is int:
            return v
        if t is float:
            return flt(v)
        if t is torch.Tensor or t is torch.nn.Parameter:  # the plan refused other tensor types
            if id(v) in memo:
                return ["r", memo[id(v)]]
            memo[id(v)] = len(memo)
            ref = tensors[id(v)]
            flags = REQUIRES_GRAD if v.requires_grad else 0
            if t is torch.nn.Parameter:
                flags |= PARAMETER
            if not v.is_xla and (v.is_conj() or v.is_neg()):
                flags |= CONJ * v.is_conj() | NEG * v.is_neg()
            dtype = dtypes.get(ref.dtype)
            if dtype is None:
                dtype = dtypes[ref.dtype] = len(dtypes)
            return ["t", ref.storage.index, ref.offset, dtype, flags, *ref.size, *ref.stride]
        tag = _CONTAINER_TAGS.get(t)
        if tag is not None:
            if t in _MUTABLE:
                if id(v) in memo:
                    return ["r", memo[id(v)]]
                memo[id(v)] = len(memo)
            if t in (dict, OrderedDict):
                items = [[k if type(k) is str else enc(k), enc(x)] for k, x in v.items()]
                attrs = getattr(v, "__dict__", None)  # state_dict()'s `_metadata`, as pickle keeps it
                return [tag, items, enc(dict(attrs))] if attrs else [tag, items]
            return [tag, [enc(x) for x in v]]
        if t is bytes:
            return ["b", base64.b64encode(v).decode()]
        if t is complex:
            return ["c", flt(v.real), flt(v.imag)]
        if t is torch.dtype:
            return ["dt", str(v).removeprefix("torch.")]
        if t is torch.Size:
            return ["z", list(v)]
        if t is torch.device:
            return ["dv", str(v)]
        raise TypeError(f"no structure for a {t.__qualname__}")  # state.plan refused it already

    try:
        node = enc(state)
    finally:
        del enc  # it refers to itself (and to `plan`'s tensors): no cycle outlives the call
    names = [str(d).removeprefix("torch.") for d in sorted(dtypes, key=dtypes.get)]
    root: dict[str, Any] = {"dtypes": names, "state": node}
    if any(bits != _CANONICAL_NAN for bits in nans):
        root[_NAN_BITS] = nans
    return json.dumps(root, separators=(",", ":")).encode()


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def decode(data: bytes, tensor: Callable[..., Any], where: str, *, storages: Any = None) -> Any:
    """Rebuild the state from `data`, each tensor made by `tensor(storage, offset, size, stride, dtype, flags)`.

    `storage` is the index row, or `storages[row]` when `storages` is given.

    Raises:
        CheckpointCorruptError: the record is not a structure this reader made.
    """
    memo: list[Any] = []
    parsed_nans: list[float] = []  # each NaN the parser made, in document order
    exact: dict[int, float] = {}  # id of such a NaN -> the float with its recorded bits

    def constant(name: str) -> float:
        value = float(name)  # NaN, Infinity, -Infinity; a new object each time
        if value != value:
            parsed_nans.append(value)
        return value

    def fix(v: Any) -> Any:
        return exact.get(id(v), v) if type(v) is float else v

    def dec(node: Any) -> Any:
        if type(node) is not list:
            return fix(node) if exact else node
        tag = node[0]
        if tag == "t":
            ndim = (len(node) - 5) // 2
            made = tensor(node[1] if storages is None else storages[node[1]], node[2], tuple(node[5:5 + ndim]),
                          tuple(node[5 + ndim:]), dtypes[node[3]], node[4])
            memo.append(made)
            return made
        if tag in ("d", "o"):
            out: Any = {} if tag == "d" else OrderedDict()
            memo.append(out)
            for k, v in node[1]:
                out[dec(k)] = dec(v)
            if len(node) > 2:
                for name, value in dec(node[2]).items():
                    setattr(out, name, value)
            return out
        if tag == "l":
            out = []
            memo.append(out)
            out.extend(dec(x) for x in node[1])
            return out
        if tag == "s":
            out = set()
            memo.append(out)
            out.update(dec(x) for x in node[1])
            return out
        if tag == "u":
            return tuple(dec(x) for x in node[1])
        if tag == "f":
            return frozenset(dec(x) for x in node[1])
        if tag == "r":
            return memo[node[1]]
        if tag == "b":
            return base64.b64decode(node[1])
        if tag == "c":
            return complex(fix(node[1]), fix(node[2]))
        if tag == "dt":
            return _dtype(node[1])
        if tag == "z":
            return torch.Size(node[1])
        if tag == "dv":
            return torch.device(node[1])
        raise ValueError(f"unknown node tag {tag!r}")

    try:
        root = json.loads(data, parse_constant=constant)
        dtypes = [_dtype(name) for name in root["dtypes"]]
        bits = root.get(_NAN_BITS)
        if bits is not None:
            if not isinstance(bits, list) or len(bits) != len(parsed_nans):
                raise ValueError(f"{len(parsed_nans)} NaNs but {_NAN_BITS} of {len(bits)}")
            exact.update((id(v), _float_of(b)) for v, b in zip(parsed_nans, bits))
        return dec(root["state"])
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise CheckpointCorruptError(f"{where}: the structure record is not one xlakit wrote ({e})") from e
    finally:
        # `dec` refers to itself through its closure: left alone, that cycle (and `memo`, which
        # holds every object made) would keep the whole loaded state alive until a garbage collection.
        memo.clear()
        del dec, fix


spec = TensorSpec  # the `decode` arguments of a tensor as a `TensorSpec`


def materialize(storage: torch.UntypedStorage, offset: int, size: tuple, stride: tuple, dtype: torch.dtype,
                flags: int) -> torch.Tensor:
    """The tensor on `storage` (bytes already in place), as torch.load makes it."""
    t = set_math_bits(torch.empty(0, dtype=dtype).set_(storage, offset, size, stride), flags)
    if flags & PARAMETER:
        return torch.nn.Parameter(t, requires_grad=bool(flags & REQUIRES_GRAD))
    if flags & REQUIRES_GRAD:
        t.requires_grad_(True)
    return t


def set_math_bits(t: torch.Tensor, flags: int) -> torch.Tensor:
    """`t` with the conj/neg bits of `flags` set, as torch.load sets them."""
    if flags & (CONJ | NEG):
        # Only the bits that are on: torch sets a bit for every key it is given, even with False.
        torch._utils.set_tensor_metadata(t, {k: True for k, bit in (("conj", CONJ), ("neg", NEG)) if flags & bit})
    return t
