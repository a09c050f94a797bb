"""A job that reads memory per device through xlakit's PJRT wrapper while a sharded array lives and dies (tests only).

Run as a fresh process with the wrapper in front of a real CPU plugin with 4
devices (the test sets the environment):

* `torch_xla`: stock torch_xla 2.9 under SPMD, `PJRT_DEVICE=TPU` with
  `TPU_LIBRARY_PATH` the wrapper and `XLAKIT_PJRT_PLUGIN` xla-cpu-pjrt's
  plugin; reads `xlakit.memory_info()`;
* `jax`: jax on lammps-jax-pjrt-cpu through the wrapper; reads
  `wrap_memory.by_device()` (memory_info is torch_xla's view).

A (1024, 256) float32 array is sharded by rows over a 4-device mesh, so each
device holds a 256 KiB shard. Prints one JSON line: the figures before, while
it lives and after it is freed, per device (torch_xla: then live bytes after
each of a few training steps).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time

ROWS, COLS = 1024, 256


def run_torch_xla() -> dict:
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import xlakit

    xr.use_spmd()

    def snap():
        return {i.device: dataclasses.asdict(i) for i in xlakit.memory_info()}

    out = {"runtime_devices": list(torch_xla._XLAC._xla_get_runtime_devices()), "before": snap()}
    mesh = xs.Mesh(np.arange(4), (4,), ("x",))
    t = torch.ones(ROWS, COLS).to(torch_xla.device())
    xs.mark_sharding(t, mesh, ("x", None))
    torch_xla.sync()
    out["live"] = snap()
    del t
    gc.collect()
    out["freed"] = snap()
    # Training steps: every Execute's outputs are counted and the buffers they replace are freed, so the
    # live bytes settle instead of growing step by step.
    model = torch.nn.Sequential(torch.nn.Linear(COLS, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(
        torch_xla.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(64, COLS).to(torch_xla.device())
    xs.mark_sharding(x, mesh, ("x", None))
    out["steps"] = []
    for _ in range(6):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        torch_xla.sync()
        torch_xla._XLAC._xla_wait_device_ops([])
        out["steps"].append({i.device: i.live_bytes for i in xlakit.memory_info()})
    try:
        xlakit.memory_info("CPU:9")
    except ValueError as e:
        out["unknown_device"] = str(e)
    one = xlakit.memory_info("CPU:3")
    out["one"] = dataclasses.asdict(one)
    start = time.perf_counter()
    for _ in range(200):
        xlakit.memory_info()
    out["call_us"] = (time.perf_counter() - start) / 200 * 1e6
    from xlakit.runtime import manifest, pjrt_wrap

    out["manifest_memory"] = manifest.manifest()["memory"]
    out["counts"] = pjrt_wrap.status()["counts"]
    return out


def run_jax() -> dict:
    from tests.support import pjrt_job
    from xlakit.runtime import pjrt_wrap, wrap_memory

    os.environ.setdefault("XLAKIT_PJRT_PLUGIN", pjrt_job.lammps_plugin())
    os.environ["JAX_PLATFORMS"] = "xlakitcpu"
    import jax
    import numpy as np
    from jax._src import xla_bridge
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    xla_bridge.register_plugin("xlakitcpu", library_path=str(pjrt_wrap.library_path()))
    devices = jax.devices()
    out = {"jax_devices": [str(d) for d in devices], "before": wrap_memory.by_device()}
    mesh = Mesh(np.array(devices[:4]), ("x",))
    x = jax.device_put(np.ones((ROWS, COLS), np.float32), NamedSharding(mesh, PartitionSpec("x", None)))
    x.block_until_ready()
    out["live"] = wrap_memory.by_device()
    x.delete()
    del x
    gc.collect()
    out["freed"] = wrap_memory.by_device()
    wrap_memory.reset_peaks()
    out["reset"] = wrap_memory.by_device(plugin_stats=False)
    return out


def main() -> None:
    which = sys.argv[1]
    out = run_torch_xla() if which == "torch_xla" else run_jax()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
