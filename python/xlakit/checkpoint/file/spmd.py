"""SPMD-sharded XLA tensors to host memory, shard by shard, never replicated on the device.

Stock `.cpu()` of a sharded tensor runs `ReplicateShardedData`: it compiles a
replication program on every call (one new compile per `.cpu()` of the same
tensor on torch_xla 2.9) and puts a full copy of the tensor on every device.
Here each tensor's local shards are copied to the host with torch_xla's
`_get_local_shards` and written into one host tensor at the indices
`_get_local_shard_replica_and_indices` gives, dropping replicas and padding;
no program is compiled and the devices hold nothing extra.

The stock binding copies every local shard, replicas included (it offers no
selection), so a partially replicated tensor costs its replication factor in
transient host memory; shards are therefore fetched one tensor at a time, and
the deadline is checked between tensors. Assembly needs all shards local:
single-host SPMD. On several hosts a tensor's local shards do not cover it and
this module refuses with a pointer to `xlakit.dcp_save`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import torch

from xlakit.errors import CheckpointTimeoutError, RuntimeFeatureError

# torch_xla's ShardingType values whose data is split across devices (TILED,
# PARTIAL); REPLICATED and unsharded data copy to the host without a compile.
_SPLIT_SHARDING_TYPES = (3, 5)

Shard = tuple[torch.Tensor, tuple[slice, ...]]


def is_sharded(t: torch.Tensor) -> bool:
    """True when `t` is an XLA tensor whose data is split over devices (not replicated)."""
    if t.device.type != "xla":
        return False
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_type(t) in _SPLIT_SHARDING_TYPES


def has_sharded(tensors: Sequence[torch.Tensor]) -> bool:
    return any(is_sharded(t) for t in tensors)


def unique_shard_indices(t: torch.Tensor) -> list[tuple[int, tuple[slice, ...]]]:
    """(position in `_get_local_shards`, index into `t`) of each distinct local shard.

    Replicas (same index on another device) and empty shards (padding only) are dropped.
    """
    import torch_xla

    seen: set[tuple[tuple[int, int], ...]] = set()
    unique = []
    for pos, (_, index) in enumerate(torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]):
        if index is Ellipsis:  # a full replica
            index = tuple(slice(0, n, 1) for n in t.shape)
        index = tuple(index)
        key = tuple((s.start, s.stop) for s in index)
        if key in seen or any(s.stop <= s.start for s in index):
            continue
        seen.add(key)
        unique.append((pos, index))
    return unique


def local_shards(t: torch.Tensor) -> list[Shard]:
    """The distinct local shards of `t` as host tensors without padding, with their indices."""
    import torch_xla

    datas = torch_xla._XLAC._get_local_shards([t])[0]
    shards = []
    for pos, index in unique_shard_indices(t):
        data = datas[pos][0]
        shards.append((data[tuple(slice(0, s.stop - s.start) for s in index)], index))
    return shards


def assemble(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of sharded `t`, built from its local shards.

    Raises:
        RuntimeFeatureError: the local shards do not cover `t` (multi-host SPMD).
    """
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if t.numel() == 0:
        return host
    covered = 0
    for data, index in local_shards(t):
        host[index] = data
        covered += data.numel()
    if covered != t.numel():
        err = RuntimeFeatureError(
            f"the local shards of a sharded {tuple(t.shape)} tensor cover {covered} of its "
            f"{t.numel()} elements: the rest live on other hosts, so it cannot be assembled here")
        err.add_note("Multi-host SPMD state is saved with xlakit.dcp_save, which writes each "
                     "host's shards and assembles nothing.")
        raise err
    return host


def to_host(tensors: Sequence[torch.Tensor], *, timeout_s: float,
            others: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> list[torch.Tensor]:
    """Host copies of `tensors` in order: sharded ones assembled here, the rest by `others`.

    Args:
        tensors: one transfer batch of XLA tensors, already synced.
        timeout_s: what is left of the save's deadline; checked between tensors.
        others: copies the tensors that are not sharded (the caller's usual path).

    Raises:
        CheckpointTimeoutError: the deadline passed between two tensors.
    """
    deadline = time.monotonic() + timeout_s
    sharded = [is_sharded(t) for t in tensors]
    plain = iter(others([t for t, s in zip(tensors, sharded) if not s]) if not all(sharded) else [])
    hosts = []
    for i, (t, s) in enumerate(zip(tensors, sharded)):
        if not s:
            hosts.append(next(plain))
            continue
        if time.monotonic() > deadline:
            raise CheckpointTimeoutError(
                f"copying SPMD shards to the host ran out of time after {i} of {len(tensors)} "
                f"tensors of this batch (timeout_s={timeout_s:.3g} was left)", stage="transfer")
        hosts.append(assemble(t))
    return hosts


def padded_shard_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of each device's shard of tiled `t`, padding included; None if not tiled."""
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec(t)
    m = re.match(r"\{devices=\[([\d,]+)\]", spec)
    if m is None:
        return None
    tiles = [int(x) for x in m.group(1).split(",")][:t.dim()]
    return tuple(-(-n // k) for n, k in zip(t.shape, tiles))


def load_from_host(t: torch.Tensor, host: torch.Tensor) -> None:
    """Fill tiled (or partially replicated) `t` in place from its full host value, shard by shard.

    Each local device receives exactly its shard (padding zeroed); nothing is
    replicated on the device and nothing compiles. Needs every local shard's
    slice, as `_get_local_shard_replica_and_indices` gives them in device order.
    """
    import torch_xla

    xlac = torch_xla._XLAC
    shape = padded_shard_shape(t)
    if shape is None:
        raise ValueError(f"not a tiled tensor: {xlac._get_xla_sharding_spec(t)}")
    shards = []
    for index in local_shard_indices(t, shape):
        piece = host[index]
        if tuple(piece.shape) == shape:
            shards.append(piece.contiguous())
            continue
        padded = torch.zeros(shape, dtype=host.dtype)
        padded[tuple(slice(0, n) for n in piece.shape)] = piece
        shards.append(padded)
    xlac._load_local_shards(t, shards, list(xlac._xla_get_runtime_devices()))


_TILED = re.compile(r"\{devices=\[([\d,]+)\]([\d,]+)( last_tile_dim_replicate)?\}")


def local_shard_indices(t: torch.Tensor, shard_shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The region of tiled `t` each local device holds, in runtime device order.

    Read from the sharding's tile assignment (devices listed row-major over the tile grid).
    torch_xla's own `_get_local_shard_replica_and_indices` is asked only for other forms: for
    a tensor whose data is not sharded yet (`torch.zeros(..., device=d)` annotated by
    `mark_sharding` with an uneven split) it answers "replicated" and turns the tensor's
    sharding into that.
    """
    import torch_xla

    xlac = torch_xla._XLAC
    m = _TILED.fullmatch(xlac._get_xla_sharding_spec(t))
    if m is None:
        return [tuple(index) if index is not Ellipsis else (...,)
                for _, index in xlac._get_local_shard_replica_and_indices([t])[0]]
    grid = [int(x) for x in m.group(1).split(",")]
    ids = [int(x) for x in m.group(2).split(",")]
    regions = []
    for device in xlac._xla_get_runtime_devices():
        position = ids.index(int(device.rsplit(":", 1)[1]))
        coords = []
        for extent in reversed(grid):
            position, c = divmod(position, extent)
            coords.append(c)
        coords.reverse()
        regions.append(tuple(slice(min(c * k, n), min((c + 1) * k, n))
                             for c, n, k in zip(coords, t.shape, shard_shape)))
    return regions
