"""The share plan of a replica-parallel save: which rank writes which tensors, and how they go back.

Every rank holds the same state, so every rank computes the same plan without
talking: the state's tensors are grouped by the storage they live on (views and
tied weights stay together, so a share is an ordinary xlakit file that keeps
their sharing) and the groups are dealt largest first to the rank with the
fewest bytes so far. Each share is then at most `total / R` plus the largest
storage, so with many storages each rank writes about 1/R of the bytes.

A share is a plain dict of tensors keyed by slot number; the writing rank's
share also holds the *skeleton* (the state with every tensor replaced by None)
and the slots' paths, which `assemble` fills back in. Every rank must hold the same tensors: the save agrees on
`digest` first. Only dicts, OrderedDicts,
lists and tuples are walked (what a weights-only load rebuilds); anything else
stays in the skeleton as it is.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
import xxhash

AGREED_FIELD = "replicated_tensors"  # every rank's `digest` must match: the same tensors, the same plan
SKELETON = "skeleton"
PATHS = "paths"
TENSORS = "tensors"


_KEEP = object()  # a `leaf` answer: not a leaf, walk into it (or keep it as it is)


def _rebuild(value: Any, path: tuple, leaf: Callable[[Any, tuple], Any]) -> Any:
    """`value` rebuilt with each place where `leaf(value, path)` answers something other than _KEEP replaced.

    Only dicts, OrderedDicts, lists and tuples are walked into; anything else is kept.
    """
    replaced = leaf(value, path)
    if replaced is not _KEEP:
        return replaced
    t = type(value)
    if t is dict or t is OrderedDict:
        return t((k, _rebuild(v, path + (k,), leaf)) for k, v in value.items())
    if t is list:
        return [_rebuild(v, path + (i,), leaf) for i, v in enumerate(value)]
    if t is tuple:
        return tuple(_rebuild(v, path + (i,), leaf) for i, v in enumerate(value))
    return value


def flatten(state: Any) -> tuple[Any, list[tuple], list[torch.Tensor]]:
    """(skeleton, the path of each tensor slot, the tensor of each slot), in walk order."""
    paths: list[tuple] = []
    tensors: list[torch.Tensor] = []

    def take(value: Any, path: tuple) -> Any:
        if not isinstance(value, torch.Tensor):
            return _KEEP
        paths.append(path)
        tensors.append(value)
        return None

    return _rebuild(state, (), take), paths, tensors


def assemble(skeleton: Any, paths: list, tensors: dict[int, torch.Tensor]) -> Any:
    """The state again: `skeleton` with slot i (at `paths[i]`) holding `tensors[i]`."""
    by_path = {tuple(p): i for i, p in enumerate(paths)}

    def put(value: Any, path: tuple) -> Any:
        slot = by_path.get(path)
        return _KEEP if slot is None else tensors[slot]

    return _rebuild(skeleton, (), put)


def _storage(t: torch.Tensor) -> tuple[object, int]:
    """A key for the storage `t` lives on, and its size in bytes."""
    if t.device.type == "xla":  # no storage to share on the host side; one tensor, one group
        return ("tensor", id(t)), t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


def deal(tensors: list[torch.Tensor], world: int) -> list[int]:
    """The rank that writes each slot: storages largest first, each to the least loaded rank."""
    groups: dict[object, list[int]] = {}
    sizes: dict[object, int] = {}
    for slot, t in enumerate(tensors):
        key, nbytes = _storage(t)
        groups.setdefault(key, []).append(slot)
        sizes[key] = nbytes
    load = [0] * world
    owner = [0] * len(tensors)
    for key in sorted(groups, key=lambda k: (-sizes[k], groups[k][0])):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += sizes[key]
        for slot in groups[key]:
            owner[slot] = rank
    return owner


def share(state: Any, rank: int, world: int, writer: int) -> dict:
    """What `rank` writes: its slots' tensors, and (the writer) the skeleton and paths."""
    skeleton, paths, tensors = flatten(state)
    owner = deal(tensors, world)
    mine: dict = {TENSORS: {i: t for i, t in enumerate(tensors) if owner[i] == rank}}
    if rank == writer:
        mine[SKELETON], mine[PATHS] = skeleton, [list(p) for p in paths]
    return mine


def digest(state: Any, world: int) -> str:
    """The plan's fingerprint: each tensor slot's path, dtype, shape and writing rank (no data read).

    Every rank of a replica-parallel save proposes it, and the save goes on only when they are all
    equal: a rank whose state has other tensors (a rank-local entry, another shape) would deal the
    slots differently, and the shares would not make one state. Values are not compared (that
    would read every byte); ranks must hold the same values, as for any replicated save.
    """
    _, paths, tensors = flatten(state)
    owner = deal(tensors, world)
    h = xxhash.xxh3_64()
    for path, t, rank in zip(paths, tensors, owner):
        h.update(repr((path, str(t.dtype), tuple(t.shape), rank)).encode())
    return f"{len(tensors)} tensors, {h.hexdigest()}"
