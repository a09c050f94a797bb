"""A replicated training state for the replica-parallel tests and bench: the same on every rank.

Many storages of mixed sizes and dtypes (so shares can be balanced), a tied
weight and a view sharing a storage, nested lists, tuples and plain values.
"""

from __future__ import annotations

import copy

import xxhash

import torch

from xlakit.checkpoint.multirank import replica_plan


def state(version: int, *, tensors: int = 48, max_elems: int = 100_000) -> dict:
    g = torch.Generator().manual_seed(version)
    sizes = torch.randint(1_000, max_elems, (tensors,), generator=g).tolist()
    layers = {}
    for i, n in enumerate(sizes):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 3]
        t = torch.randn(n, generator=g).mul(100)
        layers[f"layer{i}"] = t.to(dtype)
    return {"version": version, "model": layers, "tied": layers["layer0"], "view": layers["layer3"][10:20],
            "opt": [{"step": version * 7, "m": torch.randn(3, 5, generator=g)}, ("lr", 0.1)]}


def zeroed(state: dict) -> dict:
    """A template for `xlakit.restore`: a copy of `state` (its sharing kept) holding zeros."""
    template = copy.deepcopy(state)
    for t in replica_plan.flatten(template)[2]:
        t.zero_()
    return template


def nbytes(state: dict) -> int:
    """Bytes of the distinct storages of `state`."""
    seen = {}
    for t in replica_plan.flatten(state)[2]:
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def digest(state: object) -> str:
    """Structure, dtypes, shapes and every tensor's bytes."""
    skeleton, paths, tensors = replica_plan.flatten(state)
    h = xxhash.xxh3_64(repr(skeleton).encode())
    for path, t in zip(paths, tensors):
        h.update(repr((path, t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
