"""`make bench`: checkpoint save methods side by side, measured in one run.

Each (workload, method) runs in a fresh process so compile caches and peak
RSS do not leak between rows; a synced state is saved `--repeat` times per
row and the best time kept, since this VM's page cache alone makes single
writes vary several-fold. Baselines are run as users run them: plain
`torch.save` and `xm.save` do not fsync, xlakit does (its numbers include
durability). The raw row writes the same number of bytes from a reused
buffer and fsyncs: the disk's limit on this machine, now.

`many` (100,000 small CPU tensors) measures the per-tensor cost of a save
against `torch.save`'s; its methods run in `--rounds` interleaved rounds (see
measure.py), best kept, so both face the same load on a shared machine.
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

import workloads  # noqa: E402
from measure import MiB, PeakRss, best_of_rounds, compiles as _compiles, fresh_process, rss as _rss  # noqa: E402

METHODS = {"pending": ("torch.save", "sync+cpu", "xm.save", "xlakit.save", "raw write+fsync"),
           "synced": ("torch.save", "sync+cpu", "xm.save", "xlakit.save", "raw write+fsync"),
           "many": ("torch.save", "xlakit.save", "raw write+fsync")}


def _sync_then_cpu(state, path):
    import torch
    import torch_xla

    tensors = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, dict):
            [collect(v) for v in x.values()]
        elif isinstance(x, (list, tuple)):
            [collect(v) for v in x]

    collect(state)
    torch_xla.sync()

    def to_cpu(x):
        if isinstance(x, torch.Tensor):
            return x.cpu()
        if isinstance(x, dict):
            return {k: to_cpu(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(to_cpu(v) for v in x)
        return x

    torch.save(to_cpu(state), path)


def _raw_write(nbytes: int, path: str) -> None:
    chunk = bytearray(64 * MiB)  # touched once, reused: the disk is the only limit
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(chunk))
            f.write(memoryview(chunk)[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def run_one(workload: str, method: str, folder: str, max_inflight_bytes: int, repeat: int) -> dict:
    """One row, measured in this process."""
    import torch
    import torch_xla.core.xla_model as xm

    import xlakit

    on_xla = workload != "many"
    state = workloads.BUILDERS[workload]()
    nbytes = workloads.nbytes(state)
    path = os.path.join(folder, f"{workload}-{method.replace(' ', '_').replace('+', '_')}.pt")
    save = {
        "torch.save": lambda: torch.save(state, path),
        "sync+cpu": lambda: _sync_then_cpu(state, path),
        "xm.save": lambda: xm.save(state, path),
        "xlakit.save": lambda: xlakit.save(state, path, max_inflight_bytes=max_inflight_bytes),
        "raw write+fsync": lambda: _raw_write(nbytes, path),
    }[method]
    compiles, base = (_compiles() if on_xla else 0), _rss()
    walls, peak, file_bytes = [], 0, 0
    # A pending state is pending only once; a synced one is saved `repeat` times (best kept)
    # because this VM's page cache makes single writes vary by 5x.
    for _ in range(1 if workload == "pending" else repeat):
        with PeakRss() as rss:
            start = time.perf_counter()
            save()
            walls.append(time.perf_counter() - start)
        peak = max(peak, rss.peak - base)
        file_bytes = os.path.getsize(path)
        os.unlink(path)
    return {"workload": workload, "method": method, "bytes": nbytes, "wall_s": min(walls),
            "walls_s": walls, "compiles": (_compiles() if on_xla else 0) - compiles, "peak_rss_increase": peak,
            "file_bytes": file_bytes}


def _measure(workload: str, method: str, folder: str, max_inflight_bytes: int, repeat: int) -> dict:
    return fresh_process(__file__, [workload, method, "--folder", folder, "--max-inflight-bytes",
                                    str(max_inflight_bytes), "--repeat", str(repeat)])


def _table(rows: list[dict], max_inflight_bytes: int) -> str:
    head = (f"{'workload':9} {'method':16} {'best s':>8} {'compiles':>8} {'peak RSS +MiB':>13} "
            f"{'GB/s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['workload']:9} {r['method']:16} {r['wall_s']:8.2f} {r['compiles']:8d} "
                     f"{r['peak_rss_increase'] / MiB:13.0f} {r['bytes'] / r['wall_s'] / 1e9:7.2f}")
    by = {(r["workload"], r["method"]): r for r in rows}
    lines.append("")
    for w in sorted({r["workload"] for r in rows}):
        x = by.get((w, "xlakit.save"))
        if not x:
            continue
        for m in ("torch.save", "sync+cpu", "xm.save"):
            if (w, m) in by:
                lines.append(f"{w}: xlakit.save is {by[(w, m)]['wall_s'] / x['wall_s']:.1f}x faster "
                             f"than {m}")
        if (w, "raw write+fsync") in by:
            raw = by[(w, "raw write+fsync")]
            lines.append(f"{w}: xlakit.save takes {x['wall_s'] / raw['wall_s']:.2f}x the raw "
                         f"write+fsync time of the same bytes")
        lines.append(f"{w}: xlakit peak RSS increase {x['peak_rss_increase'] / MiB:.0f} MiB "
                     f"(max_inflight_bytes {max_inflight_bytes / MiB:.0f} MiB, bound x1.25 = "
                     f"{1.25 * max_inflight_bytes / MiB:.0f} MiB)")
    x, t = by.get(("many", "xlakit.save")), by.get(("many", "torch.save"))
    if x and t:
        lines.append(f"many: xlakit.save takes {x['wall_s'] / t['wall_s']:.2f}x the time of torch.save "
                     f"(target <= 1; best of {x.get('rounds', 1)} interleaved rounds x {len(x['walls_s']) // max(x.get('rounds', 1), 1)} saves each)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="pending,synced,many")
    p.add_argument("--methods", help="comma-separated (default: every method of each workload)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the `many` workload (best kept)")
    p.add_argument("--max-inflight-bytes", type=int, default=256 * MiB)
    p.add_argument("--folder", help="where files are written (default: a temporary folder)")
    p.add_argument("--repeat", type=int, default=3, help="saves per row of the synced state (best kept)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--one", nargs=2, metavar=("WORKLOAD", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args.folder, args.max_inflight_bytes, args.repeat)))
        return 0
    rows = []
    def said(row: dict) -> None:
        print(f"  measured {row['workload']}/{row['method']}: {row['wall_s']:.2f} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        for w in args.workloads.split(","):
            methods = args.methods.split(",") if args.methods else list(METHODS[w])
            if w == "many":  # the ratio is the result: interleaved rounds, best kept
                rows += best_of_rounds(lambda m: _measure(w, m, folder, args.max_inflight_bytes, 2),
                                       methods, args.rounds, on_row=said)
                continue
            for m in methods:
                rows.append(_measure(w, m, folder, args.max_inflight_bytes, args.repeat))
                said(rows[-1])
    print(_table(rows, args.max_inflight_bytes))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
