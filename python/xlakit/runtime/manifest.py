"""The run manifest: what stack a run ran on, and whether that is the pinned one.

`xlakit.manifest` is the function of that name here (re-exported by the
package), never this module, which lives in `xlakit.runtime`.

Every fact is read from the running process, never from a checkout: versions
and git revisions from the imported modules, the patch set from the
provenance binding the patch series stamps into the binary (`stock` where it
is absent), versions of packages we must not import (libtpu, jax, jaxlib)
from their installed metadata. Drift is judged against a profile of the pins
baked into xlakit at build time (see `runtime/pins.py`). Anything that cannot be read is
recorded with the reason, so the manifest itself never fails a run.

The runtime is only started here when the run contract holds: a removed
libtpu flag would otherwise abort the process inside libtpu before the
manifest could say why. A runtime that cannot start is a finding with its fix
(`startup.py`), never an exception.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import sys
from typing import Any

from xlakit import _knobs
from xlakit.runtime import compile_cache, contract, features, memory, pins as _pins, pjrt_wrap, startup, torchtpu
from xlakit._version import BUILD, __version__

SCHEMA = 1
_GIT_LABEL = re.compile(r"\+git([0-9a-f]{7,40})")


def _short(rev: str | None) -> str | None:
    return rev[:7] if rev else None


def _torch() -> dict[str, Any]:
    try:
        torch = torchtpu.import_torch()  # what torch-tpu prints at its import goes to stderr: stdout is ours
    except Exception as e:  # a broken torch raises more than ImportError (OSError for a missing library)
        return {"version": None, "why_not": f"cannot import torch: {type(e).__name__}: {e}"}
    return {"version": torch.__version__, "git": torch.version.git_version}


def _torch_xla(build: dict | None) -> dict[str, Any]:
    if features.xlac() is None:
        return {"version": None, "why_not": f"cannot import torch_xla: {features.xla_import_error()}"}
    import torch_xla
    import torch_xla.version as v

    label = _GIT_LABEL.search(torch_xla.__version__)
    # Stock wheels record which torch and openxla they were built against but
    # not their own commit; a source build carries it in the version label and
    # the patched binary in its provenance.
    commit = (build or {}).get("torch_xla_commit") or (label.group(1) if label else None)
    return {
        "version": torch_xla.__version__,
        "commit": commit,
        "torch_git": getattr(v, "__torch_gitrev__", None),
        "xla_git": (build or {}).get("xla_commit") or getattr(v, "__xla_gitrev__", None),
    }


def _package(dist: str) -> dict[str, Any]:
    version = _pins.installed_version(dist)
    if version is None:
        return {"version": None, "why_not": f"not installed (no '{dist}' distribution in {sys.prefix})"}
    return {"version": version}


def _patches(build: dict | None) -> dict[str, Any]:
    if features.xlac() is None:
        return {"patch_set": None, "why_not": f"cannot import torch_xla: {features.xla_import_error()}"}
    if build is None:
        return {"patch_set": "stock", "why": f"torch_xla has no {features.BUILD_INFO} binding"}
    # patch_series_id: what the runtime stamps into cache entries and checks them against (the series,
    # the placed C++ and the upstream commits), as the binary itself reports it.
    return {k: build.get(k) for k in ("patch_set", "patches", "series_sha256", "patch_series_id")}


def _same_commit(found: str | None, pinned: str) -> bool:
    # A short revision (a `+gitc04e61c` label) matches the full pin it abbreviates.
    return bool(found) and len(found) >= 7 and (pinned.startswith(found) or found.startswith(pinned))


def _drift_item(what: str, pin: str, expected: str, found: str | None, missing: str) -> dict[str, str]:
    return {"what": what, "pin": pin, "expected": expected, "found": found or missing}


def drift(m: dict[str, Any], profile: str, pins: str | os.PathLike | None = None) -> list[dict[str, str]]:
    """Where manifest `m` differs from pinned `profile`: one item per mismatch."""
    prof = _pins.profile(profile, pins)
    key = f"profiles.{profile}"
    out = []
    if "python" in prof and not _pins.satisfies(m["python"], prof["python"]):
        out.append(_drift_item("python", f"{key}.python", _pins.describe(prof["python"]), m["python"], ""))
    modules = {"torch": m["torch"], "torch_xla": m["torch_xla"]}
    for dist, spec in prof.get("packages", {}).items():
        part = modules.get(dist) or m.get(dist) or _package(dist)
        found = part.get("version")
        if found is None or not _pins.satisfies(found, spec):
            why = part.get("why_not") or "not installed"
            out.append(_drift_item(dist, f"{key}.packages.{dist}", _pins.describe(spec), found,
                                   f"{part['installed']} installed, which {why}" if part.get("installed") else why))
    src = prof.get("sources", {})
    revisions = {  # pinned source -> (what it is, the revision the running stack reports)
        "pytorch": ("torch git revision", m["torch"].get("git"), m["torch"].get("version")),
        "torch_xla": ("torch_xla git revision", m["torch_xla"].get("commit"), m["torch_xla"].get("version")),
        "openxla": ("openxla git revision", m["torch_xla"].get("xla_git"), None),
    }
    for name, (what, rev, version) in revisions.items():
        if name not in src:
            continue
        pinned = src[name]
        if not _same_commit(rev, pinned["commit"]):
            out.append(_drift_item(what, f"{key}.sources.{name}.commit", pinned["commit"], rev,
                                   "unknown (this build does not record it)"))
        if version is not None and "version" in pinned and not _pins.satisfies(version, pinned["version"]):
            out.append(_drift_item(f"{name} version", f"{key}.sources.{name}.version", pinned["version"],
                                   version, "unknown"))
    if src:  # a source-built profile ships our patched binary
        want = _pins.expected_patch_set(pins)
        if m["patches"].get("patch_set") != want:
            out.append(_drift_item("patch set", "xlakit.patch_level", want, m["patches"].get("patch_set"), "unknown"))
    return out


def manifest(*, profile: str | None = None, pins: str | os.PathLike | None = None) -> dict[str, Any]:
    """The stack this process runs on, its run contract and its drift from the _pins.

    Starts the XLA runtime (to list devices) unless the run contract is broken;
    call it after `torch_xla.runtime.use_spmd()` and `enable_persistent_cache()`.

    Args:
        profile: VERSIONS.toml profile to compare with; default `XLAKIT_PROFILE`,
            else `tpu` on a TPU host, else `cpu-dev`.
        pins: A pins file other than the copy baked into xlakit.

    Returns:
        A JSON-ready dict: `xlakit` (the version), `xlakit_build` (the
        commit, compiler and glibc floor it was built from and with),
        `python`, `torch`, `torch_xla`, `libtpu`, `jax`,
        `jaxlib`, `patches`, `runtime`, `cache` (the persistent cache
        folder's trust state: owner-only, shared-trusted or untrusted, and
        whether entries are authenticated), `pjrt_wrap` (xlakit's PJRT
        wrapper: the C API version it was built for, whether this process
        runs through it, the plugin it wraps, its hit/miss counts), `env`,
        `contract` (violations),
        `profile` and `drift` (mismatches, each with `what`, `pin`,
        `expected`, `found`). A part that cannot be read holds `why_not`;
        a runtime that cannot start holds `why_not` and `fix`.

    Example:
        >>> import xlakit
        >>> m = xlakit.manifest()
        >>> m["patches"]["patch_set"] in ("stock", "xlakit1")
        True
    """
    # Read before torch_xla is imported: its import fills in PJRT_DEVICE and XLA_FLAGS defaults.
    env = {k: os.environ.get(k) for k in _knobs.CONTRACT_ENV}
    name, why = _pins.choose_profile(profile, pins)
    # On TorchTPU nothing of torch_xla is imported: its parts say so, and TorchTPU's replace them.
    tpu = torchtpu.in_use()
    hazard = torchtpu.start_hazard()
    build = None if tpu else features.build_info()
    not_used = {"version": None, "patch_set": None, "why_not": "TorchTPU stack: torch_xla is not used"}
    violations = contract.contract_violations(pins=pins)
    m: dict[str, Any] = {
        "schema": SCHEMA,
        "xlakit": __version__,
        # What this xlakit was built from and with (its stamp, never a checkout).
        "xlakit_build": dict(BUILD),
        "python": platform.python_version(),
        "torch": {"version": None, "installed": _pins.installed_version("torch"),
                  "why_not": f"cannot be imported here: {hazard}"} if hazard else _torch(),
        "torch_xla": not_used if tpu else _torch_xla(build),
        "torch_tpu": _package(torchtpu.DIST) | ({"plugin": torchtpu.versions()["plugin"]} if tpu else {}),
        "libtpu": _package("libtpu"),
        "jax": _package("jax"),
        "jaxlib": _package("jaxlib"),
        "patches": not_used if tpu else _patches(build),
        "env": env,
        "contract": violations,
        "runtime": (torchtpu.runtime_report() if tpu else startup.start(contract_ok=not violations, pins=pins)),
        "cache": torchtpu.cache_report() if tpu else compile_cache.folder_report(),
        "pjrt_wrap": pjrt_wrap.status(),
        "profile": {"name": name, "why": why, "pins": str(pins or _pins.baked_path())},
    }
    # Per-device memory: whether, and from where.
    m["memory"] = memory.availability(m["pjrt_wrap"], m["runtime"].get("device_type"))
    m["drift"] = drift(m, name, pins)
    return m


def problems(m: dict[str, Any]) -> list[str]:
    """Every drift, contract violation and runtime failure of manifest `m`, one message each."""
    out = [f"drift from {m['profile']['name']}: {d['what']}: expected {d['expected']} ({d['pin']}), "
           f"found {d['found']}" for d in m["drift"]]
    out += [f"contract: {v}" for v in m["contract"]]
    if "fix" in m["runtime"]:  # a runtime that failed, not one left unstarted because of the contract
        out.append(f"runtime: {m['runtime']['why_not']}; fix: {m['runtime']['fix']}")
    wrap = m.get("pjrt_wrap", {})
    if wrap.get("refused"):
        out.append(f"pjrt wrapper: {wrap['refused']}")
    cache = m["cache"]
    if cache.get("folder") == "untrusted":
        out.append(f"cache: {cache['problem']}; fix: {cache['fix']}")
    if "key_problem" in cache:
        out.append(f"cache: {cache['key_problem']}")
    if "off" in cache:
        out.append(f"cache: {cache['off']}; fix: {cache['off_fix']}")
    return out


def manifest_line(m: dict[str, Any] | None = None) -> str:
    """The stack as one human row, e.g. for the first line of a training log.

    Example:
        >>> import xlakit
        >>> xlakit.manifest_line().startswith("torch ")
        True
    """
    m = m if m is not None else manifest()

    def version(part: dict, rev: str | None = None) -> str:
        v = part.get("version") or "none"
        return f"{v} git{_short(rev)}" if rev and _short(rev) not in v else v

    rt = m["runtime"]
    devices = (f"{rt['device_type']} {rt['local_devices']}/{rt['global_devices']}"
               if "device_type" in rt else "runtime not started")
    verdict = "ok" if not m["drift"] else f"DRIFT x{len(m['drift'])}"
    torch = (f"{m['torch']['installed']} NOT IMPORTABLE (xlakit doctor)" if m["torch"].get("installed") else
             version(m["torch"], m["torch"].get("git")))
    parts = [
        f"torch {torch}",
        *([f"torch_tpu {m['torch_tpu']['version']}"] if m.get("torch_tpu", {}).get("version") else []),
        f"torch_xla {version(m['torch_xla'], m['torch_xla'].get('commit'))}",
        f"libtpu {m['libtpu'].get('version') or 'none'}",
        f"jax {m['jax'].get('version') or 'none'}",
        f"patches {m['patches'].get('patch_set') or 'unknown'}",
        devices,
        f"{m['profile']['name']} {verdict}",
    ]
    wrap = m.get("pjrt_wrap", {})
    if wrap.get("active"):
        counts = wrap["counts"]
        shared = m.get("cache", {}).get("shared_tier")
        parts.append(f"pjrt-wrap {wrap['plugin_api']} cache {counts['hits']} hits {counts['misses']} misses"
                     + (f" shared {shared}" if shared else "")
                     if wrap["cache"]["on"] else f"pjrt-wrap {wrap['plugin_api']} cache off")
    if m["contract"]:
        parts.append(f"CONTRACT BROKEN x{len(m['contract'])}")
    if "fix" in rt:
        parts.append("RUNTIME BROKEN")
    return " | ".join(parts)


def log_manifest(logger: logging.Logger | None = None, **kwargs: Any) -> dict[str, Any]:
    """Log the manifest: the row for people, then one JSON line for machines.

    Drift and contract violations are logged as warnings, one per line.

    Args:
        logger: Where to log; default the `xlakit.manifest` logger.
        **kwargs: Passed to `manifest()` (`profile`, `pins`).

    Returns:
        The manifest dict that was logged.

    Example:
        >>> import logging, xlakit
        >>> logging.basicConfig(level=logging.INFO)
        >>> m = xlakit.log_manifest()
    """
    logger = logger or logging.getLogger("xlakit.manifest")
    m = manifest(**kwargs)
    logger.info("xlakit manifest: %s", manifest_line(m))
    logger.info("xlakit manifest json: %s", json.dumps(m, sort_keys=True))
    for p in problems(m):
        logger.warning("xlakit manifest: %s", p)
    return m


