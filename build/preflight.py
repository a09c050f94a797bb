"""Preflight: name everything a host lacks before anything long starts.

Every check runs (no early exit) and the report lists each failure with
what was expected and what was found, so one run tells an operator all
that must change. The bazel version comes from the torch_xla checkout's
`.bazelversion` when there is one; the fallback is the version torch_xla
c04e61c pins, which `verify` keeps honest.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from runner import Runner

FALLBACK_BAZEL_VERSION = "7.4.1"  # torch_xla c04e61c .bazelversion
MIN_FREE_DISK_GIB = 120  # pytorch + torch_xla checkouts, bazel cache, wheels
MIN_MEMORY_GIB = 32  # bazel + the XLA compile at default parallelism
# git applies the series (no `patch` needed); cc/c++ build torch and the ext.
COMPILERS = ("cc", "c++", "git")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _bazel(runner: Runner, want: str) -> Check:
    exe = shutil.which("bazelisk") or shutil.which("bazel")
    if exe is None:
        return Check("bazel", False, f"expected bazel {want} (or bazelisk) on PATH, found none")
    if os.path.basename(exe) == "bazelisk":
        return Check("bazel", True, f"bazelisk at {exe} will fetch {want} from .bazelversion")
    r = runner.capture([exe, "--version"], check=False, timeout_s=120)
    if r.returncode != 0:
        return Check("bazel", False, f"{exe} --version failed: {r.stderr.strip()}")
    found = r.stdout.split()[-1] if r.stdout.split() else "?"
    return Check("bazel", found == want, f"expected bazel {want}, found {found} at {exe}")


def _reachable(runner: Runner, url: str) -> Check:
    # `git ls-remote` proves both the network path and that it is a git repo.
    r = runner.capture(["git", "ls-remote", "--heads", url], check=False, timeout_s=30,
                       env={"GIT_TERMINAL_PROMPT": "0"})
    why = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return Check(f"source {url}", r.returncode == 0, "reachable" if r.returncode == 0 else f"not reachable: {why}")


def run(runner: Runner, *, work: Path, bazel_version: str, sources: dict[str, str]) -> list[Check]:
    checks = [_bazel(runner, bazel_version)]
    probe = work if work.exists() else next(p for p in [work, *work.parents] if p.exists())
    free = shutil.disk_usage(probe).free
    checks.append(Check("disk", free >= MIN_FREE_DISK_GIB * 2**30,
                        f"expected {MIN_FREE_DISK_GIB} GiB free under {probe}, found {_gib(free)}"))
    mem = _memory_bytes()
    checks.append(Check("memory", mem >= MIN_MEMORY_GIB * 2**30,
                        f"expected {MIN_MEMORY_GIB} GiB of memory, found {_gib(mem)}"))
    for tool in COMPILERS:
        path = shutil.which(tool)
        checks.append(Check(tool, path is not None, f"found {path}" if path else f"expected {tool} on PATH"))
    for name, url in sources.items():
        c = _reachable(runner, url)
        checks.append(Check(f"{name} source", c.ok, f"{url}: {c.detail}"))
    return checks


def report(checks: list[Check], out) -> bool:
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}", file=out)
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"preflight failed: this host lacks {', '.join(failed)}", file=out)
    else:
        print("preflight passed", file=out)
    return not failed
