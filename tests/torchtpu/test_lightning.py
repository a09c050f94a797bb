"""xlakit's Lightning plugin on TorchTPU's `tpu` tensors (the plugin itself needs no torch_xla)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.torchtpu


@pytest.mark.parametrize("asynchronous", [False, True])
def test_checkpoint_io_saves_tpu_state_and_maps_it_back(tpu, tmp_path, asynchronous):
    from xlakit.lightning import XlakitCheckpointIO

    io = XlakitCheckpointIO(asynchronous=asynchronous)
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(3)).to(tpu)
    expected = w.cpu()
    io.save_checkpoint({"state_dict": {"layer.weight": w}, "epoch": 2}, tmp_path / "epoch=2.ckpt")
    w.mul_(0)  # the loop goes on; the checkpoint keeps the values at the call
    back = io.load_checkpoint(tmp_path / "epoch=2.ckpt", map_location="tpu")
    io.teardown()
    got = back["state_dict"]["layer.weight"]
    assert back["epoch"] == 2 and got.device.type == "tpu" and torch.equal(got.cpu(), expected)
