"""`xlakit manifest`, `xlakit memory`, `xlakit doctor`: the runtime's reports on the command line.

Each command prints what `xlakit.runtime` computes (the manifest, memory per
device, the doctor's probes) and turns it into an exit status; nothing here
starts or judges anything itself.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from xlakit import _knobs
from xlakit.runtime import contract, doctor, manifest, memory, startup, torchtpu


def _manifest(args: argparse.Namespace) -> int:
    m = manifest.manifest(profile=args.profile, pins=args.pins)
    print(json.dumps(m, indent=2, sort_keys=True) if args.json else manifest.manifest_line(m))
    if not args.check:
        return 0
    found = manifest.problems(m)
    for p in found:
        print(f"xlakit manifest --check: {p}", file=sys.stderr)
    if not found:
        print(f"check: ok against profile {m['profile']['name']} ({m['profile']['why']})", file=sys.stderr)
    return 1 if found else 0


def _add_manifest(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("manifest", help="print the run manifest (stack, contract, drift)")
    p.add_argument("--json", action="store_true", help="the whole manifest as JSON instead of the row")
    p.add_argument("--check", action="store_true",
                   help="exit 1 on drift from the pinned profile, a broken run contract, a runtime that cannot "
                        "start or a compile cache that is untrusted or off while the environment asks for it, naming "
                        "each with its fix")
    p.add_argument("--profile", help=f"VERSIONS.toml profile to check against (default: ${_knobs.PROFILE}, "
                   "else tpu on a TPU host, else cpu-dev)")
    p.add_argument("--pins", help="a pins file instead of the one baked into xlakit")
    p.set_defaults(func=_manifest)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_table(infos: list[memory.MemoryInfo]) -> str:
    rows = [("DEVICE", "USED", "LIMIT", "PEAK", "LIVE", "BUFFERS", "LIVE-PEAK", "SOURCE")]
    notes = []
    for i in infos:
        live = (_bytes(i.live_bytes), "-" if i.live_buffers is None else str(i.live_buffers), _bytes(i.peak_live_bytes))
        if i.supported:
            rows.append((i.device, _bytes(i.bytes_used), _bytes(i.bytes_limit), _bytes(i.peak_bytes_used), *live,
                         i.source or "-"))
            if i.plugin_unavailable:
                notes.append(f"{i.device}: the plugin's own statistics are unavailable ({i.plugin_unavailable}); "
                             "LIVE is the wrapper's count of the buffers the runtime holds")
            if i.live_unavailable:
                notes.append(f"{i.device}: LIVE is not counted: {i.live_unavailable}")
        else:
            rows.append((i.device, "-", "-", "-", *live, "not supported"))
            notes.append(f"{i.device}: not supported: {i.unsupported}")
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + notes)


def _memory(args: argparse.Namespace) -> int:
    if args.count is not None and args.watch is None:
        print("xlakit memory: --count N counts --watch intervals: add --watch SECONDS", file=sys.stderr)
        return 2
    problems = contract.contract_violations()
    found = (None if torchtpu.in_use() else startup.blocker()) or (  # on TorchTPU, memory.py answers
        {"why_not": "the run contract is broken: " + "; ".join(problems),
         "fix": "change the run's environment as each item says"} if problems else None)
    try:
        infos = None if found else memory.memory_info(args.device)
    except ValueError as e:  # an unknown device is a usage error, not a crash
        print(f"xlakit memory: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the runtime starts
        return 130
    # Starting the runtime may raise anything a plugin raises; it is a finding here, not a crash.
    except Exception as e:
        found = startup.failure(e)
    if found:
        print(f"xlakit memory: {found['why_not']}\n  fix: {found['fix']}", file=sys.stderr)
        return 1
    infos = infos if isinstance(infos, list) else [infos]
    if args.watch is not None:
        return _watch(args, infos)
    print(format_table(infos))
    return 0 if all(i.supported for i in infos) else 1


def format_line(info: memory.MemoryInfo, at: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"
    if not info.supported:
        return f"{stamp} {info.device} not supported: {info.unsupported}"
    fields = {"used": info.bytes_used, "limit": info.bytes_limit, "peak": info.peak_bytes_used,
              "live": info.live_bytes, "buffers": info.live_buffers, "peak_live": info.peak_live_bytes}
    # Plain integers (bytes), `-` where unknown: one line splits on spaces for a log shipper.
    return " ".join([stamp, info.device, *(f"{k}={'-' if v is None else v}" for k, v in fields.items()),
                     f"source={info.source}"])


def _watch(args: argparse.Namespace, infos: list[memory.MemoryInfo]) -> int:
    """A line per device per interval, `--count` times (default: until Ctrl-C, which exits 130)."""
    try:
        done = 0
        while True:
            at = time.time()
            print("\n".join(format_line(i, at) for i in infos), flush=True)
            done += 1
            if args.count and done >= args.count:
                return 0
            time.sleep(max(0.0, at + args.watch - time.time()))
            infos = memory.memory_info(args.device)
            infos = infos if isinstance(infos, list) else [infos]
    except KeyboardInterrupt:
        return 130


def _interval_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.05 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"expected an interval from 0.05 to 86400 seconds, found {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of intervals, found {text}")
    return value


def _add_memory(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("memory", help="device memory per local runtime device (used/limit/peak)")
    p.add_argument("device", nargs="?", help="one raw runtime device, e.g. TPU:3 (default: every local one)")
    p.add_argument("--watch", type=_interval_s, metavar="SECONDS",
                   help="print a line per device every SECONDS (Ctrl-C stops, exit status 130)")
    p.add_argument("--count", type=_count, metavar="N", help="with --watch: stop after N intervals (exit 0)")
    p.set_defaults(func=_memory)


def _timeout_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):  # as `selftest --timeout-s`
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, found {text}")
    return value


def _doctor(args: argparse.Namespace) -> int:
    return doctor.run(profile=args.profile, pins=args.pins, timeout_s=args.timeout_s)


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="probe the stack, contract, compile cache, memory telemetry")
    p.add_argument("--profile", help="VERSIONS.toml profile to check the stack against")
    p.add_argument("--pins", help="a pins file instead of the one baked into xlakit")
    p.add_argument("--timeout-s", type=_timeout_s, default=None,
                   help=f"deadline for the cache probe's subprocesses (default ${_knobs.DOCTOR_TIMEOUT_S} or "
                        f"{_knobs.DEFAULTS[_knobs.DOCTOR_TIMEOUT_S]:g})")
    p.set_defaults(func=_doctor)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    _add_manifest(subparsers)
    _add_memory(subparsers)
    _add_doctor(subparsers)
