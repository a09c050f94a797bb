"""Run an SPMD scenario script in a fresh process and return the JSON it wrote.

SPMD must be switched on before the XLA runtime starts, and conftest.py starts
the runtime for the whole test session; so every SPMD scenario runs in its own
process on a CPU mesh (4 devices unless told), using the same xlakit the tests import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import xlakit

SCRIPTS = Path(__file__).parent / "spmd_scripts"


def run_scenario(name: str, tmp_path: Path, *args: str, devices: int = 4,
                 timeout_s: float = 120) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), XLA_USE_SPMD="1",
               PYTHONPATH=os.pathsep.join(
                   [str(Path(xlakit.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), str(tmp_path), *args],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())
