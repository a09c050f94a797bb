"""`make demo` keeps working: it trains, checkpoints mid-step, reloads bit-exactly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


@pytest.mark.xla
@pytest.mark.slow
def test_demo_runs_and_reports_one_compile_and_exact_reload():
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # The save's one sync runs the training step's own graph: compiled once at most.
    assert re.search(r"xlakit\.save: [01] compile\(s\)", out.stdout), out.stdout
    assert "bit-exact = True" in out.stdout
    assert "plain torch.save on the same pending state:" in out.stdout
