"""The `compile_cache` check: a restart loads what the last process compiled, bit-exact, and no tampered entry.

Two fresh processes compile the same two programs (`programs.py`) with the
cache in the self-test's temporary folder, as `xlakit.enable_persistent_cache`
sets it up for this backend: through xlakit's PJRT wrapper (torch_xla with
libtpu or another plugin; jax for torch on CUDA or the CPU), torch_xla's own
cache on the patched runtime, TorchTPU's tier-3 cache. Between them the
entries the first wrote for `Q` get one byte flipped. The second must load
`P` without compiling it, refuse `Q`'s entries and compile `Q` again, and
both must give the first's results bit for bit. The time saved is the first's
compile time against the second's load time, as the wrapper counts them (on
TorchTPU, the calls' wall times). TorchTPU's entries are its own format,
which xlakit cannot verify, so nothing is tampered with there.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from xlakit.selftest import children, device_job, devices, programs, report

NAME = "compile_cache"
_COMPILES = re.compile(r"num_compilations=(\d+)")
_WRAPPED = ("pjrt-wrap", "jax")


def _entries(folder: Path) -> list[str]:
    from xlakit.runtime import cache_files

    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if cache_files.is_entry_name(p.name)
                  and p.is_file())


def _counters(route: str) -> dict[str, Any]:
    if route in _WRAPPED:
        from xlakit.runtime import pjrt_wrap

        s = pjrt_wrap.status()
        c = s.get("counts") or {}
        return {"hits": c.get("hits", 0), "misses": c.get("misses", 0), "writes": c.get("writes", 0),
                "refused": sum((s.get("refused_entries") or {}).values()), "refused_by": s.get("refused_entries"),
                "compile_s": c.get("compile_s", 0.0), "load_s": c.get("load_s", 0.0),
                "cache": (s.get("cache") or {}).get("why_off")}
    if route == "torch_xla":
        import xlakit

        c = xlakit.cache_stats()
        return {"hits": c["hits"], "misses": c["misses"], "refused": c["deserialize_failures"]}
    return {}


def child(params: dict[str, Any], results) -> None:
    """One process of the pair: start with the cache on, run P then Q, recording what each did; then the
    device checks, if `params["device"]` asks for them (`device_job`)."""
    import time

    route, cache, dev = params["route"], Path(params["cache_dir"]), None
    with results.part("start") as got:
        if route == "torchtpu":  # a tier-2 cache of its own: only tier 3 (the folder) can serve the second
            os.environ["TORCH_TPU_TIER2_COMPILATION_CACHE"] = params["tier2"]
        if route == "jax":
            runner = devices.start_jax(params["plugin"], cache)
            run = lambda which: programs.jax_program(which, runner)  # noqa: E731
        else:
            dev = devices.start(params["backend"]["name"], cache_dir=cache)
            run = lambda which: programs.torch_program(which, dev)  # noqa: E731
        got["counters"] = _counters(route)
    if "error" in got:
        return
    seen = set(_entries(cache))
    for which in programs.PROGRAMS:
        with results.part(which) as got:
            start = time.perf_counter()
            got["digest"] = run(which)
            got["wall_s"] = time.perf_counter() - start
            got["counters"] = _counters(route)
            now = set(_entries(cache))
            got["entries"], seen = sorted(now - seen), now
    if params.get("device"):
        with results.part("device start") as got:
            dev = dev or devices.start(params["backend"]["name"])
        if "error" not in got:
            device_job.run_parts(params["backend"], dev, params["device"], results)


def _tamper(folder: Path, names: list[str]) -> list[str]:
    """Flip one byte near the end (the payload) of each named entry; the names tampered with."""
    done = []
    for name in names:
        path = folder / name
        data = bytearray(path.read_bytes())
        if len(data) > 16:
            data[-10] ^= 0x01
            path.write_bytes(bytes(data))
            done.append(name)
    return done


def _delta(after: dict, before: dict, key: str) -> float:
    return (after.get(key) or 0) - (before.get(key) or 0)


def _program_counts(outcome: children.Outcome) -> dict[str, dict[str, float]]:
    out, before = {}, outcome.parts["start"].get("counters", {})
    for which in programs.PROGRAMS:
        after = outcome.parts[which]["counters"]
        out[which] = {k: _delta(after, before, k) for k in ("hits", "misses", "writes", "refused", "compile_s",
                                                            "load_s")}
        before = after
    return out


def _incomplete(outcome: children.Outcome, n: int) -> str | None:
    for part in ("start", *programs.PROGRAMS):
        got = outcome.parts.get(part)
        if got is None:
            where = f" in {outcome.running}" if outcome.running else ""
            return f"process {n} {outcome.ended()}{where} before {part}: {outcome.last_error()}"
        if "error" in got:
            return f"process {n}, {part}: {got['error']}"
    return None


def run(backend: dict[str, Any], *, scratch: Path, deadline: float, env: dict[str, str],
        device: dict[str, Any] | None = None) -> tuple[dict[str, Any], children.Outcome | None]:
    """Both processes and the verdict, and the second process's outcome (it ran the device checks that
    `device` asks for, if any)."""
    route = backend.get("cache_route")
    if backend.get("unusable"):
        return report.skipped(NAME, f"not run: {backend['unusable']}"), None
    if not route:
        return report.skipped(NAME, backend.get("cache_skip") or "no compile cache to check on this backend"), None
    cache = scratch / "compile-cache"
    cache.mkdir(mode=0o700)
    params = {"route": route, "backend": backend, "cache_dir": str(cache), "plugin": backend.get("plugin")}
    tier2 = [f"xlakit-selftest-{uuid.uuid4().hex}" for _ in range(2)]
    outcomes: list[children.Outcome] = []
    tampered: list[str] = []
    try:
        for n in (1, 2):
            if n == 2 and route != "torchtpu":
                tampered = _tamper(cache, outcomes[0].parts["Q"]["entries"])
            outcomes.append(children.run("cache", {**params, "tier2": tier2[n - 1],
                                                   "device": device if n == 2 else None},
                                         scratch=scratch, deadline=deadline, env=env, name=f"cache-{n}"))
            broken = _incomplete(outcomes[-1], n)
            if broken:
                return (report.failed(NAME, f"a compile-cache process did not finish: {broken}",
                                      "run `xlakit doctor`; if it passes, attach this report to an issue",
                                      details={"route": route}), outcomes[-1] if n == 2 else None)
    finally:
        if route == "torchtpu":
            from xlakit.runtime import torchtpu

            for name in tier2:  # the node-local caches these children made, by the unique names given them
                shutil.rmtree(Path(torchtpu.TIER2_ROOT) / name, ignore_errors=True)
    return _verdict(route, outcomes, tampered), outcomes[1]


def _verdict(route: str, outcomes: list[children.Outcome], tampered: list[str]) -> dict[str, Any]:
    first, second = outcomes
    digests = [[o.parts[w]["digest"] for w in programs.PROGRAMS] for o in outcomes]
    walls = {f"{w}_process{n}": o.parts[w]["wall_s"] for n, o in enumerate(outcomes, 1) for w in programs.PROGRAMS}
    details: dict[str, Any] = {"route": route, "entries_written": {w: first.parts[w]["entries"]
                                                                   for w in programs.PROGRAMS},
                               "tampered": tampered}
    if digests[0] != digests[1]:
        return report.failed(NAME, "the second process's results differ from the first's (not bit-exact): "
                             "an executable loaded from the cache computed something else",
                             "report it with this report attached; meanwhile run without the persistent cache",
                             timings_s=walls, details=details)
    if route == "torchtpu":
        compiles = [int(m[-1]) if (m := _COMPILES.findall(o.stderr)) else None for o in outcomes]
        details["compilations"] = compiles
        if None in compiles or not compiles[1] < compiles[0]:
            return report.failed(NAME, f"TorchTPU compiled as much after the restart as before ({compiles}): its "
                                 "tier-3 cache served nothing", "check TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT is "
                                 "writable and kept; attach this report to an issue", timings_s=walls, details=details)
        return report.check(NAME, report.PASS, f"a fresh process compiled {compiles[1]} programs where the first "
                            f"compiled {compiles[0]}, results bit-exact (TorchTPU's tier-3 cache; its entries are its "
                            "own format, so no tampered entry was tried)", timings_s=walls, details=details)
    counts = [_program_counts(o) for o in outcomes]
    details["counts"] = counts
    p1, p2, q2 = counts[0]["P"], counts[1]["P"], counts[1]["Q"]
    if not first.parts["P"]["entries"]:
        why = first.parts["P"]["counters"].get("cache")
        return report.failed(NAME, f"the first process wrote no entry ({p1['misses']:.0f} misses, "
                             f"{p1['writes']:.0f} written){f': {why}' if why else ''}",
                             "check the temporary folder is writable and on a local disk (--tmpdir)",
                             timings_s=walls, details=details)
    if p2["hits"] < 1 or p2["misses"] > 0:
        return report.failed(NAME, f"the second process compiled P again ({p2['hits']:.0f} hits, "
                             f"{p2['misses']:.0f} misses): the first process's entries did not load",
                             "run `xlakit doctor`; the cache keys differ between two identical processes: attach this "
                             "report to an issue", timings_s=walls, details=details)
    # The wrapper counts each refusal; the patched runtime's own cache may count one as a miss only.
    refused = q2["refused"] >= 1 if route in _WRAPPED else q2["misses"] >= 1
    if tampered and (q2["hits"] > 0 or not refused):
        return report.failed(NAME, f"a tampered entry was not refused ({q2['hits']:.0f} hits, {q2['refused']:.0f} "
                             "refused while running Q)", "do not use the persistent cache; attach this report to "
                             "an issue", timings_s=walls, details=details)
    saved = {"compile_s_process1": p1["compile_s"], "load_s_process2": p2["load_s"]} if route in _WRAPPED else {}
    reasons = second.parts["Q"]["counters"].get("refused_by") or {}
    said = (f"; {len(tampered)} tampered entr{'y' if len(tampered) == 1 else 'ies'} refused "
            f"({', '.join(sorted(k for k, v in reasons.items() if v)) or 'a miss'}) and Q recompiled, right result"
            if tampered else "; no entry of Q to tamper with")
    time_saved = (f"; compile {p1['compile_s']:.3f} s -> load {p2['load_s']:.3f} s" if saved else
                  f"; P took {walls['P_process1']:.3f} s, then {walls['P_process2']:.3f} s")
    hits = f"{p2['hits']:.0f} hit{'' if p2['hits'] == 1 else 's'}"
    return report.check(NAME, report.PASS, f"a fresh process loaded P from the cache ({hits}, "
                        f"0 compiles), results bit-exact{time_saved}{said}", timings_s={**walls, **saved},
                        details=details)
