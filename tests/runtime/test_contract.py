"""The run contract: removed libtpu flags and the SPMD setting, refused before the runtime starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import xlakit
from xlakit.runtime import pins, contract
from tests.support import REPO

BAD = "--xla_tpu_enable_latency_hiding_scheduler=true --xla_disable_hlo_passes=rematerialization"
REPLACEMENT = "--xla_jf_vmem_memory_space_assignment=false"
PINS = REPO / "VERSIONS.toml"


def _pins_with_libtpu(tmp_path: Path, allowed: list[str]) -> Path:
    text = PINS.read_text().replace('allowed = ["0.0.36", "0.0.37"]', f"allowed = {allowed!r}".replace("'", '"'))
    assert text != PINS.read_text(), "VERSIONS.toml no longer spells the libtpu pin this test rewrites"
    out = tmp_path / "pins.toml"
    out.write_text(text)
    return out


def test_removed_flag_is_refused_naming_version_and_replacement():
    # Regression: a run script passing --xla_disable_hlo_passes died at start-up ("unknown flag") on libtpu 0.0.37.
    with pytest.raises(xlakit.RunContractError) as e:
        xlakit.check_run_contract(env={"LIBTPU_INIT_ARGS": BAD}, libtpu_version="0.0.37")
    message = str(e.value)
    assert "--xla_disable_hlo_passes=rematerialization" in message
    assert "libtpu 0.0.37 removed --xla_disable_hlo_passes" in message
    assert f"pass {REPLACEMENT} instead" in message
    assert len(e.value.violations) == 1  # the valid flag beside it is not reported
    assert isinstance(e.value, ValueError)


def test_removed_flag_is_refused_from_the_real_environment(monkeypatch):
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_disable_hlo_passes=x")
    with pytest.raises(xlakit.RunContractError, match="xla_jf_vmem_memory_space_assignment=false"):
        xlakit.check_run_contract(libtpu_version="0.0.38")


def test_flag_is_fine_on_a_libtpu_that_still_has_it():
    xlakit.check_run_contract(env={"LIBTPU_INIT_ARGS": BAD}, libtpu_version="0.0.36")


def test_absl_negated_spelling_is_the_same_flag():
    problems = contract.contract_violations(env={"LIBTPU_INIT_ARGS": "--noxla_disable_hlo_passes"},
                                            libtpu_version="0.0.37")
    assert len(problems) == 1 and "--noxla_disable_hlo_passes" in problems[0]


@pytest.mark.skipif(pins.installed_version("libtpu") is not None, reason="libtpu is installed: its version rules")
def test_without_libtpu_the_pinned_tpu_profile_decides(tmp_path):
    problems = contract.contract_violations(env={"LIBTPU_INIT_ARGS": BAD}, pins=PINS)
    assert len(problems) == 1 and "the newest the pinned tpu profile allows" in problems[0]
    older = _pins_with_libtpu(tmp_path, ["0.0.36"])
    assert contract.contract_violations(env={"LIBTPU_INIT_ARGS": BAD}, pins=older) == []


def test_spmd_needs_no_special_scalars():
    # Regression: SPMD runs without XLA_NO_SPECIAL_SCALARS=1 gave silently wrong losses.
    with pytest.raises(xlakit.RunContractError, match="XLA_NO_SPECIAL_SCALARS is unset, expected 1"):
        xlakit.check_run_contract(env={"XLA_USE_SPMD": "1"})
    with pytest.raises(xlakit.RunContractError, match="XLA_NO_SPECIAL_SCALARS is '0'"):
        xlakit.check_run_contract(env={"XLA_NO_SPECIAL_SCALARS": "0"}, spmd=True)
    xlakit.check_run_contract(env={"XLA_USE_SPMD": "1", "XLA_NO_SPECIAL_SCALARS": "1"})
    xlakit.check_run_contract(env={})  # no SPMD, nothing required


def test_every_violation_is_reported_at_once():
    with pytest.raises(xlakit.RunContractError) as e:
        xlakit.check_run_contract(env={"LIBTPU_INIT_ARGS": BAD, "XLA_USE_SPMD": "true"}, libtpu_version="0.0.37")
    assert len(e.value.violations) == 2


def test_flag_table_rows_are_well_formed():
    rows = contract.removed_flags()
    assert rows, "the shipped libtpu flag table is empty"
    for row in rows:
        assert row.name and not row.name.startswith("-") and "=" not in row.name
        pins.release(row.removed_in)  # raises on a malformed version
        assert row.replacement == "" or row.replacement.startswith("--")
    assert contract.RemovedFlag("xla_disable_hlo_passes", "0.0.37", REPLACEMENT) in rows


@pytest.mark.slow
@pytest.mark.xla
def test_manifest_check_refuses_before_the_runtime_starts(tmp_path):
    env = dict(os.environ, LIBTPU_INIT_ARGS=BAD, PJRT_DEVICE="CPU", PYTHONPATH=str(Path(xlakit.__file__).parents[1]))
    run = subprocess.run([sys.executable, "-m", "xlakit", "manifest", "--check", "--profile", "cpu-dev"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "runtime not started" in run.stdout and "CONTRACT BROKEN x1" in run.stdout
    assert "--xla_disable_hlo_passes" in run.stderr and REPLACEMENT in run.stderr


def _installed_plugins() -> list[str]:
    import importlib.metadata

    return sorted({ep.name.upper() for ep in importlib.metadata.entry_points(group="torch_xla.plugins")})


def test_accepted_devices_are_cpu_and_the_installed_plugins():
    accepted, source = contract.accepted_devices({})
    assert accepted == ("CPU", *_installed_plugins()) and "torch_xla.plugins" in source
    static, source = contract.accepted_devices({"XLA_REGISTER_INSTALLED_PLUGINS": "0"})
    assert static == ("CPU", "NEURON", "TPU", "XPU") and "XLA_REGISTER_INSTALLED_PLUGINS=0" in source


@pytest.mark.parametrize("value, says", [
    ("FOO", "PJRT_DEVICE='FOO' is not a device torch_xla can start, expected one of CPU"),
    ("CUDA", "or install the plugin for CUDA (a package with a 'cuda' entry point in torch_xla.plugins)"),
    ("", "PJRT_DEVICE is set but empty, expected one of CPU"),
    ("cpu", "names are case-sensitive: export PJRT_DEVICE=CPU"),
])
def test_a_device_torch_xla_cannot_start_breaks_the_contract(value, says):
    # Regression: PJRT_DEVICE=FOO passed `xlakit manifest --check`.
    if value in contract.accepted_devices({})[0]:
        pytest.skip(f"a plugin for {value} is installed here")
    with pytest.raises(xlakit.RunContractError) as e:
        xlakit.check_run_contract(env={"PJRT_DEVICE": value})
    assert says in str(e.value) and len(e.value.violations) == 1


@pytest.mark.parametrize("env", [{}, {"PJRT_DEVICE": "CPU"}, {"PJRT_DEVICE": "TPU"}])
def test_an_unset_or_accepted_device_holds(env):
    assert contract.contract_violations(env=env) == []


def test_a_cache_path_that_is_a_file_breaks_the_contract(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for path, says in ((blocker, "is a file, expected a folder"), (blocker / "sub", f"lies under {blocker}")):
        (problem,) = contract.contract_violations(env={"XLA_PERSISTENT_CACHE_PATH": str(path)})
        assert f"XLA_PERSISTENT_CACHE_PATH={path} {says}" in problem
    assert contract.contract_violations(env={"XLA_PERSISTENT_CACHE_PATH": str(tmp_path / "new" / "cache")}) == []
