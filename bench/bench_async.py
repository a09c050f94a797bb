"""Part of `make bench`: how long an asynchronous save blocks the training loop.

For a ~1 GB state, in one process: the full synchronous save, then
asynchronous saves (the first touches fresh staging memory, the next reuse
it), each reporting the time the caller was blocked and the time until the
checkpoint was committed. Run for a synced XLA state and for a CPU state
(the one whose bytes must be copied into the staging arena).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import workloads  # noqa: E402
import xlakit  # noqa: E402


def _state(kind: str, total_mib: int) -> dict:
    if kind == "xla":
        return workloads.synced(total_mib=total_mib, tensor_mib=32)
    n = 32 * workloads.MiB // 4
    return {"model": {f"layer{i}.weight": torch.full((n,), float(i)) for i in range(total_mib // 32)}}


def measure(kind: str, total_mib: int, repeat: int, folder: str) -> list[str]:
    state = _state(kind, total_mib)
    path = os.path.join(folder, f"{kind}.pt")
    sync = []
    for _ in range(repeat):
        t = time.perf_counter()
        xlakit.save(state, path)
        sync.append(time.perf_counter() - t)
    rows = [f"{kind:4} {'sync save':22} blocked {min(sync):6.2f} s  committed {min(sync):6.2f} s"]
    for i in range(repeat):
        t = time.perf_counter()
        handle = xlakit.save(state, path, asynchronous=True)
        handle.result()
        total = time.perf_counter() - t
        label = "async (fresh arena)" if i == 0 else "async (reused arena)"
        rows.append(f"{kind:4} {label:22} blocked {handle.blocked_s:6.2f} s  committed {total:6.2f} s"
                    f"  blocked/sync = {handle.blocked_s / min(sync):.2f}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kinds", default="xla,cpu")
    args = p.parse_args()
    print(f"asynchronous save of a {args.total_mib} MiB state (best sync save of {args.repeat}; "
          f"goal: blocked at most 1/3 of the sync save)")
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.kinds.split(","):
            print("\n".join(measure(kind, args.total_mib, args.repeat, folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
