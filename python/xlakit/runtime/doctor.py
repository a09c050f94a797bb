"""`xlakit doctor`: ask the runtime what is wrong, one probe per line.

Each probe prints a verdict (`ok`, `warn`, `FAIL`, or `n/a` where the
platform cannot have the feature), what it found and, when not ok, what to
do. The exit status is 1 when any probe fails.

The cache probe runs first, in two fresh subprocesses, because only a second
process can tell whether entries written by a first one load, and because on
a TPU host only one process may hold the chips: the probes that need the
runtime in this process run after the children have exited. The children
share one deadline; on expiry the probe fails and says which stage ran out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from xlakit import _knobs
from xlakit.runtime import features, manifest, startup, compile_cache, contract, memory, pjrt_wrap
from xlakit.runtime import host_heap, torchtpu, torchtpu_doctor
from xlakit.errors import ConfigurationError

_STATS_MARK = "xlakit-cache-probe-stats: "
UNPATCHED = "entries are written but never load: this torch_xla is unpatched, install the xlakit wheels"


@dataclass(frozen=True)
class Probe:
    """One line of the report."""

    name: str
    verdict: str  # ok | warn | fail | n/a
    detail: str
    fix: str | None = None

    def render(self) -> str:
        line = f"{self.verdict.upper() if self.verdict == 'fail' else self.verdict:<5} {self.name}: {self.detail}"
        return line + (f"\n      fix: {self.fix}" if self.fix else "")


def _cache_probe_child(folder: str) -> None:
    """Runs in each probe subprocess: compile one small graph with the cache on."""
    import torch
    import torch_xla

    compile_cache.enable_persistent_cache(folder)
    x = torch.arange(64, dtype=torch.float32, device=torch_xla.device()).reshape(8, 8)
    (x @ x.T + 1).sum().item()
    print(_STATS_MARK + json.dumps(compile_cache.cache_stats()), flush=True)


def _child_env() -> dict[str, str]:
    # The children must import this very xlakit, wherever it was imported from.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this xlakit package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _last_line(text: str, needle: str = "") -> str:
    lines = [ln.strip() for ln in text.splitlines() if needle.lower() in ln.lower() and ln.strip()]
    if not lines:
        return "(no output)"
    # Drop a C++ log prefix ("2026-... W path/file.cpp:694] ") but keep the message.
    return lines[-1].split("] ", 1)[-1][-300:]


def probe_cache(*, timeout_s: float) -> Probe:
    """Compile the same graph in two fresh processes sharing a cache; read the second's counters."""
    deadline = time.monotonic() + timeout_s
    code = "import sys; from xlakit.runtime.doctor import _cache_probe_child; _cache_probe_child(sys.argv[1])"
    with tempfile.TemporaryDirectory(prefix="xlakit-doctor-cache-") as folder:
        stats, stderr = {}, ""
        for stage in ("first", "second"):
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise subprocess.TimeoutExpired("probe", timeout_s)
                run = subprocess.run([sys.executable, "-c", code, folder], env=_child_env(),
                                     capture_output=True, text=True, timeout=left)
            except subprocess.TimeoutExpired:
                return Probe("cache", "fail",
                             f"the probe timed out after {timeout_s:g} s in the {stage} process "
                             "(compiling a small graph with the cache on)",
                             f"look for a hung or busy runtime; give it longer with --timeout-s or "
                             f"{_knobs.DOCTOR_TIMEOUT_S}")
            if run.returncode != 0 or _STATS_MARK not in run.stdout:
                return Probe("cache", "fail", f"the {stage} probe process exited with {run.returncode} without "
                             f"reporting its counters; its last error line: {_last_line(run.stderr)}",
                             "run `xlakit manifest --check` to see whether the stack and contract are sound")
            stats = json.loads(run.stdout.rsplit(_STATS_MARK, 1)[1].splitlines()[0])
            stderr = run.stderr
            if stage == "first":
                entries = [p for p in Path(folder).rglob("*")
                           if p.is_file() and p.name != compile_cache.KEY_FILE]
                if not entries:
                    return Probe("cache", "fail", f"the first process wrote no entry under {folder}",
                                 "check the cache folder is writable and XLA_PERSISTENT_CACHE_* is not overridden")
    return cache_verdict(stats, stderr, features.build_info())


def cache_verdict(stats: dict, stderr: str, build: dict | None) -> Probe:
    """Judge the second probe process's cache counters (and its stderr, for evidence)."""
    if stats["deserialize_failures"]:
        evidence = (f"second process: {stats['hits']} hits, {stats['deserialize_failures']} deserialize "
                    f"failures; {_last_line(stderr, 'deserializ')}")
        if build is None:
            return Probe("cache", "fail", f"{UNPATCHED} ({evidence})",
                         "install the xlakit torch_xla wheels (`xlakit manifest` must show a patch set, not stock); "
                         "on a TPU (or another PJRT plugin) stock torch_xla caches through xlakit's PJRT wrapper, "
                         "which xlakit.enable_persistent_cache() turns on by itself")
        return Probe("cache", "fail", f"entries are written but never load, although this torch_xla carries patch "
                     f"set {build.get('patch_set')} ({evidence})",
                     "report it with the output of `xlakit manifest --json`")
    if stats["hits"]:
        return Probe("cache", "ok", f"works: the second process loaded the first one's entry ({stats['hits']} hits)")
    return Probe("cache", "fail", f"the second process found no entry ({stats['misses']} misses): the cache key "
                 "differs between two identical processes", "report it with the output of `xlakit manifest --json`")


def probe_stack(m: dict) -> list[Probe]:
    line = manifest.manifest_line(m)
    prof = m["profile"]
    out = []
    if m["drift"]:
        mismatches = "; ".join(f"{d['what']}: expected {d['expected']}, found {d['found']}" for d in m["drift"])
        out.append(Probe("stack", "fail", f"{line}; drift from profile {prof['name']}: {mismatches}",
                         f"install the stack pinned in VERSIONS.toml profile {prof['name']} "
                         f"(chosen: {prof['why']}), or name the right one with --profile"))
    else:
        out.append(Probe("stack", "ok", f"{line} (matches profile {prof['name']}: {prof['why']})"))
    if "device_type" not in m["runtime"]:
        out.append(Probe("runtime", "fail", m["runtime"].get("why_not", "unknown"),
                         m["runtime"].get("fix") or "fix the contract above, then re-run"))
    return out


def probe_contract() -> Probe:
    problems = contract.contract_violations()
    if problems:
        return Probe("contract", "fail", "; ".join(problems), "change the run's environment as each item says")
    args = os.environ.get(_knobs.LIBTPU_INIT_ARGS)
    spmd = (f"SPMD on with {_knobs.XLA_NO_SPECIAL_SCALARS}=1" if _knobs.xla_flag(_knobs.XLA_USE_SPMD)
            else "SPMD off")
    flags = f"{_knobs.LIBTPU_INIT_ARGS} has no removed flag" if args else f"{_knobs.LIBTPU_INIT_ARGS} unset"
    return Probe("contract", "ok", f"holds ({flags}; {spmd})")


def probe_cache_folder() -> Probe:
    """Who can put an entry into the cache this environment points at, and whether entries are authenticated."""
    r = compile_cache.folder_report()
    name = "cache folder"
    if r["path"] is None:
        return Probe(name, "n/a", f"{r['why']}; xlakit.enable_persistent_cache() sets it inside the job")
    if r["folder"] == "untrusted":
        return Probe(name, "fail", f"{r['path']}: {r['problem']}", r["fix"])
    if "key_problem" in r:
        return Probe(name, "fail", r["key_problem"], f"give the job a longer {_knobs.CACHE_KEY}")
    if "off" in r:  # the wrapper's cache the environment asks for will not run (as `manifest --check` says)
        return Probe(name, "fail", r["off"], r["off_fix"])
    auth = (f"entries authenticated ({_knobs.CACHE_KEY})" if r["authenticated"] else
            f"entries not authenticated ({r.get('why_not_authenticated') or _knobs.CACHE_KEY + ' unset'})")
    if r["folder"] == "shared-trusted":
        return Probe(name, "warn", f"{r['path']}: shared-trusted ({'; '.join(r['shared'])}); {auth}",
                     f"every member of those groups can put code into your jobs; set {_knobs.CACHE_KEY} so only "
                     "jobs holding the key can")
    return Probe(name, "ok", f"{r['path']}: owner-only; {auth}")


def probe_pjrt_wrapper(s: dict, device_type: str | None) -> Probe:
    """Whether xlakit's PJRT wrapper is built, and what it did in this process (`s` is `pjrt_wrap.status()`)."""
    name = "pjrt wrapper"
    if not s["built"]:
        return Probe(name, "warn", s["why_not"], "install the prebuilt xlakit wheel, or `pip install .` from a clone on "
                     "a host with a C++ compiler")
    if s.get("refused"):
        return Probe(name, "fail", s["refused"], f"point {_knobs.PJRT_PLUGIN} at the real plugin (xlakit pjrt env)")
    if s.get("active"):
        cache, c = s["cache"], s["counts"]
        head = f"wrapping {s['plugin']} (PJRT C API {s['plugin_api']}; built for {s['built_api']})"
        if not cache["on"]:
            return Probe(name, "warn", f"{head}; compile cache off: {cache['why_off']}",
                         f"set {_knobs.PJRT_CACHE_DIR} to a folder only you can write")
        refused = sum(s["refused_entries"].values())
        return Probe(name, "ok", f"{head}; cache {cache['dir']} ({cache['folder']}"
                     f"{', authenticated' if cache['authenticated'] else ''}): {c['hits']} hits, {c['misses']} misses "
                     f"({refused} refused entries), {c['writes']} written, {c['write_failures']} write failures")
    plugin, via = pjrt_wrap.plugin_of(device_type) if device_type else (None, "the runtime did not start")
    if plugin is None:
        return Probe(name, "n/a", f"built for PJRT C API {s['built_api']}, not in use: {via}")
    return Probe(name, "ok", f"built for PJRT C API {s['built_api']}, not loaded in this process; {device_type} loads "
                 f"{plugin} ({via}): xlakit.enable_persistent_cache() puts the wrapper around it, or `xlakit pjrt env "
                 "DIR` prints the variables")


def probe_memory_source(available: dict) -> Probe:
    """Whether memory per raw runtime device can be read in this process, and from where (`memory.availability()`)."""
    name = "per-device memory"
    if available["per_device"]:
        how = available.get("note", "the patched binding")
        if available["source"] == memory.PJRT_WRAP:
            how = f"{available['devices']} devices, live buffers {'counted' if available['accounting'] else 'not counted'}"
        return Probe(name, "ok", f"from {available['source']} ({how})")
    if available["fix"] is None:
        return Probe(name, "n/a", available["why_not"])
    return Probe(name, "warn", available["why_not"], available["fix"])


def probe_memory(device_type: str | None) -> list[Probe]:
    out = []
    for info in memory.memory_info():
        name = f"memory {info.device}"
        if info.supported and info.plugin_unavailable:
            live = (f"live buffers not counted ({info.live_unavailable})" if info.live_unavailable else
                    f"live {info.live_bytes} bytes in {info.live_buffers} buffers, peak {info.peak_live_bytes}")
            out.append(Probe(name, "ok", f"{live} (via {info.source}); the plugin's own statistics are "
                             f"unavailable: {info.plugin_unavailable}"))
        elif info.supported:
            out.append(Probe(name, "ok", f"used {info.bytes_used}, limit {info.bytes_limit}, "
                             f"peak {info.peak_bytes_used} bytes (via {info.source})"))
        elif device_type == "CPU":  # the CPU client has no allocator statistics at all: nothing to fix
            out.append(Probe(name, "n/a", f"not supported: {info.unsupported}"))
        else:
            out.append(Probe(name, "fail", f"not supported: {info.unsupported}",
                             "install the xlakit wheels (they add per-chip memory telemetry)"))
    return out


def probe_transfer() -> Probe:
    if features.has_binding(features.TRANSFER_TO_HOST):
        return Probe("transfer", "ok", f"the safe host transfer binding {features.TRANSFER_TO_HOST} is present")
    return Probe("transfer", "warn", f"no {features.TRANSFER_TO_HOST} binding: checkpoints use the stock "
                 "device-to-host path", "install the xlakit wheels for the safe host transfer")


def probe_host_heap(device_type: str | None) -> Probe:
    """Whether a save's device-to-host copies map fresh host memory for every batch (host_heap.py)."""
    which = host_heap.allocator()
    try:
        keep = _knobs.get_flag(_knobs.KEEP_HOST_HEAP)
    except ConfigurationError as e:  # every copying save refuses it: say so here, and go on
        return Probe("host heap", "fail", f"{which}; {e}; every save from a device refuses it",
                     f"set {_knobs.KEEP_HOST_HEAP} to 1 or 0, or unset it")
    if which != "glibc":
        return Probe("host heap", "ok", f"{which}: freed host memory is reused by the next save's copies")
    if keep:
        when = "since xlakit was imported" if host_heap.kept() else "from the first copying save"
        return Probe("host heap", "ok", f"glibc, kept ({_knobs.KEEP_HOST_HEAP} set) {when}")
    if host_heap.kept_at_launch():
        return Probe("host heap", "ok", "glibc, kept (GLIBC_TUNABLES set at launch)")
    if _knobs.xla_flag(_knobs.THP_MEM_ALLOC_ENABLE):
        return Probe("host heap", "ok", f"glibc; torch's tensors on huge pages ({_knobs.THP_MEM_ALLOC_ENABLE}=1)")
    if device_type in (None, "CPU"):
        return Probe("host heap", "n/a", "glibc; saves from this device need no host copy")
    return Probe("host heap", "warn", "glibc with its defaults: each save's device-to-host copies map fresh "
                 "memory, which the kernel faults in and zeroes on the cores the write needs",
                 f"run under tcmalloc (LD_PRELOAD, as torch_xla's TPU images do), or set "
                 f"{_knobs.THP_MEM_ALLOC_ENABLE}=1 before torch starts, or {_knobs.KEEP_HOST_HEAP}=1 in the "
                 f"environment (or GLIBC_TUNABLES={host_heap.LAUNCH_TUNABLES}) for faster copies at a cost "
                 f"in memory: docs/checkpoints.md, Host memory of device copies")


def run(*, profile: str | None = None, pins: str | None = None, timeout_s: float | None = None,
        out=sys.stdout) -> int:
    """Run every probe, printing each line as it is known; 1 when any probe fails."""
    timeout_s = timeout_s if timeout_s is not None else _knobs.get_float(_knobs.DOCTOR_TIMEOUT_S)
    probes: list[Probe] = []

    def report(*found: Probe) -> None:
        for p in found:
            probes.append(p)
            print(p.render(), file=out, flush=True)

    report(probe_contract())
    if torchtpu.in_use():  # TorchTPU: its stack, cache and memory; nothing of torch_xla (torchtpu_doctor.py)
        report(*(Probe(*p) for p in torchtpu_doctor.probes(profile=profile, pins=pins, timeout_s=timeout_s)))
        return 1 if any(p.verdict == "fail" for p in probes) else 0
    contract_failed = probes[-1].verdict == "fail"
    report(probe_cache_folder())
    blocked = startup.blocker(pins)
    if contract_failed:
        # The children would start the runtime with the broken environment (libtpu aborts on a removed flag).
        report(Probe("cache", "fail", "not probed: the run contract is broken", "fix the contract first"))
    elif blocked:
        report(Probe("cache", "fail", f"not probed: the runtime cannot start ({blocked['why_not']})",
                     "fix the runtime first (see the runtime line)"))
    else:
        report(probe_cache(timeout_s=timeout_s))
    m = manifest.manifest(profile=profile, pins=pins)
    report(*probe_stack(m))
    report(probe_pjrt_wrapper(m["pjrt_wrap"], m["runtime"].get("device_type")))
    report(probe_memory_source(m["memory"]))
    if "device_type" in m["runtime"]:
        report(*probe_memory(m["runtime"]["device_type"]))
    report(probe_transfer())
    report(probe_host_heap(m["runtime"].get("device_type")))
    return 1 if any(p.verdict == "fail" for p in probes) else 0


