"""One deadline per save: a hung device raises in time, never hangs the caller, never loses data."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import xlakit
from tests.support import fakes
from xlakit.checkpoint.core import workers

# After the deadline the owner waits STOP_GRACE_S for the hung worker (its note says whether it stopped); the rest
# is slack for a loaded machine. A hang (the device never returns) would still fail it by far.
MARGIN_S = workers.STOP_GRACE_S + 2.0


@pytest.fixture(autouse=True)
def no_stuck_workers_left():
    yield
    from xlakit.checkpoint.core import workers

    assert workers.wait_until_idle(10), "a fake hung device was never released"


@pytest.fixture
def previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    xlakit.save({"w": torch.full((1000,), 1.0)}, path)
    return path


@pytest.mark.parametrize("stage", ["sync", "transfer"])
def test_hung_device_raises_timeout_within_deadline_and_keeps_previous(previous, monkeypatch, stage):
    hung = fakes.FakeHungDevice(hang_in=stage)
    fakes.install(monkeypatch, hung)
    start = time.monotonic()
    try:
        with pytest.raises(xlakit.CheckpointTimeoutError) as info:
            xlakit.save({"w": torch.full((1000,), 2.0), "b": torch.zeros(3)}, previous, timeout_s=1.0)
        elapsed = time.monotonic() - start
    finally:
        hung.release()
    assert 1.0 <= elapsed < 1.0 + MARGIN_S
    err = info.value
    assert isinstance(err, TimeoutError)
    assert err.stage == stage
    assert f"stage {stage!r}" in str(err) and "timeout_s=1" in str(err)
    if stage == "transfer":
        assert err.tensor == "w" and "'w' in flight" in str(err)
    assert any("previous checkpoint" in n for n in err.__notes__)
    assert torch.equal(xlakit.load(previous)["w"], torch.full((1000,), 1.0))
    assert [p.name for p in previous.parent.iterdir()] == ["ckpt.pt"]


def test_next_save_refuses_while_the_device_is_stuck_and_works_once_it_recovers(previous, monkeypatch):
    hung = fakes.FakeHungDevice()
    fakes.install(monkeypatch, hung)
    with pytest.raises(xlakit.CheckpointTimeoutError):
        xlakit.save({"w": torch.full((1000,), 2.0)}, previous, timeout_s=0.5)
    monkeypatch.undo()
    with pytest.raises(xlakit.CheckpointBusyError, match="still blocked inside the runtime"):
        xlakit.save({"w": torch.full((1000,), 3.0)}, previous)
    hung.release()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            xlakit.save({"w": torch.full((1000,), 3.0)}, previous)
            break
        except xlakit.CheckpointBusyError:
            time.sleep(0.05)
    assert torch.equal(xlakit.load(previous)["w"], torch.full((1000,), 3.0))
    assert [p.name for p in previous.parent.iterdir()] == ["ckpt.pt"]


def test_stall_is_warned_before_the_deadline_naming_stage_and_tensor(tmp_path, monkeypatch, caplog):
    hung = fakes.FakeHungDevice()
    fakes.install(monkeypatch, hung)
    try:
        with caplog.at_level(logging.WARNING, logger="xlakit"):
            with pytest.raises(xlakit.CheckpointTimeoutError):
                xlakit.save({"big": torch.ones(10)}, tmp_path / "c.pt", timeout_s=1.0,
                            stall_warning_s=0.3)
    finally:
        hung.release()
    stalls = [r.getMessage() for r in caplog.records if "no progress" in r.getMessage()]
    assert len(stalls) == 1 and "stage 'transfer'" in stalls[0] and "'big'" in stalls[0]


def test_slow_but_progressing_save_within_deadline_succeeds(tmp_path, monkeypatch):
    fakes.install(monkeypatch, fakes.FakeSlowDevice(delay_s=0.1))
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(5)}
    xlakit.save(state, tmp_path / "c.pt", timeout_s=5, max_inflight_bytes=4000)
    assert torch.equal(xlakit.load(tmp_path / "c.pt")["t4"], torch.full((1000,), 4.0))


class FakeDeadlineDevice(fakes.HostTransfer):
    """A fake of the patched binding hitting its own deadline (DEADLINE_EXCEEDED -> TimeoutError)."""

    def to_host(self, tensors, *, timeout_s):
        raise TimeoutError("tensor #0 (f32[10]): 0 of 40 bytes copied before the deadline")


def test_runtime_deadline_error_becomes_a_checkpoint_timeout_naming_the_tensor(previous, monkeypatch):
    fakes.install(monkeypatch, FakeDeadlineDevice())
    with pytest.raises(xlakit.CheckpointTimeoutError, match=r"copy of 'w' passed its deadline") as info:
        xlakit.save({"w": torch.ones(10)}, previous)
    assert info.value.tensor == "w" and isinstance(info.value.__cause__, TimeoutError)
    assert torch.equal(xlakit.load(previous)["w"], torch.full((1000,), 1.0))
