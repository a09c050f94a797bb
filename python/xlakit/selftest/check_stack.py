"""The `stack` check: the run contract and the manifest, and what the job runs on.

Runs first, in a child with the job's environment untouched (its cache
settings too; nothing is turned on): the manifest there is the job's own. It
also decides the backend and the routes the other checks take (`backend`),
so that a runtime that cannot start is found once, here, and the device
checks say they did not run because of it instead of failing one by one.

Where the device checks need nothing loaded before the device starts
(TorchTPU, torch on CUDA or the CPU), they run here too, after the manifest,
with the job's cache settings set aside first (TorchTPU reads its cache
folders at its first compile) and TorchTPU's node-local cache named for this
run: one process start fewer.
"""

from __future__ import annotations

import os
from typing import Any

from xlakit import _knobs
from xlakit.selftest import device_job, devices, environment, report
from xlakit.selftest.children import Outcome

NAME = "stack"
HERE = ("torchtpu", "cuda", "cpu")  # the backends whose device checks run in this child
STOCK_CPU_CACHE = ("torch_xla's built-in CPU client (PJRT_DEVICE=CPU) is no PJRT plugin, so xlakit's PJRT wrapper "
                   "cannot serve it, and stock torch_xla's own cache writes entries it cannot load "
                   "(pytorch/xla#9094); run the self-test with PJRT_DEVICE=TPU (libtpu) or a registered PJRT plugin")


def _torch_xla(m: dict[str, Any]) -> dict[str, Any]:
    from xlakit.errors import CompileCacheError
    from xlakit.runtime import compile_cache, features, pjrt_wrap

    rt = m["runtime"]
    if "device_type" not in rt:
        return {"unusable": rt.get("why_not", "the runtime did not start"), "unusable_fix": rt.get("fix")}
    out: dict[str, Any] = {"device_type": rt["device_type"], "devices": rt["local_devices"], "spmd": rt["spmd"]}
    try:
        wrapped = compile_cache.through_wrapper()
    except CompileCacheError as e:
        wrapped, out["cache_skip"] = False, str(e)
    if wrapped:
        plugin, via = pjrt_wrap.plugin_of(rt["device_type"])
        out.update(cache_route="pjrt-wrap", plugin=plugin, plugin_via=via)
    elif features.build_info() is not None:
        out["cache_route"] = "torch_xla"
    else:
        out.setdefault("cache_skip", STOCK_CPU_CACHE)
    return out


def _torchtpu(violations: list[str]) -> dict[str, Any]:
    from xlakit.runtime import torchtpu

    if violations:
        return {"unusable": "not started: the run contract is broken (see stack)"}
    try:
        devices.start("torchtpu")
    # Starting TorchTPU may raise anything its plugin raises: the reason the device checks cannot run.
    except Exception as e:
        return {"unusable": f"TorchTPU did not start: {type(e).__name__}: {e}"}
    rt = torchtpu.runtime_report()
    return {"device_type": rt.get("device_type"), "devices": rt.get("local_devices"), "plugin": rt.get("plugin"),
            "cache_route": "torchtpu"}


def _host_tensors(name: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"device_type": name}
    if name == "cuda" and not torch.cuda.is_available():
        return {"unusable": f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"}
    if name == "cuda":
        out.update(devices=torch.cuda.device_count(), device_name=torch.cuda.get_device_name(0))
    plugin, why = devices.jax_plugin(name)
    if plugin:
        out.update(cache_route="jax", plugin=plugin, plugin_via=why)
    else:
        out["cache_skip"] = f"torch on {name.upper() if name == 'cuda' else 'the CPU'} compiles no XLA program; {why}"
    return out


def describe(b: dict[str, Any]) -> str:
    """One line: what the checks run on."""
    if b.get("unusable"):
        return f"{b['name']} ({b['why']}): cannot run: {b['unusable']}"
    where = {"torch_xla": f"torch_xla on {b.get('device_type')}", "torchtpu": "TorchTPU on tpu",
             "cuda": f"torch on CUDA ({b.get('device_name')})", "cpu": "torch on the CPU"}[b["name"]]
    if b.get("devices") is not None:
        where += f", {b['devices']} local devices{' under SPMD' if b.get('spmd') else ''}"
    if b.get("plugin"):
        where += f"; plugin {b['plugin']}"
    if b.get("cache_route") in ("pjrt-wrap", "jax"):
        where += " (through xlakit's PJRT wrapper in the checks" + (", with jax)" if b["cache_route"] == "jax" else ")")
    return where


def child(params: dict[str, Any], results) -> None:
    with results.part(NAME) as got:
        from xlakit.runtime import contract, manifest

        name, why = devices.choose(params["backend"])
        backend: dict[str, Any] = {"name": name, "why": why}
        got["backend"] = backend
        violations = contract.contract_violations(pins=params.get("pins"))
        if name == "torchtpu":  # the manifest never starts TorchTPU itself
            backend.update(_torchtpu(violations))
        m = manifest.manifest(profile=params.get("profile"), pins=params.get("pins"))
        got.update(manifest=m, line=manifest.manifest_line(m), problems=manifest.problems(m))
        if name == "torch_xla":
            backend.update(_torch_xla(m) if m["torch_xla"].get("version") else {
                "unusable": m["torch_xla"].get("why_not", "torch_xla cannot be imported")})
        elif name in ("cuda", "cpu"):
            backend.update(_host_tensors(name))
        backend["description"] = describe(backend)
    device = params.get("device")
    if device and "backend" in got and got["backend"]["name"] in HERE and not got["backend"].get("unusable"):
        environment.set_aside_here()
        if got["backend"]["name"] == "torchtpu":
            os.environ[_knobs.TORCH_TPU_TIER2_CACHE] = params["tier2"]
        results.put("device ran", True)
        with results.part("device start") as started:
            dev = devices.start(got["backend"]["name"])
        if "error" not in started:
            device_job.run_parts(got["backend"], dev, device, results)


def verdict(outcome: Outcome, chosen: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """(the stack check, the backend, the manifest) from the stack child's outcome."""
    got = outcome.parts.get(NAME)
    if not got or "error" in got and "manifest" not in got:
        what = got["error"] if got else f"its process {outcome.ended()}: {outcome.last_error()}"
        backend = (got or {}).get("backend") or {"name": chosen, "why": "chosen before the stack check failed"}
        backend.setdefault("unusable", f"the stack check failed: {what}")
        backend["description"] = describe(backend)
        return (report.failed(NAME, f"the manifest could not be taken: {what}",
                              "run `xlakit manifest --check` and `xlakit doctor`; repair what they name"),
                backend, None)
    m, backend = got["manifest"], got["backend"]
    problems = list(got["problems"])
    if "error" in got:
        problems.append(f"while finding the backend: {got['error']}")
    timings = {"stack_process": outcome.wall_s}
    details = {"profile": m["profile"], "contract": m["contract"], "drift": m["drift"]}
    if problems:
        fixes = "; ".join(p.split("; fix: ", 1)[1] for p in problems if "; fix: " in p)
        found = "; ".join(p.split("; fix: ", 1)[0] for p in problems)
        return (report.failed(NAME, found, fixes or f"install the pinned stack (VERSIONS.toml profile "
                              f"{m['profile']['name']}) or name the right one with --profile; correct each item",
                              timings_s=timings, details=details), backend, m)
    return (report.check(NAME, report.PASS, f"{got['line']} (profile {m['profile']['name']}: {m['profile']['why']};"
                         " run contract holds)", timings_s=timings, details=details), backend, m)
