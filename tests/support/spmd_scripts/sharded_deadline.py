"""The SPMD shard copy runs under the save's deadline; multi-host shards are refused, not guessed."""


import torch

import common
import xlakit
from xlakit.checkpoint.file import spmd

tmp = common.args()
host, mesh, spec = common.sources()["even"]
state = {"w": common.sharded(host, mesh, spec)}
xlakit.save(state, tmp / "c.pt")
result = {}

result["timeout"] = common.timed_out_with_slow_shards(
    lambda: xlakit.save({"w": state["w"] * 0}, tmp / "c.pt", timeout_s=0.5))
result["previous_intact"] = bool(torch.equal(xlakit.load(tmp / "c.pt")["w"], host))

try:
    spmd.to_host([state["w"]], timeout_s=0.0, others=lambda ts: [])
except xlakit.CheckpointTimeoutError as e:
    result["to_host_expired_stage"] = e.stage

# A host that holds only some shards (multi-host SPMD) must not write a half-filled tensor.
real_indices = spmd.unique_shard_indices
spmd.unique_shard_indices = lambda t: real_indices(t)[:2]
try:
    spmd.assemble(state["w"])
except xlakit.RuntimeFeatureError as e:
    result["partial_cover_error"] = str(e)
common.finish("sharded_deadline", result)
