"""CheckpointManager in one process: saving policy, retention kept exactly, discovery from disk,
restores, asynchronous errors, preemption, and what a new user gets wrong."""

from __future__ import annotations

import json
import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import xlakit
from tests.support import fakes
from xlakit.checkpoint.core import paths
from xlakit.checkpoint.format import archive
from xlakit.checkpoint.stepstore import steps
from xlakit.checkpoint.manager.checkpoint_manager import CheckpointManager
from tests.support.manager_folders import names

pytestmark = pytest.mark.usefixtures("no_pending_save")


def state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


# -- policy ------------------------------------------------------------------------------------

def test_should_save_follows_the_interval_and_never_a_saved_step(tmp_path):
    mgr = CheckpointManager(tmp_path, save_interval_steps=3)
    assert [s for s in range(10) if mgr.should_save(s)] == [0, 3, 6, 9]
    assert mgr.save(3, state(3)) is True
    assert mgr.save(4, state(4)) is False and mgr.all_steps() == [3]
    assert not mgr.should_save(3) and mgr.should_save(6)
    assert mgr.save(4, state(4), force=True) is True and mgr.all_steps() == [3, 4]
    with pytest.raises(ValueError, match="step 4 is already committed"):
        mgr.save(4, state(4), force=True)


def test_max_to_keep_keeps_exactly_the_most_recent(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=3)
    for step in range(1, 8):
        mgr.save(step, state(step))
        assert mgr.all_steps() == list(range(max(1, step - 2), step + 1))
    assert names(tmp_path) == ["5", "6", "7"]  # no trash, no temporaries left


def test_keep_every_n_steps_and_the_best_are_kept_beside_the_recent(tmp_path):
    losses = {1: 5.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 2.0, 6: 1.0, 7: 2.5, 8: 0.9, 9: 1.5, 10: 0.7}
    mgr = CheckpointManager(tmp_path, max_to_keep=2, keep_every_n_steps=4, best_metric="loss")
    for step, loss in losses.items():
        mgr.save(step, state(step), metrics={"loss": loss})
    assert mgr.all_steps() == [3, 4, 8, 9, 10]  # best 3, every 4th, the two latest
    assert mgr.best_step() == 3
    maxed = CheckpointManager(tmp_path / "max", max_to_keep=1, best_metric="acc", best_mode="max")
    for step, acc in ((1, 0.2), (2, 0.9), (3, 0.4), (4, 0.9), (5, 0.1)):
        maxed.save(step, state(step), metrics={"acc": torch.tensor(acc)})
    assert maxed.all_steps() == [4, 5] and maxed.best_step() == 4  # a tie goes to the later step


def test_the_latest_step_is_kept_even_when_it_is_not_the_best(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=1, best_metric="loss")
    mgr.save(1, state(1), metrics={"loss": 0.1})
    mgr.save(2, state(2), metrics={"loss": 9.0})
    assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2 and mgr.best_step() == 1


# -- discovery and what is not the manager's -----------------------------------------------------

def test_steps_are_discovered_from_commit_records_by_a_new_manager(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        for step in (10, 20):
            mgr.save(step, state(step), metrics={"loss": 1.0 / step})
    again = CheckpointManager(tmp_path, save_interval_steps=10)
    assert again.all_steps() == [10, 20] and again.latest_step() == 20
    assert not again.should_save(20) and again.should_save(30)
    assert again.restore()["step"] == 20 and again.restore(10)["step"] == 10
    record = json.loads((tmp_path / "10" / steps.STEP_RECORD).read_text())
    assert record["metrics"] == {"loss": 0.1} and record["layout"] == "single"


def test_an_interrupted_save_is_not_a_step_and_goes_once_superseded(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    os.remove(tmp_path / "2" / steps.CHECKPOINT_FILE)  # as if killed before the commit
    mgr.close()
    mgr2 = CheckpointManager(tmp_path)
    assert mgr2.all_steps() == [1] and mgr2.latest_step() == 1
    with pytest.raises(xlakit.CheckpointIncompleteError, match="step 2 .* never committed"):
        mgr2.restore(2)
    mgr2.save(2, state(2))  # the same step saved again into its folder
    assert mgr2.restore(2)["step"] == 2
    os.remove(tmp_path / "2" / steps.CHECKPOINT_FILE)
    mgr2.close()
    mgr3 = CheckpointManager(tmp_path)
    mgr3.save(3, state(3))  # step 3 commits: the interrupted step 2 goes
    assert names(tmp_path) == ["1", "3"]


def test_a_save_that_raised_can_be_retried_at_the_same_step(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    with pytest.raises(xlakit.CheckpointSerializationError):
        mgr.save(2, {"w": torch.ones(2), "bad": object()})
    assert mgr.should_save(2) and mgr.all_steps() == [1]
    assert mgr.save(2, state(2)) is True
    assert mgr.all_steps() == [1, 2] and mgr.restore(2)["step"] == 2


@pytest.mark.parametrize("layout, asynchronous", [("single", False), ("single", True), ("dcp", False)])
def test_a_refused_state_leaves_no_step_behind_and_a_step_left_by_a_dead_save_is_not_touched(
        tmp_path, capsys, layout, asynchronous):
    # Regression: a refused save left <step>/xlakit-step.json, which `xlakit ckpt ls` listed as an
    # interrupted save, though its error said nothing was written.
    from xlakit import cli

    mgr = CheckpointManager(tmp_path, layout=layout, asynchronous=asynchronous)
    with pytest.raises(xlakit.CheckpointSerializationError, match="argparse.Namespace"):
        mgr.save(1, {"w": torch.ones(2), "bad": argparse.Namespace(a=1)})
    assert names(tmp_path) == [] and not steps.scan(tmp_path).pending
    assert cli.main(["ckpt", "ls", str(tmp_path)]) == 0
    assert "interrupted" not in capsys.readouterr().out
    mgr.save(1, state(1))
    mgr.wait()
    # A step folder holding more than the record (a killed save's temporary file) stays an interrupted
    # step after a refused save of that step: only a folder of nothing but the record is removed.
    (tmp_path / "2").mkdir()
    steps.write_record(tmp_path / "2", json.loads((tmp_path / "1" / steps.STEP_RECORD).read_text()) | {"step": 2})
    killed = paths.temp_path(tmp_path / "2" / "ckpt")
    killed.write_bytes(b"half")
    with pytest.raises(xlakit.CheckpointSerializationError):
        mgr.save(2, {"bad": argparse.Namespace(a=1)})
    assert sorted(os.listdir(tmp_path / "2")) == sorted([killed.name, steps.STEP_RECORD])
    assert mgr.all_steps() == [1] and steps.scan(tmp_path).pending.keys() == {2}
    mgr.close()


def test_a_forced_save_below_the_latest_step_is_refused(tmp_path):
    # Regression: save(3, force=True) returned True and its own retention deleted step 3 at once;
    # since issue 25 a save below the latest step is refused (test_manager_rollback.py).
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    mgr.save(10, state(10))
    with pytest.raises(ValueError, match="cannot save step 3 .*latest committed step is 10"):
        mgr.save(3, state(3), force=True)
    assert mgr.all_steps() == [10]
    mgr.save(11, state(11))
    assert mgr.all_steps() == [11]


def test_a_second_manager_on_a_folder_in_use_is_refused_until_the_first_closes(tmp_path):
    # Regression: a job launched twice on one folder: the second's retention deleted the first's
    # save in progress as an "interrupted save".
    first = CheckpointManager(tmp_path)
    other = subprocess.run([sys.executable, "-c", "import sys, xlakit; xlakit.CheckpointManager(sys.argv[1])",
                            str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert other.returncode == 1 and "CheckpointBusyError" in other.stderr, other.stderr[-2000:]
    assert f"pid {os.getpid()}" in other.stderr
    with pytest.raises(xlakit.CheckpointBusyError, match="another checkpoint manager is using"):
        CheckpointManager(tmp_path)
    first.close()
    with CheckpointManager(tmp_path) as second:
        second.save(1, state(1))
    dropped = CheckpointManager(tmp_path)
    del dropped  # a manager dropped without close() lets go of the folder too
    CheckpointManager(tmp_path).close()


def test_folders_that_are_not_the_managers_are_never_touched(tmp_path):
    (tmp_path / "500").mkdir()
    (tmp_path / "500" / "notes.txt").write_text("mine")
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / steps.STEP_RECORD).write_text("{not json")
    (tmp_path / "README").write_text("mine too")
    mgr = CheckpointManager(tmp_path, max_to_keep=1)
    for step in (1, 2, 3):
        mgr.save(step, state(step))
    assert mgr.all_steps() == [3]
    with pytest.raises(xlakit.CheckpointWriteError, match=r"500.*not a step of an xlakit manager.*notes.txt"):
        mgr.save(500, state(500))
    assert names(tmp_path) == ["3", "500", "7", "README"]
    assert names(tmp_path / "500") == ["notes.txt"] and (tmp_path / "README").read_text() == "mine too"
    found = steps.scan(tmp_path)
    assert set(found.other) == {"500", "README"} and "not whole JSON" in found.damaged[7]


def test_trash_left_by_a_killed_retention_is_not_a_step_and_is_removed_later(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    trash = steps.to_trash(tmp_path / "1")  # the first half of a deletion, then a kill
    assert trash.name.startswith(".1.") and trash.name.endswith(steps.TRASH_SUFFIX)
    assert steps.scan(tmp_path).committed.keys() == {2}
    mgr.close()
    CheckpointManager(tmp_path)
    assert names(tmp_path) == ["2"]


def test_a_step_folder_half_made_by_a_dead_process_is_removed_by_the_next_manager(tmp_path):
    # Regression: a kill between the step folder's mkdir and its record left an empty "13/" that
    # no manager could tell from a user's folder; the folder now appears only with its record.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    half = tmp_path / f".13.{paths.host()}.{dead.pid}.deadbeef{paths.TMP_SUFFIX}"
    half.mkdir()
    (half / f".{steps.STEP_RECORD}.{paths.host()}.{dead.pid}.0badf00d{paths.TMP_SUFFIX}").write_text("{")
    assert steps.scan(tmp_path).other == {}  # a temporary, not someone else's folder
    CheckpointManager(tmp_path)
    assert names(tmp_path) == []


# -- restore ------------------------------------------------------------------------------------

def test_restore_names_what_it_found(tmp_path):
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no committed step in .*\(it is empty\)"):
        mgr.restore()
    mgr.save(5, state(5))
    with pytest.raises(FileNotFoundError, match=r"no committed step 6 .* committed: \[5\]"):
        mgr.restore(6)


def test_dcp_layout_restores_into_a_template_and_refuses_without_one(tmp_path):
    mgr = CheckpointManager(tmp_path, layout="dcp", max_to_keep=1)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((8,), float(step)), "step": step})
    assert mgr.all_steps() == [2] and names(tmp_path / "2") == [steps.CHECKPOINT_FOLDER, steps.STEP_RECORD]
    with pytest.raises(ValueError, match="layout='dcp'.*template"):
        mgr.restore()
    template = {"w": torch.zeros(8), "step": 0}
    assert mgr.restore(template=template) is template
    assert torch.equal(template["w"], torch.full((8,), 2.0)) and template["step"] == 2


def test_restore_into_a_template_fills_it_in_place(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"w": torch.arange(6.0).reshape(2, 3), "step": 1})
    template = {"w": torch.zeros(2, 3), "step": 0}
    out = mgr.restore(1, template=template)
    assert out["w"] is template["w"] and out["step"] == 1
    assert torch.equal(template["w"], torch.arange(6.0).reshape(2, 3))


# -- asynchronous -------------------------------------------------------------------------------

def _full_disk(monkeypatch) -> threading.Event:
    """A fake full disk: every storage write fails with ENOSPC; the event is set once one did."""
    failed = threading.Event()

    def full(*args, **kwargs):
        failed.set()
        raise OSError(28, "No space left on device")

    for name in fakes.FakeFullDisk.METHODS:
        monkeypatch.setattr(archive.ArchiveWriter, name, full)
    return failed


@pytest.mark.parametrize("next_call", ["save", "wait", "close"])
def test_an_asynchronous_failure_is_raised_by_the_next_call(tmp_path, monkeypatch, next_call):
    mgr = CheckpointManager(tmp_path, asynchronous=True, max_to_keep=1)
    mgr.save(1, state(1))
    mgr.wait()
    failed = _full_disk(monkeypatch)
    assert mgr.save(2, state(2)) is True  # returns once staged; the write fails behind it
    assert failed.wait(30)
    monkeypatch.undo()
    call = {"save": lambda: mgr.save(3, state(3)), "wait": mgr.wait, "close": mgr.close}[next_call]
    with pytest.raises(xlakit.CheckpointWriteError, match="No space") as info:
        call()
    assert any("asynchronous save of step 2" in n for n in info.value.__notes__)
    assert mgr.all_steps() == [1]  # the failed step never counted, nothing was deleted for it
    if next_call != "close":
        mgr.save(4, state(4))
        mgr.wait()
        assert mgr.all_steps() == [4]


def test_asynchronous_saves_commit_and_retention_follows(tmp_path):
    with CheckpointManager(tmp_path, asynchronous=True, max_to_keep=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, state(step))
        assert mgr.restore()["step"] == 5  # restore waits for the save in flight
    assert CheckpointManager(tmp_path).all_steps() == [4, 5]


# -- preemption (one process) -------------------------------------------------------------------

def test_sigterm_makes_the_next_step_a_save_then_reached_preemption(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(tmp_path, save_interval_steps=100)
    mgr.install_preemption_handler(grace_s=30)
    saved = []
    for step in range(1, 50):
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # twice: still one agreed step
        if mgr.should_save(step):
            mgr.save(step, state(step))
            saved.append(step)
        if mgr.reached_preemption(step):
            break
    assert saved == [7] and step == 7 and mgr.all_steps() == [7]
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_an_asynchronous_manager_saves_the_preemption_step_synchronously(tmp_path):
    mgr = CheckpointManager(tmp_path, asynchronous=True, save_interval_steps=2)
    mgr.install_preemption_handler(grace_s=30)
    mgr.save(2, state(2))  # in the background
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.should_save(3) and mgr.save(3, state(3))
    assert mgr.all_steps() == [2, 3] and mgr.reached_preemption(3)  # committed before save returned
    mgr.close()


def test_a_preemption_save_that_cannot_finish_within_the_grace_is_not_committed(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.install_preemption_handler(grace_s=0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the grace is gone before the loop gets to the save
    with pytest.raises(xlakit.CheckpointTimeoutError):
        mgr.save(1, state(1))
    assert mgr.reached_preemption(1) and mgr.all_steps() == []
    mgr.close()


# -- what a new user gets wrong -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    ({"max_to_keep": 0}, ValueError, "max_to_keep must be at least 1"),
    ({"max_to_keep": 2.5}, TypeError, "max_to_keep must be a whole number"),
    ({"keep_every_n_steps": True}, TypeError, "keep_every_n_steps"),
    ({"save_interval_steps": 0}, ValueError, "save_interval_steps must be at least 1"),
    ({"best_mode": "lowest"}, ValueError, "best_mode must be 'min' or 'max'"),
    ({"best_metric": ""}, TypeError, "best_metric"),
    ({"layout": "sharding"}, ValueError, "layout must be one of"),
    ({"layout": "dcp", "asynchronous": True}, ValueError, "dcp_save, which is synchronous"),
    ({"options": xlakit.SaveOptions(asynchronous=True)}, ValueError, "options.asynchronous is the manager's"),
    ({"layout": "replicated"}, xlakit.XlakitError, "needs torch.distributed initialised"),
])
def test_wrong_configuration_is_refused_before_anything_is_written(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        CheckpointManager(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists() or names(tmp_path / "m") == []


def test_a_file_is_not_a_manager_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(xlakit.CheckpointWriteError, match="cannot use .* as a manager folder: it is a file"):
        CheckpointManager(tmp_path / "f")


def test_wrong_arguments_name_what_was_expected(tmp_path):
    mgr = CheckpointManager(tmp_path, best_metric="loss")
    with pytest.raises(TypeError, match="step must be a whole number"):
        mgr.save("5", state(5), metrics={"loss": 1.0})
    with pytest.raises(ValueError, match="step must be 0 or more"):
        mgr.should_save(-1)
    with pytest.raises(ValueError, match="step must be at most 9999999999999999999"):
        mgr.should_save(10**19)  # a 20-digit folder that no listing would recognize
    with pytest.raises(ValueError, match=r"metrics must hold best_metric 'loss'.*\['acc'\]"):
        mgr.save(1, state(1), metrics={"acc": 1.0})
    with pytest.raises(TypeError, match="metric 'loss' must be a number"):
        mgr.save(1, state(1), metrics={"loss": "low"})
    with pytest.raises(xlakit.CheckpointSerializationError, match="cannot save model"):
        mgr.save(1, {"model": torch.nn.Linear(2, 2)}, metrics={"loss": 1.0})
    assert mgr.all_steps() == [] and not steps.scan(tmp_path).pending  # refused: no step folder left
    mgr.close()
    with pytest.raises(RuntimeError, match="is closed"):
        mgr.save(2, state(2), metrics={"loss": 1.0})


# -- issue 19: damaged records, rollbacks, numpy numbers, exit without close -----------------------

def _truncate(record) -> None:
    text = record.read_text()
    record.write_text(text[: len(text) // 2])


def test_a_damaged_step_record_is_named_never_skipped_silently_nor_reused(tmp_path, caplog):
    # Regression: a truncated xlakit-step.json made its step vanish from all_steps() without a word,
    # save(20, force=True) then raised a raw JSONDecodeError, and a step folder copied under
    # another number raised a bare ValueError.
    with CheckpointManager(tmp_path) as mgr:
        for step in (10, 20):
            mgr.save(step, state(step))
    _truncate(tmp_path / "20" / steps.STEP_RECORD)
    mgr = CheckpointManager(tmp_path)
    with caplog.at_level("WARNING", logger="xlakit"):
        assert mgr.all_steps() == [10] and mgr.latest_step() == 10
    told = [r.getMessage() for r in caplog.records if "is not a step of the manager" in r.getMessage()]
    assert len(told) == 1 and f"{tmp_path / '20'}" in told[0] and "damaged (it is not whole JSON" in told[0]
    with pytest.raises(xlakit.CheckpointWriteError, match=r"cannot save step 20 .* is damaged") as info:
        mgr.save(20, state(20), force=True)
    assert any("move it away" in n for n in info.value.__notes__)
    with pytest.raises(xlakit.CheckpointCorruptError, match="step 20 .* is not a step: its xlakit-step.json is damaged"):
        mgr.restore(20)
    mgr.close()
    shutil.copytree(tmp_path / "10", tmp_path / "30")  # a step folder copied under another number
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(xlakit.CheckpointWriteError, match=r"cannot save step 30 .*records step 10 in folder '30'"):
            mgr.save(30, state(30))
        mgr.save(40, state(40))
        assert mgr.all_steps() == [10, 40]
    assert sorted(steps.scan(tmp_path).damaged) == [20, 30]  # never touched, never reused


def test_should_save_after_rolling_back_saves_the_steps_trained_again(tmp_path):
    # Regression: after restoring an earlier step and training on, should_save was False up to the
    # old latest step, so the steps trained again were never saved (the latest was from the run
    # given up); a step whose asynchronous save failed was never saved again either.
    mgr = CheckpointManager(tmp_path, save_interval_steps=10)
    for step in (10, 20, 30):
        mgr.save(step, state(step))
    mgr.restore(10)  # roll back, train on from step 11
    # 20 is due and its save refused, naming retire_steps_after (test_manager_rollback.py)
    assert [s for s in range(11, 41) if mgr.should_save(s)] == [20, 40]
    shutil.rmtree(tmp_path / "20")  # the run given up, deleted by hand, then a rollback
    shutil.rmtree(tmp_path / "30")
    assert mgr.restore(10)["step"] == 10
    assert [s for s in range(11, 41) if mgr.should_save(s)] == [20, 30, 40]
    mgr.save(20, state(20))
    assert mgr.all_steps() == [10, 20] and not mgr.should_save(20)
    mgr.close()


def test_a_failed_asynchronous_save_leaves_its_step_to_save_again(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, asynchronous=True)
    failed = _full_disk(monkeypatch)
    assert mgr.save(1, state(1)) is True
    assert failed.wait(30)
    monkeypatch.undo()
    with pytest.raises(xlakit.CheckpointWriteError):
        mgr.wait()
    assert mgr.should_save(1) and mgr.save(1, state(1)) is True
    mgr.close()
    assert mgr.all_steps() == [1]


def test_numpy_steps_and_metrics_are_numbers(tmp_path):
    np = pytest.importorskip("numpy")
    with CheckpointManager(tmp_path, best_metric="loss") as mgr:
        assert mgr.should_save(np.int64(5))
        assert mgr.save(np.int64(5), state(5), metrics={"loss": np.float32(0.25), "n": np.int32(3)}) is True
        assert mgr.save(np.int64(6), state(6), metrics={"loss": np.float64(0.5)}) is True
        assert mgr.all_steps() == [5, 6] and mgr.best_step() == 5
    record = json.loads((tmp_path / "5" / steps.STEP_RECORD).read_text())
    assert record["step"] == 5 and record["metrics"] == {"loss": 0.25, "n": 3}
    with CheckpointManager(tmp_path, best_metric="loss") as mgr:
        with pytest.raises(TypeError, match="metric 'loss' must be a number, got True"):
            mgr.save(7, state(7), metrics={"loss": np.bool_(True)})
        with pytest.raises(TypeError, match="step must be a whole number"):
            mgr.save(np.float64(7.0), state(7), metrics={"loss": 1.0})


def test_an_asynchronous_save_committed_at_exit_without_close_applies_retention(tmp_path):
    # Regression: the exit hook committed the last asynchronous save, but retention never ran for
    # it, so a script that forgot close() kept one step more than max_to_keep on every run.
    code = ("import sys, torch, xlakit\n"
            "mgr = xlakit.CheckpointManager(sys.argv[1], asynchronous=True, max_to_keep=1)\n"
            "for step in (1, 2):\n"
            "    mgr.save(step, {'w': torch.full((1 << 20,), float(step))})\n")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    # It may say that it waits for the save; nothing failed.
    assert run.returncode == 0 and all("waiting for the asynchronous save of step 2" in line
                                       for line in run.stderr.splitlines()), run.stderr
    assert names(tmp_path) == ["2"]


def test_restore_of_part_of_a_step_with_strict_false_by_the_manager_and_a_reader(tmp_path):
    # Regression (issue 19's partial restore, noticed left out of the manager): the template of the
    # model alone, from a step that saved the model, the optimizer and the step.
    state = {"model": {"w": torch.full((3,), 2.0)}, "optim": {"m": torch.ones(3)}, "step": 5}
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(5, state)
        model = {"model": {"w": torch.zeros(3)}}
        with pytest.raises(xlakit.CheckpointMismatchError, match="optim"):
            mgr.restore(5, template=model)  # strict by default
        assert torch.equal(model["model"]["w"], torch.zeros(3))
        out = mgr.restore(5, template=model, options=xlakit.LoadOptions(strict=False))
        assert out["model"]["w"] is model["model"]["w"] and torch.equal(model["model"]["w"], torch.full((3,), 2.0))
        assert set(out) == {"model"}
        seen = []
        reader = xlakit.ReadOnlyCheckpointManager(tmp_path / "run")
        fresh = {"model": {"w": torch.zeros(3)}}
        reader.restore(template=fresh, options=xlakit.LoadOptions(strict=False, extra_keys_callback=seen.extend))
        assert torch.equal(fresh["model"]["w"], torch.full((3,), 2.0)) and sorted(seen) == ["optim", "step"]
