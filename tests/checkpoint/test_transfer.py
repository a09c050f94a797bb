"""Host copies for storage-backed devices: never a device-side clone, exact values."""

from __future__ import annotations

import pytest
import torch

import xlakit
from xlakit.checkpoint.file import transfer
from xlakit.checkpoint.format.state import StorageEntry


@pytest.mark.parametrize("make", [
    lambda: torch.arange(60.0).reshape(6, 10),
    lambda: torch.arange(60.0).reshape(6, 10).t(),
    lambda: torch.arange(200.0).reshape(10, 20)[2:7, 3:15:2],
    lambda: torch.arange(24, dtype=torch.int16).reshape(2, 3, 4).permute(2, 0, 1),
    lambda: torch.arange(10.0)[10:],
])
def test_byte_span_copy_of_any_view_matches_contiguous(make):
    # The CUDA path copies a view's storage span and compacts it on the host; here it runs on CPU.
    t = make()
    host = transfer.copy_to_host(t)
    assert host.is_contiguous() and host.dtype == t.dtype and torch.equal(host, t.contiguous())


def test_batches_respect_the_cap_and_keep_order():
    entries = [StorageEntry(i, f"t{i}", torch.empty(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]
    plan = [[e.index for e in b] for b in transfer.batches(entries, 80)]
    assert plan == [[0, 1], [2], [3, 4, 5]]  # 40+40 bytes, then a 120-byte tensor alone


@pytest.mark.cuda
def test_cuda_state_is_copied_to_host_without_device_clones(tmp_path):
    device = torch.device("cuda")
    base = torch.randn(64, 64, device=device)
    state = {"w": base, "view": base.t()[3:9], "step": 1}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    xlakit.save(state, tmp_path / "c.pt")
    assert torch.cuda.max_memory_allocated(device) == resident  # nothing new on the device
    loaded = xlakit.load(tmp_path / "c.pt")
    assert torch.equal(loaded["w"], base.cpu()) and torch.equal(loaded["view"], base.t()[3:9].cpu())
