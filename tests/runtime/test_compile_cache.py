"""The persistent cache helpers: runtime-keyed subfolders and the counters, on stock torch_xla."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import xlakit
from tests.support.fakes import FakeXLAC
from xlakit.runtime import compile_cache, features

pytestmark = pytest.mark.xla

CHILD = """
import json, sys, torch, torch_xla, xlakit
where = xlakit.enable_persistent_cache(sys.argv[1])
x = torch.arange(16, dtype=torch.float32, device=torch_xla.device())
(x * 3 + 1).sum().item()
print(json.dumps({"where": str(where), "stats": xlakit.cache_stats()}))
"""


KEY = {"device_type": "TPU", "platform_version": "PJRT C API\nTFRT TPU v6 lite", "torch_xla": "2.9.0",
       "torch_xla_commit": None, "xla_commit": "x" * 40, "torch_commit": "t" * 40, "patch_set": "stock",
       "patch_series_id": None}


def test_folder_name_is_readable_and_changes_with_the_runtime():
    name = compile_cache.cache_dir_name(KEY)
    assert name.startswith("tpu-stock-") and name == compile_cache.cache_dir_name(dict(KEY))
    for field, other in (("platform_version", "PJRT C API\nTFRT TPU v5 lite"), ("torch_xla_commit", "c04e61c"),
                         ("xla_commit", "y" * 40), ("patch_series_id", "xlakit3:" + "ab" * 32)):
        assert compile_cache.cache_dir_name({**KEY, field: other}) != name, field
    assert compile_cache.cache_dir_name({**KEY, "patch_set": "xlakit1"}).startswith("tpu-xlakit1-")


def test_key_describes_this_runtime():
    import torch_xla

    key = compile_cache.cache_key()
    assert key["device_type"] == "CPU" and key["patch_set"] == "stock"
    assert key["platform_version"] == torch_xla._XLAC._xla_get_platform_version()
    assert key["torch_xla"] == torch_xla.__version__


def test_key_carries_the_patched_runtimes_own_series_id(monkeypatch):
    # The id the C++ salts its keys with and writes into entries, read from the binary, never recomputed.
    series_id = "xlakit3:" + "cd" * 32
    monkeypatch.setattr(features, "build_info", lambda: {"patch_set": "xlakit3", "patch_series_id": series_id,
                                                          "torch_xla_commit": "c" * 40, "xla_commit": "x" * 40})
    key = compile_cache.cache_key()
    assert key["patch_series_id"] == series_id and key["patch_set"] == "xlakit3"
    assert compile_cache.cache_dir_name(key).startswith("cpu-xlakit3-")


@pytest.mark.slow
def test_enable_places_entries_in_a_keyed_subfolder_of_a_fresh_process(tmp_path):
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(Path(xlakit.__file__).parents[1]))
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cache")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    where = Path(out["where"])
    assert where.parent == (tmp_path / "cache").resolve() and where.name.startswith("cpu-stock-")
    assert json.loads((where / compile_cache.KEY_FILE).read_text())["patch_set"] == "stock"
    assert [p for p in where.iterdir() if p.name != compile_cache.KEY_FILE], "no cache entry was written"
    assert out["stats"] == {"path": str(where), "readonly": False, "hits": 0, "misses": 1,
                            "deserialize_failures": 0, "via": "torch_xla"}
    assert "install the xlakit wheels" in run.stderr  # stock builds are told their cache will not load


def test_enabling_after_the_first_compilation_is_refused(monkeypatch):
    import torch
    import torch_xla

    (torch.ones(2, device=torch_xla.device()) + 1).cpu()  # creates the computation cache
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH", raising=False)
    with pytest.raises(xlakit.CompileCacheError, match="before the first compilation"):
        xlakit.enable_persistent_cache("/nonexistent/never-created")
    assert "XLA_PERSISTENT_CACHE_PATH" not in os.environ


def test_readonly_creates_nothing(monkeypatch, tmp_path):
    import torch_xla.runtime as xr

    asked = []
    monkeypatch.setattr(features, "xlac", lambda: FakeXLAC(features._import_xlac()[0]))
    monkeypatch.setattr(xr, "initialize_cache", lambda path, readonly: asked.append((path, readonly)))
    where = xlakit.enable_persistent_cache(tmp_path / "shared", readonly=True)
    assert asked == [(str(where), True)] and not (tmp_path / "shared").exists()


def test_unwritable_folder_is_refused_naming_it(monkeypatch, tmp_path):
    monkeypatch.setattr(features, "xlac", lambda: FakeXLAC(features._import_xlac()[0]))
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(xlakit.CompileCacheError, match="lies below .*, which is a regular file"):
        xlakit.enable_persistent_cache(blocker)


def test_stats_read_the_counters(monkeypatch):
    import torch_xla.debug.metrics as met

    counters = {"PersistentCacheHit": 3, "PersistentCacheDeserializeFailure": 1}
    monkeypatch.setattr(met, "counter_value", counters.get)
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", "/cache/cpu-stock-0123")
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_READ_ONLY", raising=False)
    assert xlakit.cache_stats() == {"path": "/cache/cpu-stock-0123", "readonly": False, "hits": 3, "misses": 0,
                                    "deserialize_failures": 1, "via": "torch_xla"}


@pytest.fixture
def enable_here(monkeypatch):
    """The real enable_persistent_cache before any compilation; torch_xla's own switch is recorded, not flipped."""
    import torch_xla.runtime as xr

    monkeypatch.setattr(features, "xlac", lambda: FakeXLAC(features._import_xlac()[0]))
    monkeypatch.setattr(xr, "initialize_cache", lambda path, readonly: None)
    monkeypatch.delenv("XLAKIT_CACHE_TRUST_SHARED", raising=False)
    return xlakit.enable_persistent_cache


def test_a_key_gets_its_own_subfolder_named_without_revealing_it(enable_here, monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("XLAKIT_CACHE_KEY", raising=False)
    plain = enable_here(tmp_path)
    secret = "s3cret-" * 6
    monkeypatch.setenv("XLAKIT_CACHE_KEY", secret)
    with caplog.at_level("WARNING", logger="xlakit.compile_cache"):
        keyed = enable_here(tmp_path)
    monkeypatch.setenv("XLAKIT_CACHE_KEY", "another-" * 6)
    other = enable_here(tmp_path)
    assert len({plain, keyed, other}) == 3  # jobs with different keys, or none, never evict each other's entries
    recorded = json.loads((keyed / compile_cache.KEY_FILE).read_text())
    assert recorded["key_id"] == compile_cache.key_id(secret.encode()) and "key_id" not in json.loads(
        (plain / compile_cache.KEY_FILE).read_text())
    assert not any(secret in p.read_text() for p in tmp_path.rglob("*") if p.is_file())
    assert "XLAKIT_CACHE_KEY is set, but stock torch_xla writes and reads entries without a tag" in caplog.text
    assert secret not in caplog.text


def test_a_short_key_is_refused_before_anything_is_made(enable_here, monkeypatch, tmp_path):
    monkeypatch.setenv("XLAKIT_CACHE_KEY", "short")
    with pytest.raises(xlakit.CompileCacheError, match="holds 5 bytes, expected a secret of at least 32"):
        enable_here(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_folder_report_records_trust_and_authentication(monkeypatch, tmp_path):
    monkeypatch.delenv("XLAKIT_CACHE_KEY", raising=False)
    monkeypatch.delenv("XLA_PERSISTENT_CACHE_PATH", raising=False)
    assert compile_cache.folder_report()["folder"] is None
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(tmp_path))
    assert compile_cache.folder_report() == {"path": str(tmp_path), "folder": "owner-only", "authenticated": False,
                                             "via": "torch_xla"}
    monkeypatch.setenv("XLAKIT_CACHE_KEY", "k" * 32)
    report = compile_cache.folder_report()
    assert not report["authenticated"] and "stock torch_xla writes entries without a tag" in \
        report["why_not_authenticated"]
    tmp_path.chmod(0o777)
    try:
        report = compile_cache.folder_report()
    finally:
        tmp_path.chmod(0o700)
    assert report["folder"] == "untrusted" and report["fix"] == f"chmod 700 {tmp_path}"
