"""Running one part of the self-test in a fresh child process, under what is left of the deadline.

Every device action happens in a child: only a fresh process shows what a
restart sees (the compile cache), only one process at a time may hold a TPU's
chips, TorchTPU writes to stdout from native code (so the self-test's own
`--json` stays clean), and a plugin that aborts takes down a child, not the
report. The child (`child.py`) writes its results to a JSON file as it goes,
naming the part it is in before each starts, so a crash or a timeout is told
against the part it struck. Its stdout and stderr go to files in the
self-test's temporary folder (no pipe to fill), and their last lines explain a
failure. The child runs in a session of its own; on timeout or Ctrl-C that
session, which holds only what the self-test started, is killed. A self-test
killed outright (SIGKILL) cannot do that: the child then dies with it
(`child.py`, Linux's parent-death signal), rather than hold the device on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    """What a child left: its results (`parts` by name), how it ended, and its output."""

    job: str
    returncode: int | None
    timed_out: bool
    wall_s: float
    results: dict[str, Any] = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""

    @property
    def parts(self) -> dict[str, Any]:
        return self.results.get("parts", {})

    @property
    def running(self) -> str | None:
        """The part the child was in when it ended, if it did not finish it."""
        return self.results.get("running")

    def ended(self) -> str:
        """How the child ended, in words (for a reason)."""
        if self.timed_out:
            return f"did not finish within {self.wall_s:.0f} s (the self-test's deadline) and was stopped"
        if self.returncode is not None and self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"was killed by {name}"
        return f"exited with status {self.returncode}"

    def last_error(self) -> str:
        """The child's last line that reads like an error, else its last line (a C++ log prefix dropped)."""
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if any(w in ln for w in ("Error", "error", "abort", "Abort", "FATAL", "F0"))]
        pick = (errors or lines or ["(no output)"])[-1]
        return pick.split("] ", 1)[-1][-400:]


def _tail(path: Path, limit: int = 64 << 10) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run(job: str, params: dict[str, Any], *, scratch: Path, deadline: float, env: dict[str, str],
        name: str | None = None) -> Outcome:
    """Run `python -m xlakit.selftest.child JOB` with `params`; never raises for what the child does."""
    name = name or job
    src, dst = scratch / f"{name}.in.json", scratch / f"{name}.out.json"
    src.write_text(json.dumps(params))
    out_path, err_path = scratch / f"{name}.stdout", scratch / f"{name}.stderr"
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "xlakit.selftest.child", job, str(src), str(dst),
                                 str(os.getpid())],
                                env=env, cwd=scratch, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:  # timed out, or Ctrl-C here: stop the child's session (ours alone)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    try:
        results = json.loads(dst.read_text())
    except (OSError, ValueError):
        results = {}
    return Outcome(job, proc.returncode, timed_out, time.monotonic() - start, results,
                   _tail(out_path), _tail(err_path))
