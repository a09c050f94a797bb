"""`make bench` (load side): resuming from a checkpoint, methods side by side, measured in one run.

Two states are written once, by xlakit.save (and as safetensors), then read
back by each method in a fresh process, `--repeat` times with the best kept
(the page cache is warm after the first read, as on a restarted host that
just wrote it):

* `big`: 2 GiB as 64 x 32 MiB fp32, restored onto the XLA device (a module of
  64 parameters there): `torch.load` + `load_state_dict`, `xlakit.load` +
  `load_state_dict`, `xlakit.restore`, safetensors (read fully, host only),
  and the limit: one read of the file's bytes into (warm) memory plus one
  batched host-to-device transfer per 256 MiB of them (`limit`).
* `many`: 100,000 tensors of 64 floats (26 MiB), read to the host:
  `torch.load`, `xlakit.load`, `xlakit.restore` into a CPU template,
  safetensors, and the read of the bytes alone (`limit`); in `--rounds`
  interleaved rounds (measure.py), best kept, as its ratios are the result.
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

from measure import MiB, PeakRss, best_of_rounds, compiles, fresh_process, rss  # noqa: E402

METHODS = {"big": ("torch.load+lsd", "xlakit.load+lsd", "xlakit.restore", "safetensors", "limit"),
           "many": ("torch.load", "xlakit.load", "xlakit.restore", "safetensors", "limit")}
BATCH = 256 * MiB


def _values(workload: str) -> dict:
    import torch

    if workload == "big":
        n = 32 * MiB // 4
        return {f"layer{i}": torch.full((n,), float(i)) for i in range(64)}
    torch.manual_seed(0)
    return {f"block{i // 100}.t{i % 100}": torch.randn(64) for i in range(100_000)}


def write(folder: str) -> None:
    import xlakit

    for workload in ("big", "many"):
        values = _values(workload)
        xlakit.save(values, os.path.join(folder, f"{workload}.pt"))
        try:
            from safetensors.torch import save_file
        except ImportError:
            continue
        save_file(values, os.path.join(folder, f"{workload}.safetensors"))


def _module(workload: str, device):
    """The training state to resume into: parameters of the saved shapes on `device`."""
    import torch

    values = _values(workload) if workload == "many" else {
        k: torch.empty(32 * MiB // 4) for k in (f"layer{i}" for i in range(64))}
    params = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(torch.zeros_like(v))
                                     for k, v in values.items()})
    return params.to(device)


def _read_bytes(path: str, buf: bytearray) -> None:
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(buf), 0
        while done < len(buf):
            done += f.readinto(view[done:])


def run_one(workload: str, method: str, folder: str, repeat: int) -> dict:
    import torch

    import xlakit

    path = os.path.join(folder, f"{workload}.pt")
    on_xla = workload == "big"
    if on_xla:
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device("cpu")
    module = _module(workload, device)
    if on_xla:
        torch_xla.sync()

    def rename(sd: dict) -> dict:
        return {k.replace(".", "_"): v for k, v in sd.items()}

    # The state to resume into exists before a restore (a model's state_dict()): made once, not timed.
    template = dict(zip(_values_keys(workload), module.values()))
    warm = bytearray(os.path.getsize(path))  # touched once here: the limit copies into warm memory

    def limit() -> None:
        _read_bytes(path, warm)
        if not on_xla:
            return
        # The same bytes as the 64 tensors, 8 per batch: one batched transfer per 256 MiB.
        n = 32 * MiB // 4
        host = torch.frombuffer(warm, dtype=torch.float32, count=64 * n)
        for start in range(0, 64, 8):
            torch_xla._XLAC._xla_tensors_from_aten([host[(start + k) * n:(start + k + 1) * n] for k in range(8)],
                                                   [str(device)] * 8)

    def safetensors() -> None:
        from safetensors.torch import load

        load(Path(folder, f"{workload}.safetensors").read_bytes())  # read fully, not mapped

    run = {
        "torch.load+lsd": lambda: module.load_state_dict(rename(torch.load(path, weights_only=True))),
        "xlakit.load+lsd": lambda: module.load_state_dict(rename(xlakit.load(path))),
        "torch.load": lambda: torch.load(path, weights_only=True),
        "xlakit.load": lambda: xlakit.load(path),
        "xlakit.restore": lambda: xlakit.restore(path, template, max_inflight_bytes=BATCH),
        "safetensors": safetensors,
        "limit": limit,
    }[method]
    before_compiles, base = (compiles() if on_xla else 0), rss()
    walls, peak = [], 0
    for _ in range(repeat):
        with PeakRss() as sampler:
            start = time.perf_counter()
            run()
            if on_xla:
                torch_xla._XLAC._xla_wait_device_ops(devices=[])
            walls.append(time.perf_counter() - start)
        peak = max(peak, sampler.peak - base)
    return {"workload": workload, "method": method, "bytes": os.path.getsize(path), "wall_s": min(walls),
            "walls_s": walls, "compiles": (compiles() if on_xla else 0) - before_compiles,
            "peak_rss_increase": peak}


def _values_keys(workload: str) -> list[str]:
    if workload == "big":
        return [f"layer{i}" for i in range(64)]
    return [f"block{i // 100}.t{i % 100}" for i in range(100_000)]


def _table(rows: list[dict]) -> str:
    head = f"{'workload':9} {'method':16} {'best s':>8} {'GB/s':>7} {'peak RSS +MiB':>13} {'compiles':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['workload']:9} {r['method']:16} {r['wall_s']:8.2f} "
                     f"{r['bytes'] / r['wall_s'] / 1e9:7.2f} {r['peak_rss_increase'] / MiB:13.0f} "
                     f"{r['compiles']:8d}")
    by = {(r["workload"], r["method"]): r for r in rows}
    lines.append("")
    big = {m: by.get(("big", m)) for m in METHODS["big"]}
    if big["xlakit.restore"] and big["limit"]:
        lines.append(f"big: xlakit.restore takes {big['xlakit.restore']['wall_s'] / big['limit']['wall_s']:.2f}x "
                     f"the limit (one read + one batched host-to-device copy; target <= 1.3x)")
    if big["xlakit.restore"] and big["torch.load+lsd"]:
        lines.append(f"big: xlakit.restore is {big['torch.load+lsd']['wall_s'] / big['xlakit.restore']['wall_s']:.1f}x "
                     f"faster than torch.load + load_state_dict")
        lines.append(f"big: xlakit.restore peak RSS increase {big['xlakit.restore']['peak_rss_increase'] / MiB:.0f} "
                     f"MiB (max_inflight_bytes {BATCH / MiB:.0f} MiB, bound x1.25 = {1.25 * BATCH / MiB:.0f} MiB)")
        if big["limit"] and os.environ.get("PJRT_DEVICE", "CPU").upper() == "CPU":
            lines.append(f"big: on the CPU PJRT client device buffers are host memory: the limit row, which "
                         f"runs no xlakit code, rises {big['limit']['peak_rss_increase'] / MiB:.0f} MiB; "
                         f"xlakit.restore's own share is the difference")
    many = {m: by.get(("many", m)) for m in METHODS["many"]}
    if many["xlakit.load"] and many["torch.load"]:
        lines.append(f"many: xlakit.load is {many['torch.load']['wall_s'] / many['xlakit.load']['wall_s']:.1f}x "
                     f"faster than torch.load of the same file (target >= 5x)")
    if many["xlakit.load"] and many["xlakit.restore"]:
        x = many["xlakit.restore"]
        lines.append(f"many: xlakit.restore into a CPU template takes {x['wall_s'] / many['xlakit.load']['wall_s']:.2f}x "
                     f"the time of xlakit.load of the same file (target <= 1; best of {x.get('rounds', 1)} "
                     f"interleaved rounds)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="big,many")
    p.add_argument("--methods", help="comma-separated (default: every method of each workload)")
    p.add_argument("--folder", help="where the files are written (default: a temporary folder)")
    p.add_argument("--repeat", type=int, default=3, help="reads per row (best kept)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the `many` workload (best kept)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--one", nargs=2, metavar=("WORKLOAD", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args.folder, args.repeat)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        write(folder)
        def said(row: dict) -> None:
            print(f"  measured {row['workload']}/{row['method']}: {row['wall_s']:.2f} s", file=sys.stderr, flush=True)

        for w in args.workloads.split(","):
            methods = []
            for m in args.methods.split(",") if args.methods else METHODS[w]:
                if m == "safetensors" and not os.path.exists(os.path.join(folder, f"{w}.safetensors")):
                    print("  safetensors is not installed: its rows are skipped", file=sys.stderr)
                    continue
                methods.append(m)

            def measure(m: str, w: str = w) -> dict:
                return fresh_process(__file__, [w, m, "--folder", folder, "--repeat", str(args.repeat)])

            if w == "many":
                rows += best_of_rounds(measure, methods, args.rounds, on_row=said)
                continue
            for m in methods:
                rows.append(measure(m))
                said(rows[-1])
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
