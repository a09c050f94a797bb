"""Diagnostics on a broken runtime, through the real CLI in fresh processes: findings with fixes, never tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import xlakit
from xlakit.runtime import pins, contract

pytestmark = [pytest.mark.xla, pytest.mark.slow]

ROOT = str(Path(xlakit.__file__).resolve().parents[1])
PINNED_LIBTPU = pins.newest_pinned("libtpu", "tpu")
ACCEPTED = ", ".join(contract.accepted_devices({})[0])


def _env(tmp_path: Path, **over: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PJRT_DEVICE", "XLAKIT_PROFILE", "LIBTPU_INIT_ARGS", "XLA_USE_SPMD", "TPU_LIBRARY_PATH",
                        "XLA_PERSISTENT_CACHE_PATH")}
    env["PYTHONPATH"] = os.pathsep.join((over.pop("PYTHONPATH_FIRST"), ROOT)) if "PYTHONPATH_FIRST" in over else ROOT
    env["HOME"] = str(tmp_path)  # nothing the children write lands outside tmp_path
    env.update(over)
    return env


def _xlakit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "xlakit", *args], env=env, capture_output=True, text=True,
                         timeout=240)
    assert "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
    return run


def _check_and_doctor(env: dict[str, str]) -> tuple[str, str]:
    """`manifest --check` and `doctor` both fail (exit 1); returns what each printed (stderr, stdout)."""
    check = _xlakit(env, "manifest", "--check")
    doctor = _xlakit(env, "doctor", "--timeout-s", "60")
    assert (check.returncode, doctor.returncode) == (1, 1), check.stderr + doctor.stdout
    return check.stderr, doctor.stdout


def _fake_torch_xla(tmp_path: Path, raises: str) -> str:
    """A stand-in torch_xla package whose import fails the way a broken install does."""
    fake = tmp_path / "fake-site"
    (fake / "torch_xla").mkdir(parents=True)
    (fake / "torch_xla" / "__init__.py").write_text(f"raise {raises}\n")
    return str(fake)


@pytest.fixture
def tpu_without_libtpu(tmp_path):
    if pins.installed_version("libtpu"):
        pytest.skip("libtpu is installed here")
    return _env(tmp_path, PJRT_DEVICE="TPU")


def test_tpu_without_libtpu_is_a_finding_with_the_pinned_fix(tpu_without_libtpu):
    # Regression: PJRT_DEVICE=TPU without libtpu crashed manifest, --check and doctor with "OSError: libtpu not found".
    finding = "PJRT_DEVICE=TPU but libtpu is not installed"
    fix = f"pip install libtpu=={PINNED_LIBTPU} (the newest the pinned tpu profile allows)"
    row = _xlakit(tpu_without_libtpu, "manifest")
    assert row.returncode == 0 and row.stdout.rstrip().endswith("| RUNTIME BROKEN")
    check, doctor = _check_and_doctor(tpu_without_libtpu)
    assert f"xlakit manifest --check: runtime: {finding}" in check and f"fix: {fix}" in check
    assert f"FAIL  runtime: {finding}" in doctor and f"      fix: {fix}" in doctor
    assert "FAIL  cache: not probed: the runtime cannot start" in doctor


def test_log_manifest_logs_the_finding_and_returns(tpu_without_libtpu):
    code = textwrap.dedent("""
        import logging, xlakit
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        m = xlakit.log_manifest()
        print("returned", sorted(m["runtime"]))
    """)
    run = subprocess.run([sys.executable, "-c", code], env=tpu_without_libtpu, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "returned ['fix', 'why_not']" in run.stdout
    assert f"WARNING xlakit manifest: runtime: PJRT_DEVICE=TPU but libtpu is not installed" in run.stderr
    assert f"pip install libtpu=={PINNED_LIBTPU}" in run.stderr


@pytest.mark.parametrize("device, says", [
    ("FOO", f"contract: PJRT_DEVICE='FOO' is not a device torch_xla can start, expected one of {ACCEPTED}"),
    ("CUDA", "contract: PJRT_DEVICE='CUDA' is not a device torch_xla can start"),
    ("", f"contract: PJRT_DEVICE is set but empty, expected one of {ACCEPTED}"),
])
def test_a_device_torch_xla_cannot_start_fails_check_and_doctor(tmp_path, device, says):
    if device in contract.accepted_devices({})[0]:
        pytest.skip(f"a plugin for {device} is installed here")
    check, doctor = _check_and_doctor(_env(tmp_path, PJRT_DEVICE=device))
    assert says in check
    assert f"FAIL  {says}" in doctor and "FAIL  cache: not probed: the run contract is broken" in doctor


@pytest.mark.parametrize("raises", ['RuntimeError("fake: built for another torch")',
                                    'ImportError("fake: undefined symbol _ZN3c10")',
                                    'OSError("fake: libxla.so: cannot open shared object file")'])
def test_a_torch_xla_that_fails_to_import_is_a_finding(tmp_path, raises):
    env = _env(tmp_path, PJRT_DEVICE="CPU", PYTHONPATH_FIRST=_fake_torch_xla(tmp_path, raises))
    kind, message = raises.split("(", 1)
    imported = f"cannot import torch_xla: {kind}: {message[1:-2]}"
    check, doctor = _check_and_doctor(env)
    assert f"xlakit manifest --check: runtime: {imported}; fix: repair" in check
    assert f"torch_xla: expected 2.9.0 (profiles.cpu-dev.packages.torch_xla), found {imported}" in check
    assert f"FAIL  runtime: {imported}" in doctor


def test_a_cache_path_that_is_a_file_fails_check_and_doctor(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    says = f"contract: XLA_PERSISTENT_CACHE_PATH={blocker} is a file, expected a folder"
    check, doctor = _check_and_doctor(_env(tmp_path, PJRT_DEVICE="CPU", XLA_PERSISTENT_CACHE_PATH=str(blocker)))
    assert says in check and f"FAIL  {says}" in doctor


def test_a_runtime_that_fails_inside_its_plugin_is_a_finding(tmp_path):
    not_a_library = tmp_path / "libtpu.so"
    not_a_library.write_text("not a shared object")
    env = _env(tmp_path, PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=str(not_a_library))
    check = _xlakit(env, "manifest", "--check")
    assert check.returncode == 1
    failed = f"the runtime did not start: RuntimeError: Failed to open {not_a_library}"
    assert f"xlakit manifest --check: runtime: {failed}" in check.stderr
    assert "fix: check that PJRT_DEVICE=TPU names hardware this host has" in check.stderr


def test_memory_reports_a_runtime_that_cannot_start(tmp_path, tpu_without_libtpu):
    run = _xlakit(tpu_without_libtpu, "memory")
    assert run.returncode == 1
    assert run.stderr.startswith("xlakit memory: PJRT_DEVICE=TPU but libtpu is not installed")
    assert f"  fix: pip install libtpu=={PINNED_LIBTPU}" in run.stderr
    run = _xlakit(_env(tmp_path, PJRT_DEVICE="FOO"), "memory")
    assert run.returncode == 1 and "xlakit memory: the run contract is broken: PJRT_DEVICE='FOO'" in run.stderr
