"""A rollback in CheckpointManager is explicit: a save at or below the latest step is refused, naming
`retire_steps_after`, which deletes the newer steps once every rank agreed (issue 25, item 1).

On disk and on both object-storage servers; across real ranks in tests/support/rollback_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import xlakit
from tests.support import SUPPORT
from tests.support.ranks import Job
from xlakit import cli
from xlakit.checkpoint.stepstore import steps
from xlakit.checkpoint.manager.checkpoint_manager import CheckpointManager
from xlakit.checkpoint.objstore.client import Location, store_for

pytestmark = pytest.mark.usefixtures("no_pending_save")
WORKER = SUPPORT / "rollback_worker.py"


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


def entries(directory) -> list[str]:
    """What the manager folder (or URL) holds, step folders by name and trash, but not the lock or lease."""
    if isinstance(directory, Path):
        return sorted(n for n in os.listdir(directory) if n != steps.LOCK_FILE)
    loc = Location.parse(directory)
    return sorted({n.split("/")[0] for n in store_for(loc).list(None, loc) if not n.startswith("xlakit-lease.")})


def listed(directory, capsys) -> list[tuple[int, str]]:
    assert cli.main(["ckpt", "ls", "--json", str(directory)]) == 0
    shown = json.loads(capsys.readouterr().out)
    return [(s["step"], s["state"]) for s in shown["steps"]]


def _reproduce_then_roll_back(directory, capsys) -> None:
    # Regression (issue 25): save 10, 20, 100; restore(20); train on and save 30: the save committed,
    # a restart resumed from 100 (the run given up) and retention kept 100 and dropped 20 and 30 first.
    with CheckpointManager(directory, save_interval_steps=10) as mgr:
        for step in (10, 20, 100):
            mgr.save(step, state(step))
        assert mgr.restore(20)["step"] == 20  # roll back, train on from step 21
        assert mgr.should_save(30)  # due, and its save says what to do
        with pytest.raises(ValueError, match=r"cannot save step 30 .*latest committed step is 100 .*nothing "
                                             r"was written") as caught:
            mgr.save(30, state(30))
        assert "mgr.retire_steps_after(20)` deletes steps [100]" in "\n".join(caught.value.__notes__)
        assert mgr.all_steps() == [10, 20, 100] and entries(directory) == ["10", "100", "20"]
    with CheckpointManager(directory, save_interval_steps=10, max_to_keep=2) as mgr:  # a restart
        assert mgr.latest_step() == 100  # nothing forked: the refused save wrote nothing
        assert mgr.restore(20)["step"] == 20
        assert mgr.retire_steps_after(20) == [100]
        assert mgr.latest_step() == 20 and mgr.should_save(30)
        assert mgr.save(30, state(30)) is True
        assert mgr.all_steps() == [20, 30]  # retention follows the new timeline: 10 went, not 30
    assert listed(directory, capsys) == [(20, "committed"), (30, "committed")]
    assert entries(directory) == ["20", "30"]  # the retired step is gone, not left as trash
    with CheckpointManager(directory, save_interval_steps=10, max_to_keep=2) as mgr:
        assert mgr.latest_step() == 30 and torch.equal(mgr.restore()["w"], state(30)["w"])


def test_rollback_on_disk_is_refused_then_retired_explicitly(tmp_path, capsys):
    _reproduce_then_roll_back(tmp_path, capsys)


def test_rollback_on_a_bucket_is_refused_then_retired_explicitly(bucket, capsys):
    _reproduce_then_roll_back(f"{bucket}/run", capsys)


def test_an_asynchronous_save_below_the_latest_is_refused_once_the_one_in_flight_committed(tmp_path):
    mgr = CheckpointManager(tmp_path, asynchronous=True)
    for step in (10, 20, 100):
        mgr.save(step, state(step))
    mgr.restore(20)
    with pytest.raises(ValueError, match="cannot save step 30 .*latest committed step is 100"):
        mgr.save(30, state(30))
    assert mgr.retire_steps_after(20) == [100] and mgr.save(30, state(30)) is True
    mgr.close()
    assert mgr.all_steps() == [10, 20, 30]


def test_should_save_after_a_rollback_makes_every_step_on_the_interval_due_and_the_save_says_why(tmp_path):
    # Regression: steps of the run given up that were still on disk were skipped silently, and the
    # first step past them (40) was saved beside them: a timeline of 10, 20 and 30 from one run and
    # 40 from another.
    mgr = CheckpointManager(tmp_path, save_interval_steps=10)
    for step in (10, 20, 30):
        mgr.save(step, state(step))
    mgr.restore(10)
    assert [s for s in range(11, 41) if mgr.should_save(s)] == [20, 40]  # 20 is below the latest: due
    with pytest.raises(ValueError, match=r"cannot save step 20 .*committed at or after 20: \[20, 30\]") as caught:
        mgr.save(20, state(20))
    assert "mgr.retire_steps_after(10)` deletes steps [20, 30]" in "\n".join(caught.value.__notes__)
    with pytest.raises(ValueError, match="cannot save step 5 .*latest committed step is 30"):
        mgr.save(5, state(5), force=True)  # forcing does not fork the timeline either
    assert mgr.retire_steps_after(10) == [20, 30]
    assert [s for s in range(11, 41) if mgr.should_save(s)] == [20, 30, 40]
    mgr.save(20, state(20))
    assert mgr.all_steps() == [10, 20] and not mgr.should_save(20)
    with pytest.raises(ValueError, match="step 20 is already committed"):  # the latest: as before
        mgr.save(20, state(20), force=True)
    mgr.close()


def test_with_every_step_newer_the_refusal_names_a_folder_of_its_own(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(100, state(100))
    with pytest.raises(ValueError, match="cannot save step 50") as caught:
        mgr.save(50, state(50))
    assert "save the new run into a folder of its own" in "\n".join(caught.value.__notes__)
    mgr.close()


def test_retire_steps_after_deletes_only_newer_steps_of_the_manager(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path)
    for step in (10, 20, 30):
        mgr.save(step, state(step))
    mgr.close()
    os.remove(tmp_path / "30" / steps.CHECKPOINT_FILE)  # an interrupted save of 30
    (tmp_path / "40").mkdir()
    (tmp_path / "40" / "notes.txt").write_text("a user's folder named like a step")
    (tmp_path / "50").mkdir()
    (tmp_path / "50" / steps.STEP_RECORD).write_text("{truncated")  # a damaged record: not the manager's
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match=r"step 15 is not committed there \(committed: \[10, 20\]\).*nothing "
                                         r"was deleted"):
        mgr.retire_steps_after(15)
    with pytest.raises(ValueError, match="step 30 is not committed"):
        mgr.retire_steps_after(30)  # an interrupted save is no step to go on from
    assert entries(tmp_path) == ["10", "20", "30", "40", "50"]
    assert mgr.retire_steps_after(20) == [30]  # the interrupted save of the run given up goes too
    assert entries(tmp_path) == ["10", "20", "40", "50"]  # the user's folder and the damaged one stay
    assert mgr.retire_steps_after(20) == [] and mgr.retire_steps_after(10) == [20]
    assert mgr.all_steps() == [10] and mgr.latest_step() == 10
    with pytest.raises(TypeError, match="step must be a whole number"):
        mgr.retire_steps_after("20")
    mgr.close()
    with pytest.raises(RuntimeError, match="is closed"):
        mgr.retire_steps_after(10)


def test_a_preemption_after_a_rollback_is_refused_at_once_then_saved_once_retired(tmp_path):
    mgr = CheckpointManager(tmp_path, save_interval_steps=10)
    for step in (10, 20, 100):
        mgr.save(step, state(step))
    mgr.install_preemption_handler(grace_s=30)
    mgr.restore(20)
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.should_save(25)  # the agreed preemption step
    with pytest.raises(ValueError, match="cannot save step 25 .*latest committed step is 100"):
        mgr.save(25, state(25))
    assert mgr.all_steps() == [10, 20, 100]  # nothing written, nothing deleted
    assert mgr.retire_steps_after(20) == [100]
    assert mgr.should_save(25) and mgr.save(25, state(25)) is True
    assert mgr.reached_preemption(25) and mgr.all_steps() == [10, 20, 25]
    mgr.close()


@pytest.mark.multiproc
@pytest.mark.slow
def test_ranks_refuse_alike_then_retire_together(tmp_path):
    results = Job(WORKER, "rollback", tmp_path, 3).results()
    for r in range(3):
        out = results[r]
        assert out["exit"] == 0, out["stderr"]
        assert out["restored"] == 20 and out["first_save"]["error"] == "ValueError", out
        assert "latest committed step is 100" in out["first_save"]["message"], out
        assert out["retired"] == [100] and out["saved"] is True, out
        assert out["steps"] == [10, 20, 30] and out["latest"] == 30, out
    assert entries(tmp_path) == ["10", "20", "30"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_ranks_that_disagree_on_a_rollback_delete_nothing(tmp_path):
    results = Job(WORKER, "disagree", tmp_path, 3).results()
    for r in range(3):
        out = results[r]
        assert out["exit"] == 0, out["stderr"]
        assert out["retire"]["error"] == "CheckpointPeerError" and "the ranks disagree on" in out["retire"]["message"]
        assert out["steps"] == [10, 20, 100], out
    assert entries(tmp_path) == ["10", "100", "20"]


def test_on_a_bucket_a_rollback_never_touches_what_is_not_the_managers(bucket):
    # (tests/objstore/test_objstore_manager.py's save into a user's prefix is now below the latest step,
    # refused before the prefix is looked at: the same refusal above the latest is checked here.)
    url = f"{bucket}/run"
    loc = Location.parse(url)
    with CheckpointManager(url) as mgr:
        for step in (10, 20, 100):
            mgr.save(step, state(step))
        store_for(loc).put(None, loc.child("200/notes.txt"), b"a user's file named like a step")
        with pytest.raises(xlakit.CheckpointWriteError, match="not a step of an xlakit manager"):
            mgr.save(200, state(200))
        assert mgr.retire_steps_after(10) == [20, 100]
        assert mgr.all_steps() == [10] and mgr.save(20, state(20)) is True
    assert entries(url) == ["10", "20", "200"]
    assert sorted(store_for(loc).list(None, loc.child("200"))) == ["notes.txt"]
