"""`xlakit selftest`: check on the job's own accelerator what only it can show, and report it.

Five checks (`report.NAMES`): the stack (manifest and run contract), the
compile cache across a restart (and its refusal of a tampered entry), memory
figures per device, checkpoints of a device-resident state (bit-exact,
synchronous and in the background, with the transfer bandwidths), and, under
a launcher, several ranks (agreement, a sharded save, the local tier's peer
copies). Each ends `pass`, `fail` (with the fix) or `skip` (with why).

This process imports no framework: each part runs in a fresh child process
(`children.py`, `child.py`) under one deadline, in order, so that at most one
process holds the device at a time (a TPU's chips admit one), a restart is a
real one, a plugin that aborts costs one child and not the report, and
nothing a framework prints reaches this process's stdout (`--json` stays
clean). Everything is written under one temporary folder of the self-test's
own, removed at the end unless a check failed (then kept, and named, for a
bug report).

Example:
    >>> from xlakit import selftest
    >>> r = selftest.run(selftest.Options(quick=True, checks=("stack",)))  # doctest: +SKIP
    >>> [c["status"] for c in r["checks"]]  # doctest: +SKIP
    ['pass', 'skip', 'skip', 'skip', 'skip']
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xlakit.selftest import check_compile_cache, check_ranks, check_stack, children, devices, environment, report
from xlakit.selftest.report import NAMES

MiB = 1 << 20
_DEVICE_CHECKS = ("memory", "checkpoint")


@dataclass(frozen=True)
class Options:
    """How `run` runs.

    Attributes:
        quick: smaller states (16 MiB checkpoint, 4 MiB memory buffer, 2 MiB per rank) for a run of seconds.
        checks: the checks to run, of `report.NAMES`; the others are reported as skipped.
        backend: "auto" (what the job runs on) or one of `devices.BACKENDS`.
        profile: the VERSIONS.toml profile the stack is checked against (default as `xlakit manifest`).
        pins: a pins file instead of the one baked into xlakit.
        tmpdir: where the temporary folder goes (default: Python's, from TMPDIR).
        shared_dir: for `ranks` on several hosts, a folder every host sees (for the sharded save).
        timeout_s: one deadline for the whole self-test; each child gets what is left.
    """

    quick: bool = False
    checks: tuple[str, ...] = NAMES
    backend: str = "auto"
    profile: str | None = None
    pins: str | None = None
    tmpdir: str | None = None
    shared_dir: str | None = None
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        unknown = [c for c in self.checks if c not in NAMES]
        if unknown or not self.checks:
            raise ValueError(f"checks: expected some of {', '.join(NAMES)}, found {', '.join(unknown) or 'none'}")
        if self.backend not in ("auto", *devices.BACKENDS):
            raise ValueError(f"backend: expected auto or one of {', '.join(devices.BACKENDS)}, found {self.backend!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s: expected a positive number of seconds, found {self.timeout_s!r}")
        if self.shared_dir and "://" in self.shared_dir:
            raise ValueError(f"shared_dir: expected a folder every host mounts, found the URL {self.shared_dir!r}")


def _device_params(wanted: list[str], o: Options, scratch: Path, deadline: float) -> dict[str, Any]:
    (scratch / "device-cache").mkdir(mode=0o700, exist_ok=True)
    return {"checks": wanted, "cache_dir": str(scratch / "device-cache"),
            "folder": str(scratch / "checkpoints"), "memory_bytes": (4 if o.quick else 64) * MiB,
            "checkpoint_bytes": (16 if o.quick else 256) * MiB, "timeout_s": max(10.0, deadline - time.monotonic() - 5)}


def _device_verdicts(outcome: children.Outcome, wanted: list[str], backend: dict[str, Any]) -> list[dict[str, Any]]:
    """The device checks a child ran (the device child, or the compile cache's second process)."""
    out = []
    start = {**(outcome.parts.get("start") or {}), **(outcome.parts.get("device start") or {})}
    for name in wanted:
        got = outcome.parts.get(name)
        if "error" in start:
            out.append(report.failed(name, f"the {backend['name']} device did not start: {start['error']}",
                                     "run `xlakit doctor`, which names what stops the runtime"))
        elif got and "check" in got:
            out.append(got["check"])
        elif got:
            out.append(report.failed(name, f"{got['error']} (at {got.get('where')})",
                                     "attach this report to an issue", details={"where": got.get("where")}))
        else:
            where = f" during {outcome.running}" if outcome.running else ""
            out.append(report.failed(name, f"the device process {outcome.ended()}{where}: {outcome.last_error()}",
                                     "run `xlakit doctor`; if the device is busy, stop the job that holds it"))
    return out


def _scratch(o: Options) -> tuple[Path | None, Path | None, str | None]:
    """(the self-test's temporary folder, the folder it is in, or why it could not be made)."""
    try:
        base = Path(o.tmpdir).expanduser() if o.tmpdir else Path(tempfile.gettempdir())
        return Path(tempfile.mkdtemp(prefix="xlakit-selftest-", dir=base)), base, None
    except (OSError, ValueError) as e:
        where = o.tmpdir or "TMPDIR, /tmp, /var/tmp or the working folder"
        return None, None, f"cannot make a temporary folder in {where}: {type(e).__name__}: {e}"


def _run_checks(o: Options, scratch: Path, base: Path, deadline: float, job: dict[str, Any], tier2: str,
                say: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
    """(the selected checks, the backend, the manifest), each check in its child process, in order."""
    checks: list[dict[str, Any]] = []
    backend: dict[str, Any] = {"name": o.backend, "description": None}
    manifest = None
    env = environment.child_env()
    wanted = [n for n in _DEVICE_CHECKS if n in o.checks]
    device = _device_params(wanted, o, scratch, deadline) if wanted else None
    ran = None  # the child that ran the device checks, where one of the others did
    if "stack" in o.checks or wanted or "compile_cache" in o.checks:
        say("stack: the run contract, the manifest, the backend")
        outcome = children.run("stack", {"backend": o.backend, "profile": o.profile, "pins": o.pins, "device": device,
                                         "tier2": tier2},
                               scratch=scratch, deadline=deadline, env=environment.child_env(set_aside=False))
        stack, backend, manifest = check_stack.verdict(outcome, o.backend)
        checks += [stack] if "stack" in o.checks else []
        ran = outcome if outcome.parts.get("device ran") else None
    if "compile_cache" in o.checks:
        # TorchTPU counts compiles per process: its cache's processes compile nothing else.
        merged = device if ran is None and backend.get("cache_route") != "torchtpu" else None
        say("compile_cache: two fresh processes share a temporary cache" +
            (f"; then {', '.join(wanted)} in the second" if merged else ""))
        cache, second = check_compile_cache.run(backend, scratch=scratch, deadline=deadline, env=env, device=merged)
        checks.append(cache)
        if merged and second is not None and "device start" in second.parts:  # else: a device child of their own
            ran = second
    if wanted and backend.get("unusable"):
        checks += [report.skipped(n, f"not run: {backend['unusable']}") for n in wanted]
    elif wanted:
        if ran is None:
            say(f"{', '.join(wanted)}: on the device")
            ran = children.run("device", {**device, "backend": backend}, scratch=scratch, deadline=deadline, env=env)
        checks += _device_verdicts(ran, wanted, backend)
    if "ranks" in o.checks:
        say("ranks: agreement, a sharded save, the local tier's peer copies")
        checks.append(check_ranks.run(job, quick=o.quick, tmp_base=base, shared_dir=o.shared_dir, scratch=scratch,
                                      deadline=deadline, env=env))
    return checks, backend, manifest


def run(options: Options | None = None, *, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the selected checks; the report (see `report.schema.json`). Never raises for what a check finds.

    Args:
        options: an `Options`; default every check, full size.
        say: called with a line as each check starts (progress, for stderr).

    Returns:
        The report: `schema`, `status`, `checks` (one per name), `backend`, `manifest`, `env`, `job`, ...
    """
    o = options or Options()
    started, t0 = time.time(), time.monotonic()
    job = environment.job()
    job["cache_settings_set_aside"] = environment.cache_settings_set_aside()
    secrets = environment.secret_values()
    checks = [report.skipped(n, f"not selected (--checks {','.join(o.checks)})") for n in NAMES if n not in o.checks]
    backend: dict[str, Any] = {"name": o.backend, "description": None}
    manifest = None
    scratch, base, no_folder = _scratch(o)
    tier2 = f"xlakit-selftest-{uuid.uuid4().hex}"  # TorchTPU's node-local cache for the stack child's device work
    try:
        if scratch is None:
            fix = "pass --tmpdir DIR (a folder you can write, on a local disk), or set TMPDIR to one"
            checks += [report.failed(n, no_folder, fix) for n in o.checks]
        else:
            found, backend, manifest = _run_checks(o, scratch, base, t0 + o.timeout_s, job, tier2,
                                                   say or (lambda line: None))
            checks += found
    finally:
        from xlakit.runtime import torchtpu

        shutil.rmtree(Path(torchtpu.TIER2_ROOT) / tier2, ignore_errors=True)  # named for this run alone
        kept = scratch is not None and any(c["status"] == report.FAIL for c in checks)
        if scratch is not None and not kept:
            shutil.rmtree(scratch, ignore_errors=True)  # the folder mkdtemp made for this run: ours alone
    if kept:
        job["kept_folder"] = str(scratch)
    out = report.assemble(checks, backend=backend, manifest=manifest, env=environment.variables(), job=job,
                          quick=o.quick, started=started, duration_s=time.monotonic() - t0)
    return environment.scrub(out, secrets)
