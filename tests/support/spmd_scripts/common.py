"""Shared set-up of the SPMD scenario scripts: a 4-device CPU mesh and a sharded state."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()
DEVICES = xr.global_runtime_device_count()
MESH_ALL = xs.Mesh(np.arange(DEVICES), (DEVICES, 1), ("x", "y"))
if DEVICES == 4:
    MESH_4 = MESH_ALL
    MESH_2X2 = xs.Mesh(np.arange(4), (2, 2), ("x", "y"))


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def sharded(host: torch.Tensor, mesh: xs.Mesh, spec: tuple) -> torch.Tensor:
    t = host.to(torch_xla.device())
    xs.mark_sharding(t, mesh, spec)
    return t


def values() -> dict[str, torch.Tensor]:
    """Host values of the test state: float32, bfloat16 and int64, shapes that pad on 4 devices."""
    g = torch.Generator().manual_seed(0)
    return {
        "even": torch.randn(8, 6, generator=g),
        "padded": torch.randn(5, 7, generator=g),
        "dim1": torch.randn(3, 9, generator=g),
        "partial_bf16": torch.randn(6, 7, generator=g).to(torch.bfloat16),
        "tiled_int": torch.arange(60).reshape(6, 10),
        "replicated": torch.randn(4, 4, generator=g),
    }


def sources() -> dict[str, tuple[torch.Tensor, xs.Mesh, tuple]]:
    """The values with their sharding on 4 devices: even, padded, partially replicated, 2-D tiled."""
    assert DEVICES == 4, f"expected CPU_NUM_DEVICES=4, got {DEVICES} devices"
    specs = {
        "even": (MESH_4, ("x", None)),
        "padded": (MESH_4, ("x", None)),
        "dim1": (MESH_4, (None, "x")),
        "partial_bf16": (MESH_2X2, ("x", None)),
        "tiled_int": (MESH_2X2, ("x", "y")),
        "replicated": (MESH_4, (None, None)),
    }
    return {name: (host, *specs[name]) for name, host in values().items()}


def args() -> Path:
    return Path(sys.argv[1])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of two host tensors (dtype, shape and every byte)."""
    def raw(t: torch.Tensor) -> bytes:
        return bytes(t.contiguous().view(torch.uint8).numpy())

    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def finish(name: str, result: dict) -> None:
    (args() / f"{name}.json").write_text(json.dumps(result))


def timed_out_with_slow_shards(save, delay_s: float = 3.0) -> dict | None:
    """Run `save()` while every local-shard copy takes `delay_s` (a fake slow device).

    Returns the CheckpointTimeoutError's stage, tensor and elapsed time, or None.
    """
    import time

    import xlakit
    from xlakit.checkpoint.file import spmd

    real = spmd.local_shards

    def slow(t):
        time.sleep(delay_s)
        return real(t)

    spmd.local_shards = slow
    start = time.monotonic()
    try:
        save()
    except xlakit.CheckpointTimeoutError as e:
        return {"stage": e.stage, "tensor": e.tensor, "elapsed_s": time.monotonic() - start}
    finally:
        spmd.local_shards = real
    return None


@contextlib.contextmanager
def counting_calls(module, name: str):
    """Count the calls of `module.name` inside the block (the list grows by one per call)."""
    calls: list[int] = []
    real = getattr(module, name)
    setattr(module, name, lambda *args: calls.append(1) or real(*args))
    try:
        yield calls
    finally:
        setattr(module, name, real)
