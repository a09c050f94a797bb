"""The run manifest on the real stock torch_xla (CPU), and against a patched stand-in."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import xlakit
from tests.support.fakes import FakePatchedXLAC
from xlakit import cli
from xlakit.runtime import features, manifest, pins
from tests.support import REPO

PINS = REPO / "VERSIONS.toml"

pytestmark = pytest.mark.xla



@pytest.fixture(scope="module")
def m():
    return xlakit.manifest(profile="cpu-dev", pins=PINS)


def test_fields_match_the_installed_stack(m):
    import torch
    import torch_xla
    import torch_xla.version

    assert m["python"] == platform.python_version()
    assert m["torch"] == {"version": torch.__version__, "git": torch.version.git_version}
    assert m["torch_xla"]["version"] == torch_xla.__version__
    assert m["torch_xla"]["torch_git"] == torch_xla.version.__torch_gitrev__
    assert m["torch_xla"]["xla_git"] == torch_xla.version.__xla_gitrev__
    for dist in ("libtpu", "jax", "jaxlib"):
        try:
            assert m[dist] == {"version": importlib.metadata.version(dist)}
        except importlib.metadata.PackageNotFoundError:
            assert m[dist]["version"] is None and "not installed" in m[dist]["why_not"]
    assert m["patches"]["patch_set"] == "stock"  # the PyPI wheel has no provenance binding
    rt = m["runtime"]
    assert rt["device_type"] == "CPU"
    assert rt["runtime_devices"] == list(torch_xla._XLAC._xla_get_runtime_devices())
    assert rt["local_devices"] == len(rt["runtime_devices"]) and rt["global_devices"] >= rt["local_devices"]
    assert set(m["env"]) >= {"PJRT_DEVICE", "XLA_NO_SPECIAL_SCALARS", "XLA_FLAGS", "LIBTPU_INIT_ARGS",
                             "XLA_PERSISTENT_CACHE_PATH"}
    assert m["profile"]["name"] == "cpu-dev" and m["profile"]["pins"] == str(PINS)
    json.dumps(m)  # JSON-ready, for the log


def test_the_installed_cpu_dev_stack_has_no_drift(m):
    assert m["drift"] == [] and m["contract"] == []


def _pins_copy(tmp_path: Path, old: str, new: str) -> Path:
    text = PINS.read_text()
    assert old in text, f"VERSIONS.toml no longer holds {old!r}"
    out = tmp_path / "_pins.toml"
    out.write_text(text.replace(old, new))
    return out


def test_drift_is_reported_against_a_profile_that_differs(tmp_path, capsys):
    pins = _pins_copy(tmp_path, 'torch = "2.9.0"', 'torch = "2.8.0"')
    m = xlakit.manifest(profile="cpu-dev", pins=pins)
    assert [(d["what"], d["expected"], d["pin"]) for d in m["drift"]] == [
        ("torch", "2.8.0", "profiles.cpu-dev.packages.torch")]
    assert m["drift"][0]["found"].startswith("2.9.0")
    assert "cpu-dev DRIFT x1" in xlakit.manifest_line(m)

    assert cli.main(["manifest", "--check", "--profile", "cpu-dev", "--pins", str(pins)]) == 1
    err = capsys.readouterr().err
    assert "drift from cpu-dev: torch: expected 2.8.0 (profiles.cpu-dev.packages.torch), found 2.9.0" in err


def test_stock_wheels_drift_from_the_tpu_profile(m):
    drift = {d["what"]: d for d in manifest.drift(m, "tpu", PINS)}
    level = pins.load(PINS)["xlakit"]["patch_level"]
    assert drift["patch set"]["expected"] == f"xlakit{level}" and drift["patch set"]["found"] == "stock"
    assert drift["torch git revision"]["expected"] == "21fec65781bebe867faf209f89bb687ffd236ca4"
    assert drift["torch_xla git revision"]["found"].startswith("unknown")  # stock wheels do not record it


def test_check_passes_on_the_pinned_stack(capsys):
    assert cli.main(["manifest", "--check", "--profile", "cpu-dev", "--pins", str(PINS)]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("torch ") and "check: ok against profile cpu-dev" in out.err


def test_json_output_is_the_manifest(capsys):
    assert cli.main(["manifest", "--json", "--profile", "cpu-dev", "--pins", str(PINS)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["schema"] == manifest.SCHEMA and printed["patches"]["patch_set"] == "stock"


def test_manifest_line_format(m):
    import torch
    import torch_xla

    line = xlakit.manifest_line(m)
    parts = line.split(" | ")
    assert parts[0] == f"torch {torch.__version__} git{torch.version.git_version[:7]}"
    assert parts[1] == f"torch_xla {torch_xla.__version__}"
    assert parts[2].startswith("libtpu ") and parts[3].startswith("jax ")
    assert parts[4:] == ["patches stock", f"CPU {m['runtime']['local_devices']}/{m['runtime']['global_devices']}",
                         "cpu-dev ok"]


def test_log_manifest_logs_the_row_and_json(caplog):
    logger = logging.getLogger("test.run")
    with caplog.at_level(logging.INFO, logger="test.run"):
        m = xlakit.log_manifest(logger, profile="cpu-dev", pins=PINS)
    messages = [r.getMessage() for r in caplog.records if r.name == "test.run"]
    assert messages[0] == f"xlakit manifest: {xlakit.manifest_line(m)}"
    assert json.loads(messages[1].removeprefix("xlakit manifest json: "))["torch"] == m["torch"]


def test_patched_build_info_is_read_from_the_binding(monkeypatch):
    patch_set = f"xlakit{pins.load(PINS)['xlakit']['patch_level']}"
    build = {"patch_set": patch_set, "patches": ["0001-add-build-info.patch"], "series_sha256": "ab" * 32,
             "patch_series_id": "xlakit3:" + "cd" * 16,
             "torch_xla_commit": "c04e61c3424142c0eebcc9e59984b9d8fced18c0",
             "xla_commit": "9a9aa0e11e4fcda8d6a9c3267dca6776ddbdb0ca"}
    fake = FakePatchedXLAC(features.xlac(), _xlakit_build_info=lambda: dict(build))
    monkeypatch.setattr(features, "xlac", lambda: fake)
    m = xlakit.manifest(profile="tpu", pins=PINS)
    # Regression: the patch series id the runtime checks cache entries against was not reported.
    assert m["patches"] == {k: build[k] for k in ("patch_set", "patches", "series_sha256", "patch_series_id")}
    assert m["torch_xla"]["commit"] == build["torch_xla_commit"]
    assert m["torch_xla"]["xla_git"] == build["xla_commit"]
    whats = {d["what"] for d in m["drift"]}
    assert not whats & {"patch set", "torch_xla git revision", "openxla git revision"}
    assert f"patches {patch_set}" in xlakit.manifest_line(m)


@pytest.mark.parametrize("found, spec, ok", [
    ("2.9.0+cu128", "2.9.0", True), ("2.9.1", "2.9.0", False), ("3.13.2", "3.13", True),
    ("3.11.7", ">=3.11", True), ("3.10.9", ">=3.11", False),
    ("0.0.37", {"floor": "0.0.36", "allowed": ["0.0.36", "0.0.37"]}, True),
    ("0.0.38", {"floor": "0.0.36", "allowed": ["0.0.36", "0.0.37"]}, False),
])
def test_pin_matching(found, spec, ok):
    assert pins.satisfies(found, spec) is ok


def test_profile_choice(monkeypatch):
    monkeypatch.delenv("XLAKIT_PROFILE", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert pins.choose_profile()[0] == "tpu"
    monkeypatch.setenv("XLAKIT_PROFILE", "cpu-dev")
    assert pins.choose_profile() == ("cpu-dev", "from XLAKIT_PROFILE")
    assert pins.choose_profile("tpu") == ("tpu", "given explicitly")
    monkeypatch.delenv("XLAKIT_PROFILE")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert pins.choose_profile()[0] == ("tpu" if pins.installed_version("libtpu") else "cpu-dev")


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(xlakit.PinsError, match="found only: cpu-dev, torchtpu, torchtpu-cpu, tpu"):
        xlakit.manifest(profile="gpu", pins=PINS)


def test_missing_pins_file_says_how_to_fix(tmp_path):
    with pytest.raises(xlakit.PinsError, match="reinstall xlakit"):
        pins.load(tmp_path / "nope.toml")


@pytest.mark.parametrize("command", ["manifest", "doctor"])
def test_pins_that_are_binary_or_a_folder_are_one_line_exit_2(tmp_path, command):
    # Regression: `--pins a.pt` (not UTF-8) ended in a UnicodeDecodeError traceback, `--pins DIR` in an
    # IsADirectoryError one, exit 1.
    binary = tmp_path / "a.pt"
    binary.write_bytes(b"PK\x03\x04\x80\x81 not text")
    env = {**os.environ, "PYTHONPATH": str(Path(xlakit.__file__).parents[1])}
    for given, says in ((binary, "found binary data"), (tmp_path, "found a folder")):
        run = subprocess.run([sys.executable, "-m", "xlakit", command, "--pins", str(given)], env=env,
                             capture_output=True, text=True, timeout=240)
        assert run.returncode == 2, run.stderr
        assert run.stderr.startswith(f"xlakit {command}: {given}: expected a TOML pins file, {says}"), run.stderr
        assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr


def test_the_package_reads_its_baked_pins_not_the_checkout(monkeypatch, tmp_path):
    assert pins.baked_path() == Path(xlakit.__file__).parent / "_pins.toml"
    baked = _pins_copy(tmp_path, 'torch = "2.9.0"', 'torch = "2.8.0"')
    monkeypatch.setattr(pins, "baked_path", lambda: baked)  # an installed copy that differs from the checkout
    m = xlakit.manifest(profile="cpu-dev")
    assert m["profile"]["pins"] == str(baked) and [d["what"] for d in m["drift"]] == ["torch"]


def test_an_untrusted_cache_folder_fails_the_check_with_its_fix(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path))
    monkeypatch.delenv("XLAKIT_CACHE_KEY", raising=False)
    assert xlakit.manifest(profile="cpu-dev", pins=PINS)["cache"]["folder"] == "owner-only"
    tmp_path.chmod(0o777)
    try:
        assert cli.main(["manifest", "--check", "--profile", "cpu-dev", "--pins", str(PINS)]) == 1
    finally:
        tmp_path.chmod(0o700)
    err = capsys.readouterr().err
    assert f"xlakit manifest --check: cache: {tmp_path} (owner " in err and f"fix: chmod 700 {tmp_path}" in err
