"""Capture the programs in tests/runtime/programs/ (run by hand when they should be refreshed).

jax (0.10, lammps-jax-pjrt-cpu) and torch_xla (2.9, xla-cpu-pjrt, XLA_HLO_DEBUG=1) compile a few small
programs through `pjrt_shims.program_shim` in front of the wrapper, which records each program exactly as a
framework hands it to a PJRT plugin: jax's MLIR bytecode (a StableHLO portable artifact) and torch_xla's
serialized HloModuleProto.

Usage: python -m tests.support.capture_programs jax|torch_xla OUT_DIR
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def capture_jax() -> None:
    import numpy as np

    from tests.support import pjrt_job

    jax = pjrt_job.start_jax(os.environ["CAPTURE_SHIM"], "capture")
    import jax.numpy as jnp

    @jax.jit
    def step(w, x):
        h = jnp.tanh(x @ w * 0.5)
        return w - 0.1 * (h.T @ x).T

    @jax.jit
    def loss(params, x, y):
        def f(p):
            h = jax.nn.relu(x @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["w2"] - y) ** 2) + 1e-3 * jnp.sum(p["w1"] ** 2)

        value, grads = jax.value_and_grad(f)(params)
        return value, jax.tree.map(lambda a, b: a - 0.01 * b, params, grads)

    @jax.jit
    def misc(x, i):
        y = jnp.where(x > 0, jnp.sin(x), jnp.cos(x))
        z = jax.lax.fori_loop(0, 3, lambda k, a: a * 1.5 + k, y)
        return jnp.sort(z, axis=-1)[..., :2], jnp.argmax(z, axis=0) + i, jnp.cumsum(z, axis=1).astype(jnp.bfloat16)

    x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
    step(np.eye(8, dtype=np.float32), x).block_until_ready()
    params = {"w1": np.full((8, 16), 0.1, np.float32), "b1": np.zeros(16, np.float32),
              "w2": np.ones((16, 4), np.float32)}
    jax.block_until_ready(loss(params, x, np.ones((8, 4), np.float32)))
    jax.block_until_ready(misc(x, 3))


def capture_torch_xla() -> None:
    import torch

    from tests.support import pjrt_job

    torch_xla = pjrt_job.start_torch_xla(os.environ["CAPTURE_SHIM"], "CAPTURE")
    torch.manual_seed(0)
    device = torch_xla.device()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = (torch.arange(64, dtype=torch.float32).reshape(4, 16) / 64).to(device)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        torch_xla.sync()
    with torch.no_grad():
        model(x * 2).softmax(dim=1).sum(dim=0).cpu()


def main() -> None:
    framework, out = sys.argv[1], Path(sys.argv[2]).resolve()
    if "CAPTURE_SHIM" not in os.environ:  # the parent: build the shim, then run this again through it
        import subprocess

        from tests.support import pjrt_job, pjrt_shims
        from xlakit.runtime import pjrt_wrap

        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, CAPTURE_SHIM=str(pjrt_shims.program_shim(Path(tmp))), SHIM_RECORD_DIR=str(out),
                       SHIM_NEXT=str(pjrt_wrap.library_path()))
            if framework == "jax":
                env["XLAKIT_PJRT_PLUGIN"] = pjrt_job.lammps_plugin()
            else:
                env.update(XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(), XLA_HLO_DEBUG="1")
            subprocess.run([sys.executable, "-m", "tests.support.capture_programs", framework, str(out)], env=env,
                           check=True)
        return
    capture_jax() if framework == "jax" else capture_torch_xla()


if __name__ == "__main__":
    main()
