"""`xlakit cache ls|verify|prune` on a folder of real envelopes, and on folders that are not (only) a cache."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import xlakit
from xlakit import _C
from xlakit.runtime import cache_files, compile_cache
from xlakit.runtime.compile_cache import KEY_FILE
from xlakit.cli import main
from tests.support.cli import as_a_user

IDENTITY = dict(platform_name="tpu", platform_version="v1", patch_series_id="xlakit1:abc")
ARGS = ["--platform-name", "tpu", "--platform-version", "v1", "--patch-series-id", "xlakit1:abc"]
STOCK_ENTRY = b"\x08\x01stock torch_xla entry"
OLD = time.time() - 2 * cache_files.TEMP_MIN_AGE_S
KEY_JSON = json.dumps({"patch_set": "stock", "platform_version": "cpu"})


def _entry(version="v1", kind="executable", payload=b"exe" * 100, key=None) -> bytes:
    return _C.encode_entry(payload, kind=kind, torch_xla_revision="c04e61c", key=key,
                           **{**IDENTITY, "platform_version": version})


@pytest.fixture
def cache(tmp_path):
    (tmp_path / "111").write_bytes(_entry())
    (tmp_path / "222").write_bytes(_entry(kind="hlo_module"))
    (tmp_path / "333").write_bytes(_entry()[:-5])  # truncated
    corrupt = bytearray(_entry())
    corrupt[-1] ^= 0xFF
    (tmp_path / "444").write_bytes(bytes(corrupt))
    (tmp_path / "555").write_bytes(_entry(version="v0"))  # older libtpu
    (tmp_path / "666").write_bytes(STOCK_ENTRY)
    temp = tmp_path / f"{_C.TEMP_PREFIX}777.host.123.0.0123456789abcdef"
    temp.write_bytes(b"XLKC")
    os.utime(temp, (OLD, OLD))  # left by a writer killed long ago
    return tmp_path


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (None if p.is_dir() or p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*"))}


def _statuses(capsys, *argv) -> tuple[int, dict[str, str]]:
    rc = main([*argv, "--json"])
    return rc, {r["name"]: r["status"] for r in json.loads(capsys.readouterr().out)["entries"]}


def test_ls_reads_headers_only(cache, capsys):
    rc, st = _statuses(capsys, "cache", "ls", str(cache))
    assert rc == 0
    # The flipped payload byte is invisible without reading the payload.
    assert st["111"] == st["222"] == st["444"] == st["555"] == "ok"
    assert st["333"] == "truncated" and st["666"] == "foreign"
    assert st[f"{_C.TEMP_PREFIX}777.host.123.0.0123456789abcdef"] == "temporary"


def test_verify_checksums_and_checks_identity(cache, capsys):
    rc, st = _statuses(capsys, "cache", "verify", str(cache), *ARGS)
    assert rc == 1
    assert st["111"] == st["222"] == "ok"
    assert st["444"] == "checksum_mismatch"
    assert st["555"] == "platform_version_mismatch"


def test_verify_of_a_clean_cache_made_by_xlakit_exits_zero(tmp_path, capsys):
    # Regression: the key file enable_persistent_cache writes was counted as a foreign, unloadable entry.
    (tmp_path / "1").write_bytes(_entry())
    (tmp_path / xlakit.runtime.compile_cache.KEY_FILE).write_text(KEY_JSON)
    assert main(["cache", "verify", str(tmp_path)]) == 0
    assert "2 files, " in capsys.readouterr().out


def test_prune_removes_what_the_runtime_would_reject(cache, capsys):
    assert main(["cache", "prune", str(cache), *ARGS]) == 0
    assert sorted(p.name for p in cache.iterdir()) == ["111", "222", "666"]


def test_prune_dry_run_removes_nothing(cache, capsys):
    before = _tree(cache)
    assert main(["cache", "prune", str(cache), "--dry-run"]) == 0
    assert _tree(cache) == before
    assert "would remove: 333 (truncated)" in capsys.readouterr().out


@pytest.fixture
def mixed(tmp_path):
    """A folder that is not only a cache: what a user may point prune at by mistake."""
    (tmp_path / "__init__.py").write_bytes(b"")
    (tmp_path / ".gitkeep").write_bytes(b"")
    (tmp_path / "cache.lock").write_bytes(b"1\n")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "README").write_text("notes\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "9").write_bytes(_entry()[:-1])  # a broken entry, but in a subfolder
    (tmp_path / "12345").write_bytes(STOCK_ENTRY)  # a stock torch_xla entry
    (tmp_path / "678").write_bytes(b"")  # entry-shaped names too short for a magic
    (tmp_path / "679").write_bytes(b"XLK")
    (tmp_path / "notes.bin").write_bytes(_entry()[:-1])  # an envelope, but not named like an entry
    outside = tmp_path / "sub" / "target"
    outside.write_bytes(_entry()[:-1])
    (tmp_path / "4242").symlink_to(outside)  # a link never written by the runtime
    return tmp_path


def test_prune_leaves_what_it_cannot_identify_alone(mixed, capsys):
    # Regression: prune deleted every 0-3 byte file (__init__.py, .gitkeep, locks) as a truncated entry.
    before = _tree(mixed)
    assert main(["cache", "prune", str(mixed)]) == 0
    assert main(["cache", "prune", str(mixed), *ARGS]) == 0
    assert _tree(mixed) == before
    assert "0 of 9 files removed" in capsys.readouterr().out
    rc, st = _statuses(capsys, "cache", "verify", str(mixed))
    strangers = ("__init__.py", ".gitkeep", "cache.lock", "empty", "README", "notes.bin")
    assert {n: st[n] for n in strangers} == dict.fromkeys(strangers, "other")
    assert st["12345"] == st["678"] == st["679"] == "foreign"
    assert st["4242"] == st["sub"] == "other"  # a link and a subfolder: listed, never read nor removed


# Regression (issue 19): `cache ls` and `verify` left out a link or a subfolder named like an entry,
# although both are documented as listed (`other`).
def test_links_and_subfolders_named_like_entries_are_listed_as_other(cache, capsys):
    (cache / "888").mkdir()
    (cache / "999").symlink_to(cache / "111")
    for command in ("ls", "verify"):
        rc, st = _statuses(capsys, "cache", command, str(cache))
        assert st["888"] == st["999"] == "other", (command, st)
    assert main(["cache", "ls", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "a subfolder named like an entry" in out and "a link named like an entry" in out
    assert main(["cache", "prune", str(cache)]) == 0
    assert (cache / "888").is_dir() and (cache / "999").is_symlink()


def test_foreign_is_refused_outside_a_folder_xlakit_made(mixed, capsys):
    before = _tree(mixed)
    assert main(["cache", "prune", str(mixed), "--foreign"]) == 2
    assert f"only in a folder xlakit.enable_persistent_cache made (it holds {xlakit.runtime.compile_cache.KEY_FILE})" in \
        capsys.readouterr().err
    assert _tree(mixed) == before


def test_foreign_removes_only_entry_named_files_in_a_folder_xlakit_made(mixed, capsys):
    (mixed / xlakit.runtime.compile_cache.KEY_FILE).write_text(KEY_JSON)
    assert main(["cache", "prune", str(mixed), "--foreign"]) == 0
    left = {p.name for p in mixed.iterdir()}
    assert not left & {"12345", "678", "679"}
    assert left == {"__init__.py", ".gitkeep", "cache.lock", "empty", "README", "sub", "notes.bin", "4242",
                    xlakit.runtime.compile_cache.KEY_FILE}
    assert (mixed / "sub" / "target").exists() and (mixed / "sub" / "9").exists()


def test_max_bytes_evicts_only_files_it_identifies_as_entries(mixed, capsys):
    # Regression (a helper's audit): --max-bytes removed every file named like an entry (a decimal number, 64 hex
    # digits) in any folder, content unchecked: the very files --foreign refuses as "may be another program's".
    (mixed / ("a" * 64)).write_bytes(b"my notes\n")
    (mixed / "1000").write_bytes(_entry())  # an envelope: the cache's, whatever the folder
    os.utime(mixed / "1000", (OLD, OLD))
    before = _tree(mixed)
    assert main(["cache", "prune", str(mixed), "--max-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert "removed: 1000 (least recently used" in out and "kept: 4 file(s) named like entries without" in out
    del before["1000"]
    assert _tree(mixed) == before
    # In a folder enable_persistent_cache made, a stock torch_xla's entries are the cache's too.
    (mixed / KEY_FILE).write_text(KEY_JSON)
    assert main(["cache", "prune", str(mixed), "--max-bytes", "0"]) == 0
    assert not {p.name for p in mixed.iterdir()} & {"12345", "678", "679", "a" * 64}


@pytest.mark.parametrize("action", ["ls", "verify", "prune"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(cache, monkeypatch, capsys, action):
    # Regression: `xlakit cache prune ""` (an unset variable) pruned the current directory.
    monkeypatch.chdir(cache)
    before = _tree(cache)
    assert main(["cache", action, ""]) == 2
    assert "expected a cache folder, found an empty path" in capsys.readouterr().err
    assert _tree(cache) == before


def test_missing_folder_is_one_line_error(tmp_path, capsys):
    assert main(["cache", "ls", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["ls", "verify", "prune", "explain"])
def test_a_folder_you_cannot_list_is_one_line_and_its_fix_exit_2(tmp_path, action):
    # Regression: ls, verify and prune printed a PermissionError traceback and exited 1 (from verify: "an entry
    # is not loadable"); explain exited 0 with "no key records to compare".
    folder = tmp_path / "c4"
    folder.mkdir()
    (folder / "111").write_bytes(_entry())
    env = {**os.environ, "PYTHONPATH": str(Path(xlakit.__file__).parents[1])}
    folder.chmod(0)
    try:
        run = subprocess.run([*as_a_user(), sys.executable, "-m", "xlakit", "cache", action, str(folder)], env=env,
                             capture_output=True, text=True, timeout=120)
    finally:
        folder.chmod(0o700)
    first, *hints = run.stderr.splitlines()
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stdout == "", run.stderr
    assert first == f"xlakit cache: {folder}: permission denied: you cannot list this folder", run.stderr
    assert hints == [f"  chmod u+rx {folder} (u+rwx to prune it), or run this as its owner"], run.stderr
    assert (folder / "111").exists()


def test_partial_identity_is_an_error(cache, capsys):
    assert main(["cache", "verify", str(cache), "--platform-name", "tpu"]) == 2
    assert "pass all of" in capsys.readouterr().err
    assert main(["cache", "verify", str(cache), "--torch-xla-revision", "c04e61c"]) == 2
    assert "only together with" in capsys.readouterr().err


def test_verify_and_prune_check_the_torch_xla_revision_when_given(tmp_path, capsys):
    # Regression: the revision was written into every entry and `cache verify` never compared it.
    (tmp_path / "1").write_bytes(_entry())
    rc, st = _statuses(capsys, "cache", "verify", str(tmp_path), *ARGS, "--torch-xla-revision", "d15ea5e")
    assert rc == 1 and st["1"] == "torch_xla_revision_mismatch"
    rc, st = _statuses(capsys, "cache", "verify", str(tmp_path), *ARGS, "--torch-xla-revision", "c04e61c")
    assert rc == 0 and st["1"] == "ok"
    assert main(["cache", "prune", str(tmp_path), *ARGS, "--torch-xla-revision", "c04e61c"]) == 0
    assert (tmp_path / "1").exists()
    assert main(["cache", "prune", str(tmp_path), *ARGS, "--torch-xla-revision", "d15ea5e"]) == 0
    assert "removed: 1 (torch_xla_revision_mismatch)" in capsys.readouterr().out and not (tmp_path / "1").exists()


def test_a_killed_writers_temporary_is_kept_while_young_and_pruned_when_old(tmp_path, capsys):
    # The real atomic writer, killed mid-write by SIGXFSZ (Python ignores it; the child restores the default).
    code = textwrap.dedent("""
        import resource, signal, sys
        from xlakit import _C
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        _C.write_file_atomic(sys.argv[1], b"x" * 65536)
    """)
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "1234")], timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(Path(xlakit.__file__).parents[1])))
    assert run.returncode == -signal.SIGXFSZ
    (temp,) = tmp_path.iterdir()
    assert main(["cache", "prune", str(tmp_path)]) == 0
    assert f"1 of 1 files removed" not in capsys.readouterr().out and temp.exists()
    os.utime(temp, (OLD, OLD))
    assert main(["cache", "prune", str(tmp_path)]) == 0
    assert f"removed: {temp.name} (temporary)" in capsys.readouterr().out and not temp.exists()


def test_an_entry_replaced_after_it_was_judged_is_kept(cache, monkeypatch, capsys):
    judge = cache_files.classify
    fresh = _entry(payload=b"fresh")

    def classify_then_a_writer_renames(path, st, **kw):  # a writer's rename lands between judging and unlinking
        report = judge(path, st, **kw)
        if path.name == "444":
            (cache / "new").write_bytes(fresh)
            os.replace(cache / "new", path)
        return report

    monkeypatch.setattr(cache_files, "classify", classify_then_a_writer_renames)
    assert main(["cache", "prune", str(cache)]) == 0
    assert "changed since it was checked, kept: 444" in capsys.readouterr().out
    assert (cache / "444").read_bytes() == fresh


FNV_OFFSET, FNV_PRIME = 14695981039346656037, 1099511628211


def _sparse_entry(path: Path, payload_bytes: int) -> None:
    """A valid envelope whose payload is `payload_bytes` zeros, as a sparse file (no disk, no memory)."""
    head = _entry(payload=b"")[:-16] + payload_bytes.to_bytes(8, "little")
    h = FNV_OFFSET
    for c in head:
        h = ((h ^ c) * FNV_PRIME) % 2**64
    h = h * pow(FNV_PRIME, payload_bytes, 2**64) % 2**64  # a zero byte only multiplies by the prime
    with open(path, "wb") as f:
        f.write(head + h.to_bytes(8, "little"))
        f.truncate(len(head) + 8 + payload_bytes)


@pytest.mark.slow
def test_verify_and_prune_stream_a_large_entry_in_bounded_memory(tmp_path):
    # Regression: verify/prune read each file whole into memory.
    size = 1 << 30
    _sparse_entry(tmp_path / "777", size)
    code = textwrap.dedent("""
        import json, resource, sys
        from xlakit.cli import main
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rcs = [main(["cache", "verify", sys.argv[1], "--json"]), main(["cache", "prune", sys.argv[1]])]
        print(json.dumps({"rcs": rcs, "base_kib": base,
                          "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
    """)
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(Path(xlakit.__file__).parents[1])))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    listed = json.loads(run.stdout[:run.stdout.index("\n}") + 2])
    assert listed["entries"][0]["status"] == "ok"  # every byte was hashed
    assert out["rcs"] == [0, 0] and (tmp_path / "777").exists()
    assert (out["peak_kib"] - out["base_kib"]) * 1024 < size // 64, out


KEY = "k" * 32


@pytest.fixture
def keyed(tmp_path):
    from tests.runtime.test_cext_envelope import _tampered

    payload = b"exe" * 100
    good = _entry(payload=payload, key=KEY.encode())
    (tmp_path / "1").write_bytes(good)
    (tmp_path / "2").write_bytes(_tampered(good, len(payload)))  # altered, FNV checksum recomputed
    (tmp_path / "3").write_bytes(_entry(payload=payload))  # plain: written without the key
    (tmp_path / "4").write_bytes(_entry(payload=payload, key=b"o" * 32))  # another job's key
    return tmp_path


def test_with_the_key_verify_refuses_what_the_keyed_runtime_refuses(keyed, capsys, monkeypatch):
    monkeypatch.setenv("XLAKIT_CACHE_KEY", KEY)
    rc, st = _statuses(capsys, "cache", "verify", str(keyed))
    assert rc == 1 and st == {"1": "ok", "2": "bad_tag", "3": "unauthenticated", "4": "bad_tag"}
    assert main(["cache", "verify", str(keyed)]) == 1
    assert "4 entries (3 not loadable)" in capsys.readouterr().out
    # A folder not made for this key may hold other jobs' good entries (the PJRT wrapper keeps every key in
    # one folder): prune keeps what is refused only for its tag.
    assert main(["cache", "prune", str(keyed)]) == 0
    assert sorted(p.name for p in keyed.iterdir()) == ["1", "2", "3", "4"]
    assert capsys.readouterr().out.count("kept: ") == 3
    # In the folder enable_persistent_cache made for this key they are positively not this key's: removed.
    (keyed / KEY_FILE).write_text(json.dumps({"patch_set": "xlakit3", "platform_version": "v",
                                              "key_id": compile_cache.key_id(KEY.encode())}))
    assert main(["cache", "prune", str(keyed)]) == 0
    assert sorted(p.name for p in keyed.iterdir()) == ["1", KEY_FILE]


def test_without_the_key_tags_are_not_checked_and_say_so(keyed, capsys, monkeypatch):
    monkeypatch.delenv("XLAKIT_CACHE_KEY", raising=False)
    assert main(["cache", "verify", str(keyed), "--json"]) == 0
    entries = {e["name"]: e for e in json.loads(capsys.readouterr().out)["entries"]}
    assert entries["2"]["status"] == "ok" and "tag not checked" in entries["2"]["message"]
    assert entries["3"]["message"] == ""  # a plain entry carries no tag to check


def test_a_short_key_is_refused_without_showing_it(keyed, capsys, monkeypatch):
    monkeypatch.setenv("XLAKIT_CACHE_KEY", "hunter2")
    assert main(["cache", "verify", str(keyed)]) == 2
    err = capsys.readouterr().err
    assert "XLAKIT_CACHE_KEY holds 7 bytes, expected a secret of at least 32" in err and "hunter2" not in err


def test_ls_says_who_can_put_entries_into_the_folder(cache, capsys):
    assert main(["cache", "ls", str(cache)]) == 0
    assert capsys.readouterr().out.startswith(f"folder {cache}: owner-only")
    cache.chmod(0o777)
    try:
        assert main(["cache", "ls", str(cache), "--json"]) == 0
    finally:
        cache.chmod(0o700)
    folder = json.loads(capsys.readouterr().out)["folder"]
    assert folder["state"] == "untrusted" and folder["fix"] == f"chmod 700 {cache}"


def test_the_key_variable_is_the_one_the_runtime_reads():
    assert xlakit._knobs.CACHE_KEY == _C.CACHE_KEY_ENV
