"""`make bench`: a CheckpointManager's local tier (host RAM, peer copies) against its persistent tier.

`--ranks` gloo processes on this machine as 2 simulated hosts (`XLAKIT_HOST_ID`: the
first half of the ranks "host0", the rest "host1"), a sharded state of `--mib` MiB
in all (each rank its share); the local tier in `/dev/shm` (`--shm`), the
persistent tier a folder on disk (`--dir`) or, with `--gcs`, a bucket on
fake-gcs-server started here. Measured, as the slowest rank sees it:

* the training loop's stall: a local-tier save (write + peer copy, synchronous)
  against a persistent save, synchronous and asynchronous (until `save` returns);
* time to a restored state in a restarted manager: every part from its own
  host ("local"), host1's tier emptied ("peer"), every local tier gone
  ("persistent"); each restore checked bit-exact.

Multi-host is simulated: the peer copies cross loopback, not a network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20
TENSOR_MIB = 64


def _state(mib: int, rank: int, world: int) -> dict:
    import torch

    n = max(mib // world // TENSOR_MIB, 1)
    g = torch.Generator().manual_seed(rank)
    return {f"layer{i}": torch.randn(TENSOR_MIB * MiB // 4, generator=g) for i in range(n)}


def rank_main(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["XLAKIT_HOST_ID"] = f"host{rank * 2 // world}"
    import torch
    import torch.distributed as dist

    import xlakit

    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    state = _state(args.mib, rank, world)
    shm, persistent = Path(args.shm), args.dir  # in a rank: the folders themselves
    out: dict = {"rank": rank, "bytes": sum(t.numel() * t.element_size() for t in state.values())}

    def timed(name: str, fn) -> object:
        dist.barrier()
        t = time.perf_counter()
        result = fn()
        out[f"{name}_s"] = time.perf_counter() - t
        dist.barrier()
        return result

    def manager(asynchronous: bool = False) -> "xlakit.CheckpointManager":
        tier = xlakit.LocalTier(shm, interval_steps=3, peers=1, keep=1, timeout_s=900)
        return xlakit.CheckpointManager(persistent, layout="sharded", save_interval_steps=2,
                                        asynchronous=asynchronous, local=tier,
                                        options=xlakit.SaveOptions(timeout_s=900))

    mgr = manager(asynchronous=True)
    timed("persistent_async_stall", lambda: mgr.save(2, state))
    timed("persistent_async_commit", mgr.wait)
    timed("local_stall", lambda: mgr.save(3, state))  # local only: interval 3
    mgr.close()
    sync = manager()
    timed("persistent_sync_stall", lambda: sync.save(4, state))  # persistent only
    sync.close()
    # Step 6: both tiers hold it; the restores below go from the fastest to the slowest tier.
    both = manager()
    both.save(6, state)
    both.close()

    def restore(name: str) -> None:
        mgr = manager()
        got = timed(f"restore_{name}", mgr.restore)
        out[f"restore_{name}_parts"] = mgr.local.restored_from["parts"]
        out[f"restore_{name}_exact"] = all(torch.equal(got[k], v) for k, v in state.items())
        mgr.close()

    restore("local")
    if rank == world - 1:
        from xlakit.checkpoint.tier.local_tier import run_name

        shutil.rmtree(shm / run_name(persistent) / "host1")  # host1 recreated: its RAM is empty
    dist.barrier()
    restore("peer")
    if rank == 0:
        shutil.rmtree(shm)  # every host recreated
    dist.barrier()
    restore("persistent")
    print(json.dumps(out), flush=True)
    dist.barrier()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=1024, help="state size of the whole job (each rank its share)")
    p.add_argument("--dir", default=None, help="the persistent tier's parent (default: a temporary folder)")
    p.add_argument("--shm", default="/dev/shm", help="the local tier's parent")
    p.add_argument("--gcs", action="store_true", help="the persistent tier on fake-gcs-server")
    args = p.parse_args()
    if os.environ.get("XLAKIT_BENCH_RANK"):
        rank_main(args)
        return
    server = None
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-local-tier-") as folder, \
            tempfile.TemporaryDirectory(dir=args.shm, prefix="bench-local-tier-") as shm:
        env = dict(os.environ)
        persistent = str(Path(folder) / "ckpt")
        if args.gcs:
            from tests.support import objstore_servers

            server = objstore_servers.Server("gs", Path(folder) / "gcs")
            env.update(server.env())
            persistent = f"{server.bucket()}/ckpt"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.ranks),
                   XLAKIT_BENCH_RANK="1")
        argv = [sys.executable, __file__, "--mib", str(args.mib), "--shm", str(Path(shm) / "tier")]
        try:
            procs = [subprocess.Popen([*argv, "--dir", persistent], env={**env, "RANK": str(r)},
                                      stdout=subprocess.PIPE, text=True) for r in range(args.ranks)]
            results = []
            for proc in procs:
                out, _ = proc.communicate()
                lines = [line for line in out.splitlines() if line.startswith("{")]
                if proc.returncode or not lines:
                    raise SystemExit(f"a rank failed (exit {proc.returncode})")
                results.append(json.loads(lines[-1]))
        finally:
            if server is not None:
                server.stop()
    _report(results, args, persistent)


def _report(results: list[dict], args, persistent: str) -> None:
    slowest = {k.removesuffix("_s"): max(r[k] for r in results) for k in results[0] if k.endswith("_s")}
    total = sum(r["bytes"] for r in results)
    print(f"local tier: {args.ranks} ranks as 2 simulated hosts, {total / MiB:.0f} MiB sharded state; "
          f"local tier in {args.shm}, persistent tier {'fake-gcs-server' if args.gcs else 'a disk folder'}")
    print("stall of the training loop (slowest rank):")
    print(f"  local-tier save (write + peer copy): {slowest['local_stall']:.2f} s")
    print(f"  persistent save, synchronous:        {slowest['persistent_sync_stall']:.2f} s")
    print(f"  persistent save, asynchronous:       {slowest['persistent_async_stall']:.2f} s "
          f"(committed after {slowest['persistent_async_commit']:.2f} s more)")
    print("time to a restored state (slowest rank):")
    for name in ("local", "peer", "persistent"):
        parts = sorted(set(results[0][f"restore_{name}_parts"].values()))
        exact = all(r[f"restore_{name}_exact"] for r in results)
        print(f"  {name:<10} {slowest[f'restore_{name}']:.2f} s  (sources {parts}, bit-exact: {exact})")
    args_out = {"ranks": args.ranks, "mib": args.mib, "gcs": args.gcs}
    print(json.dumps({**args_out, "slowest_s": slowest, "per_rank": results}))


if __name__ == "__main__":
    main()
