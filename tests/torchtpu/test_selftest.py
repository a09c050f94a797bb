"""`xlakit selftest` on TorchTPU (torch_tpu over xla-cpu-pjrt): every check passes or says why it cannot,
and `--json` stays one clean JSON document although TorchTPU prints to stdout from native code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from tests.support import REPO
from xlakit import _knobs
from xlakit.selftest import report

pytestmark = [pytest.mark.torchtpu, pytest.mark.slow]


def test_selftest_on_torchtpu_passes_or_says_why_and_json_is_clean(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (_knobs.TORCH_TPU_TIER3_CACHE_ROOT, "RANK", "WORLD_SIZE")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO)]))
    run = subprocess.run([sys.executable, "-m", "xlakit", "selftest", "--quick", "--json"], env=env,
                         capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr[-4000:]
    found = json.loads(run.stdout)
    jsonschema.validate(found, report.schema(), cls=jsonschema.Draft202012Validator)
    checks = {c["name"]: c for c in found["checks"]}
    assert {n: c["status"] for n, c in checks.items()} == {
        "stack": "pass", "compile_cache": "pass", "memory": "skip", "checkpoint": "pass", "ranks": "skip"}, checks
    assert found["backend"]["name"] == "torchtpu" and found["manifest"]["profile"]["name"] == "torchtpu-cpu"
    compiles = checks["compile_cache"]["details"]["compilations"]
    assert compiles[1] < compiles[0] and checks["compile_cache"]["details"]["tampered"] == []
    assert "HBM figures need a TPU" in checks["memory"]["reason"]  # the CPU plugin keeps no statistics
    assert checks["checkpoint"]["details"]["device"] == "tpu:0"
    assert not list(tmp_path.glob("xlakit-selftest*"))  # its temporary folder removed (torch keeps its own there)


@pytest.mark.multiproc
def test_two_ranks_under_torchrun_on_torchtpu_pass_the_ranks_check(tmp_path):
    # Regression (issue 32, found again by this check): xlakit.restore into CPU tensors waited for its deadline
    # on torch 2.13, so the sharded save's restore of every rank timed out.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO)]))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "xlakit",
                          "selftest", "--quick", "--checks", "ranks", "--report", str(tmp_path / "r.json")],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"r.rank{rank}.json").read_text())
        ranks = {c["name"]: c for c in found["checks"]}["ranks"]
        assert ranks["status"] == "pass" and ranks["details"]["sources"] == {"0": "peer", "1": "local"}, ranks
