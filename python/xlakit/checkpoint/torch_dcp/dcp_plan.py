"""How a state dict maps onto torch.distributed.checkpoint's plans, for `dcp.py`.

Saving: host tensors (CPU, DTensor) go through DCP's default plan; device
tensors are planned as their distinct local shards (`spmd.py`; one DCP chunk
per shard, the layout torch_xla's `SPMDSavePlanner` writes) and their data is
pulled to the host only when DCP's writer asks, in byte-capped batches under
the save's deadline, so a whole device state is never staged at once. Keys
are flattened as torch_xla's planners do, so its `SPMDLoadPlanner` reads the
folders too.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.utils._pytree import tree_leaves

from xlakit.runtime import features, torchtpu
from xlakit.checkpoint.file import spmd, transfer
from xlakit.checkpoint.core.operation import Operation
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.checkpoint.format import pickled
from xlakit.checkpoint.format.state import StorageEntry
from xlakit.errors import CheckpointFormatError, CheckpointSerializationError


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, with device tensors written as local shards pulled in batches."""

    def __init__(self, op: Operation, opts: SaveOptions):
        super().__init__()
        self.op, self.opts = op, opts
        self.staged: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        # Flattened as torch_xla's planners do, so that its SPMDLoadPlanner finds every key;
        # DCP's own flattening also splits containers that hold no tensor.
        flat, self.mappings = _flatten(state_dict)
        self.state_dict = {k: _unwrap(v) for k, v in flat.items()}
        check_values(self.state_dict)
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        host = {k: v for k, v in self.state_dict.items() if not _on_device(v)}
        items = create_default_local_save_plan(host, self.is_coordinator).items
        self.order = [k for k, v in self.state_dict.items() if _on_device(v)]
        self.position = {k: i for i, k in enumerate(self.order)}
        for fqn in self.order:
            t = self.state_dict[fqn]
            indices = ([idx for _, idx in spmd.unique_shard_indices(t)] if spmd.is_sharded(t)
                       else [tuple(slice(0, n) for n in t.shape)])
            items += [_shard_item(fqn, i, idx, t) for i, idx in enumerate(indices)]
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if not _on_device(self.state_dict.get(fqn)):
            return super().resolve_data(write_item)
        key = (fqn, tuple(write_item.index.offset))
        if key not in self.staged:
            self._stage_from(fqn)
        self.op.enter("write", fqn)
        host = self.staged.pop(key)
        self.op.advance(host.numel() * host.element_size())
        return host

    def _stage_from(self, fqn: str) -> None:
        """Copy `fqn` and the device tensors after it, up to the byte cap, to the host."""
        batch, size = [], 0
        for name in self.order[self.position[fqn]:]:
            nbytes = self.state_dict[name].numel() * self.state_dict[name].element_size()
            if batch and size + nbytes > self.opts.max_inflight_bytes:
                break
            batch.append(name)
            size += nbytes
        self.op.enter("transfer", fqn)
        plain = [n for n in batch if not spmd.is_sharded(self.state_dict[n])]
        for name in batch:
            if name not in plain:
                for data, idx in spmd.local_shards(self.state_dict[name]):
                    self.staged[(name, tuple(s.start for s in idx))] = data
        if plain:
            entries = [StorageEntry(i, n, self.state_dict[n]) for i, n in enumerate(plain)]
            backend = transfer.backend_for(entries[0].device_type, entries[0].tensor,
                                              mode=self.opts.transfer_backend)
            left = max(self.op.remaining(), 0.001)
            for name, host in zip(plain, transfer.batch_to_host(backend, entries, timeout_s=left)):
                self.staged[(name, (0,) * host.dim())] = host


def _shard_item(fqn: str, i: int, index: tuple[slice, ...], t: torch.Tensor) -> WriteItem:
    offsets = torch.Size(s.start for s in index)
    sizes = torch.Size(s.stop - s.start for s in index)
    return WriteItem(
        index=MetadataIndex(fqn, offsets, i), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            # is_pinned() is not defined for XLA tensors; device data is never pinned.
            properties=TensorProperties(dtype=t.dtype, requires_grad=t.requires_grad),
            size=t.size()))


def _xla() -> bool:
    """torch_xla's planners apply (never even imported on TorchTPU)."""
    return not torchtpu.in_use() and features.xlac() is not None


def _flatten(state: dict) -> tuple[dict, dict]:
    if _xla():
        from torch_xla.experimental.distributed_checkpoint._helpers import flatten_state_dict
    else:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    return flatten_state_dict(state)


def load_value(value: io.BytesIO, fqn: str, where: str, map_location: str | None = None) -> Any:
    """A DCP checkpoint's non-tensor value (DCP pickles each one), read weights-only: pickled code is
    refused, naming what it names, never run. `io.BytesIO` values, which DCP documents, are allowed,
    and so is what the user allowed with `torch.serialization.add_safe_globals`.

    DCP's own planner loads them with `weights_only=False` (and torch_xla's with torch's default), so
    a checkpoint, from a bucket too, could run code in the job that loads it. Tensors inside a value come
    back on the device they were saved from, as those planners load them, unless `map_location` says."""
    try:
        return _weights_only(value, map_location)
    except pickle.UnpicklingError as e:
        err = CheckpointFormatError(f"{where}: the value {fqn!r} holds pickled objects that a weights-only load "
                                    f"refuses to run{pickled.naming_refused(e)}; nothing of it was run")
        err.add_note(_ALLOW)
        raise err from None


def _weights_only(data: io.BytesIO, map_location: str | None) -> Any:
    """`torch.load(weights_only=True)` with `io.BytesIO` allowed too. torch's `safe_globals` removes what
    it added on exit, so it is entered only when the user has not allowed `io.BytesIO` themselves."""
    if io.BytesIO in torch.serialization.get_safe_globals():
        return torch.load(data, map_location=map_location, weights_only=True)
    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(data, map_location=map_location, weights_only=True)


_ALLOW = ("xlakit never runs pickled code from a checkpoint. If you trust the classes named, allow them "
          "with torch.serialization.add_safe_globals([...]) (numpy arrays need numpy's, e.g. "
          "numpy._core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, and numpy.dtypes.UInt32DType for "
          "np.random.get_state()); or save such values as "
          "tensors, numbers, strings or containers of them.")


def check_values(state: dict[str, Any]) -> None:
    """Refuse, before anything is written, a value of the flat `state` that `load_value` would refuse to
    load back (as `xlakit.save` refuses one `torch.load(weights_only=True)` would)."""
    for fqn, value in state.items():
        # Exact types: a subclass (numpy.float64 is a float, an IntEnum an int) pickles as its own class.
        if isinstance(value, torch.Tensor) or type(value) in (int, float, str, bool, type(None)):
            continue
        data = io.BytesIO()
        try:
            torch.save(value, data)  # as DCP pickles it
        except Exception as e:  # noqa: BLE001 - a value pickle cannot write (a lambda, a lock): named
            raise CheckpointSerializationError(f"dcp_save: the value {fqn!r} ({type(value).__name__}) cannot be "
                                               f"pickled ({type(e).__name__}: {e}); nothing was written") from e
        data.seek(0)
        try:
            _weights_only(data, "cpu")
        except pickle.UnpicklingError as e:
            err = CheckpointSerializationError(f"dcp_save: the value {fqn!r} ({type(value).__name__}) could not be "
                                               f"loaded back weights-only{pickled.naming_refused(e)}; nothing was written")
            err.add_note(_ALLOW)
            raise err from None


def set_value(planner: Any, fqn: str, value: Any) -> None:
    """Where DCP's load planners put a loaded non-tensor value (their `load_bytes`, without its load)."""
    if getattr(planner, "flatten_state_dict", True) and fqn in getattr(planner, "mappings", {}):
        from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415 - DCP's own helper

        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def load_planner_base() -> type:
    if _xla():
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        return SPMDLoadPlanner
    return DefaultLoadPlanner


def _unwrap(v: Any) -> Any:
    """The XLA tensor inside torch_xla's `XLAShardedTensor` wrapper (saved as that tensor)."""
    inner = getattr(v, "global_tensor", None)
    return inner if isinstance(v, torch.Tensor) and isinstance(inner, torch.Tensor) else v


def _on_device(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type != "cpu"


def tensors(state: Any) -> list[torch.Tensor]:
    return [_unwrap(t) for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
