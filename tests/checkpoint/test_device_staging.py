"""Asynchronous saves staged on the device (`staging="device"`): the caller waits for a device copy, the
background moves it to the host batch by batch (issue 35, item 3: the copy route a TPU takes).

The XLA tests run torch_xla's stock copy (`transfer_backend="stock"`) on the CPU PJRT client: a real copying
route, the one a TPU's buffers take; only its speed differs from a TPU's. One test runs torch_xla's own TPU
route (`PJRT_DEVICE=TPU`, xla-cpu-pjrt standing in for libtpu behind xlakit's PJRT wrapper, whose count of live
device buffers shows the copies' device memory). Out of device memory is a fake
(a CPU client does not run out); its message is the one PJRT raises.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

import xlakit
from tests.support import fakes, training
from xlakit.checkpoint.file import device_staging, pipeline, transfer

pytestmark = pytest.mark.usefixtures("no_pending_save")
MiB = 1 << 20


@pytest.mark.xla
def test_training_goes_on_while_the_device_copies_are_moved_to_the_host_off_the_callers_thread(tmp_path, monkeypatch):
    import torch_xla

    callers = []
    real = transfer.batch_to_host

    def recording(backend, batch, **kwargs):
        if batch[0].device_type == "xla":
            callers.append(threading.current_thread().name)
        return real(backend, batch, **kwargs)

    monkeypatch.setattr(transfer, "batch_to_host", recording)
    device = torch_xla.device()
    model, opt, step = training.linear_model(device, 256)
    step()  # pending: the save's sync runs it
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    handle = xlakit.save(state, tmp_path / "c.pt", asynchronous=True, transfer_backend="stock",
                         staging="device", max_inflight_bytes=MiB)
    assert callers == []  # no XLA tensor crossed to the host while the caller waited
    at_save = {k: v.cpu() for k, v in model.state_dict().items()}
    for _ in range(3):  # in-place updates that donate the old buffers, while the write runs
        step()
        torch_xla.sync()
    handle.result(timeout=60)
    assert callers and all(name.startswith("xlakit-transfer") for name in callers), callers
    saved = xlakit.load(tmp_path / "c.pt")
    assert all(torch.equal(saved["model"][k], at_save[k]) for k in at_save)
    assert not torch.equal(model.weight.cpu(), at_save["weight"])
    assert handle.transfer_s > 0 and handle.write_s > 0


@pytest.mark.xla
def test_each_batch_of_device_copies_is_dropped_once_on_the_host_and_none_outlives_the_save(tmp_path, monkeypatch):
    import torch_xla

    left, copies = [], []
    real_copy, real_to_host = device_staging._copy, device_staging.Copies.entries_to_host

    def copy(t):
        c = real_copy(t)
        copies.append(weakref.ref(c))
        return c

    def entries_to_host(self, entries, *, timeout_s):
        hosts = real_to_host(self, entries, timeout_s=timeout_s)
        left.append(len(self._copies))
        return hosts

    monkeypatch.setattr(device_staging, "_copy", copy)
    monkeypatch.setattr(device_staging.Copies, "entries_to_host", entries_to_host)
    device = torch_xla.device()
    state = {f"w{i}": torch.full((MiB // 4,), float(i), device=device) for i in range(8)}
    handle = xlakit.save(state, tmp_path / "c.pt", asynchronous=True, transfer_backend="stock",
                         staging="device", max_inflight_bytes=2 * MiB)
    handle.result(timeout=60)
    assert len(left) >= 4 and left == sorted(left, reverse=True) and left[-1] == 0, left
    gc.collect()
    assert len(copies) == 8 and all(ref() is None for ref in copies)
    assert torch.equal(xlakit.load(tmp_path / "c.pt")["w7"], torch.full((MiB // 4,), 7.0))


@pytest.mark.xla
def test_the_zero_copy_route_and_cpu_tensors_are_staged_as_on_the_host(tmp_path, monkeypatch):
    import torch_xla

    made = []
    real_copy = device_staging._copy
    monkeypatch.setattr(device_staging, "_copy", lambda t: made.append(t) or real_copy(t))
    state = {"x": torch.ones(1000, device=torch_xla.device()), "c": torch.zeros(1000)}
    # The CPU client's DLPack export already holds immutable buffers: nothing to copy on the device.
    handle = xlakit.save(state, tmp_path / "c.pt", asynchronous=True, transfer_backend="dlpack",
                         staging="device")
    state["c"].add_(1)  # a CPU tensor changed in place after the call: saved as it was
    handle.result(timeout=60)
    loaded = xlakit.load(tmp_path / "c.pt")
    assert made == [] and torch.equal(loaded["c"], torch.zeros(1000)) and torch.equal(loaded["x"], torch.ones(1000))


@pytest.mark.xla
def test_out_of_device_memory_fails_the_save_before_anything_is_written_and_says_what_to_do(tmp_path, monkeypatch):
    import torch_xla

    def out_of_memory(device_type, copies):  # a fake: the CPU client never runs out
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 33554432 bytes.")

    monkeypatch.setattr(device_staging, "_wait", out_of_memory)
    state = {"w": torch.ones(MiB // 4, device=torch_xla.device())}
    room = r"staging='device' needs room on the device .*staging='host'"
    with pytest.raises(xlakit.CheckpointError, match=room) as e:
        xlakit.save(state, tmp_path / "c.pt", asynchronous=True, transfer_backend="stock", staging="device")
    assert "bytes. Nothing was written" in str(e.value)  # the runtime's own full stop, not two
    assert list(tmp_path.iterdir()) == []
    # The bytes it needed were rounded to MiB: a state under half a MiB "needed room for 0 MiB".
    with pytest.raises(xlakit.CheckpointError, match=r"copy of the state's xla tensors \(3.9 KiB\)"):
        xlakit.save({"b": torch.ones(1000, device=torch_xla.device())}, tmp_path / "c.pt", asynchronous=True,
                    transfer_backend="stock", staging="device")
    monkeypatch.undo()
    xlakit.save(state, tmp_path / "c.pt", asynchronous=True, transfer_backend="stock", staging="device").result(60)
    assert torch.equal(xlakit.load(tmp_path / "c.pt")["w"], torch.ones(MiB // 4))


@pytest.mark.xla
def test_the_deadline_stops_the_background_transfer_and_nothing_commits_later(tmp_path, monkeypatch):
    import torch_xla

    path = tmp_path / "c.pt"
    xlakit.save({"w0": torch.zeros(4)}, path)
    fakes.slow_disk(monkeypatch, 0.3)  # a disk that stalls: the deadline passes mid-write
    device = torch_xla.device()
    state = {f"w{i}": torch.full((MiB // 4,), 1.0, device=device) for i in range(16)}
    handle = xlakit.save(state, path, asynchronous=True, transfer_backend="stock", staging="device",
                         max_inflight_bytes=2 * MiB, timeout_s=1.0)
    with pytest.raises(xlakit.CheckpointTimeoutError):
        handle.result(timeout=30)
    # Whatever was in flight has ended (waited for: a fixed sleep guessed how long the cancelled worker takes to
    # end, on a loaded machine too): still the previous checkpoint, and nothing else.
    assert xlakit.wait_until_idle(30)
    assert torch.equal(xlakit.load(path)["w0"], torch.zeros(4))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def _tpu_route_job(backend: str, staging: str) -> dict:
    """`device_staging_job.py` on torch_xla's TPU route: xlakit's PJRT wrapper in front of xla-cpu-pjrt."""
    import json
    import os

    from tests.support import REPO, pjrt_job
    from xlakit.runtime import pjrt_wrap

    env = {k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO)]), PJRT_DEVICE="TPU",
               TPU_LIBRARY_PATH=str(pjrt_wrap.library_path()), XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(),
               XLA_NO_SPECIAL_SCALARS="1")
    run = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "device_staging_job.py"), backend, staging],
                         env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.pjrt
@pytest.mark.slow
def test_on_the_tpu_route_the_device_holds_one_copy_of_the_state_until_it_is_on_the_host():
    pytest.importorskip("xla_plugins", reason="needs the xla-cpu-pjrt plugin from PyPI (the pjrt test tools)")
    on_device, on_host = _tpu_route_job("stock", "device"), _tpu_route_job("stock", "host")
    print("device:", on_device, "host:", on_host)  # shown when an assertion fails
    state = on_device["state_bytes"]
    assert on_device["backends"] == on_host["backends"] == ["xla-stock"]
    # The wrapper's count of live device buffers: the copies exist when the call returns, and are gone after.
    assert on_device["returned_extra"] == state and on_host["returned_extra"] == 0
    assert on_device["after_extra"] == 0 and on_host["after_extra"] == 0
    # After each training step, once the runtime freed what it dropped: at most the one copy on the device
    # (less as batches reach the host); on the host route nothing. A second copy anywhere reads here as
    # 2x the state for 10 s.
    assert max(on_device["settled_extra"]) <= state and on_host["settled_extra"] == [0, 0, 0]
    assert on_device["saved_the_call"] and on_host["saved_the_call"]


def test_device_staging_is_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match="staging must be one of 'host', 'device'"):
        xlakit.SaveOptions(staging="gpu")
    with pytest.raises(ValueError, match="applies to asynchronous saves only .*asynchronous=True"):
        xlakit.save({"w": torch.ones(2)}, tmp_path / "c.pt", staging="device")
    with pytest.raises(ValueError, match="staging applies to xlakit.save, not to dcp_save"):
        xlakit.dcp_save({"w": torch.ones(2)}, tmp_path / "d", staging="device")
    with pytest.raises(ValueError, match=r"CheckpointManager\(asynchronous=True\)"):
        xlakit.CheckpointManager(tmp_path / "m", options=xlakit.SaveOptions(staging="device"))
    assert list(tmp_path.iterdir()) == []


def test_a_manager_stages_its_asynchronous_saves_on_the_device_and_its_preemption_save_on_the_host(tmp_path,
                                                                                                     monkeypatch):
    seen = []
    real = pipeline.synced_groups
    monkeypatch.setattr(pipeline, "synced_groups",
                        lambda op, plan, opts: seen.append((opts.asynchronous, opts.staging)) or real(op, plan, opts))
    previous = signal.getsignal(signal.SIGTERM)
    mgr = xlakit.CheckpointManager(tmp_path, save_interval_steps=2, asynchronous=True,
                                   options=xlakit.SaveOptions(staging="device"))
    mgr.install_preemption_handler(grace_s=30)
    try:
        for step in range(1, 10):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the save at the agreed step is synchronous
            if mgr.should_save(step):
                mgr.save(step, {"w": torch.full((4,), float(step))})
            if mgr.reached_preemption(step):
                break
        mgr.wait()
        restored = mgr.restore(3)
    finally:
        mgr.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    assert mgr.all_steps() == [2, 3] and seen == [(True, "device"), (False, "host")]
    assert torch.equal(restored["w"], torch.full((4,), 3.0))


SAVER = textwrap.dedent("""
    import sys, torch, torch_xla, xlakit
    path, start = sys.argv[1], int(sys.argv[2])
    device = torch_xla.device()
    state = {"version": start, **{f"w{i}": torch.full((1 << 20,), float(start)).to(device) for i in range(8)}}
    torch_xla.sync()
    for version in range(start, start + 1000):
        handle = xlakit.save(state, path, asynchronous=True, transfer_backend="stock", staging="device",
                             max_inflight_bytes=8 << 20)
        state = {"version": version + 1, **{k: v + 1 for k, v in state.items() if k != "version"}}
        torch_xla.sync()  # the next step runs while the save moves its device copies to the host
        handle.result()
        print(version, flush=True)
""")


@pytest.mark.xla
@pytest.mark.slow
def test_kill_9_during_device_staged_saves_never_leaves_a_torn_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    versions = training.kill_9_trials(path, SAVER, seed=7)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    assert len(set(versions)) > 1


def _stalled_write(monkeypatch):
    fakes.slow_disk(monkeypatch, 0.2)  # a disk that stalls: the write is still going when it fails


def _failing_transfer(monkeypatch):
    real, calls = device_staging.Copies.entries_to_host, []

    def entries_to_host(self, entries, *, timeout_s):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("INTERNAL: the device was lost")
        return real(self, entries, timeout_s=timeout_s)

    monkeypatch.setattr(device_staging.Copies, "entries_to_host", entries_to_host)


def _refused_file(monkeypatch):
    from xlakit.checkpoint.store import local

    def open_part(self, op, rank, world):  # before the write asks for a batch
        raise xlakit.CheckpointWriteError("cannot create the temporary file: [Errno 28] No space left on device")

    monkeypatch.setattr(local.LocalFile, "open_part", open_part)


@pytest.mark.xla
@pytest.mark.parametrize("failure", ["deadline", "cancel", "transfer error", "file refused"])
def test_a_failed_write_frees_its_device_copies_while_its_handle_lives(tmp_path, monkeypatch, failure):
    # The error a handle keeps held the write's frames, and one of them the device copies not yet moved:
    # after a failed or cancelled save the device held up to a whole copy of the state until the handle went.
    import torch_xla

    refs = []
    real_copy = device_staging._copy
    monkeypatch.setattr(device_staging, "_copy", lambda t: refs.append(weakref.ref(c := real_copy(t))) or c)
    {"transfer error": _failing_transfer, "file refused": _refused_file}.get(failure, _stalled_write)(monkeypatch)
    device = torch_xla.device()
    state = {f"w{i}": torch.full((MiB // 4,), 1.0, device=device) for i in range(16)}
    handle = xlakit.save(state, tmp_path / "c.pt", asynchronous=True, transfer_backend="stock", staging="device",
                         max_inflight_bytes=2 * MiB, timeout_s=1.0 if failure == "deadline" else 60)
    if failure == "cancel":
        time.sleep(0.3)
        assert handle.cancel()
    else:
        with pytest.raises((xlakit.CheckpointError, RuntimeError)):
            handle.result(timeout=30)
    assert xlakit.wait_until_idle(10)  # a write past its deadline stops at its next check, then lets go
    gc.collect()
    assert len(refs) == 16 and [ref() for ref in refs if ref() is not None] == []
    assert handle.done() and list(tmp_path.iterdir()) == []


@pytest.mark.xla
def test_a_deadline_during_the_device_copy_names_that_stage_and_writes_nothing(tmp_path, monkeypatch):
    # It said stage 'stage', the name of the host arena's copy.
    import torch_xla

    real_wait = device_staging._wait

    def slow_device(device_type, copies):  # a fake: a device whose copy program outlasts the deadline
        time.sleep(1.5)
        real_wait(device_type, copies)

    monkeypatch.setattr(device_staging, "_wait", slow_device)
    state = {"w": torch.ones(MiB // 4, device=torch_xla.device())}
    with pytest.raises(xlakit.CheckpointTimeoutError) as info:
        xlakit.save(state, tmp_path / "c.pt", asynchronous=True, transfer_backend="stock", staging="device",
                    timeout_s=1.0)
    assert info.value.stage == "device copy" and info.value.tensor == "w"
    assert xlakit.wait_until_idle(10) and list(tmp_path.iterdir()) == []
