"""A job that compiles and runs programs through xlakit's PJRT wrapper, as a fresh process (tests only).

Two frameworks drive it, each with a real PJRT C API plugin from PyPI:

* `jax`: jax loads the wrapper with `xla_bridge.register_plugin`, the wrapper
  loads `lammps-jax-pjrt-cpu`'s CPU plugin (C API 0.115); jax's own
  compilation cache is off;
* `torch_xla`: stock torch_xla 2.9 loads it as a registered device plugin,
  the wrapper loads OpenXLA's `xla-cpu-pjrt` CPU plugin (C API 0.81);
  `--enable DIR` turns the cache on through `xlakit.enable_persistent_cache`,
  otherwise the environment does (`XLAKIT_PJRT_*`, set by the test);
* `torch_xla --tpu`: the same on torch_xla's TPU route (`PJRT_DEVICE=TPU`),
  with the plugin the caller names in `TPU_LIBRARY_PATH` (xla-cpu-pjrt
  standing in for libtpu), which `--enable` puts behind the wrapper, as on a
  TPU VM.

Usage: pjrt_job.py jax|torch_xla [--variant N] [--enable DIR] [--tpu]. Prints
one JSON line: the results' bytes (hex) and the wrapper's status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def lammps_plugin() -> str:
    import lammps_jax_pjrt_cpu

    return str(lammps_jax_pjrt_cpu.PLUGIN_PATH)


def xla_cpu_plugin() -> str:
    import xla_plugins.xla_cpu_pjrt as p

    return str(Path(p.__file__).parent / "xla_cpu_pjrt.so")


def start_jax(library: str | None = None, platform: str = "xlakitcpu"):
    """jax with `library` (default: the wrapper) as its only platform, jax's own compilation cache off."""
    os.environ["JAX_PLATFORMS"] = platform
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from jax._src import xla_bridge

    from xlakit.runtime import pjrt_wrap

    xla_bridge.register_plugin(platform, library_path=library or str(pjrt_wrap.library_path()))
    return jax


def start_torch_xla(library: str | None = None, name: str = "XLACPU"):
    """torch_xla with `library` (default: the wrapper) registered as the device plugin `name`."""
    os.environ["PJRT_DEVICE"] = name
    import torch_xla
    import torch_xla.experimental.plugins as plugins

    from xlakit.runtime import pjrt_wrap

    class Plugin(plugins.DevicePlugin):
        def library_path(self) -> str:
            return library or str(pjrt_wrap.library_path())

    plugins.use_dynamic_plugins()
    plugins.register_plugin(name, Plugin())
    return torch_xla


def run_jax(variant: int) -> list[bytes]:
    os.environ.setdefault("XLAKIT_PJRT_PLUGIN", lammps_plugin())
    jax = start_jax()
    import jax.numpy as jnp

    @jax.jit
    def step(x):
        for i in range(8):
            x = jnp.tanh(x @ x.T * 0.5 + i + variant)
        return x

    x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64
    y = step(x)
    z = jax.jit(lambda a: (a * 3).sum(axis=0))(y)
    return [bytes(jax.device_get(y).tobytes()), bytes(jax.device_get(z).tobytes())]


def run_torch_xla(variant: int, enable: str | None, tpu: bool = False) -> list[bytes]:
    import torch

    if tpu:  # torch_xla's own TPU route: TPU_LIBRARY_PATH names the plugin standing in for libtpu
        os.environ["PJRT_DEVICE"] = "TPU"
        import torch_xla
    else:
        torch_xla = start_torch_xla(os.environ.get("XLAKIT_TEST_REAL_PLUGIN") or xla_cpu_plugin())
    if enable:
        import xlakit

        xlakit.enable_persistent_cache(enable)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    device = torch_xla.device()
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = (torch.arange(64, dtype=torch.float32).reshape(4, 16) / 64 + variant).to(device)
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        torch_xla.sync()
    with torch.no_grad():  # a second program: evaluation
        score = model(x * 2).softmax(dim=1).sum(dim=0)
    tensors = [*model.parameters(), loss, score]
    return [t.detach().cpu().numpy().tobytes() for t in tensors]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("jax", "torch_xla"))
    parser.add_argument("--variant", type=int, default=0, help="changes the program")
    parser.add_argument("--enable", help="xlakit.enable_persistent_cache(DIR) (torch_xla)")
    parser.add_argument("--tpu", action="store_true", help="torch_xla's TPU route (TPU_LIBRARY_PATH: the plugin)")
    args = parser.parse_args()
    results = run_jax(args.variant) if args.framework == "jax" else run_torch_xla(args.variant, args.enable, args.tpu)
    from xlakit.runtime import compile_cache, pjrt_wrap

    import resource

    out = {"results": [r.hex() for r in results], "status": pjrt_wrap.status(),
           "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    if args.framework == "torch_xla":
        from xlakit.runtime import manifest, doctor

        out["cache_stats"] = compile_cache.cache_stats()
        m = manifest.manifest()
        out["manifest_line"] = manifest.manifest_line(m)
        out["doctor"] = doctor.probe_pjrt_wrapper(m["pjrt_wrap"], m["runtime"].get("device_type")).render()
    print(json.dumps(out), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
