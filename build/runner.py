"""The one runner every external command of the build goes through.

Each command is printed (`+ cd DIR && ENV=.. cmd ...`) before it runs, so a
log shows the exact pipeline, and with `dry_run` nothing runs at all: the
same code path prints the full plan. Reads that later steps depend on
(`capture`) run even in a dry run only when marked safe.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path


class CommandError(RuntimeError):
    """An external command failed; carries the command line and its output."""


class Runner:
    def __init__(self, *, dry_run: bool = False, out=None):
        self.dry_run = dry_run
        self.out = out or sys.stdout

    def describe(self, cmd: list[str], cwd: Path | None, env: dict[str, str] | None) -> str:
        prefix = f"cd {shlex.quote(str(cwd))} && " if cwd else ""
        env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        return "+ " + prefix + (env_text + " " if env_text else "") + shlex.join(cmd)

    def note(self, text: str) -> None:
        print(f"# {text}", file=self.out, flush=True)

    def run(self, cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        print(self.describe(cmd, cwd, env), file=self.out, flush=True)
        if self.dry_run:
            return
        result = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.stdout:
            print(result.stdout, end="", file=self.out, flush=True)
        if result.returncode != 0:
            raise CommandError(f"`{shlex.join(cmd)}` exited with {result.returncode}:\n{result.stdout.strip()}")

    def capture(self, cmd: list[str], *, cwd: Path | None = None, check: bool = True,
                env: dict[str, str] | None = None, timeout_s: float | None = None) -> subprocess.CompletedProcess:
        """Run a read-only command and return its output; logged, run even in a dry run.

        A timeout or a missing executable comes back as a failed result
        (returncode 124 / 127, the reason in stderr) so probes can report it.
        """
        print(self.describe(cmd, cwd, env), file=self.out, flush=True)
        try:
            result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                                    env={**os.environ, **(env or {})}, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            result = subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout_s} s")
        except OSError as e:
            result = subprocess.CompletedProcess(cmd, 127, "", str(e))
        if check and result.returncode != 0:
            raise CommandError(f"`{shlex.join(cmd)}` exited with {result.returncode}: {result.stderr.strip()}")
        return result
