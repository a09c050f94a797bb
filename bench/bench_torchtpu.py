"""`make bench-torchtpu`: a `tpu` state saved by xlakit against `torch.save` of the same state, one run.

TorchTPU runs here on xla-cpu-pjrt (no TPU): its `tpu` memory is host
memory, and its device-to-host copies are blocking (the CPU plugin has no
host allocator), so the numbers measure xlakit's path over TorchTPU (sync,
bounded batches, write, checksums, fsync, atomic commit), not a TPU's DMA.
`torch.save` does not fsync; xlakit does (its time includes durability), so a
third row fsyncs torch.save's file after it returns. Both write to the same
folder; each file is removed before the next row. One run each, in this
order, on a shared machine: read the ratio, not the last digit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import MiB, PeakRss, rss  # noqa: E402


def _state(device, total_mib: int, tensor_mib: int):
    import torch

    n = max(1, total_mib // tensor_mib)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(tensor_mib * MiB // 4, generator=g).to(device) for i in range(n)}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024, help="state size in MiB [1024]")
    p.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor in MiB [64]")
    p.add_argument("--dir", default=None, help="where to write [a temporary folder]")
    args = p.parse_args()
    from xlakit.runtime import torchtpu

    device = torchtpu.start_on_cpu_plugin()
    import torch
    import xlakit

    state = _state(device, args.mib, args.tensor_mib)
    torch.accelerator.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for name in ("torch.save", "torch.save+fsync", "xlakit.save"):
            path = Path(d) / "state.pt"
            base = rss()
            with PeakRss() as peak:
                start = time.perf_counter()
                if name == "xlakit.save":
                    xlakit.save(state, path)
                else:
                    torch.save(state, path)
                    if name.endswith("+fsync"):
                        _fsync(path)
                elapsed = time.perf_counter() - start
            rows.append((name, elapsed, nbytes / MiB / elapsed, (peak.peak - base) / MiB))
            path.unlink()
    print(f"TorchTPU {torchtpu.versions()['torch_tpu']} on {torchtpu.versions()['plugin']}: "
          f"{nbytes / MiB:.0f} MiB in {len(state)} tensors on `tpu`, one run each")
    print(f"{'method':<18} {'seconds':>8} {'MiB/s':>8} {'peak RSS +MiB':>14}")
    for name, s, rate, extra in rows:
        print(f"{name:<18} {s:8.2f} {rate:8.0f} {extra:14.0f}")


if __name__ == "__main__":
    main()
