"""The `tpu` (TorchTPU) transfer backend's logic, with fake tensors: runs without torch_tpu.

TorchTPU itself is exercised in tests/torchtpu (its own environment); its CPU
plugin has no host allocator, so the non-blocking branch is proven here only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xlakit.checkpoint.file import transfer


class FakeTpuTensor:
    """Answers `.to("cpu", non_blocking=True)` as a client with (or without) a host allocator would."""

    def __init__(self, value: float, *, allocator: bool, index: int = 0):
        self.value, self.allocator, self.calls = value, allocator, []
        self.device = SimpleNamespace(type="tpu", index=index)

    def detach(self):
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(non_blocking)
        if non_blocking and not self.allocator:
            raise NotImplementedError("to_copy(): host memory allocator is not implemented for this client")
        return torch.full((2,), self.value)


@pytest.fixture
def syncs(monkeypatch):
    count = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda index=None: count.append(index))
    return count


def test_backend_for_tpu():
    assert isinstance(transfer.backend_for("tpu", torch.zeros(1)), transfer.TpuTransfer)


def test_non_blocking_copies_then_one_sync_per_batch(syncs):
    backend = transfer.TpuTransfer()
    tensors = [FakeTpuTensor(i, allocator=True, index=i % 2) for i in range(3)]
    backend.prepare(tensors)
    hosts = backend.to_host(tensors, timeout_s=10)
    assert [h[0].item() for h in hosts] == [0, 1, 2]
    assert all(t.calls == [True] for t in tensors)
    assert syncs == [0, 1, 0, 1], "each device synced before the transfer, and after the batch's copies"


def test_without_a_host_allocator_falls_back_to_blocking_copies_for_good(syncs, monkeypatch):
    copied = []
    monkeypatch.setattr(transfer, "copy_to_host", lambda t: copied.append(t) or torch.full((2,), t.value))
    backend = transfer.TpuTransfer()
    tensors = [FakeTpuTensor(i, allocator=False) for i in range(3)]
    hosts = backend.to_host(tensors, timeout_s=10)
    assert [h[0].item() for h in hosts] == [0, 1, 2] and copied == tensors
    assert tensors[0].calls == [True] and tensors[1].calls == [] and not backend.non_blocking
    assert syncs == [], "blocking copies need no synchronisation after them"


def test_the_deadline_is_checked_before_each_copy(syncs, monkeypatch):
    clock = iter([0.0, 0.0, 5.0, 99.0])
    monkeypatch.setattr(transfer.time, "monotonic", lambda: next(clock))
    backend = transfer.TpuTransfer()
    with pytest.raises(TimeoutError, match="1 of 3 tensors of the batch copied"):
        backend.to_host([FakeTpuTensor(i, allocator=True) for i in range(3)], timeout_s=1.0)
