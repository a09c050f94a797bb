"""Atomicity: kills, full disks and missing permissions never cost the previous checkpoint."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import xlakit

SAVER = textwrap.dedent("""
    import sys, torch, xlakit
    path, start = sys.argv[1], int(sys.argv[2])
    for version in range(start, start + 1000):
        state = {"version": version, "w": torch.full((4, 1 << 20), float(version))}
        xlakit.save(state, path)
        print(version, flush=True)
""")


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _assert_loads_whole(path) -> int:
    state = xlakit.load(path)
    plain = torch.load(path, map_location="cpu", weights_only=True)
    assert torch.equal(state["w"], torch.full((4, 1 << 20), float(state["version"])))
    assert plain["version"] == state["version"]
    return state["version"]


@pytest.mark.slow
def test_kill_9_at_random_moments_never_leaves_a_torn_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    xlakit.save({"version": 0, "w": torch.full((4, 1 << 20), 0.0)}, path)
    rng = random.Random(7)
    versions = []
    for trial in range(5):
        proc = _python(SAVER, str(path), str(1 + trial * 1000))
        assert proc.stdout.readline(), proc.communicate()[1]  # it is saving in a loop now
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        versions.append(_assert_loads_whole(path))
    # a later save removes what the killed ones left behind
    xlakit.save({"version": -1, "w": torch.full((4, 1 << 20), -1.0)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert len(set(versions)) > 1  # the kills landed on different saves


def test_leftovers_of_live_processes_are_not_touched(tmp_path):
    from xlakit.checkpoint.core import paths

    path = tmp_path / "ckpt.pt"
    mine = paths.temp_path(path)
    mine.write_bytes(b"in progress")
    dead = path.with_name(mine.name.replace(f".{os.getpid()}.", ".999999999."))
    dead.write_bytes(b"torn")
    other_host = path.with_name(".ckpt.pt.elsewhere.1.abcd1234.xlakit-tmp")
    other_host.write_bytes(b"theirs")
    assert paths.remove_stale_temps(path.parent, stem=path.name) == [dead]
    assert mine.exists() and other_host.exists() and not dead.exists()


def test_a_zombie_writer_counts_as_dead_and_its_leftovers_go(tmp_path):
    # A process that ended but was not yet reaped (a shell killed under a publisher, a parent that never
    # waits) writes nothing more: its temporaries are stale, and a follower of it stops.
    from xlakit.checkpoint.core import paths

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{ended.pid}/stat").read_bytes().rpartition(b")")[2].split()[0] != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert paths.pid_alive(live.pid) and not paths.pid_alive(ended.pid)
        path = tmp_path / "ckpt.pt"
        mine = paths.temp_path(path)
        left = {pid: path.with_name(mine.name.replace(f".{os.getpid()}.", f".{pid}.")) for pid in (live.pid, ended.pid)}
        for p in left.values():
            p.write_bytes(b"torn")
        assert paths.remove_stale_temps(path.parent, stem=path.name) == [left[ended.pid]]
    finally:
        live.kill()
        live.wait()
        ended.wait()


def test_disk_full_raises_clearly_and_keeps_previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    xlakit.save({"version": 0, "w": torch.zeros(10)}, path)
    code = textwrap.dedent("""
        import resource, sys, torch, xlakit
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # files of 1 MiB at most
        try:
            xlakit.save({"w": torch.ones(1 << 20)}, sys.argv[1])
        except OSError as e:
            print(type(e).__name__, e.errno, e, "|", " ".join(e.__notes__))
    """)
    proc = _python(code, str(path))
    out, err = proc.communicate(timeout=120)
    assert out.startswith(f"CheckpointWriteError {errno.EFBIG} "), out + err
    assert "no space for the checkpoint" in out and "previous checkpoint" in out
    assert torch.equal(xlakit.load(path)["w"], torch.zeros(10))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                    reason="root ignores folder permissions and setpriv is missing to drop that")
def test_permission_denied_raises_clearly_and_keeps_previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    xlakit.save({"w": torch.zeros(10)}, path)
    code = textwrap.dedent("""
        import sys, torch, xlakit
        try:
            xlakit.save({"w": torch.ones(10)}, sys.argv[1])
        except xlakit.CheckpointWriteError as e:
            print(e.errno, e)
    """)
    cmd = [sys.executable, "-c", code, str(path)]
    if os.geteuid() == 0:  # drop root's permission override so the mode bits apply
        caps = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *cmd]
    tmp_path.chmod(0o555)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    finally:
        tmp_path.chmod(0o755)
    assert out.startswith(f"{errno.EACCES} ") and "no permission to write" in out, out
    assert torch.equal(xlakit.load(path)["w"], torch.zeros(10))


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(xlakit.CheckpointWriteError, match=r"folder .*nope does not exist") as info:
        xlakit.save({"w": torch.zeros(1)}, tmp_path / "nope" / "c.pt")
    assert info.value.errno == errno.ENOENT
