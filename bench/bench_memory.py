"""Part of `make bench`: what the PJRT wrapper's memory accounting costs a training step.

Stock torch_xla 2.9 under SPMD on OpenXLA's xla-cpu-pjrt plugin with 4
devices, through xlakit's wrapper (`PJRT_DEVICE=TPU`, the wrapper as libtpu):
a data-parallel training step of a small MLP (small on purpose: the
accounting's cost is per buffer, so a short step shows it most). Each row is
a fresh process, one run of BENCH_MEMORY_STEPS timed steps after warm-up,
each step waited for (`--rounds N` repeats the three rows N times,
interleaved, and reports each row's median over the rounds: this machine's
noise is larger than the difference):

* `accounting off`: `XLAKIT_PJRT_MEMORY_ACCOUNTING=0` (the wrapper without it);
* `accounting on`: the default;
* `on + memory_info()`: the default, and `xlakit.memory_info()` for every
  device after every step (a `/memory` endpoint's cost).

The ratios are each row's median step (wall) and its CPU time per step (every
thread of the process) over the `accounting off` row's;
`buffers/step` is how many buffers the wrapper accounted per step on all
devices (what the accounting's cost scales with), `in accounting` the time
per step spent in the accounting itself (the wrapper times it: a figure the
step-time noise of a shared machine cannot blur).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import measure  # noqa: E402

STEPS = int(os.environ.get("BENCH_MEMORY_STEPS", "300"))
ROWS = (("accounting off", "0", False), ("accounting on", "1", False), ("on + memory_info()", "1", True))


def one(read_memory: bool) -> None:
    """In a fresh process: time the training step, print a JSON row."""
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import xlakit

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(4), (4,), ("data",))
    torch.manual_seed(0)
    device = torch_xla.device()
    model = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.Tanh())),
                                torch.nn.Linear(256, 8)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256).to(device)
    xs.mark_sharding(x, mesh, ("data", None))

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        torch_xla.sync()
        xm.wait_device_ops()
        if read_memory:
            xlakit.memory_info()

    from xlakit.runtime import wrap_memory

    for _ in range(10):  # compile, settle
        step()
    before = wrap_memory.report(plugin_stats=False)
    times = []
    cpu = time.process_time()  # every thread of the process: less blurred by other processes than wall time
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    live = sum(i.live_bytes or 0 for i in xlakit.memory_info())
    after = wrap_memory.report(plugin_stats=False)
    created = sum(d["created_buffers"] for d in after["devices"]) - sum(d["created_buffers"] for d in before["devices"])
    print(json.dumps({"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3,
                      "cpu_ms": cpu / STEPS * 1e3, "live_bytes": live, "buffers_per_step": created / STEPS,
                      "accounting_us_per_step": (after["accounting_s"] - before["accounting_s"]) / STEPS * 1e6}),
          flush=True)


def _env(accounting: str) -> None:
    import xla_plugins.xla_cpu_pjrt as p

    from xlakit.runtime import pjrt_wrap

    os.environ.update(PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=str(pjrt_wrap.library_path()),
                      XLAKIT_PJRT_PLUGIN=str(Path(p.__file__).parent / "xla_cpu_pjrt.so"), XLA_USE_SPMD="1",
                      XLA_NO_SPECIAL_SCALARS="1", XLA_FLAGS="--xla_force_host_platform_device_count=4",
                      XLAKIT_PJRT_MEMORY_ACCOUNTING=accounting)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(sys.argv[2] == "read")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs of every row, interleaved (default 1)")
    rounds = parser.parse_args().rounds
    print(f"PJRT wrapper memory accounting: a data-parallel MLP training step, stock torch_xla under SPMD on "
          f"xla-cpu-pjrt (4 devices), {STEPS} steps per row, {rounds} run(s) each", flush=True)
    print(f"{'row':20} {'median ms':>10} {'ratio':>6} {'CPU ms':>7} {'ratio':>6} {'buffers/step':>12} "
          f"{'in accounting':>13} {'live bytes':>11}", flush=True)
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in ROWS}
    for _ in range(rounds):
        for label, accounting, read in ROWS:
            _env(accounting)
            runs[label].append(measure.fresh_process(__file__, ["read" if read else "step"]))
    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[label])

    base, base_cpu = med(ROWS[0][0], "median_ms"), med(ROWS[0][0], "cpu_ms")
    for label, found in runs.items():
        median, cpu = med(label, "median_ms"), med(label, "cpu_ms")
        print(f"{label:20} {median:10.3f} {median / base:6.3f} {cpu:7.3f} {cpu / base_cpu:6.3f} "
              f"{found[-1]['buffers_per_step']:12.1f} {med(label, 'accounting_us_per_step'):10.1f} us "
              f"{found[-1]['live_bytes']:11d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
