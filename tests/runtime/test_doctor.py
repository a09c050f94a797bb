"""`xlakit doctor` on the real stock stack: it must tell the truth about this build."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import xlakit
from xlakit.runtime import doctor

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(Path(xlakit.__file__).parents[1]))
    for name in ("LIBTPU_INIT_ARGS", "XLA_USE_SPMD", "XLAKIT_PROFILE"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "xlakit", "doctor", "--profile", "cpu-dev"], env=env,
                          capture_output=True, text=True, timeout=240)


def _line(report, name: str) -> str:
    found = [ln for ln in report.stdout.splitlines() if ln[6:].startswith(f"{name}")]
    assert found, f"no {name!r} line in:\n{report.stdout}\n{report.stderr}"
    return found[0]


@pytest.mark.slow
def test_reports_the_stock_cache_as_broken_for_the_right_reason(report):
    # Regression: stock torch_xla writes cache entries and fails every load (PersistentCacheDeserializeFailure).
    line = _line(report, "cache:")
    assert line.startswith("FAIL  cache: " + doctor.UNPATCHED)
    assert "deserialize failures" in line  # the second process's counters are the evidence
    assert report.returncode == 1


@pytest.mark.slow
def test_other_probes_on_the_stock_cpu_stack(report):
    assert _line(report, "contract:").startswith("ok    contract: holds")
    assert _line(report, "stack:").startswith("ok    stack: torch ")
    assert _line(report, "memory ").startswith("n/a   memory CPU:0: not supported:")
    assert _line(report, "transfer:").startswith("warn  transfer: no _xla_transfer_to_host binding")
    assert "fix: install the xlakit wheels" in report.stdout


def test_a_probe_past_its_deadline_says_so():
    probe = doctor.probe_cache(timeout_s=0.5)
    assert probe.verdict == "fail"
    assert probe.detail == ("the probe timed out after 0.5 s in the first process "
                            "(compiling a small graph with the cache on)")
    assert "--timeout-s" in probe.fix


@pytest.mark.parametrize("stats, build, verdict, says", [
    ({"hits": 1, "misses": 0, "deserialize_failures": 0}, {"patch_set": "xlakit1"}, "ok", "works"),
    ({"hits": 0, "misses": 0, "deserialize_failures": 1}, None, "fail", doctor.UNPATCHED),
    ({"hits": 0, "misses": 0, "deserialize_failures": 1}, {"patch_set": "xlakit1"}, "fail",
     "although this torch_xla carries patch set xlakit1"),
    ({"hits": 0, "misses": 1, "deserialize_failures": 0}, None, "fail", "found no entry"),
])
def test_cache_verdicts(stats, build, verdict, says):
    stderr = "2026-01-01 W pjrt_computation_client.cpp:694] Failed to deserialize executable: UNIMPLEMENTED\n"
    probe = doctor.cache_verdict(stats, stderr, build)
    assert probe.verdict == verdict and says in probe.detail
    if stats["deserialize_failures"]:
        assert "Failed to deserialize executable: UNIMPLEMENTED" in probe.detail
        assert "2026-01-01" not in probe.detail  # the C++ log prefix is dropped


def test_broken_contract_fails_without_starting_the_probes(monkeypatch):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_disable_hlo_passes=x")
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    out = io.StringIO()
    assert doctor.run(profile="cpu-dev", timeout_s=5, out=out) == 1
    text = out.getvalue()
    assert "FAIL  contract: LIBTPU_INIT_ARGS passes --xla_disable_hlo_passes=x" in text
    assert "--xla_jf_vmem_memory_space_assignment=false" in text
    assert "FAIL  cache: not probed: the run contract is broken" in text


def test_a_probe_process_that_dies_is_reported_with_its_error(monkeypatch):
    def fake_run(cmd, **kwargs):  # stands in for a probe child that crashes at start-up
        return subprocess.CompletedProcess(cmd, 3, stdout="", stderr="noise\nRuntimeError: TPU in use by pid 7\n")

    monkeypatch.setattr(doctor.subprocess, "run", fake_run)
    probe = doctor.probe_cache(timeout_s=30)
    assert probe.verdict == "fail"
    assert probe.detail == ("the first probe process exited with 3 without reporting its counters; "
                            "its last error line: RuntimeError: TPU in use by pid 7")


def test_the_deadline_knob_reaches_the_cache_probe(monkeypatch):
    seen = []

    def fake_probe_cache(*, timeout_s):  # stands in for the subprocess probe
        seen.append(timeout_s)
        return doctor.Probe("cache", "ok", "stand-in")

    monkeypatch.setattr(doctor, "probe_cache", fake_probe_cache)
    monkeypatch.setenv("XLAKIT_DOCTOR_TIMEOUT_S", "7.5")
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    doctor.run(profile="cpu-dev", out=io.StringIO())
    assert seen == [7.5]
    doctor.run(profile="cpu-dev", timeout_s=2.0, out=io.StringIO())  # the argument beats the environment
    assert seen == [7.5, 2.0]


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "-inf"])
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_a_wrong_argument(monkeypatch, capsys, value):
    # Regression: `doctor --timeout-s -5` ran, and reported the runtime as hung ("the probe timed out after
    # -5 s"), exit 1; `selftest --timeout-s` refuses the same values with exit 2.
    from xlakit import cli

    monkeypatch.setattr(doctor, "run", lambda **kw: pytest.fail(f"doctor ran with {kw}"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["doctor", f"--timeout-s={value}"])
    assert exited.value.code == 2
    assert f"argument --timeout-s: expected a positive number of seconds, found {value}" in capsys.readouterr().err


def test_the_cache_folder_probe_says_who_can_write_it(monkeypatch, tmp_path):
    monkeypatch.delenv("XLAKIT_CACHE_KEY", raising=False)
    monkeypatch.delenv("XLAKIT_CACHE_TRUST_SHARED", raising=False)
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH", raising=False)
    assert doctor.probe_cache_folder().verdict == "n/a"
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path))
    probe = doctor.probe_cache_folder()
    assert probe.verdict == "ok" and probe.detail == (f"{tmp_path}: owner-only; entries not authenticated "
                                                      "(XLAKIT_CACHE_KEY unset)")
    tmp_path.chmod(0o770)
    try:
        refused = doctor.probe_cache_folder()
        monkeypatch.setenv("XLAKIT_CACHE_TRUST_SHARED", "1")
        shared = doctor.probe_cache_folder()
    finally:
        tmp_path.chmod(0o700)
    assert refused.verdict == "fail" and refused.fix.startswith(f"chmod g-w {tmp_path}")
    assert shared.verdict == "warn" and "shared-trusted" in shared.detail and "XLAKIT_CACHE_KEY" in shared.fix
