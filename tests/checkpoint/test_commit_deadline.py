"""No late commit: an operation whose deadline passed before its commit never commits.

Regression (issue 25, item 2): the owner looks at the clock only between polls, so a save that
reached its commit after its deadline (`timeout_s=0.001` on 32 MiB) committed all the same.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import xlakit
from xlakit.checkpoint.core import operation, workers
from xlakit.checkpoint.objstore.client import Location, store_for


SHORT_S = 5.0


@pytest.fixture
def late_commit(monkeypatch):
    """Every commit point of an operation with a short deadline (`SHORT_S`) is reached just after
    it, and the owner does not poll the clock before (the race the bug lost, made certain)."""
    monkeypatch.setattr(operation, "_POLL_S", 30.0)
    original = operation.Operation.commit_point

    def late(self):
        if self.watch.timeout_s <= SHORT_S:
            time.sleep(max(self.deadline - time.monotonic(), 0.0) + 0.02)
        return original(self)

    monkeypatch.setattr(operation.Operation, "commit_point", late)


def state(v: float) -> dict:
    return {"w": torch.full((1000,), v), "step": int(v)}


def check_timed_out_at_commit(info) -> None:
    err = info.value
    assert err.stage == "commit", str(err)
    assert "stage 'commit'" in str(err)
    assert any("did not commit" in n for n in err.__notes__)


def test_the_issues_tiny_deadline_never_commits_a_quick_save(tmp_path):
    p = tmp_path / "x.pt"
    with pytest.raises(xlakit.CheckpointTimeoutError):
        xlakit.save({f"w{i}": torch.randn(2**20) for i in range(8)}, p, timeout_s=0.001)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_file_save_reaching_its_commit_after_the_deadline_does_not_commit(tmp_path, late_commit,
                                                                             asynchronous, no_pending_save):
    p = tmp_path / "x.pt"
    xlakit.save(state(1), p)
    with pytest.raises(xlakit.CheckpointTimeoutError) as info:
        h = xlakit.save(state(2), p, timeout_s=1, asynchronous=asynchronous)
        if h is not None:
            h.result()
    check_timed_out_at_commit(info)
    assert workers.wait_until_idle(10)
    assert xlakit.load(p)["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["x.pt"]


def test_a_dcp_save_reaching_its_commit_after_the_deadline_does_not_commit(tmp_path, late_commit):
    p = tmp_path / "d"
    with pytest.raises(xlakit.CheckpointTimeoutError) as info:
        xlakit.dcp_save({"w": torch.ones(10)}, p, timeout_s=1)
    check_timed_out_at_commit(info)
    assert workers.wait_until_idle(10)
    assert os.listdir(tmp_path) == []


def test_a_manager_step_reaching_its_commit_after_the_deadline_does_not_commit(tmp_path, late_commit):
    m = xlakit.CheckpointManager(tmp_path / "run", options=xlakit.SaveOptions(timeout_s=1))
    try:
        with pytest.raises(xlakit.CheckpointTimeoutError) as info:
            m.save(10, state(1))
        check_timed_out_at_commit(info)
        assert workers.wait_until_idle(10)
        assert m.latest_step() is None
    finally:
        m.close()


def test_on_a_bucket_a_save_reaching_its_commit_after_the_deadline_creates_no_record(bucket, late_commit):
    url = f"{bucket}/x.pt"
    xlakit.save(state(1), url)
    with pytest.raises(xlakit.CheckpointTimeoutError) as info:
        xlakit.save(state(2), url, timeout_s=2)
    check_timed_out_at_commit(info)
    assert workers.wait_until_idle(10)
    assert xlakit.load(url)["step"] == 1
    loc = Location.parse(url)
    assert len([n for n in store_for(loc).list(None, loc) if "commit" in n]) == 1


def test_on_a_bucket_a_dcp_save_reaching_its_commit_after_the_deadline_creates_no_record(bucket, late_commit):
    url = f"{bucket}/d"
    with pytest.raises(xlakit.CheckpointTimeoutError) as info:
        xlakit.dcp_save({"w": torch.ones(10)}, url, timeout_s=2)
    check_timed_out_at_commit(info)
    assert workers.wait_until_idle(10)
    loc = Location.parse(url)
    assert [n for n in store_for(loc).list(None, loc) if "commit" in n] == []


def test_on_a_bucket_a_manager_step_reaching_its_commit_after_the_deadline_does_not_commit(bucket, late_commit):
    m = xlakit.CheckpointManager(f"{bucket}/run", options=xlakit.SaveOptions(timeout_s=2))
    try:
        with pytest.raises(xlakit.CheckpointTimeoutError) as info:
            m.save(10, state(1))
        check_timed_out_at_commit(info)
        assert workers.wait_until_idle(10)
        assert m.latest_step() is None
    finally:
        m.close()
