"""Start the ranks of a real multi-process job for a test: gloo over loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(worker: Path, scenario: str, folder: Path, world: int) -> list[tuple[int, str, str]]:
    """Run `worker scenario folder` as ranks 0..world-1; (exit status, stdout, stderr) each."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, str(worker), scenario, str(folder)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append((proc.returncode, out, err))
    return results
