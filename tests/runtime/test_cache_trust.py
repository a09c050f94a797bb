"""Who may put entries into the persistent cache: folders other users can write are refused, with the fix.

Folders owned by another user are made by that user: a child process that
drops root (`setpriv`, like the permission tests) to uid 4242. Such children
keep CAP_DAC_READ_SEARCH only, so they can reach pytest's root-owned 0700
tmp_path without being able to write there.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import xlakit
from tests.support.fakes import FakeXLAC
from xlakit.runtime import features, cache_trust, compile_cache

OTHER = 4242
ROOT = str(Path(xlakit.__file__).resolve().parents[1])
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="making folders owned by another user needs root and setpriv")


def _as_user(code: str, *args: str, uid: int = OTHER, groups: str | None = None,
             env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    caps = "+dac_read_search"  # reach root's 0700 test folders; writing them stays refused
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}",
           f"--groups={groups}" if groups else "--clear-groups", f"--inh-caps={caps}", f"--ambient-caps={caps}",
           sys.executable, "-c", textwrap.dedent(code), *args]
    run_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env)


JUDGE = """
import dataclasses, json, sys
from xlakit.runtime import cache_trust
v = cache_trust.judge(sys.argv[1], trust_shared=sys.argv[2] == "1")
print(json.dumps({**dataclasses.asdict(v), "folder": str(v.folder)}))
"""


def _judge_as(uid: int, path: Path, *, trust_shared: bool = False, groups: str | None = None) -> dict:
    run = _as_user(JUDGE, str(path), "1" if trust_shared else "0", uid=uid, groups=groups)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.fixture
def public(tmp_path) -> Path:
    """A /tmp-style folder: everyone may create entries, nobody may remove another's (mode 1777)."""
    pub = tmp_path / "pub"
    pub.mkdir()
    pub.chmod(0o1777)
    return pub


@pytest.fixture
def enable(monkeypatch):
    """The real enable_persistent_cache, before any compilation, with torch_xla's own switch recorded."""
    import torch_xla.runtime as xr

    asked = []
    monkeypatch.setattr(features, "xlac", lambda: FakeXLAC(features._import_xlac()[0]))
    monkeypatch.setattr(xr, "initialize_cache", lambda path, readonly: asked.append(path))
    monkeypatch.delenv("XLAKIT_CACHE_TRUST_SHARED", raising=False)
    monkeypatch.delenv("XLAKIT_CACHE_KEY", raising=False)
    monkeypatch.setattr(compile_cache, "_shared_accepted", set())
    return xlakit.enable_persistent_cache


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.xla
def test_a_world_writable_folder_is_refused_naming_it_and_the_fix(enable, tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(xlakit.CacheFolderTrustError) as e:
        enable(folder)
    assert f"{folder} (owner root, group root, mode drwxrwxrwx 0777) is writable by every user" in str(e.value)
    assert f"fix: chmod o-w {folder}" in str(e.value)
    assert isinstance(e.value, PermissionError) and isinstance(e.value, xlakit.CompileCacheError)
    assert list(folder.iterdir()) == []  # nothing was created in it


@pytest.mark.xla
def test_a_world_writable_folder_above_is_refused_too(enable, tmp_path):
    above = tmp_path / "shared"
    above.mkdir()
    above.chmod(0o777)
    with pytest.raises(xlakit.CacheFolderTrustError, match=f"{above} .* is writable by every user.*chmod o-w {above}"):
        enable(above / "mine" / "cache")
    assert not (above / "mine").exists()


def test_the_cache_folder_itself_may_not_be_sticky_and_world_writable(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c").chmod(0o1777)
    verdict = cache_trust.judge(tmp_path / "c")
    assert not verdict.trusted and "its sticky bit does not stop others adding entries" in verdict.problem
    assert verdict.fix.endswith(f"or chmod 700 {tmp_path / 'c'} if nobody else uses it")


@pytest.mark.xla
@needs_root
def test_a_folder_another_user_made_is_refused(enable, public):
    run = _as_user("import os, sys; os.mkdir(sys.argv[1], 0o755); os.mkdir(sys.argv[2], 0o777)",
                   str(public / "theirs"), str(public / "theirs-open"))
    assert run.returncode == 0, run.stderr
    for folder in (public / "theirs", public / "theirs-open"):
        with pytest.raises(xlakit.CacheFolderTrustError) as e:
            enable(folder)
        assert f"{folder} (owner uid {OTHER}, group gid {OTHER}, mode" in str(e.value)
        assert f"is owned by uid {OTHER}, not by you or root" in str(e.value)
        assert "fix: use a folder you own (mkdir -m 700 <folder>)" in str(e.value)


@needs_root
def test_a_group_folder_is_accepted_only_with_trust_shared(public):
    team = public / "team"
    team.mkdir()
    os.chown(team, 1, 1)  # made by daemon (uid 1, primary group daemon) for its group
    team.chmod(0o2770)
    refused = _judge_as(OTHER, team, groups="1")
    assert refused["state"] == "untrusted"
    assert f"{team} (owner daemon, group daemon, mode drwxrws--- 2770) is owned by daemon" in refused["problem"]
    assert "pass trust_shared=True (or export XLAKIT_CACHE_TRUST_SHARED=1)" in refused["fix"]
    accepted = _judge_as(OTHER, team, groups="1", trust_shared=True)
    assert accepted["state"] == "shared-trusted"
    assert accepted["shared"] == [f"{team} is owned by daemon of group daemon", f"{team} is writable by group daemon"]
    # trust_shared trusts a group you belong to, nobody else
    outsider = _judge_as(OTHER, team, trust_shared=True)
    assert outsider["state"] == "untrusted" and "trust_shared" not in outsider["fix"]


@needs_root
def test_a_sticky_parent_with_a_user_owned_folder_is_accepted_for_that_user(public):
    run = _as_user("import os, sys; os.mkdir(sys.argv[1], 0o700)", str(public / "mine"))
    assert run.returncode == 0, run.stderr
    assert _judge_as(OTHER, public / "mine")["state"] == "owner-only"
    assert _judge_as(OTHER, public / "mine" / "not-yet" / "made")["state"] == "owner-only"
    public.chmod(0o777)  # the same parent without its sticky bit: others may rename "mine" away
    verdict = _judge_as(OTHER, public / "mine")
    assert verdict["state"] == "untrusted" and f"chmod o-w {public} (or chmod +t {public}" in verdict["fix"]


@pytest.mark.xla
@pytest.mark.slow
@needs_root
def test_another_user_caches_in_a_sticky_parent_with_owner_only_folders(public):
    """The whole path as a non-root user: enable in /tmp-style public/<own folder>, compile, look at the modes."""
    code = """
        import json, os, sys, torch, torch_xla, xlakit
        os.umask(0)  # xlakit's folders must not depend on the umask
        where = xlakit.enable_persistent_cache(sys.argv[1])
        (torch.arange(8, dtype=torch.float32, device=torch_xla.device()) * 2).sum().item()
        print(json.dumps({"where": str(where), "uid": os.geteuid()}))
    """
    home = public / "home"
    run = _as_user("import os, sys; os.mkdir(sys.argv[1], 0o700)", str(home))
    assert run.returncode == 0, run.stderr
    env = {"PJRT_DEVICE": "CPU", "HOME": str(home), "USER": "xlakit-test"}  # uid 4242 has no passwd entry
    run = _as_user(code, str(public / "mine" / "xla"), env=env, timeout=180)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    where = Path(out["where"])
    for folder in (public / "mine", public / "mine" / "xla", where):
        assert folder.stat().st_uid == OTHER and _mode(folder) == 0o700, folder
    key_file = where / compile_cache.KEY_FILE
    assert _mode(key_file) == 0o600
    entries = [p for p in where.iterdir() if p != key_file]
    assert entries, "torch_xla wrote no entry"
    # Stock torch_xla writes entries 0666 & ~umask (umask 0 here); on it, the 0700 folder is what keeps others out.
    assert {_mode(p) for p in entries} == {0o666}


@pytest.mark.xla
def test_trust_shared_accepts_your_groups_folder_logs_once_and_creates_group_readable(enable, tmp_path, caplog,
                                                                                     monkeypatch):
    team = tmp_path / "team"
    team.mkdir()
    os.chown(team, -1, os.getegid())
    team.chmod(0o2770)
    with pytest.raises(xlakit.CacheFolderTrustError, match=f"is writable by group .*chmod g-w {team}"):
        enable(team)
    saved = os.umask(0o077)  # group-readable whatever the umask
    try:
        with caplog.at_level(logging.WARNING, logger="xlakit.compile_cache"):
            where = enable(team, trust_shared=True)
            monkeypatch.setenv("XLAKIT_CACHE_TRUST_SHARED", "1")
            assert enable(team) == where
    finally:
        os.umask(saved)
    monkeypatch.delenv("XLAKIT_CACHE_TRUST_SHARED")
    monkeypatch.setenv("XLA_PERSISTENT_CACHE_PATH", str(where))
    assert compile_cache.folder_report()["folder"] == "shared-trusted"  # what this process accepted
    shared_logs = [r for r in caplog.records if "is shared (trust_shared)" in r.getMessage()]
    assert len(shared_logs) == 1 and f"{team} is writable by group" in shared_logs[0].getMessage()
    assert _mode(where) == 0o750 and _mode(where / compile_cache.KEY_FILE) == 0o640


@pytest.mark.xla
def test_folders_xlakit_creates_are_owner_only_whatever_the_umask(enable, tmp_path):
    saved = os.umask(0)
    try:
        where = enable(tmp_path / "a" / "b")
    finally:
        os.umask(saved)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", where):
        assert _mode(folder) == 0o700, folder
    assert _mode(where / compile_cache.KEY_FILE) == 0o600


@pytest.mark.xla
def test_readonly_checks_the_folder_too(enable, tmp_path):
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o757)
    with pytest.raises(xlakit.CacheFolderTrustError):
        enable(tmp_path / "open", readonly=True)


def test_a_link_is_judged_by_the_folder_it_leads_to(tmp_path):
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    (tmp_path / "link").symlink_to(tmp_path / "open")
    verdict = cache_trust.judge(tmp_path / "link" / "cache")
    assert not verdict.trusted and verdict.fix.startswith(f"chmod o-w {tmp_path / 'open'}")


# Regression (issue 19): a cache folder holding an entry other users can write, or another user's entry,
# was reported "owner-only" by `xlakit cache ls` and accepted by enable_persistent_cache.
def test_entries_others_can_rewrite_make_the_folder_untrusted(tmp_path, capsys):
    from xlakit.cli import main

    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    entry = folder / "1234"
    entry.write_bytes(b"entry")
    entry.chmod(0o600)
    (folder / "5678").symlink_to(tmp_path / "elsewhere")  # dangling: nothing is read through it
    assert cache_trust.judge(folder).state == "owner-only"
    entry.chmod(0o666)
    verdict = cache_trust.judge(folder)
    assert verdict.state == "untrusted" and f"{entry} (owner root" in verdict.problem
    assert "is writable by every user" in verdict.problem and verdict.fix == f"chmod go-w {entry}"
    assert main(["cache", "ls", str(folder)]) == 0
    assert f"folder {folder}: untrusted: {entry}" in capsys.readouterr().out
    entry.chmod(0o600)
    (tmp_path / "elsewhere").write_bytes(b"x")
    (tmp_path / "elsewhere").chmod(0o666)  # the link now leads to a file anyone can write
    verdict = cache_trust.judge(folder)
    assert not verdict.trusted and f"{folder / '5678'}" in verdict.problem


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user or group needs root")
def test_an_entry_another_user_owns_or_another_group_can_write_makes_the_folder_untrusted(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    (folder / "1234").write_bytes(b"entry")
    os.chown(folder / "1234", OTHER, OTHER)
    verdict = cache_trust.judge(folder)
    assert not verdict.trusted and f"is owned by uid {OTHER}, not by you or root" in verdict.problem
    os.chown(folder / "1234", 0, OTHER)
    (folder / "1234").chmod(0o620)  # writable by a group that is not root's own
    verdict = cache_trust.judge(folder)
    assert not verdict.trusted and f"is writable by group gid {OTHER}" in verdict.problem
    os.chown(folder / "1234", 0, 0)  # root's own group: what a stock runtime writes under umask 002
    assert cache_trust.judge(folder).state == "owner-only"
