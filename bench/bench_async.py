"""Part of `make bench`: how long an asynchronous save blocks the training loop, xlakit against its peers.

One table per state, a 1 GiB state of 32 MiB fp32 tensors by default: CPU
tensors (`cpu`) and a synced XLA state (`xla`). The XLA table has xlakit twice:
on this machine's route (the CPU client's zero-copy DLPack export) and on the
copy route a TPU's buffers take (`xlakit-copy`), and on that route staged on the device
(`xlakit-device`); the goal lines judge the first. Each row is a fresh process
(clean RSS), in which the peer (`async_peers.py`: each one's own documented
asynchronous path) saves the state twice, as a training loop does; the
columns are:

* `blocked 1st`, `blocked`: how long the caller could not change the state,
  on the first save of the process and on the second (steady state: staging
  memory a peer keeps is reused); `x memcpy` is `blocked` over the baseline
  measured in the same process just before;
* `returns`: where the call returns before the state may change (DCP);
* `durable`: from the call until the peer reports the checkpoint written and
  every file it wrote is fsynced (peers that do not fsync get it done for
  them, timed: torch.save and Orbax do not);
* `peak RSS +MiB`: the process's high-water mark over both saves above its RSS
  with the state built (on the CPU PJRT client an XLA state's device buffers
  are host memory too: they are in it);
* `device +MiB` (XLA state): the most device memory live during the saves
  above what the state holds, counted by xlakit's PJRT wrapper (its live-buffer
  accounting, `xlakit.memory_info()`), in another fresh process that runs the
  same saves with the wrapper in front of OpenXLA's CPU plugin (torch_xla) or
  lammps-jax-pjrt-cpu (jax): the CPU client of `PJRT_DEVICE=CPU` keeps no
  allocator statistics ("GetAllocatorStats is not supported").

The baseline, measured in each row's process before its state is built (the
load of a shared machine changes within seconds): one memcpy of the state's
bytes into host memory touched beforehand (best of 3); the `memcpy` row shows
the fastest of them.
The goal: xlakit's blocked time is the lowest, at most 1.2x the memcpy, with
peak RSS at most `max_inflight_bytes` above the state.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import async_peers  # noqa: E402
from measure import MiB, best_of_rounds, fresh_process, high_water_mark, reset_high_water_mark, rss  # noqa: E402

SYNC = "xlakit-sync"


def _memcpy_s(total_mib: int, tensor_mib: int) -> float:
    """One memcpy of the state's bytes (as CPU tensors) into memory touched beforehand, best of 3."""
    import torch

    state = async_peers.torch_state("cpu", total_mib, tensor_mib)["model"]
    dst = torch.ones(total_mib * MiB, dtype=torch.uint8)  # touched
    times = []
    for _ in range(3):
        t, at = time.perf_counter(), dst.data_ptr()
        for v in state.values():
            n = v.numel() * v.element_size()
            ctypes.memmove(at, v.data_ptr(), n)
            at += n
        times.append(time.perf_counter() - t)
    return min(times)


def _wrap_device_memory(peer: str) -> None:
    """Route this process's XLA runtime (torch_xla or jax) through xlakit's PJRT wrapper."""
    from tests.support import pjrt_job
    from xlakit.runtime import pjrt_wrap

    if peer == "orbax":
        os.environ.update(XLAKIT_PJRT_PLUGIN=pjrt_job.lammps_plugin(), JAX_PLATFORMS="xlakitcpu")
        from jax._src import xla_bridge

        xla_bridge.register_plugin("xlakitcpu", library_path=str(pjrt_wrap.library_path()))
    else:
        os.environ.update(PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=str(pjrt_wrap.library_path()),
                          XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(), XLA_NO_SPECIAL_SCALARS="1")


def _device_live() -> tuple[int, int]:
    from xlakit.runtime import wrap_memory

    devices = wrap_memory.report(plugin_stats=False)["devices"]
    return sum(d["live_bytes"] for d in devices), sum(d["peak_bytes"] for d in devices)


def one(kind: str, peer: str, total_mib: int, tensor_mib: int, saves: int, folder: str,
        device_memory: bool) -> dict:
    """One row in this process: the baseline (memcpy), the state built, then `saves` saves, each timed."""
    memcpy = _memcpy_s(total_mib, tensor_mib)  # here, now: under the load the saves will see
    if device_memory:
        _wrap_device_memory(peer)
    state = async_peers.state_for(peer, kind, total_mib, tensor_mib)
    impl = None if peer == SYNC else async_peers.PEERS[peer](kind)
    if device_memory:
        from xlakit.runtime import wrap_memory

        wrap_memory.reset_peaks()
        live_before, _ = _device_live()
    base = rss()
    reset_high_water_mark()
    rows = []
    for i in range(saves):
        path = Path(folder) / f"{kind}-{peer}-{i}"
        path.mkdir()
        t = time.perf_counter()
        if impl is None:
            import xlakit

            xlakit.save(state, path / "ckpt.pt")
            returned, wait = None, lambda: None
        else:
            returned, wait = impl.start(state, path)
        blocked = time.perf_counter() - t
        wait()
        async_peers.fsync_tree(path)
        rows.append({"blocked_s": blocked, "returned_s": returned, "durable_s": time.perf_counter() - t,
                     "file_bytes": async_peers.file_bytes(path)})
        shutil.rmtree(path)
    if impl is not None:
        impl.close()
    out = {"kind": kind, "peer": peer, "state_bytes": total_mib * MiB, "memcpy_s": memcpy, "first": rows[0],
           **rows[-1], "peak_rss_increase": high_water_mark() - base}
    out["wall_s"], out["walls_s"] = out["blocked_s"], [r["blocked_s"] for r in rows]
    if device_memory:
        _, peak = _device_live()
        out["device_extra"], out["device_state"] = peak - live_before, live_before
    return out


def _table(kind: str, rows: list[dict], max_inflight_bytes: int, device: dict) -> list[str]:
    base = min(r["memcpy_s"] for r in rows)
    head = (f"{'state':5} {'peer':30} {'blocked 1st':>11} {'blocked':>8} {'x memcpy':>8} {'returns':>7} "
            f"{'durable':>8} {'file MiB':>8} {'peak RSS +MiB':>13} {'device +MiB':>11}")
    lines = [head, "-" * len(head),
             f"{kind:5} {'memcpy (touched memory)':30} {'':>11} {base:8.3f} {1:8.2f}"]
    for r in rows:
        label = "xlakit.save (synchronous)" if r["peer"] == SYNC else async_peers.LABELS[r["peer"]]
        ret = f"{r['returned_s']:7.3f}" if r["returned_s"] is not None else f"{'-':>7}"
        dev = device.get(r["peer"])
        dev = f"{dev / MiB:11.0f}" if dev is not None else f"{'n/a' if kind == 'xla' else '-':>11}"
        lines.append(f"{kind:5} {label:30} {r['first']['blocked_s']:11.3f} {r['blocked_s']:8.3f} "
                     f"{r['blocked_s'] / r['memcpy_s']:8.2f} {ret} {r['durable_s']:8.2f} {r['file_bytes'] / MiB:8.0f} "
                     f"{r['peak_rss_increase'] / MiB:13.0f} {dev}")
    copy = next((r for r in rows if r["peer"] == "xlakit-copy"), None)
    on_device = next((r for r in rows if r["peer"] == "xlakit-device"), None)
    asyncs = [r for r in rows if r["peer"] not in (SYNC, *async_peers.XLA_ONLY)]  # the routes this machine takes
    x = next((r for r in asyncs if r["peer"] == "xlakit"), None)
    if x is not None:
        lowest = min(asyncs, key=lambda r: r["blocked_s"] / r["memcpy_s"])  # each against its own baseline
        rss_ok = x["peak_rss_increase"] <= max_inflight_bytes
        lines.append(f"{kind}: xlakit blocked {x['blocked_s'] / x['memcpy_s']:.2f}x the memcpy (goal <= 1.2x); lowest "
                     f"blocked: {async_peers.LABELS[lowest['peer']]}"
                     + ("" if lowest is x else f" ({lowest['blocked_s'] / lowest['memcpy_s']:.2f}x its memcpy)")
                     + f"; xlakit peak RSS {x['peak_rss_increase'] / MiB:.0f} MiB above the state (goal <= "
                     f"max_inflight_bytes {max_inflight_bytes / MiB:.0f} MiB: {'met' if rss_ok else 'NOT met'})")
        lines.append(f"{kind}: lowest per column (docs/checkpoints.md says why where a peer wins): "
                     + "; ".join(_winners(asyncs, device)))
    if copy is not None:
        lines.append(f"{kind}: on the copy route (a TPU's) xlakit's caller waits for the device-to-host copy: blocked "
                     f"{copy['blocked_s'] / copy['memcpy_s']:.2f}x the memcpy, peak RSS "
                     f"{copy['peak_rss_increase'] / MiB:.0f} MiB above the state (docs/checkpoints.md)")
    if on_device is not None:
        dev = device.get("xlakit-device")
        lines.append(f"{kind}: staged on the device, the copy route's caller waits for a device copy: blocked "
                     f"{on_device['blocked_s'] / on_device['memcpy_s']:.2f}x the memcpy"
                     + (f" (staged on the host it blocked {copy['blocked_s'] / on_device['blocked_s']:.2f}x as long)"
                        if copy else "")
                     + (f", {dev / MiB:.0f} MiB extra device memory at most" if dev is not None else "")
                     + " (docs/checkpoints.md, \"Staging on the device\")")
    return lines


def _winners(asyncs: list[dict], device: dict) -> list[str]:
    """The asynchronous peer with the lowest value of each column, with xlakit's value beside a peer's."""
    columns = {"blocked (x its memcpy)": lambda r: r["blocked_s"] / r["memcpy_s"],
               "durable s": lambda r: r["durable_s"],
               "peak RSS +MiB": lambda r: r["peak_rss_increase"] / MiB}
    if all(device.get(r["peer"]) is not None for r in asyncs):
        columns["device +MiB"] = lambda r: device[r["peer"]] / MiB
    out = []
    x = next(r for r in asyncs if r["peer"] == "xlakit")
    for name, value in columns.items():
        best = min(asyncs, key=value)
        tied = value(best) == value(x)
        who = "xlakit" if best is x or tied else f"{async_peers.LABELS[best['peer']]} {value(best):.3g}, xlakit {value(x):.3g}"
        out.append(f"{name}: {who}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--tensor-mib", type=int, default=32)
    p.add_argument("--kinds", default="cpu,xla")
    p.add_argument("--peers", default=f"{SYNC},xlakit,xlakit-copy,xlakit-device,dcp,orbax,lightning",
                   help="xlakit-copy and xlakit-device (the copy route a TPU takes) run for the XLA state only")
    p.add_argument("--saves", type=int, default=2, help="saves per row, in one process (the last one reported)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every row (best blocked kept)")
    p.add_argument("--no-device-memory", action="store_true", help="skip the device-memory processes")
    p.add_argument("--folder", help="where checkpoints are written (default: a temporary folder)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--one", nargs=2, metavar=("KIND", "PEER"), help=argparse.SUPPRESS)
    p.add_argument("--device-memory", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(*args.one, args.total_mib, args.tensor_mib, args.saves, args.folder,
                             args.device_memory)))
        return 0
    from xlakit import _knobs

    max_inflight = _knobs.get_int(_knobs.MAX_INFLIGHT_BYTES)
    peers = args.peers.split(",")
    common = ["--total-mib", str(args.total_mib), "--tensor-mib", str(args.tensor_mib), "--saves", str(args.saves)]
    print(f"asynchronous saves of a {args.total_mib} MiB state ({args.tensor_mib} MiB fp32 tensors), a fresh "
          f"process per row, {args.saves} saves per row (the last reported), best of {args.rounds} round(s); "
          f"seconds; PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'CPU')}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(dir=args.folder, prefix="bench-async-") as folder:
        def measure(kind: str, peer: str, device: bool = False) -> dict:
            extra = ["--device-memory"] if device else []
            row = fresh_process(__file__, [kind, peer, "--folder", folder, *common, *extra])
            print(f"  measured {kind}/{peer}{' (device memory)' if device else ''}: blocked "
                  f"{row['blocked_s']:.3f} s", file=sys.stderr, flush=True)
            return row

        for kind in args.kinds.split(","):
            here = [m for m in peers if kind == "xla" or m not in async_peers.XLA_ONLY]
            rows = best_of_rounds(lambda m: measure(kind, m), here, args.rounds)
            device = {}
            if kind == "xla" and not args.no_device_memory:
                found = {m: measure(kind, m, device=True) for m in here}
                device = {m: r["device_extra"] for m, r in found.items()}
                print(f"device memory (PJRT wrapper's live count) held by the state before the saves: "
                      + ", ".join(f"{m} {r['device_state'] / MiB:.0f} MiB" for m, r in found.items()))
            print("\n".join(_table(kind, rows, max_inflight, device)), flush=True)
            results += rows
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
