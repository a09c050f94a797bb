"""The self-test's report: one record per check, the whole as JSON (a versioned schema) or as text.

A check is `pass`, `fail` (with `reason` and the `fix`) or `skip` (with the
`reason`), never a traceback: every way a check can go wrong ends as one of
these. The JSON follows `report.schema.json`, shipped beside this module;
`SCHEMA` names its version and changes with any change a reader would notice.
The report carries the environment variables that shape a run (`environment.py`
keeps secrets out of it) so that it can be pasted into an issue as it is.
"""

from __future__ import annotations

import json
import os
import time
from importlib import resources
from pathlib import Path
from typing import Any

SCHEMA = "xlakit-selftest/1"
NAMES = ("stack", "compile_cache", "memory", "checkpoint", "ranks")
PASS, FAIL, SKIP = "pass", "fail", "skip"


def check(name: str, status: str, summary: str, *, reason: str | None = None, fix: str | None = None,
          timings_s: dict[str, float] | None = None, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """One check's record; a fail names its fix, a fail or skip its reason."""
    if name not in NAMES or status not in (PASS, FAIL, SKIP):
        raise ValueError(f"expected a check in {NAMES} with status pass/fail/skip, found {name!r} {status!r}")
    if status != PASS and not reason:
        raise ValueError(f"a {status} of {name} needs its reason")
    out: dict[str, Any] = {"name": name, "status": status, "summary": summary,
                           "timings_s": {k: round(float(v), 4) for k, v in (timings_s or {}).items()},
                           "details": details or {}}
    if reason:
        out["reason"] = reason
    if status == FAIL:
        out["fix"] = fix or "run `xlakit doctor` and attach this report to an issue"
    return out


def failed(name: str, reason: str, fix: str, **kw: Any) -> dict[str, Any]:
    return check(name, FAIL, reason.split("; ")[0][:200], reason=reason, fix=fix, **kw)


def skipped(name: str, reason: str, **kw: Any) -> dict[str, Any]:
    return check(name, SKIP, reason.split("; ")[0][:200], reason=reason, **kw)


def schema() -> dict[str, Any]:
    """The JSON schema of a report (`report.schema.json`, shipped in the package)."""
    return json.loads(resources.files("xlakit.selftest").joinpath("report.schema.json").read_text())


def assemble(checks: list[dict[str, Any]], *, backend: dict[str, Any], manifest: dict[str, Any] | None,
             env: dict[str, str], job: dict[str, Any], quick: bool, started: float,
             duration_s: float) -> dict[str, Any]:
    from xlakit._version import __version__

    by_name = {c["name"]: c for c in checks}
    ordered = [by_name[n] for n in NAMES if n in by_name]
    return {
        "schema": SCHEMA,
        "xlakit": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "quick": quick,
        "status": FAIL if any(c["status"] == FAIL for c in ordered) else PASS,
        "duration_s": round(duration_s, 3),
        "job": job,
        "backend": backend,
        "checks": ordered,
        "manifest": manifest,
        "env": env,
    }


def _seconds(t: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f} s" for k, v in t.items())


def render(report: dict[str, Any]) -> str:
    """The report as text: a header, one block per check (with its fix or reason), the environment."""
    job, backend = report["job"], report["backend"]
    head = (f"xlakit selftest {report['xlakit']}{' --quick' if report['quick'] else ''}: "
            f"{backend.get('description') or 'backend not examined (no device check selected)'}")
    if job.get("world", 1) > 1:
        head += f"; rank {job['rank']} of {job['world']} on {job['host']}"
    lines = [head]
    for c in report["checks"]:
        tag = c["status"].upper() if c["status"] == FAIL else c["status"]
        lines.append(f"{tag:<5} {c['name']}: {c['summary'] if c['status'] == PASS else c['reason']}")
        if c.get("fix"):
            lines.append(f"      fix: {c['fix']}")
        if c["timings_s"]:
            lines.append(f"      timings: {_seconds(c['timings_s'])}")
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in (PASS, FAIL, SKIP)}
    env = " ".join(f"{k}={v}" for k, v in report["env"].items())
    lines.append(f"env: {env or '(none of the variables that matter is set)'}")
    lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped "
                 f"in {report['duration_s']:.1f} s "
                 f"(report schema {report['schema']})")
    return "\n".join(lines)


def write(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the JSON report to `path` atomically (a temporary file beside it, then a rename)."""
    final = Path(path).expanduser()
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(report, indent=2, sort_keys=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final
