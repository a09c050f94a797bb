"""Part of `make bench`: a restart through xlakit's PJRT wrapper, cold compile against warm load.

Each row is a fresh process running a program that takes seconds to compile,
on a real PJRT C API plugin from PyPI:

* jax 0.10 on lammps-jax-pjrt-cpu (XLA's CPU plugin, C API 0.115): a jitted
  chain of distinct matmuls; first the plugin loaded directly (the baseline:
  what the wrapper adds to a cold compile), then through the wrapper with an
  empty cache (a miss: compile, serialize, write), then again on the filled
  cache (a hit: read, verify, deserialize);
* stock torch_xla 2.9 on OpenXLA's xla-cpu-pjrt (C API 0.81): a training step
  of a deep MLP, cold then warm (stock torch_xla cannot run this plugin
  without the wrapper, so there is no baseline row).

`first call` is the time until the program's first result is on the host
(compile or load, then run); `plugin compile` and `load` are the wrapper's
own counters. Best of --repeat, each cold run in a fresh folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import measure  # noqa: E402

LAYERS = int(os.environ.get("BENCH_LAYERS", "60"))  # the jax program's depth (--layers); 60 compiles in ~1.5 s here


def jax_program(wrapped: bool, *, own_cache: bool = False) -> dict:
    """The jitted chain, through the wrapper or on the plugin alone; `own_cache` leaves JAX's own
    persistent cache on (bench_cache_tier.py compares entry sizes)."""
    from tests.support import pjrt_job
    from xlakit.runtime import pjrt_wrap

    os.environ["JAX_PLATFORMS"] = "bench"
    import jax

    jax.config.update("jax_enable_compilation_cache", own_cache)
    from jax._src import xla_bridge

    os.environ.setdefault("XLAKIT_PJRT_PLUGIN", pjrt_job.lammps_plugin())
    library = pjrt_wrap.library_path() if wrapped else pjrt_job.lammps_plugin()
    xla_bridge.register_plugin("bench", library_path=str(library))
    import jax.numpy as jnp

    @jax.jit
    def chain(x):
        for i in range(LAYERS):
            x = jnp.tanh(x @ (x.T * (1 + i / LAYERS)) / 64 + jnp.sin(x * i))
        return x.sum()

    x = jnp.ones((64, 64), dtype=jnp.float32)
    start = time.perf_counter()
    float(chain(x))
    return {"first_call_s": time.perf_counter() - start}


def torch_xla_program() -> dict:
    from tests.support import pjrt_job

    os.environ["PJRT_DEVICE"] = "XLACPU"
    import torch
    import torch_xla
    import torch_xla.experimental.plugins as plugins

    import xlakit

    class XlaCpuPlugin(plugins.DevicePlugin):
        def library_path(self) -> str:
            return pjrt_job.xla_cpu_plugin()

    plugins.use_dynamic_plugins()
    plugins.register_plugin("XLACPU", XlaCpuPlugin())
    xlakit.enable_persistent_cache(os.environ["BENCH_CACHE_ROOT"])
    layers = []
    for _ in range(96):
        layers += [torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.GELU()]
    device = torch_xla.device()
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.ones(32, 128).to(device)
    start = time.perf_counter()
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    loss.item()
    return {"first_call_s": time.perf_counter() - start}


def one(framework: str, mode: str) -> None:
    """In a fresh process: run the program, print timing and the wrapper's counters as JSON."""
    from xlakit.runtime import pjrt_wrap

    row = jax_program(mode != "plugin") if framework == "jax" else torch_xla_program()
    status = pjrt_wrap.status()
    counts = status.get("counts", {})
    row.update(hits=counts.get("hits", 0), misses=counts.get("misses", 0), compile_s=counts.get("compile_s", 0.0),
               load_s=counts.get("load_s", 0.0), active=status.get("active", False))
    print(json.dumps(row), flush=True)


def best(framework: str, mode: str, repeat: int, folder: str | None) -> dict:
    rows = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="xlakit-bench-compile-") as fresh:
            where = folder or os.path.join(fresh, "cache")
            env_cache = os.path.join(where, "pjrt-xlacpu") if framework == "torch_xla" else where
            os.environ["XLAKIT_PJRT_CACHE_DIR"] = env_cache
            os.environ["BENCH_CACHE_ROOT"] = where
            rows.append(measure.fresh_process(__file__, [framework, mode]))
    return min(rows, key=lambda r: r["first_call_s"])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--frameworks", default="jax,torch_xla")
    p.add_argument("--layers", type=int, default=LAYERS, help="depth of the jax program (compile time grows with it)")
    args = p.parse_args()
    os.environ["BENCH_LAYERS"] = str(args.layers)  # read by each fresh process
    os.environ.pop("XLAKIT_CACHE_KEY", None)
    print(f"restart through xlakit's PJRT wrapper: first call of a program that takes seconds to compile "
          f"(best of {args.repeat}, each a fresh process)")
    print(f"{'framework':10} {'path':28} {'first call s':>12} {'plugin compile s':>16} {'load s':>7} "
          f"{'hits':>5} {'misses':>6}")
    for framework in args.frameworks.split(","):
        with tempfile.TemporaryDirectory(prefix="xlakit-bench-compile-") as keep:
            folder = os.path.join(keep, "cache")
            rows = []
            if framework == "jax":
                rows.append(("plugin alone (no wrapper)", best(framework, "plugin", args.repeat, None)))
            rows.append(("wrapper, cold (miss)", best(framework, "cold", args.repeat, None)))
            # Fill the kept folder once, then time hits on it.
            best(framework, "cold", 1, folder)
            rows.append(("wrapper, warm (hit)", best(framework, "warm", args.repeat, folder)))
            for label, r in rows:
                print(f"{framework:10} {label:28} {r['first_call_s']:12.2f} {r['compile_s']:16.2f} "
                      f"{r['load_s']:7.3f} {r['hits']:5d} {r['misses']:6d}")
            cold = dict(rows)["wrapper, cold (miss)"]
            warm = dict(rows)["wrapper, warm (hit)"]
            line = f"{framework:10} cold/warm first call = {cold['first_call_s'] / warm['first_call_s']:.1f}x"
            if framework == "jax":
                alone = dict(rows)["plugin alone (no wrapper)"]
                line += f"; wrapper cold / plugin alone = {cold['first_call_s'] / alone['first_call_s']:.2f}x"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
