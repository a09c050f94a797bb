"""What the job runs on, and starting it in a child process the way a job would.

Four backends: `torch_xla` (libtpu, or another PJRT plugin, through xlakit's
PJRT wrapper when the cache or memory check loads it; the built-in CPU client
too), `torchtpu` (TorchTPU's `tpu` device, on libtpu or a PJRT plugin),
`cuda` (torch's own CUDA tensors) and `cpu` (torch alone). `choose` picks the
one this environment runs, as the framework would: TorchTPU where it is in use
(it replaces torch_xla), else torch_xla where installed (`PJRT_DEVICE` then
names the device), else CUDA where torch sees a GPU, else the CPU.

torch on CUDA or the CPU compiles no XLA program, so there the compile cache
and the wrapper's memory count are checked through jax with a PJRT plugin from
PyPI (`jax_plugin`): the CUDA plugin (`jax-cuda12-plugin`), or a CPU one
(`lammps-jax-pjrt-cpu`), loaded through the wrapper as a registered plugin.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xlakit import _knobs
from xlakit.runtime import pjrt_wrap, torchtpu

BACKENDS = ("torch_xla", "torchtpu", "cuda", "cpu")
JAX_PLATFORM = "xlakitwrapped"  # the name the wrapper is registered under in jax


def choose(request: str = "auto") -> tuple[str, str]:
    """The backend to check and why it was chosen (`request` is `--backend`, or auto)."""
    if request != "auto":
        return request, "chosen with --backend"
    if torchtpu.in_use():
        return "torchtpu", "torch-tpu is installed without torch_xla (TorchTPU replaces it)"
    if importlib.util.find_spec("torch_xla") is not None:
        return "torch_xla", f"torch_xla is installed ({_knobs.PJRT_DEVICE}={os.environ.get(_knobs.PJRT_DEVICE)})"
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda", f"torch sees {torch.cuda.device_count()} CUDA devices and no torch_xla or TorchTPU"
    except Exception as e:  # a broken torch is the stack check's finding; here only: no CUDA from it
        return "cpu", f"torch cannot be imported ({type(e).__name__}: {e})"
    return "cpu", "no torch_xla, TorchTPU or CUDA device: tensors stay on the host"


def jax_plugin(backend: str) -> tuple[str | None, str]:
    """The PJRT plugin jax can load through the wrapper for `backend` (cuda or cpu), or why there is none."""
    if importlib.util.find_spec("jax") is None:
        return None, "jax is not installed (the compile cache of torch on CUDA or the CPU is checked through jax)"
    if backend == "cuda":
        spec = importlib.util.find_spec("jax_plugins")
        for root in (spec.submodule_search_locations or []) if spec else []:
            for so in sorted(Path(root).glob("xla_cuda*/xla_cuda_plugin.so")):
                return str(so), "jax's CUDA PJRT plugin"
        return None, "no CUDA PJRT plugin for jax: pip install 'jax[cuda12]'"
    spec = importlib.util.find_spec("lammps_jax_pjrt_cpu")
    so = Path(spec.origin).parent / "pjrt_c_api_cpu_plugin.so" if spec and spec.origin else None
    if so is not None and so.is_file():
        return str(so), "XLA's CPU PJRT plugin from lammps-jax-pjrt-cpu"
    return None, "no CPU PJRT plugin for jax: pip install lammps-jax-pjrt-cpu"


@dataclass
class Device:
    """A started torch device in this process, and how to wait for it."""

    backend: str
    device: Any  # torch.device
    spmd: bool = False

    def sync(self) -> None:
        """Wait until every queued operation and transfer on the device has finished."""
        import torch

        if self.backend == "torch_xla":
            import torch_xla
            import torch_xla.core.xla_model as xm

            torch_xla.sync()
            xm.wait_device_ops()
        elif self.backend == "torchtpu":
            torch.accelerator.synchronize()
        elif self.backend == "cuda":
            torch.cuda.synchronize()

    def put(self, t):
        """`t` on the device, the transfer finished."""
        out = t.to(self.device)
        self.sync()
        return out


def start(backend: str, *, cache_dir: Path | None = None) -> Device:
    """Start `backend` in this process; with `cache_dir`, the persistent cache is turned on first
    (`xlakit.enable_persistent_cache`: on torch_xla with a plugin that loads xlakit's PJRT wrapper)."""
    import xlakit

    if backend == "torchtpu":
        hazard = torchtpu.start_hazard()
        if hazard:
            raise RuntimeError(hazard)
    if cache_dir is not None:
        xlakit.enable_persistent_cache(cache_dir)
    import torch

    if backend == "torch_xla":
        import torch_xla
        import torch_xla.runtime as xr

        if _knobs.xla_flag(_knobs.XLA_USE_SPMD) and not xr.is_spmd():
            xr.use_spmd()
        return Device(backend, torch_xla.device(), spmd=xr.is_spmd())
    if backend == "torchtpu":
        if not torchtpu.started():  # registered by its import on a TPU host; by hand over a PJRT plugin
            import torch_tpu

            torch_tpu._loader._init_device(torchtpu.DEVICE_TYPE)
        return Device(backend, torch.device(torchtpu.DEVICE_TYPE, 0))
    if backend == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        return Device(backend, torch.device("cuda", local % max(1, torch.cuda.device_count())))
    return Device(backend, torch.device("cpu"))


def start_jax(plugin: str, cache_dir: Path | None):
    """jax with `plugin` loaded through xlakit's PJRT wrapper (its cache in `cache_dir` when given); jax.
    Once started in a process, the same jax is returned."""
    if os.environ.get("JAX_PLATFORMS") == JAX_PLATFORM and "jax" in sys.modules:
        return sys.modules["jax"]
    os.environ[_knobs.PJRT_PLUGIN] = plugin
    if cache_dir is not None:
        cache_dir.mkdir(mode=0o700, exist_ok=True)
        os.environ[_knobs.PJRT_CACHE_DIR] = str(cache_dir)
    os.environ["JAX_PLATFORMS"] = JAX_PLATFORM
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # the wrapper's cache, not JAX's own
    from jax._src import xla_bridge

    xla_bridge.register_plugin(JAX_PLATFORM, library_path=str(pjrt_wrap.library_path()))
    jax.devices()  # start the client now: a plugin that cannot load fails here, named
    return jax
