"""Load a checkpoint saved on 4 devices into a 2-device mesh (another SPMD world size)."""

import sys

import torch

import common
import xlakit

assert common.DEVICES == 2, f"expected CPU_NUM_DEVICES=2, got {common.DEVICES}"
expected = common.values()
expected.update(pending=expected["even"] * 2 + 1, unsharded=torch.arange(5.0))
target = {"model": {name: common.sharded(torch.zeros_like(host), common.MESH_ALL,
                                         ("x",) + (None,) * (host.dim() - 1))
                    for name, host in expected.items()},
          "optim": {"step": 0, "lr": 0.0}, "host": torch.zeros(3)}
xlakit.dcp_load(target, sys.argv[2])
bad = [k for k, want in expected.items() if not common.same(target["model"][k].cpu(), want)]
common.finish("dcp_two_devices", {"mismatch": bad, "optim": target["optim"]})
