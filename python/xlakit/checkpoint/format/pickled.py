"""The pickle inside a checkpoint: exactly what `torch.load(weights_only=True)` reads.

It is written from tensor *metadata* only (`state.Plan`): every tensor becomes
a `_rebuild_tensor_v2/v3` of its storage, offset, size and stride (and
conj/neg bits), with storages referenced by key as torch.save does, so tensors
sharing a storage come back sharing it. It is checked with torch's own
weights-only unpickler before a byte is written. xlakit's own reader does not
unpickle: it rebuilds the state from `structure.py`'s record.

The bytes are those Python's C pickler writes for the same state with a
`persistent_id` for storages and a `reducer_override` for tensors (protocol 2,
as torch.save); `tests/checkpoint/test_format.py` pins that. They are emitted by a
subclass of the pure-Python pickler whose `save` writes the types a state is
made of (strings, numbers, dicts, lists, tuples, tensors) itself, in a few
operations each, and hands everything else (OrderedDicts, sets, dtypes, bytes,
...) to the standard code with the same memo. The C pickler calls a Python
`persistent_id` for every object (seventeen calls per tensor); with 100,000
tensors that alone cost more than torch.save's whole save.
"""

from __future__ import annotations

import io
import pickle
import re
from struct import Struct

import torch

from xlakit.checkpoint.format.state import Plan, TensorRef
from xlakit.errors import CheckpointSerializationError

_PICKLE_PROTOCOL = 2  # torch.save's default; the weights-only unpickler expects it
_BATCH = 1000  # the pickler's batch of dict items and list elements
_U8, _U16, _I32, _U32, _F64 = Struct("<B"), Struct("<H"), Struct("<i"), Struct("<I"), Struct(">d")
_TUPLE_OPS = (pickle.EMPTY_TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SMALL_INTS = [pickle.BININT1 + bytes([i]) for i in range(256)]
_PUTS = [pickle.BINPUT + bytes([i]) for i in range(256)]
_GETS = [pickle.BINGET + bytes([i]) for i in range(256)]
_STORAGE, _CPU = "storage", "cpu"


def _int(value: int) -> bytes:
    if 0 <= value <= 0xFF:
        return _SMALL_INTS[value]
    if 0 <= value <= 0xFFFF:
        return pickle.BININT2 + _U16.pack(value)
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return pickle.BININT + _I32.pack(value)
    encoded = pickle.encode_long(value)
    n = len(encoded)
    return (pickle.LONG1 + _U8.pack(n) if n < 256 else pickle.LONG4 + _I32.pack(n)) + encoded


class _Emitter(pickle._Pickler):
    """Writes the state's pickle into a list of byte strings (see the module docstring)."""

    def __init__(self, plan: Plan):
        self.parts: list[bytes] = []
        super().__init__(io.BytesIO(), protocol=_PICKLE_PROTOCOL)
        self.write = self.parts.append  # protocol 2 has no frames: every write goes straight here
        self._tensors = plan.tensors
        self._count = 0  # the next memo index (objects emitted only once are not kept in the memo)
        self._heads: dict[torch.dtype, bytes] = {}  # see `_head`
        self._cpu = b""  # "cpu" by its memo index, once it is there
        self._legacy = {dtype: getattr(torch, name) for dtype, name in
                        torch.storage._dtype_to_storage_type_map().items()}

    def dump_state(self, state: object) -> bytes:
        self.write(pickle.PROTO + bytes([_PICKLE_PROTOCOL]))
        self.save(state)
        self.write(pickle.STOP)
        return b"".join(self.parts)

    # -- the memo -----------------------------------------------------------------------------
    def _put(self) -> bytes:
        """The next memo index, as the opcode that stores into it."""
        idx = self._count
        self._count += 1
        # Made when needed: building them in bulk (65536 at a time) cost 15 ms in each save of 320 tensors.
        return _PUTS[idx] if idx < 256 else pickle.LONG_BINPUT + _U32.pack(idx)

    def memoize(self, obj):
        self.memo[id(obj)] = self._count, obj
        self.write(self._put())

    def get(self, i):
        return _GETS[i] if i < 256 else pickle.LONG_BINGET + _U32.pack(i)

    def _again(self, obj) -> bytes:
        """`obj` (a global, a constant string) by its memo index; saved first if it is not there yet."""
        x = self.memo.get(id(obj))
        if x is None:
            self.save(obj)
            return b""
        return self.get(x[0])

    def persistent_id(self, obj):
        return None  # storages are written by `_rebuild`, never met as objects

    # -- the types a state is made of -----------------------------------------------------------
    def save(self, obj, save_persistent_id=True):
        t = type(obj)
        if t is str:
            self.write(self._str(obj))
        elif t is int:
            self.write(_int(obj))
        elif t is float:
            self.write(pickle.BINFLOAT + _F64.pack(obj))
        elif obj is None:
            self.write(pickle.NONE)
        elif t is bool:
            self.write(pickle.NEWTRUE if obj else pickle.NEWFALSE)
        else:
            x = self.memo.get(id(obj))
            if x is not None:
                self.write(self.get(x[0]))
            elif t in _PLAIN:
                self._tensor(obj)
            elif t is dict:
                self._dict(obj)
            elif t is list:
                self._list(obj)
            elif t is tuple:
                self._tuple(obj)
            else:
                super().save(obj, save_persistent_id)

    def _str(self, s: str) -> bytes:
        x = self.memo.get(id(s))
        if x is not None:
            return self.get(x[0])
        encoded = s.encode("utf-8", "surrogatepass")
        self.memo[id(s)] = self._count, s
        return pickle.BINUNICODE + _U32.pack(len(encoded)) + encoded + self._put()

    def _dict(self, d: dict) -> None:
        self.write(pickle.EMPTY_DICT)
        self.memoize(d)
        if not d:
            return
        save, write = self.save, self.write
        if len(d) == 1:
            for k, v in d.items():
                save(k)
                save(v)
            write(pickle.SETITEM)
            return
        items = iter(d.items())
        memo, tensor, key = self.memo, self._tensor, self._str
        while True:  # as the C pickler: a last, empty batch after a full one
            write(pickle.MARK)
            n = 0
            for k, v in items:
                if type(k) is str:
                    write(key(k))
                else:
                    save(k)
                if type(v) in _PLAIN and id(v) not in memo:  # the common item of a state dict
                    tensor(v)
                else:
                    save(v)
                n += 1
                if n == _BATCH:
                    break
            write(pickle.SETITEMS)
            if n < _BATCH:
                return

    def _list(self, items: list) -> None:
        self.write(pickle.EMPTY_LIST)
        self.memoize(items)
        save, write = self.save, self.write
        if len(items) == 1:
            save(items[0])
            write(pickle.APPEND)
            return
        for start in range(0, len(items), _BATCH):
            write(pickle.MARK)
            for x in items[start:start + _BATCH]:
                save(x)
            write(pickle.APPENDS)

    def _tuple(self, items: tuple) -> None:
        n = len(items)
        if n == 0:
            self.write(pickle.EMPTY_TUPLE)
            return
        if n > 3:
            self.write(pickle.MARK)
        for x in items:
            self.save(x)
        if id(items) in self.memo:  # a tuple that holds itself (through a list): never in a state
            super().save(items)
            return
        self.write(_TUPLE_OPS[n] if n <= 3 else pickle.TUPLE)
        self.memoize(items)

    def _ints(self, items: tuple) -> bytes:
        """A tuple of ints (a size or a stride) and its memo store, as the pickler writes it."""
        n = len(items)
        if n == 1:
            return _int(items[0]) + pickle.TUPLE1 + self._put()
        if n == 0:
            return pickle.EMPTY_TUPLE
        body = b"".join([_int(i) for i in items])
        return (body + _TUPLE_OPS[n] if n <= 3 else pickle.MARK + body + pickle.TUPLE) + self._put()

    def _tensor(self, obj: torch.Tensor) -> None:
        """A tensor's rebuild call; a Parameter's is `_rebuild_parameter(<plain tensor>, requires_grad, None)`."""
        ref = self._tensors[id(obj)]
        if type(obj) is torch.nn.Parameter:
            self.write(self._again(torch._utils._rebuild_parameter))
            self._rebuild(ref, False)
            self.write(self._put() + (pickle.NEWTRUE if obj.requires_grad else pickle.NEWFALSE)
                       + pickle.NONE + pickle.TUPLE3 + self._put() + pickle.REDUCE)
        else:
            self._rebuild(ref, obj.requires_grad)
        self.memoize(obj)

    def _head(self, dtype: torch.dtype) -> None:
        """The rebuild function, two MARKs, "storage" and the storage class of `dtype`; once all are
        in the memo, their bytes are kept for every later tensor of that dtype."""
        legacy = self._legacy.get(dtype)
        parts = (torch._utils._rebuild_tensor_v2 if legacy is not None else torch._utils._rebuild_tensor_v3,
                 None, _STORAGE, legacy if legacy is not None else torch.UntypedStorage)
        for obj in parts:
            self.write(pickle.MARK + pickle.MARK if obj is None else self._again(obj))
        self._heads[dtype] = b"".join(pickle.MARK + pickle.MARK if obj is None else self._again(obj)
                                      for obj in parts)

    def _rebuild(self, ref: TensorRef, requires_grad: bool) -> None:
        """`_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, None[, metadata])` (v3 with
        the dtype for dtypes without a typed storage), then REDUCE. The storage is the persistent id
        ("storage", class, key, "cpu", count), then BINPERSID.

        The hot path of a save of many small tensors: it writes once, from bytes kept per dtype
        and precomputed memo stores."""
        dtype, entry = ref.dtype, ref.storage
        write = self.write
        head = self._heads.get(dtype)
        if head is None:
            self._head(dtype)
        else:
            write(head)
        write(self._str(entry.key))
        if not self._cpu:
            write(self._again(_CPU))
            self._cpu = self._again(_CPU)
        else:
            write(self._cpu)
        legacy = dtype in self._legacy
        count = entry.nbytes // dtype.itemsize if legacy else entry.nbytes
        write(_int(count) + pickle.TUPLE + self._put() + pickle.BINPERSID + _int(ref.offset)
              + self._ints(ref.size) + self._ints(ref.stride)
              + (pickle.NEWTRUE if requires_grad else pickle.NEWFALSE) + pickle.NONE)
        if not legacy:
            self.save(dtype)
        t = ref.tensor
        if not t.is_xla and (t.is_conj() or t.is_neg()):
            self.save(torch._utils.get_tensor_metadata(t))
        write(pickle.TUPLE + self._put() + pickle.REDUCE)


_REFUSED = re.compile(r"(?:Unsupported global: GLOBAL |unsupported GLOBAL |but got <class ')([\w.]+)")


_NAMED = re.compile(r"\(it names ([\w.]+)\)")


def naming_refused(e: Exception) -> str:
    """" (it names module.Class)" for torch's weights-only refusal `e`, naming what it refused (torch's
    own first line, "Weights only load failed...", names nothing); "" where it names nothing."""
    found = _REFUSED.search(str(e))
    return f" (it names {found.group(1)})" if found else ""


def named_refused(message: str) -> str | None:
    """The class an xlakit error's `message` says a weights-only load refused (`naming_refused`), or None."""
    found = _NAMED.search(message)
    return found.group(1) if found else None


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
    try:
        data = _Emitter(plan).dump_state(state)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise CheckpointSerializationError(f"the state cannot be pickled: {e}") from e
    _check_weights_only(data)
    return data
