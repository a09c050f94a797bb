"""Part of `make bench`: a save of an XLA state against the slowest of its parts (transfer, write).

For each size (`--sizes`, MiB; fp32 tensors of `--tensor-mib`, by default a
32nd of the state up to 64 MiB: a model's state has many tensors), in fresh
processes, in `--rounds` interleaved rounds (measure.py; the ratios are the
result), the best of each:

* `write alone`: `xlakit.save` of CPU tensors with the same bytes: the write
  stage with nothing to transfer (hash, write, fsync, commit);
* `transfer alone` (per transfer backend): the synced XLA state's bytes
  brought to host memory by the backend's own primitive in batches of
  `max_inflight_bytes`, each batch dropped before the next, nothing written
  (`dlpack`: `from_dlpack(_to_dlpack(t))`, the zero-copy export of the CPU
  PJRT client that `auto` picks there; `stock`: `_xla_get_cpu_tensors`, the
  real copy every other PJRT client gets on stock torch_xla; `stock+heap`: the
  same with `XLAKIT_KEEP_HOST_HEAP=1`, glibc keeping freed host memory so that
  each batch's copies reuse the last one's pages, runtime/host_heap.py; at
  least 3 saves per process, the first two growing the heap);
* `xlakit.save` (per backend): the synced XLA state saved with
  `transfer_backend=` that backend.

The goals: `xlakit.save` of the XLA state within 1.1x of the CPU state's
(`write alone`) at 2 GiB, and within 1.1x of max(transfer alone, write alone)
for any size from 64 MiB to 4 GiB (`--sizes 64,256,1024,2048,4096`).
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

from measure import MiB, PeakRss, best_of_rounds, fresh_process, report, rss  # noqa: E402

BACKENDS = ("dlpack", "stock", "stock+heap")


def _state(on: str, mib: int, tensor_mib: int) -> dict:
    import torch

    n = tensor_mib * MiB // 4
    g = torch.Generator().manual_seed(0)
    host = {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(max(mib // tensor_mib, 1))}
    if on == "cpu":
        return {"model": host}
    import torch_xla

    device = torch_xla.device()
    model = {}
    for k in list(host):
        model[k] = host.pop(k).to(device)  # one host copy at a time: the process holds the state once
    torch_xla._XLAC._xla_sync_multi(list(model.values()), devices=[], wait=True)
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    return {"model": model}


def _transfer(state: dict, backend: str, max_inflight_bytes: int) -> None:
    import torch_xla
    from torch.utils.dlpack import from_dlpack

    tensors = list(state["model"].values())
    batch: list = []
    held = 0
    for i, t in enumerate(tensors + [None]):
        nbytes = t.numel() * t.element_size() if t is not None else 0
        if batch and (t is None or held + nbytes > max_inflight_bytes):
            if backend == "dlpack":
                hosts = [from_dlpack(torch_xla._XLAC._to_dlpack(x)).contiguous() for x in batch]
            else:
                hosts = [h.contiguous() for h in torch_xla._XLAC._xla_get_cpu_tensors(batch)]
            del hosts
            batch, held = [], 0
        if t is not None:
            batch.append(t)
            held += nbytes


def run_one(method: str, mib: int, tensor_mib: int, folder: str, max_inflight_bytes: int, repeat: int) -> dict:
    kind, _, backend = method.partition(":")
    if backend.endswith("+heap"):  # as a job sets it: in the environment, applied when xlakit is imported
        os.environ["XLAKIT_KEEP_HOST_HEAP"] = "1"
        backend = backend.removesuffix("+heap")
        repeat = max(repeat, 3)  # the first save grows the heap; a training job saves many times
    import xlakit
    from xlakit.runtime import host_heap

    assert host_heap.kept() == (os.environ.get("XLAKIT_KEEP_HOST_HEAP") == "1"), "glibc did not take the setting"
    state = _state("cpu" if kind == "write" else "xla", mib, tensor_mib)
    path = os.path.join(folder, f"{method.replace(':', '-')}-{mib}.pt")
    run = {
        "write": lambda: xlakit.save(state, path, max_inflight_bytes=max_inflight_bytes),
        "transfer": lambda: _transfer(state, backend, max_inflight_bytes),
        "save": lambda: xlakit.save(state, path, max_inflight_bytes=max_inflight_bytes, transfer_backend=backend),
    }[kind]
    base, walls, peak = rss(), [], 0
    for _ in range(repeat):
        with PeakRss() as sampler:
            t = time.perf_counter()
            run()
            walls.append(time.perf_counter() - t)
        peak = max(peak, sampler.peak - base)
        if os.path.exists(path):
            os.unlink(path)
    return {"method": method, "mib": mib, "tensor_mib": tensor_mib, "wall_s": min(walls), "walls_s": walls,
            "peak_rss_increase": peak}


def methods() -> list[str]:
    return ["write", *(f"{k}:{b}" for b in BACKENDS for k in ("transfer", "save"))]


def table(rows: list[dict], rounds: int) -> str:
    by = {(r["mib"], r["method"]): r for r in rows}
    head = (f"{'MiB':>6} {'backend':10} {'write s':>8} {'transfer s':>10} {'save s':>8} {'save/write':>10} "
            f"{'save/max':>8} {'save peak RSS +MiB':>18}")
    lines = [head, "-" * len(head)]
    worst = []
    for mib in sorted({r["mib"] for r in rows}):
        write = by[(mib, "write")]["wall_s"]
        for b in BACKENDS:
            transfer, save = by.get((mib, f"transfer:{b}")), by.get((mib, f"save:{b}"))
            if not (transfer and save):
                continue
            slowest = max(write, transfer["wall_s"])
            worst.append((save["wall_s"] / slowest, mib, b))
            lines.append(f"{mib:6d} {b:10} {write:8.2f} {transfer['wall_s']:10.2f} {save['wall_s']:8.2f} "
                         f"{save['wall_s'] / write:10.2f} {save['wall_s'] / slowest:8.2f} "
                         f"{save['peak_rss_increase'] / MiB:18.0f}")
    for b in BACKENDS:  # the worst size of each backend
        ratio, mib = max(((r, m) for r, m, bb in worst if bb == b), default=(None, None))
        if ratio is not None:
            lines.append(f"worst, {b}: xlakit.save takes {ratio:.2f}x max(transfer alone, write alone) ({mib} MiB; "
                         f"goal <= 1.1x; best of {rounds} interleaved round(s))")
    two = by.get((2048, "save:dlpack"))
    if two:
        lines.append(f"2 GiB: the XLA state's save takes {two['wall_s'] / by[(2048, 'write')]['wall_s']:.2f}x the CPU "
                     f"state's (goal <= 1.1x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,512,2048", help="state sizes in MiB (up to 4096)")
    p.add_argument("--tensor-mib", type=int, default=0, help="tensor size (default: the state / 32, at most 64)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2, help="saves per process (best kept)")
    p.add_argument("--max-inflight-bytes", type=int, default=256 * MiB)
    p.add_argument("--folder", help="where files are written (default: a temporary folder)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--one", nargs=2, metavar=("METHOD", "MIB"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.tensor_mib, args.folder,
                                 args.max_inflight_bytes, args.repeat)))
        return 0
    print(f"save of a synced XLA state against transfer alone and write alone (fp32 tensors of "
          f"{args.tensor_mib or 'the state / 32, at most 64'} MiB, max_inflight_bytes "
          f"{args.max_inflight_bytes // MiB} MiB, best of {args.rounds} interleaved round(s) x {args.repeat} per "
          f"process; PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'CPU')})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.folder, prefix="bench-overlap-") as folder:
        for mib in (int(s) for s in args.sizes.split(",")):
            tensor_mib = args.tensor_mib or max(1, min(64, mib // 32))

            def measure(m: str, mib: int = mib, tensor_mib: int = tensor_mib) -> dict:
                return fresh_process(__file__, [m, str(mib), "--folder", folder, "--tensor-mib", str(tensor_mib),
                                                "--max-inflight-bytes", str(args.max_inflight_bytes),
                                                "--repeat", str(args.repeat)])

            rows += best_of_rounds(measure, methods(), args.rounds, on_row=lambda r: print(
                f"  measured {r['mib']} MiB {r['method']}: {r['wall_s']:.2f} s", file=sys.stderr, flush=True))
    return report(table(rows, args.rounds), rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
