"""`xlakit.ReadOnlyCheckpointManager`: a second process lists and restores a manager's steps while the
training job holds the folder, never writing, deleting or locking, and sees only committed steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import xlakit
from xlakit.checkpoint.stepstore import steps
from tests.support import SUPPORT

WORKER = SUPPORT / "readonly_worker.py"


def _state(step: int) -> dict:
    return {"w": torch.full((3,), float(step)), "step": step}


def test_a_reader_works_beside_the_writer_that_holds_the_folder(tmp_path):
    # Regression: the only way to read a manager's steps was a second CheckpointManager, which the
    # writer's lock refuses (rightly, for writers): an evaluation job beside training had no way in.
    with xlakit.CheckpointManager(tmp_path, max_to_keep=2, best_metric="loss") as writer:
        for step in (1, 2, 3):
            writer.save(step, _state(step), metrics={"loss": 1.0 / step if step != 2 else 0.01})
        with pytest.raises(xlakit.CheckpointBusyError):
            xlakit.CheckpointManager(tmp_path)
        before = sorted(os.listdir(tmp_path))
        reader = xlakit.ReadOnlyCheckpointManager(tmp_path)
        assert reader.all_steps() == [2, 3] and reader.latest_step() == 3 and reader.best_step() == 2
        assert reader.best_step("loss", "max") == 3 and reader.metrics(2) == {"loss": 0.01}
        assert reader.restore()["step"] == 3 and torch.equal(reader.restore(2)["w"], torch.full((3,), 2.0))
        template = {"w": torch.zeros(3), "step": 0}
        assert reader.restore(3, template=template)["w"] is template["w"] and template["w"][0] == 3.0
        assert reader.wait_for_step(2, timeout_s=1) == 3 and reader.wait_for_step(3, timeout_s=0.05) is None
        with pytest.raises(FileNotFoundError, match=r"no committed step 1 .* committed: \[2, 3\]"):
            reader.restore(1)
        writer.save(4, _state(4), metrics={"loss": 0.5})
        assert reader.wait_for_step(3, timeout_s=1) == 4
        writer.save(5, _state(5), metrics={"loss": 0.5})  # retention drops 3 (2 is the best)
        assert reader.wait_for_step(4, timeout_s=1) == 5 and reader.all_steps() == [2, 4, 5]
        assert sorted(os.listdir(tmp_path)) == sorted(set(before) - {"3"} | {"4", "5"})
    assert steps.LOCK_FILE in os.listdir(tmp_path)  # the writer's; the reader made none


def test_a_reader_never_creates_a_folder_or_a_lock(tmp_path):
    with pytest.raises(FileNotFoundError, match="it never creates one"):
        xlakit.ReadOnlyCheckpointManager(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
    reader = xlakit.ReadOnlyCheckpointManager(tmp_path)
    assert reader.all_steps() == [] and reader.latest_step() is None and reader.best_step() is None
    with pytest.raises(FileNotFoundError, match="no committed step"):
        reader.restore()
    assert os.listdir(tmp_path) == []


def test_wrong_arguments_are_named_never_a_crash_or_a_silent_wait(tmp_path, monkeypatch):
    # From an attack as a new user: `after` went unchecked (nan waited out the timeout, 'abc' was a
    # bare TypeError of a comparison), an infinite poll interval crashed in time.sleep, and "" read
    # the working directory.
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, {"w": torch.ones(1)})
    reader = xlakit.ReadOnlyCheckpointManager(tmp_path / "run")
    with pytest.raises(TypeError, match="step must be a whole number, got 'abc'"):
        reader.wait_for_step("abc", timeout_s=30)
    with pytest.raises(TypeError, match="step must be a whole number, got nan"):
        reader.wait_for_step(float("nan"), timeout_s=30)
    assert reader.wait_for_step(2, timeout_s=float("inf"), poll_interval_s=float("inf")) == 3
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        raise InterruptedError  # one poll is enough to see how long it sleeps

    monkeypatch.setattr("xlakit.checkpoint.stepstore.readonly.time.sleep", sleep)
    with pytest.raises(InterruptedError):
        reader.wait_for_step(3, timeout_s=1e300, poll_interval_s=1e300)
    assert slept == [3600.0]
    monkeypatch.undo()
    for make in (xlakit.ReadOnlyCheckpointManager, xlakit.CheckpointManager):
        with pytest.raises(ValueError, match="cannot be the empty path"):
            make("")


def _run(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "dcp"])
def test_a_reader_process_sees_only_committed_steps_while_the_writer_saves_and_deletes(tmp_path, layout):
    folder, done = tmp_path / "run", tmp_path / "writer-done"
    folder.mkdir()
    reader = _run("read", str(folder), layout, str(done))  # first: it holds nothing the writer needs
    ready = Path(f"{done}.ready")
    deadline = time.monotonic() + 120
    while not ready.exists() and reader.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    writer = _run("write", str(folder), layout, "40")
    w_out, w_err = writer.communicate(timeout=600)
    done.touch()
    r_out, r_err = reader.communicate(timeout=600)
    assert writer.returncode == 0, w_err[-3000:]
    assert reader.returncode == 0, r_err[-3000:]
    assert json.loads(w_out.splitlines()[-1]) == {"steps": [39, 40]}
    seen = json.loads(r_out.splitlines()[-1])
    assert seen["writes"] == [] and seen["bad"] == []  # never wrote, locked or read a torn state
    assert seen["reads"] >= 3 and len(set(seen["steps_read"])) >= 2, seen  # it followed the writer
    assert seen["final_steps"] == [39, 40] and seen["explicit_ok"] + seen["explicit_deleted"] == seen["reads"]
    with xlakit.CheckpointManager(folder) as again:  # and the folder is the writer's, as if it had been alone
        assert again.all_steps() == [39, 40]
