"""Part of `make bench`: how many bytes a load reads, against the size of what it loads (the goal: 1.00x).

Three shapes, each on disk and on each local object-storage server
(fake-gcs-server for gs://, moto for s3://):

* `plain`: `xlakit.load` of a file of alternating 1 MiB and 1 KiB fp32 tensors
  (`--pairs` of them, ~52 MB by default): small records sit between large ones;
* `broadcast`: `xlakit.restore` inside a job of 2 gloo ranks of a
  replica-parallel checkpoint whose shares are one 2 MiB tensor each: every
  rank reads its own share and broadcasts it; its reference size is its share;
* `dcp`: `xlakit.dcp_load` (verified) of the `plain` state as a DCP checkpoint;
  its reference size is the checkpoint's files (`.metadata` included).

One pass reads nothing but the load's own bytes.

What is counted, in the loading process, around the second of two loads (the
first imports and warms what it needs): on disk, the bytes and read calls of
every file object opened for reading under the checkpoint's folder
(`builtins.open` is wrapped here to hand out a counting `io.FileIO`: xlakit's
readers read records that way; the kernel's per-thread `rchar` cannot be used,
as a load runs on a worker thread and a broadcast's gloo reads are counted in
the process's); in a bucket, the bytes and ranged requests of every object
read through xlakit's store layer (`objstore.client.Store.get`, `get_into`,
`get_many`, wrapped here). Not counted: torch's C++ zip reader, which reads a
share's central directory and index to check it against the commit record
(a few KiB). `ratio` is bytes read over the size of the file (or share).
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import report  # noqa: E402

MiB = 1 << 20
SHARE_MIB = 2


class StoreReads:
    """Bytes and requests of every object read through `Store` while active (a bench-side wrapper)."""

    def __init__(self) -> None:
        self.bytes = self.requests = 0
        self._lock = threading.Lock()

    def install(self) -> None:
        from xlakit.checkpoint.objstore.client import Store

        get, get_into, get_many = Store.get, Store.get_into, Store.get_many
        reads = self

        def counted(n: int, requests: int) -> None:
            with reads._lock:
                reads.bytes += n
                reads.requests += requests

        def get_(store, op, loc, start=None, end=None):
            data = get(store, op, loc, start, end)
            counted(len(data), 1)
            return data

        def get_into_(store, op, loc, offset, dst, *, chunk_bytes, parallel):
            got = get_into(store, op, loc, offset, dst, chunk_bytes=chunk_bytes, parallel=parallel)
            counted(got, -(-len(dst) // chunk_bytes))
            return got

        def get_many_(store, op, locs):
            found = get_many(store, op, locs)
            counted(sum(len(d) for d in found if d is not None), len(locs))
            return found

        Store.get, Store.get_into, Store.get_many = get_, get_into_, get_many_


    def install_files(self, root: str) -> None:
        """Count the reads of every file opened for reading under `root` (a bench-side wrapper)."""
        reads, real_open = self, builtins.open

        class CountingFile(io.FileIO):
            def readinto(self, buffer):
                n = super().readinto(buffer)
                reads.add(n or 0)
                return n

            def read(self, size=-1):
                data = super().read(size)
                reads.add(len(data or b""))
                return data

            def readall(self):
                data = super().readall()
                reads.add(len(data))
                return data

        def counting_open(file, mode="r", buffering=-1, *args, **kwargs):
            if mode in ("rb", "br") and isinstance(file, (str, os.PathLike)) and \
                    os.path.abspath(file).startswith(root):
                raw = CountingFile(file, "r")
                return raw if buffering == 0 else io.BufferedReader(raw)
            return real_open(file, mode, buffering, *args, **kwargs)

        builtins.open = counting_open

    def add(self, n: int) -> None:
        if n:
            with self._lock:
                self.bytes += n
                self.requests += 1


def measured(store: StoreReads, fn) -> dict:
    """Bytes and requests read by `fn()` (see the module docstring)."""
    before = (store.bytes, store.requests)
    fn()
    return {"read_bytes": store.bytes - before[0], "requests": store.requests - before[1]}


def plain_state(pairs: int) -> dict:
    import torch

    out = {}
    for i in range(pairs):
        out[f"big{i}"] = torch.full((MiB // 4,), float(i))
        out[f"small{i}"] = torch.full((256,), float(i))
    return out


def _size(where: str, target: str, share: int | None) -> int:
    """The bytes of the file, or of share `share`'s file, at `target`."""
    if where == "disk":
        if share is None:
            return os.path.getsize(target)
        record = json.loads(Path(target, "xlakit-commit.json").read_text())
        return record["shares"][share]["bytes"]
    from xlakit.checkpoint.file import bucket_file
    from xlakit.checkpoint.objstore.client import Location
    import xlakit

    record = bucket_file.peek(Location.parse(target), xlakit.LoadOptions())
    name = record["shares"][share] if share is not None else next(iter(record["objects"]))
    return record["objects"][name]["nbytes"]


def _reads(where: str, target: str) -> StoreReads:
    reads = StoreReads()
    if where == "disk":
        reads.install_files(os.path.dirname(os.path.abspath(target)))
    else:
        reads.install()
    return reads


def one_plain(where: str, target: str, pairs: int) -> dict:
    import xlakit

    store = _reads(where, target)
    xlakit.save(plain_state(pairs), target)
    xlakit.load(target)  # warm: imports, connections
    row = measured(store, lambda: xlakit.load(target))
    return {"shape": "plain", "where": where, "size": _size(where, target, None), **row}


def one_dcp(where: str, target: str, pairs: int) -> dict:
    import xlakit

    store = _reads(where, target)
    state = plain_state(pairs)
    xlakit.dcp_save(state, target)
    xlakit.dcp_load(state, target)  # warm: imports, connections
    row = measured(store, lambda: xlakit.dcp_load(state, target))
    if where == "disk":
        files = json.loads(Path(target, "xlakit-commit.json").read_text())["files"]
    else:
        from xlakit.checkpoint.objstore import generations
        from xlakit.checkpoint.objstore.client import Location, store_for

        loc = Location.parse(target)
        files = generations.latest_record(store_for(loc), None, loc, "dcp")["objects"]
    return {"shape": "dcp", "where": where, "size": sum(e["nbytes"] for e in files.values()), **row}


def one_rank(where: str, target: str) -> dict:
    """One rank of the broadcast restore job (RANK, WORLD_SIZE, MASTER_* set by the parent)."""
    import torch
    import torch.distributed as dist

    import xlakit

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _reads(where, target)
    n = SHARE_MIB * MiB // 4
    state = {f"layer{i}": torch.full((n,), float(i)) for i in range(world)}
    xlakit.save(state, target, layout="replicated", replica_parallel=True)
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    xlakit.restore(target, template)  # warm
    dist.barrier()
    row = measured(store, lambda: xlakit.restore(target, template))
    assert all(torch.equal(template[k], v) for k, v in state.items()), "restored values differ"
    dist.barrier()
    return {"shape": "broadcast", "where": where, "rank": rank, "size": _size(where, target, rank), **row}


def _run(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _row(proc: subprocess.Popen, what: str) -> dict:
    out, err = proc.communicate(timeout=900)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return json.loads(lines[-1])


def run_where(where: str, base: str, env: dict, pairs: int, ranks: int) -> list[dict]:
    env = {**env, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    sep = "/" if "://" in base else os.sep
    rows = [_row(_run(["--plain", where, f"{base}{sep}plain.pt", "--pairs", str(pairs)], env), f"{where} plain"),
            _row(_run(["--dcp", where, f"{base}{sep}dcp", "--pairs", str(pairs)], env), f"{where} dcp")]
    from tests.support.ranks import private_port

    job = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(private_port()), "WORLD_SIZE": str(ranks)}
    procs = [_run(["--rank", where, f"{base}{sep}shares"], {**job, "RANK": str(r)}) for r in range(ranks)]
    rows += [_row(p, f"{where} broadcast rank {r}") for r, p in enumerate(procs)]
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'shape':10} {'where':5} {'rank':>4} {'size MiB':>9} {'read MiB':>9} {'requests':>8} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        rank = r.get("rank", "")
        lines.append(f"{r['shape']:10} {r['where']:5} {rank:>4} {r['size'] / MiB:9.2f} {r['read_bytes'] / MiB:9.2f} "
                     f"{r['requests']:8d} {r['read_bytes'] / r['size']:6.2f}")
    worst = max(rows, key=lambda r: r["read_bytes"] / r["size"])
    lines.append(f"most bytes read per byte loaded: {worst['read_bytes'] / worst['size']:.2f}x ({worst['shape']}, "
                 f"{worst['where']}; the goal is 1.00x: every byte read once)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--where", default="disk,gs,s3", help="disk, gs (fake-gcs-server), s3 (moto)")
    p.add_argument("--pairs", type=int, default=50, help="1 MiB + 1 KiB tensor pairs of the plain file")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--plain", nargs=2, metavar=("WHERE", "TARGET"), help=argparse.SUPPRESS)
    p.add_argument("--rank", nargs=2, metavar=("WHERE", "TARGET"), help=argparse.SUPPRESS)
    p.add_argument("--dcp", nargs=2, metavar=("WHERE", "TARGET"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain or args.rank or args.dcp:
        import warnings

        warnings.filterwarnings("ignore")
        from tests.support.objstore_servers import loopback_only

        loopback_only()
        row = (one_plain(*args.plain, args.pairs) if args.plain else one_dcp(*args.dcp, args.pairs) if args.dcp
               else one_rank(*args.rank))
        print(json.dumps(row), flush=True)
        os._exit(0)  # a gloo job's threads: no teardown to wait for
    from tests.support.objstore_servers import Server

    print(f"bytes read per load: plain = xlakit.load of {args.pairs} x (1 MiB + 1 KiB) tensors; dcp = the same "
          f"through dcp_save / dcp_load (verified); broadcast = "
          f"xlakit.restore in a {args.ranks}-rank job of {SHARE_MIB} MiB shares (per rank, against its share)",
          flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-read-once-") as tmp:
        for where in args.where.split(","):
            if where == "disk":
                rows += run_where(where, tmp, dict(os.environ), args.pairs, args.ranks)
                continue
            server = Server(where, Path(tmp) / where)
            try:
                rows += run_where(where, server.bucket(), {**os.environ, **server.env()}, args.pairs, args.ranks)
            finally:
                server.stop()
    return report(table(rows), rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
