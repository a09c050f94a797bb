"""The child process of the self-test: `python -m xlakit.selftest.child JOB IN.json OUT.json PARENT_PID`.

It runs one job's parts in order and rewrites OUT.json (atomically) before
and after each part: `running` names the part under way, `parts` holds each
finished one. A part that raises is recorded as its error (type, message and
the innermost frame of xlakit or the framework), never printed as a
traceback; the next part still runs. The jobs:

* `stack`: the run contract, the backend, the manifest (`check_stack.py`);
* `cache`: one process of the compile cache's pair (`check_compile_cache.py`);
* `device`: memory and checkpoints on the device (`check_memory.py`,
  `check_checkpoint.py`), in a process of their own, so that the cache's
  processes compile nothing else (TorchTPU counts its compiles only per process);
* `ranks`: this rank's part of the multi-process check (`check_ranks.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Results:
    """OUT.json, rewritten whole after every change."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {"parts": {}, "running": None}
        self._save()

    def _save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        os.replace(tmp, self.path)

    def put(self, name: str, value: Any) -> None:
        self.data["parts"][name] = value
        self._save()

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[dict[str, Any]]:
        """Run a part: what it puts in the yielded dict is recorded; an exception becomes its `error`."""
        self.data["running"] = name
        self._save()
        got: dict[str, Any] = {}
        try:
            yield got
        # A part of a diagnostic may meet anything a plugin or framework raises: it is that part's finding.
        except Exception as e:
            got["error"] = f"{type(e).__name__}: {e}"[:2000]
            frames = traceback.extract_tb(e.__traceback__)
            if frames:
                got["where"] = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
        self.data["running"] = None
        self.put(name, got)


def _jobs():
    from xlakit.selftest import check_compile_cache, check_ranks, check_stack, device_job

    return {"stack": check_stack.child, "cache": check_compile_cache.child, "device": device_job.child,
            "ranks": check_ranks.child}


def _die_with_parent(parent: int) -> None:
    """SIGKILL this child when the self-test that started it dies, even by SIGKILL (which gives it no
    chance to stop this child's session): a child left on its own would hold the device."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None:  # not Linux: the self-test stops its children itself, unless killed outright
        return
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def main(argv: list[str]) -> int:
    job, src, dst, parent = argv
    _die_with_parent(int(parent))
    params = json.loads(Path(src).read_text())
    _jobs()[job](params, Results(Path(dst)))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
