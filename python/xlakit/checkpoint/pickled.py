"""The pickle inside a checkpoint: exactly what `torch.load(weights_only=True)` reads.

It is written from tensor *metadata* only (`state.Plan`): every tensor becomes
a `_rebuild_tensor_v2/v3` of its storage, offset, size and stride (and
conj/neg bits), with storages referenced by key as torch.save does, so tensors
sharing a storage come back sharing it. It is checked with torch's own
weights-only unpickler before a byte is written. xlakit's own reader does not
unpickle: it rebuilds the state from `structure.py`'s record.
"""

from __future__ import annotations

import io
import pickle
from typing import BinaryIO

import torch

from xlakit.checkpoint.state import Plan, StorageEntry, TensorRef
from xlakit.errors import CheckpointSerializationError

_PICKLE_PROTOCOL = 2  # torch.save's default; the weights-only unpickler expects it


class _StorageRef:
    """Stands for one storage in the pickle; persistent_id turns it into a record key."""

    def __init__(self, entry: StorageEntry, dtype: torch.dtype, legacy: object | None):
        self.entry, self.dtype, self.legacy = entry, dtype, legacy


class _PlainTensor:
    """A Parameter's data, pickled as a plain tensor inside `_rebuild_parameter`."""

    def __init__(self, ref: TensorRef):
        self.ref = ref


class _MetadataPickler(pickle.Pickler):
    """Tensors become rebuild calls on storage references. Their backward hooks are
    pickled as None, not one `OrderedDict()` each: torch.load sets them as given, and
    a shared empty dict would make a hook registered on one loaded tensor fire for all."""

    def __init__(self, file: BinaryIO, plan: Plan):
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self._plan = plan
        self._legacy = torch.storage._dtype_to_storage_type_map()

    def persistent_id(self, obj):
        # Called for every object pickled: the common answer first.
        if type(obj) is not _StorageRef:
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
                    ref.size, ref.stride, requires_grad, None)
            return torch._utils._rebuild_tensor_v2, args + ((metadata,) if metadata else ())
        storage = _StorageRef(ref.storage, ref.dtype, None)
        return (torch._utils._rebuild_tensor_v3,
                (storage, ref.offset, ref.size, ref.stride, requires_grad, None, ref.dtype)
                + ((metadata,) if metadata else ()))

    def reducer_override(self, obj):
        if isinstance(obj, _PlainTensor):
            return self._rebuild(obj.ref, False)
        if isinstance(obj, torch.Tensor):
            ref = self._plan.tensors[id(obj)]
            if type(obj) is torch.nn.Parameter:  # the plan refused other subclasses
                return (torch._utils._rebuild_parameter,
                        (_PlainTensor(ref), obj.requires_grad, None))
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
