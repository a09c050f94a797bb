"""A CheckpointManager's local tier in one process (issue 26): intervals, retention, restore, preemption.

The multi-rank behaviour (peer copies between simulated hosts) is in
tests/multirank/test_local_tier.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import xlakit
from xlakit import _knobs
from xlakit.errors import ConfigurationError


def state(step: int) -> dict:
    return {"w": torch.full((1024,), float(step)), "step": step}


def parts(shm, step: int) -> list[str]:
    folder = shm / _knobs.get_host_id() / str(step)
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def local_steps(shm) -> list[int]:
    return sorted(int(p.name) for p in (shm / _knobs.get_host_id()).iterdir() if p.is_dir())


def test_local_and_persistent_saves_keep_their_own_interval_and_retention(tmp_path):
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=2, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=5, max_to_keep=1, local=tier) as mgr:
        due = [s for s in range(1, 11) if mgr.should_save(s) and mgr.save(s, state(s))]
        assert due == [2, 4, 5, 6, 8, 10]
        assert mgr.all_steps() == [10]  # persistent: every 5, max_to_keep=1
        assert local_steps(shm) == [8, 10]  # local: every 2, keep=2
        assert parts(shm, 10) == ["part-00000-of-00001.pt"]
        assert mgr.local.last_error is None
        assert 0 < mgr.local.bytes_used() < 3 * 5000  # two steps of one small part each, nothing else
        # The local part is an ordinary xlakit file, readable (and verified) by xlakit.load.
        assert xlakit.load(shm / _knobs.get_host_id() / "8" / "part-00000-of-00001.pt")["step"] == 8


def test_restore_takes_the_newest_step_of_any_tier(tmp_path):
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=3, local=tier) as mgr:
        for s in range(1, 8):
            mgr.save(s, state(s))
        assert mgr.restore()["step"] == 7
        assert mgr.local.restored_from["parts"] == {0: "local"}
        assert mgr.restore(3)["step"] == 3  # only the persistent tier holds it now
        assert mgr.local.restored_from["parts"] == {0: "persistent"}
        template = {"w": torch.zeros(1024), "step": 0}
        got = mgr.restore(6, template=template)  # filled in place
        assert got["step"] == 6 and template["w"][0] == 6.0 and mgr.local.restored_from["parts"] == {0: "local"}
        with pytest.raises(FileNotFoundError, match="no tier holds step 4"):
            mgr.restore(4)


def test_a_damaged_local_part_is_named_and_the_persistent_step_read(tmp_path, caplog):
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=2, local=tier) as mgr:
        for s in range(1, 5):
            mgr.save(s, state(s))
        part = shm / _knobs.get_host_id() / "4" / "part-00000-of-00001.pt"
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0x01
        part.write_bytes(bytes(data))
        got = mgr.restore()
        assert got["step"] == 4 and torch.equal(got["w"], state(4)["w"])
        report = mgr.local.restored_from
        assert report["parts"] == {0: "persistent"} and str(part) in report["damaged"][0]
        assert any("is not trusted" in r.message and str(4) in r.message for r in caplog.records)


def test_a_torn_local_part_falls_back_to_an_older_local_step(tmp_path):
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=10, local=tier) as mgr:
        for s in range(1, 5):
            mgr.save(s, state(s))
        part = shm / _knobs.get_host_id() / "4" / "part-00000-of-00001.pt"
        os.truncate(part, part.stat().st_size // 2)  # a partial copy
        assert mgr.restore()["step"] == 3
        assert mgr.local.restored_from["step"] == 3 and len(mgr.local.restored_from["damaged"]) == 1


def test_a_rollback_retires_the_newer_local_steps_too(tmp_path):
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=3)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=2, local=tier) as mgr:
        for s in range(1, 6):
            mgr.save(s, state(s))
        mgr.restore(2)
        mgr.retire_steps_after(2)
        assert local_steps(shm) == []  # the local steps 3-5 are after the rollback point
        assert mgr.restore()["step"] == 2
        mgr.save(3, state(30))
        assert mgr.restore()["w"][0] == 30.0


def test_preemption_saves_the_local_tier_first_then_the_persistent_step(tmp_path):
    # The choice (docs/manager.md): on SIGTERM the agreed step goes to the local tier first (seconds),
    # then to the persistent tier with what is left of the grace.
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=100, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=100, local=tier) as mgr:
        mgr.install_preemption_handler(grace_s=30)
        assert not mgr.should_save(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.should_save(2)
        assert mgr.save(2, state(2))
        assert mgr.reached_preemption(2)
        assert mgr.all_steps() == [2] and local_steps(shm) == [2]
        local = (shm / _knobs.get_host_id() / "2" / "part-00000-of-00001.pt").stat().st_mtime_ns
        persistent = (tmp_path / "ckpt" / "2" / "ckpt.pt").stat().st_mtime_ns
        assert local <= persistent


def test_options_are_checked_when_built(monkeypatch):
    with pytest.raises(ValueError, match="persistent tier"):
        xlakit.LocalTier("gs://bucket/shm")
    with pytest.raises(ValueError, match="keep"):
        xlakit.LocalTier("/dev/shm/x", keep=0)
    with pytest.raises(ValueError, match="interval_steps"):
        xlakit.LocalTier("/dev/shm/x", interval_steps=0)
    monkeypatch.setenv(_knobs.HOST_ID, "../evil")
    with pytest.raises(ConfigurationError, match="XLAKIT_HOST_ID"):
        _knobs.get_host_id()
    monkeypatch.setenv(_knobs.HOST_ID, "host-7")
    assert _knobs.get_host_id() == "host-7"


def test_a_dcp_manager_refuses_a_local_tier(tmp_path):
    with pytest.raises(ValueError, match="layout='dcp'"):
        xlakit.CheckpointManager(tmp_path / "ckpt", layout="dcp", local=xlakit.LocalTier(tmp_path / "shm"))
    with xlakit.CheckpointManager(tmp_path / "ckpt") as mgr:  # the refused manager let go of the folder
        assert mgr.all_steps() == []


def test_each_part_goes_to_the_same_position_on_the_next_hosts():
    from xlakit.checkpoint.peer_copy import peers_of

    two = ["a", "a", "b", "b"]
    assert peers_of(two, 1) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert peers_of(two, 5) == peers_of(two, 1)  # at most the other hosts
    assert peers_of(two, 0) == {r: [] for r in range(4)}
    three = ["a", "b", "c", "a", "b", "c"]  # hosts ordered by their lowest rank
    assert peers_of(three, 2) == {0: [1, 2], 1: [2, 0], 2: [0, 1], 3: [4, 5], 4: [5, 3], 5: [3, 4]}
    uneven = ["a", "a", "a", "b"]
    assert peers_of(uneven, 1) == {0: [3], 1: [3], 2: [3], 3: [0]}
    assert peers_of(["a", "a"], 1) == {0: [], 1: []}  # one host: no copy to make


def test_a_copy_that_arrived_unlike_what_its_sender_read_is_not_kept(tmp_path):
    from xlakit.checkpoint import paths
    from xlakit.checkpoint.peer_copy import Receive, settle

    good, bad = (Receive(source, tmp_path / f"part-{source}.pt", 4) for source in (1, 2))
    for r in (good, bad):
        r.tmp = paths.temp_path(r.path)
        r.tmp.write_bytes(b"data")
        r.got = "0123456789abcdef"
    settle([good, bad], {1: "0123456789abcdef", 2: "fedcba9876543210"})
    assert good.path.read_bytes() == b"data" and good.error is None
    assert not bad.path.exists() and "was not kept" in bad.error and "fedcba9876543210" in bad.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-1.pt"]  # no temporary left
