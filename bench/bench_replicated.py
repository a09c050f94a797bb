"""Replica-parallel replicated saves and broadcast loads against rank 0 writing everything.

Starts a job of `--ranks` processes (gloo over loopback), each holding the same
state of `--mib` MiB (32 MiB tensors), and times, one run each:

* save, `layout="replicated"` (rank 0 writes the one file) and with
  `replica_parallel=True` (each rank writes its share into a folder);
* load inside the job: every rank reading the single file, and the
  replica-parallel load (each rank reads its share, the owners broadcast).

Bytes written per rank are counted by the kernel (`wchar` of /proc/self/io
around the save) and, for shares, as the commit record names them. Loads
right after saves read from the page cache: they measure the read path,
not the disk.

    python bench/bench_replicated.py --ranks 4 --mib 1024 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

MiB = 1 << 20


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _state(mib: int) -> dict:
    import torch

    n = 32 * MiB // 4
    return {"step": 7, "model": {f"layer{i}.weight": torch.full((n,), float(i)) for i in range(mib // 32)}}


def rank_main(folder: Path, mib: int) -> None:
    import torch
    import torch.distributed as dist

    import xlakit

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    state = _state(mib)
    out: dict = {"rank": rank}

    def timed(name: str, fn) -> object:
        dist.barrier()
        w, t = _wchar(), time.perf_counter()
        result = fn()
        out[f"{name}_s"] = time.perf_counter() - t
        out[f"{name}_wchar"] = _wchar() - w
        dist.barrier()
        out[f"{name}_all_s"] = time.perf_counter() - t  # until the slowest rank is done
        return result

    single, shares = folder / "all.pt", folder / "shares"
    timed("save_rank0", lambda: xlakit.save(state, single, layout="replicated", timeout_s=600))
    timed("save_shares", lambda: xlakit.save(state, shares, layout="replicated", replica_parallel=True,
                                             timeout_s=600))
    loaded = timed("load_each_reads_all", lambda: xlakit.load(single, layout="replicated", timeout_s=600))
    del loaded
    loaded = timed("load_broadcast", lambda: xlakit.load(shares, timeout_s=600))
    out["bit_exact"] = all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    if rank == 0:
        record = json.loads((shares / "xlakit-commit.json").read_text())
        out["share_bytes"] = [s["bytes"] for s in record["shares"]]
        out["file_bytes"] = single.stat().st_size
    print(json.dumps(out), flush=True)
    dist.barrier()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=1024, help="state size per rank (every rank holds it all)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--rank-of", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_of is not None:
        rank_main(Path(args.folder), args.mib)
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-replicated-") as folder:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(args.ranks)}
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", str(r), "--folder", folder,
                                   "--mib", str(args.mib)], env={**env, "RANK": str(r)},
                                  stdout=subprocess.PIPE, text=True) for r in range(args.ranks)]
        results = []
        for proc in procs:
            out, _ = proc.communicate()
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                raise SystemExit(f"a rank failed (exit {proc.returncode})")
            results.append(json.loads(lines[-1]))
    _report(results, args)


def _report(results: list[dict], args) -> None:
    state = results[0]["file_bytes"]
    print(f"replicated save and load: {args.ranks} ranks, {args.mib} MiB state per rank "
          f"(checkpoint file {state / MiB:.1f} MiB)")
    print(f"{'rank':>4} {'rank0 save s':>12} {'wrote MiB':>9} {'shares save s':>13} {'wrote MiB':>9} "
          f"{'share % of state':>16} {'load all s':>10} {'load bcast s':>12}")
    for r in results:
        share = results[0]["share_bytes"][r["rank"]]
        print(f"{r['rank']:>4} {r['save_rank0_s']:>12.2f} {r['save_rank0_wchar'] / MiB:>9.1f} "
              f"{r['save_shares_s']:>13.2f} {r['save_shares_wchar'] / MiB:>9.1f} {100 * share / state:>15.1f}% "
              f"{r['load_each_reads_all_s']:>10.2f} {r['load_broadcast_s']:>12.2f}")
    slowest = {k: max(r[f"{k}_all_s"] for r in results)
               for k in ("save_rank0", "save_shares", "load_each_reads_all", "load_broadcast")}
    print(f"job time (slowest rank): save rank 0 writes all {slowest['save_rank0']:.2f} s, replica-parallel "
          f"{slowest['save_shares']:.2f} s ({slowest['save_rank0'] / slowest['save_shares']:.2f}x); load every "
          f"rank reads all {slowest['load_each_reads_all']:.2f} s, broadcast {slowest['load_broadcast']:.2f} s")
    most = max(max(results[0]["share_bytes"]), max(r["save_shares_wchar"] for r in results)) / state
    limit = 1 / args.ranks + 0.05
    print(f"bytes each rank writes, replica-parallel: at most {100 * most:.1f}% of the state (share or "
          f"wchar, whichever is more; the limit 1/R + 5% is {100 * limit:.1f}%): "
          f"{'within' if most <= limit else 'OVER'}")
    print(f"bit-exact after the broadcast load on every rank: {all(r['bit_exact'] for r in results)}")
    print(json.dumps({"ranks": args.ranks, "mib": args.mib, "slowest_s": slowest, "most_written_fraction": most,
                      "per_rank": results}))


if __name__ == "__main__":
    main()
