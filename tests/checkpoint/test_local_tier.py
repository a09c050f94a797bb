"""A CheckpointManager's local tier in one process (issue 26): intervals, retention, restore, preemption.

The multi-rank behaviour (peer copies between simulated hosts) is in
tests/multirank/test_local_tier.py.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal

import pytest
import torch

import xlakit
from xlakit import _knobs
from xlakit.checkpoint.tier.local_tier import run_name
from xlakit.errors import ConfigurationError


def state(step: int) -> dict:
    return {"w": torch.full((1024,), float(step)), "step": step}


def host_dir(shm, ckpt: str = "ckpt"):
    """This host's folder of the run whose persistent folder is `<shm's parent>/<ckpt>`."""
    return shm / run_name(shm.parent / ckpt) / _knobs.get_host_id()


def parts(shm, step: int) -> list[str]:
    folder = host_dir(shm) / str(step)
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def local_steps(shm, ckpt: str = "ckpt") -> list[int]:
    return sorted(int(p.name) for p in host_dir(shm, ckpt).iterdir() if p.is_dir())


def test_local_and_persistent_saves_keep_their_own_interval_and_retention(tmp_path):
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=2, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=5, max_to_keep=1, local=tier) as mgr:
        due = [s for s in range(1, 11) if mgr.should_save(s) and mgr.save(s, state(s))]
        assert due == [2, 4, 5, 6, 8, 10]
        assert mgr.all_steps() == [10]  # persistent: every 5, max_to_keep=1
        assert local_steps(shm) == [8, 10]  # local: every 2, keep=2
        assert parts(shm, 10) == ["part-00000-of-00001.pt", "xlakit-local-step.json"]
        assert mgr.local.last_error is None
        assert 0 < mgr.local.bytes_used() < 3 * 5000  # two steps of one small part each, nothing else
        # The local part is an ordinary xlakit file, readable (and verified) by xlakit.load.
        part = xlakit.load(host_dir(shm) / "8" / "part-00000-of-00001.pt")
        assert part["state"]["step"] == 8 and part["xlakit-local-part"] == {"step": 8, "rank": 0, "world": 1}


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
        # Issue 32: a persistent part's "host" was the persistent folder's path.
        assert mgr.local.restored_from["hosts"] == {0: None}
        assert mgr.local.restored_from["persistent"] == str(tmp_path / "ckpt")
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
        part = host_dir(shm) / "4" / "part-00000-of-00001.pt"
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
        part = host_dir(shm) / "4" / "part-00000-of-00001.pt"
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
        local = (host_dir(shm) / "2" / "part-00000-of-00001.pt").stat().st_mtime_ns
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
    from xlakit.checkpoint.tier.peer_copy import peers_of

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
    from xlakit.checkpoint.core import paths
    from xlakit.checkpoint.tier.peer_copy import Receive, settle

    good, bad = (Receive(source, tmp_path / f"part-{source}.pt", 4) for source in (1, 2))
    for r in (good, bad):
        r.tmp = paths.temp_path(r.path)
        r.tmp.write_bytes(b"data")
        r.got = "0123456789abcdef"
    settle([good, bad], {1: "0123456789abcdef", 2: "fedcba9876543210"})
    assert good.path.read_bytes() == b"data" and good.error is None
    assert not bad.path.exists() and "was not kept" in bad.error and "fedcba9876543210" in bad.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-1.pt"]  # no temporary left


def test_two_jobs_sharing_a_local_directory_never_see_each_others_steps(tmp_path):
    # Attack 04: folders named only by host and step mixed two jobs given the same "/dev/shm/ckpt".
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=2)
    with xlakit.CheckpointManager(tmp_path / "jobA", save_interval_steps=1000, local=tier) as a:
        for s in (500, 600):
            a.save(s, {"job": "A", "step": s})
    with xlakit.CheckpointManager(tmp_path / "jobB", save_interval_steps=1000, local=tier) as b:
        with pytest.raises(FileNotFoundError, match="no tier holds a step"):
            b.restore()  # job A's steps are not job B's
        for s in (1, 2, 3):
            assert b.save(s, {"job": "B", "step": s}) and b.local.last_error is None
        assert b.restore() == {"job": "B", "step": 3}
        assert local_steps(shm, "jobB") == [2, 3]  # its own retention, not counting A's newer steps
    assert local_steps(shm, "jobA") == [500, 600]  # never deleted by B
    with xlakit.CheckpointManager(tmp_path / "jobA", save_interval_steps=1000, local=tier) as a:
        assert a.restore() == {"job": "A", "step": 600}
        marker = json.loads((host_dir(shm, "jobA") / "xlakit-local-tier.json").read_text())
        assert marker["run"] == str(tmp_path / "jobA")


def test_a_failed_local_save_keeps_the_last_whole_step_and_leaves_no_step_folder(tmp_path, monkeypatch):
    # Attacks 01/02/08: retention ran after a failed save (keep=1 removed the only whole step), and the
    # failed step's folder was counted as a step.
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=2, keep=1)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=1000, local=tier) as mgr:
        assert mgr.save(2, state(2))
        (host_dir(shm) / "4" / "part-00000-of-00001.pt").mkdir(parents=True)  # rank 0's write of step 4 fails
        assert not mgr.save(4, state(4)) and "rank 0 on" in mgr.local.last_error
        assert local_steps(shm) == [2, 4]  # step 4's folder is not the tier's (a folder in it): left alone
        assert mgr.restore()["step"] == 2
        (host_dir(shm) / "4" / "part-00000-of-00001.pt").rmdir()
        (host_dir(shm) / "4").rmdir()
        from xlakit.checkpoint.tier import tier_rounds

        def full(*args, **kwargs):  # a fake full /dev/shm (running as root, a read-only folder is not)
            raise OSError(errno.ENOSPC, "No space left on device")

        with monkeypatch.context() as m:
            m.setattr(tier_rounds.pipeline, "save_file", full)
            assert not mgr.save(6, state(6))  # keep=1: step 2 is the only whole step
        assert "the local tier is full" in mgr.local.last_error
        assert mgr.restore()["step"] == 2 and mgr.local.restored_from["parts"] == {0: "local"}
        assert not (host_dir(shm) / "6").exists()  # removed, never counted toward keep
        assert mgr.save(8, state(8)) and local_steps(shm) == [8]  # a whole step: retention runs again


def test_a_full_local_tier_names_only_the_fixes_that_apply():
    from xlakit.checkpoint.tier.tier_rounds import described as _described

    full = OSError(errno.ENOSPC, "No space left on device")
    one = _described(full, "/dev/shm/x/part", xlakit.LocalTier("/dev/shm/x", keep=1), world=1)
    assert "the local tier is full" in one and "more room" in one
    assert "keep" not in one.split("It holds")[1].replace("keep+1", "") and "peers" not in one
    many = _described(full, "/dev/shm/x/part", xlakit.LocalTier("/dev/shm/x", keep=2, peers=1), world=4)
    assert "lower keep (now 2) or peers (now 1)" in many


def test_a_rollback_to_a_local_step_and_a_local_save_below_the_latest(tmp_path):
    # Attacks 15 and 05: retire_steps_after refused a step of the local tier; a local-only save below
    # the latest local step was not refused, so a restart resumed the abandoned branch.
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=3)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=4, local=tier) as mgr:
        for s in range(1, 8):
            mgr.save(s, state(s))
        assert mgr.all_steps() == [4] and local_steps(shm) == [5, 6, 7]
        mgr.restore(4)
        with pytest.raises(ValueError, match=r"cannot save step 5 into the local tier .* latest committed "
                                             r"step is 7") as info:
            mgr.save(5, state(50))  # a local-only save: refused like a persistent one
        assert "retire_steps_after(4)" in "".join(info.value.__notes__)
        assert local_steps(shm) == [5, 6, 7]  # nothing was written
        assert mgr.restore(5)["step"] == 5 and mgr.local.restored_from["parts"] == {0: "local"}
        # Issue 32: the local steps it removed were left out of what it returned.
        assert mgr.retire_steps_after(5) == [6, 7]  # the persistent tier has nothing newer, the local one has
        assert local_steps(shm) == [5]
        assert mgr.save(6, state(60))
        with pytest.raises(ValueError, match="not committed there .* nor whole in a local tier"):
            mgr.retire_steps_after(3)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=4, local=tier) as mgr:
        assert mgr.restore()["w"][0] == 60.0  # the new branch, not the abandoned step 7


def test_a_preemption_save_refused_by_the_local_tier_still_saves_the_persistent_step(tmp_path):
    # A rollback without retire_steps_after, then SIGTERM: the local tier refuses the step (newer local
    # steps), which must not cost the job its last persistent save; the refusal is raised after it.
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=3)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=4, local=tier) as mgr:
        for s in range(1, 8):
            mgr.save(s, state(s))
        mgr.restore(4)
        mgr.install_preemption_handler(grace_s=30)
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.should_save(5)
        with pytest.raises(ValueError, match="cannot save step 5 into the local tier") as info:
            mgr.save(5, state(50))
        assert "persistent step 5 is saved" in "".join(info.value.__notes__)
        assert mgr.all_steps() == [4, 5] and local_steps(shm) == [5, 6, 7]  # nothing local was written
        assert xlakit.load(tmp_path / "ckpt" / "5" / "ckpt.pt")["w"][0] == 50.0


def test_folders_not_the_tiers_own_are_never_counted_restored_or_removed(tmp_path):
    # Attack 03: a folder of the user's with a step-like name counted as the newest step, so retention
    # removed every real step.
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=1000, local=tier) as mgr:
        (host_dir(shm) / "99999").mkdir()
        (host_dir(shm) / "99999" / "notes.txt").write_text("mine")
        (host_dir(shm) / "88888").mkdir()
        (host_dir(shm) / "88888" / "part-00000-of-00001.pt").write_bytes(b"a part")
        (host_dir(shm) / "88888" / "notes.txt").write_text("mine too")
        for s in (1, 2, 3):
            assert mgr.save(s, state(s))
        assert local_steps(shm) == [2, 3, 88888, 99999]
        assert (host_dir(shm) / "99999" / "notes.txt").read_text() == "mine"
        assert mgr.restore()["step"] == 3 and mgr.local.restored_from["parts"] == {0: "local"}


def test_retention_does_not_run_once_the_deadline_passed(tmp_path):
    # Attack 13: the retention (and the renames of copies) ran after the save's deadline.
    import time

    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=1)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=1000, local=tier) as mgr:
        for s in (1, 2):
            mgr.save(s, state(s))
        assert local_steps(shm) == [2]
        mgr.local.folder.make_step(3)
        xlakit.save(state(3), host_dir(shm) / "3" / "part-00000-of-00001.pt")
        errors = mgr.local._settle_folder(3, True, deadline=time.monotonic() - 1)
        assert "did not run" in errors[0] and "deadline" in errors[0]
        assert local_steps(shm) == [2, 3]  # nothing removed after the deadline


def test_the_directory_is_resolved_once_and_the_timeout_is_finite(tmp_path, monkeypatch):
    # Attacks 07 and 17: a relative folder moved with the working directory; timeout_s=inf was
    # accepted, then overflowed in the ranks' copy groups.
    monkeypatch.chdir(tmp_path)
    tier = xlakit.LocalTier("rel/shm", interval_steps=1)
    assert tier.directory == tmp_path / "rel" / "shm"
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=1000, local=tier) as mgr:
        mgr.save(1, state(1))
        monkeypatch.chdir("/")
        assert mgr.restore()["step"] == 1 and mgr.local.restored_from["parts"] == {0: "local"}
    with pytest.raises(ValueError, match="at most 86400 s"):
        xlakit.LocalTier("/dev/shm/x", timeout_s=math.inf)
    with pytest.raises(ValueError, match="at most 86400 s"):
        xlakit.LocalTier("/dev/shm/x", timeout_s=1e9)


def test_a_part_copied_into_another_steps_folder_is_not_restored_as_that_step(tmp_path):
    # Attack 06: a part of step 5 under step 6's name restored as step 6.
    import shutil

    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=3)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=1000, local=tier) as mgr:
        for s in (4, 5, 6):
            mgr.save(s, state(s))
        six = host_dir(shm) / "6" / "part-00000-of-00001.pt"
        shutil.copy(host_dir(shm) / "5" / "part-00000-of-00001.pt", six)
        got = mgr.restore()
        assert got["step"] == 5 and mgr.local.restored_from["step"] == 5
        assert str(six) in mgr.local.restored_from["damaged"][0]
        assert "expected {'step': 6" in mgr.local.restored_from["damaged"][0]
        template = {"w": torch.zeros(1024), "step": 0}
        assert mgr.restore(5, template=template)["step"] == 5 and template["w"][0] == 5.0


def test_a_local_that_is_not_a_local_tier_is_a_type_error(tmp_path):
    # Issue 32: local="a string" gave AttributeError ('str' object has no attribute 'config').
    for wrong in ("/dev/shm/ckpt", {"directory": "/dev/shm/ckpt"}):
        with pytest.raises(TypeError, match=r"local must be an xlakit.LocalTier .* "
                                            r"local=xlakit.LocalTier\('/dev/shm/ckpt'\)"):
            xlakit.CheckpointManager(tmp_path / "ckpt", local=wrong)
    with xlakit.CheckpointManager(tmp_path / "ckpt") as mgr:  # nothing was held
        assert mgr.all_steps() == []


def test_a_save_at_the_newest_local_step_is_refused_naming_retire_steps_after(tmp_path):
    # Issue 32: at the newest local step the refusal advised "save the next one", never the rollback.
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=3)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=1000, local=tier) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state(s))
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=1000, local=tier) as mgr:
        with pytest.raises(ValueError, match=r"step 3 is already committed in the local tier .* "
                                             r"`mgr.retire_steps_after\(2\)` first"):
            mgr.save(3, state(30))
        assert mgr.restore()["w"][0] == 3.0  # nothing was written


def test_latest_step_sees_the_local_tier_so_the_resume_loop_goes_on(tmp_path):
    # Issue 32: latest_step() saw only persistent steps, so the resume loop restored step 4 and its next
    # local save was refused (the local tier held 7).
    shm = tmp_path / "shm"
    tier = xlakit.LocalTier(shm, interval_steps=1, keep=2)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=4, local=tier) as mgr:
        for s in range(1, 8):
            mgr.save(s, state(s))
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=4, local=tier) as mgr:
        assert mgr.all_steps() == [4]  # the persistent tier's steps
        start = mgr.latest_step()  # docs/manager.md's resume loop, as written
        assert start == 7 and mgr.restore(start)["step"] == 7
        for step in range(start + 1, 10):
            if mgr.should_save(step):
                assert mgr.save(step, state(step)) and mgr.local.last_error is None
        assert mgr.latest_step() == 9 and mgr.all_steps() == [4, 8]


def test_a_rank_that_reached_a_save_given_up_long_before_says_it_was_stalled_whenever_the_claim_arrived():
    # A rehearsal failed on this: rank 0 (the store host) stopped, rank 1's give-up queued in its store; on
    # resuming, rank 0 looked before the queued claim was served and met it only in `agree`. Its error then
    # blamed rank 1 alone. The claim's own time, not when rank 0 met it, says that rank 0 came late.
    import time
    from types import SimpleNamespace

    from xlakit.checkpoint.tier.tier_rounds import _why

    run = SimpleNamespace(rank=0, host="host0", hosts=["host0", "host0", "host1", "host1"], world=4,
                          tier=SimpleNamespace(timeout_s=6.0))
    reached = time.time()

    def why(claimed_at: float) -> str:
        held = {"decision": "abort", "rank": 1, "culprits": [1], "timeout": False, "stage": "start",
                "error": "rank 1 gave up (its arrival failed) in stage 'start'", "unix": claimed_at}
        coord = SimpleNamespace(proposals={}, gate=SimpleNamespace(held=held))
        error = RuntimeError("coordinated local-tier save: nothing was committed")
        return _why(run, coord, error, [], 3, time.monotonic() + 5, reached)

    late = why(reached - 8)
    assert late.startswith("rank 0 on host0 reached the local-tier save of step 3 after the other ranks had given "
                           "it up") and "dropped it at once" in late and "rank 1 on host0 gave the save up" in late
    assert "writing nothing" not in late  # it met the decision after writing its part
    assert why(reached + 0.5) == "rank 1 on host0 gave the save up: rank 1 gave up (its arrival failed) in stage 'start'"
