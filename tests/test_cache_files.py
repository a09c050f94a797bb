"""`xlakit cache ls|verify|prune` on a folder of real envelopes."""

from __future__ import annotations

import json

import pytest

from xlakit import _C
from xlakit.cli import main

IDENTITY = dict(platform_name="tpu", platform_version="v1", patch_series_id="xlakit1:abc")
ARGS = ["--platform-name", "tpu", "--platform-version", "v1", "--patch-series-id", "xlakit1:abc"]


@pytest.fixture
def cache(tmp_path):
    def entry(version="v1", kind="executable", payload=b"exe" * 100):
        return _C.encode_entry(payload, kind=kind, torch_xla_revision="c04e61c",
                               **{**IDENTITY, "platform_version": version})

    (tmp_path / "111").write_bytes(entry())
    (tmp_path / "222").write_bytes(entry(kind="hlo_module"))
    (tmp_path / "333").write_bytes(entry()[:-5])  # truncated
    corrupt = bytearray(entry())
    corrupt[-1] ^= 0xFF
    (tmp_path / "444").write_bytes(bytes(corrupt))
    (tmp_path / "555").write_bytes(entry(version="v0"))  # older libtpu
    (tmp_path / "666").write_bytes(b"\x08\x01stock torch_xla entry")
    (tmp_path / f"{_C.TEMP_PREFIX}777.123.0").write_bytes(b"XLKC")
    return tmp_path


def _statuses(capsys, *argv) -> tuple[int, dict[str, str]]:
    rc = main([*argv, "--json"])
    return rc, {r["name"]: r["status"] for r in json.loads(capsys.readouterr().out)}


def test_ls_reads_headers_only(cache, capsys):
    rc, st = _statuses(capsys, "cache", "ls", str(cache))
    assert rc == 0
    # The flipped payload byte is invisible without reading the payload.
    assert st["111"] == st["222"] == st["444"] == st["555"] == "ok"
    assert st["333"] == "truncated" and st["666"] == "foreign"
    assert st[f"{_C.TEMP_PREFIX}777.123.0"] == "temporary"


def test_verify_checksums_and_checks_identity(cache, capsys):
    rc, st = _statuses(capsys, "cache", "verify", str(cache), *ARGS)
    assert rc == 1
    assert st["111"] == st["222"] == "ok"
    assert st["444"] == "checksum_mismatch"
    assert st["555"] == "platform_version_mismatch"


def test_verify_of_a_clean_cache_exits_zero(tmp_path, capsys):
    (tmp_path / "1").write_bytes(_C.encode_entry(b"x", kind="executable", torch_xla_revision="r", **IDENTITY))
    assert main(["cache", "verify", str(tmp_path)]) == 0
    assert "1 files, " in capsys.readouterr().out


def test_prune_removes_what_the_runtime_would_reject(cache, capsys):
    assert main(["cache", "prune", str(cache), *ARGS]) == 0
    assert sorted(p.name for p in cache.iterdir()) == ["111", "222", "666"]
    assert main(["cache", "prune", str(cache), "--foreign"]) == 0
    assert sorted(p.name for p in cache.iterdir()) == ["111", "222"]


def test_prune_dry_run_removes_nothing(cache, capsys):
    before = sorted(p.name for p in cache.iterdir())
    assert main(["cache", "prune", str(cache), "--dry-run"]) == 0
    assert sorted(p.name for p in cache.iterdir()) == before
    assert "would remove: 333 (truncated)" in capsys.readouterr().out


def test_missing_folder_is_one_line_error(tmp_path, capsys):
    assert main(["cache", "ls", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_partial_identity_is_an_error(cache, capsys):
    assert main(["cache", "verify", str(cache), "--platform-name", "tpu"]) == 2
    assert "pass all of" in capsys.readouterr().err
