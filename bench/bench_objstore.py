"""`make bench`: checkpoints through each local object-storage server, xlakit against its baselines.

For fake-gcs-server (gs://) and moto (s3://), a state of `--gib` GiB of CPU
tensors is saved and read back, each row in a fresh process, best of
`--repeat` (the machine is shared with other work: single runs vary):

* save: `xlakit.save` (streamed multipart upload + commit record) against the
  client library's plain streamed upload of the same bytes (fsspec's
  `open(url, "wb")`, no commit protocol) and DCP's fsspec writer
  (`torch.distributed.checkpoint.save` with `FsspecWriter`);
* restore: `xlakit.restore` into a template against fsspec's plain read of
  the same bytes and DCP's `FsspecReader`.

Peak RSS is the process's high-water mark above its RSS with the state (or
template) in memory: what the transfer itself holds. The targets: save within
1.3x of the plain upload's time; RSS within 1.25x of `max_inflight_bytes`
plus the part buffers (S3: part bytes x (parts in flight + 1); GCS: two chunks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import high_water_mark, reset_high_water_mark  # noqa: E402

MiB = 1 << 20
TENSOR_MIB = 128
METHODS = ["plain:save", "xlakit:save", "dcp:save", "plain:restore", "xlakit:restore", "dcp:restore"]


def _state(gib: float):
    import torch

    n = max(int(gib * 1024 / TENSOR_MIB), 1)
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(TENSOR_MIB * MiB // 4, generator=g) for i in range(n)}


def _fs(url: str):
    from xlakit.checkpoint.objstore.client import Location, store_for

    return store_for(Location.parse(f"{url}/x")).fs


def _plain_upload(fs, url: str, state: dict) -> None:
    """The library's own streamed upload, its defaults, each tensor's bytes written whole."""
    with fs.open(url, "wb") as f:
        for t in state.values():
            f.write(memoryview(t.numpy()).cast("B"))


def one(method: str, url: str, gib: float) -> dict:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from tests.support.objstore_servers import loopback_only

    loopback_only()  # nothing but the local server (the metadata endpoints are closed: Server.env())
    state = _state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    import xlakit
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    fs = _fs(url)
    # DCP's storage makes its own fsspec filesystem: against the emulator, without credentials.
    anon = {"token": "anon"} if url.startswith("gs://") else {}
    fs.ls(url)  # connections and imports are not the transfer
    kind, _, what = method.partition(":")
    if what == "restore":  # the save being read, written first (not timed)
        if kind == "xlakit":
            xlakit.save(state, f"{url}/x.pt")
        elif kind == "dcp":
            dcp.save(state, storage_writer=FsspecWriter(f"{url}/dcp", sync_files=False, **anon), no_dist=True)
        else:
            _plain_upload(fs, f"{url}/plain", state)
        for t in state.values():
            t.zero_()
    reset_high_water_mark()
    base = high_water_mark()
    t0 = time.perf_counter()
    if method == "plain:save":
        _plain_upload(fs, f"{url}/plain", state)
    elif method == "xlakit:save":
        xlakit.save(state, f"{url}/x.pt")
    elif method == "dcp:save":
        dcp.save(state, storage_writer=FsspecWriter(f"{url}/dcp", sync_files=False, **anon), no_dist=True)
    elif method == "plain:restore":
        with fs.open(f"{url}/plain", "rb") as f:
            for t in state.values():
                f.readinto(memoryview(t.numpy()).cast("B"))
    elif method == "xlakit:restore":
        xlakit.restore(f"{url}/x.pt", state)
    elif method == "dcp:restore":
        dcp.load(state, storage_reader=FsspecReader(f"{url}/dcp", **anon), no_dist=True)
    seconds = time.perf_counter() - t0
    rss_mib = (high_water_mark() - base) / MiB
    if what == "restore":
        assert torch.equal(state["layer0"], _state(TENSOR_MIB / 1024)["layer0"]), "restored values differ"
    for path in fs.find(url):  # moto keeps objects in memory: each row frees what it wrote
        fs.rm_file(path)
    return {"method": method, "seconds": seconds, "bytes": nbytes, "rss_mib": rss_mib}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--schemes", default="gs,s3", help="the servers to run: gs (fake-gcs-server), s3 (moto)")
    ap.add_argument("--methods", default=",".join(METHODS), help="the rows to run (a ratio needs its plain row)")
    ap.add_argument("--one", nargs=3, metavar=("METHOD", "URL", "GIB"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], float(args.one[2]))))
        return
    from tests.support.objstore_servers import Server
    from xlakit import _knobs
    from xlakit.checkpoint.objstore import upload

    budgets = {s: _knobs.get_int(_knobs.MAX_INFLIGHT_BYTES) + upload.buffer_bytes("s3" if s == "s3" else "gcs")
               for s in ("gs", "s3")}
    methods = [m for m in METHODS if m in args.methods.split(",")]
    print(f"object storage: {args.gib:g} GiB of CPU tensors ({TENSOR_MIB} MiB each), best of {args.repeat}, "
          f"a fresh process per row; RSS above the state; budget = max_inflight_bytes + part buffers")
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in args.schemes.split(","):
            server = Server(scheme, Path(tmp) / scheme)
            rows = {}
            try:
                for method in methods:
                    for _ in range(args.repeat):
                        env = {**os.environ, **server.env(), "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
                        out = subprocess.run([sys.executable, __file__, "--one", method, server.bucket(),
                                              str(args.gib)], capture_output=True, text=True, env=env, timeout=3600)
                        if out.returncode != 0:
                            raise SystemExit(f"{scheme} {method} failed:\n{out.stderr[-3000:]}")
                        row = json.loads(out.stdout.strip().splitlines()[-1])
                        if method not in rows or row["seconds"] < rows[method]["seconds"]:
                            rows[method] = row
            finally:
                server.stop()
            budget = budgets[scheme]
            print(f"\n{scheme}:// ({'fake-gcs-server' if scheme == 'gs' else 'moto server'}), budget "
                  f"{budget / MiB:.0f} MiB")
            print(f"  {'method':<16} {'seconds':>8} {'MiB/s':>7} {'peak RSS MiB':>13}  ratio")
            for method in methods:
                r = rows[method]
                base = rows.get("plain:" + method.split(":")[1])
                ratio = f"{r['seconds'] / base['seconds']:.2f}x plain" if base else "(no plain row)"
                print(f"  {method:<16} {r['seconds']:8.1f} {r['bytes'] / MiB / r['seconds']:7.0f} "
                      f"{r['rss_mib']:13.0f}  {ratio}")
            if "xlakit:save" in rows and "plain:save" in rows:
                x = rows["xlakit:save"]
                print(f"  xlakit save: {x['seconds'] / rows['plain:save']['seconds']:.2f}x the plain upload's "
                      f"time (target 1.3x); RSS {x['rss_mib'] / (budget / MiB):.2f}x the budget (target 1.25x)")


if __name__ == "__main__":
    main()
