"""xlakit.dcp_save of SPMD-sharded state: compile counts, round trip, loads at other shardings."""


import torch
import torch.distributed.checkpoint as dcp
import torch_xla
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

import common
import xlakit
from xlakit.checkpoint.file import spmd

tmp = common.args()
src = common.sources()
device = torch_xla.device()
model = {name: common.sharded(host, mesh, spec) for name, (host, mesh, spec) in src.items()}
model["pending"] = model["even"] * 2 + 1  # not yet executed: the save's one sync runs it
model["unsharded"] = torch.arange(5.0).to(device)
state = {"model": model, "optim": {"step": 3, "lr": 0.5}, "host": torch.ones(3)}
expected = {name: host for name, (host, _, _) in src.items()}
expected.update(pending=src["even"][0] * 2 + 1, unsharded=torch.arange(5.0))
path = tmp / "ckpt"
result = {"path": str(path)}

saves = []
for _ in range(3):
    before = common.compiles()
    xlakit.dcp_save(state, path)
    saves.append(common.compiles() - before)
result["save_compiles"] = saves
result["sharded"] = sorted(k for k, t in model.items() if spmd.is_sharded(t))

with common.counting_calls(spmd, "local_shards") as calls:
    before = common.compiles()
    xlakit.dcp_save(state, tmp / "small", max_inflight_bytes=16)
    result["small_batch_compiles"] = common.compiles() - before
result["small_batch_shard_copies"] = len(calls)


def template(place) -> dict:
    """Zeros of every saved tensor, placed by `place(name, zeros)`."""
    return {"model": {name: place(name, torch.zeros_like(host)) for name, host in expected.items()},
            "optim": {"step": 0, "lr": 0.0}, "host": torch.zeros(3)}


def load_and_compare(target: dict, folder=path, loader=None) -> list[str]:
    specs = {k: torch_xla._XLAC._get_xla_sharding_spec(t) for k, t in target["model"].items()
             if t.device.type == "xla"}
    (loader or xlakit.dcp_load)(target, folder)
    bad = [k for k, want in expected.items() if not common.same(target["model"][k].cpu(), want)]
    bad += [f"{k} resharded" for k, spec in specs.items()
            if torch_xla._XLAC._get_xla_sharding_spec(target["model"][k]) != spec]
    if target["optim"] != {"step": 3, "lr": 0.5} or not torch.equal(target["host"], torch.ones(3)):
        bad.append("non-tensor values")
    return bad


def as_saved(name, zeros):
    if name in src:
        return common.sharded(zeros, src[name][1], src[name][2])
    return common.sharded(zeros, common.MESH_4, ("x", None)) if name == "pending" else zeros.to(device)


def other_dim(name, zeros):
    # Saved on dim 0 -> loaded on dim 1 and back; 2x2-mesh tensors onto the 1-D mesh.
    spec = (None, "x") if name in ("even", "padded", "pending", "partial_bf16") else ("x", None)
    return common.sharded(zeros, common.MESH_4, spec if zeros.dim() == 2 else ("x",))


def mesh_2x2(name, zeros):
    return common.sharded(zeros, common.MESH_2X2, ("x", "y") if zeros.dim() == 2 else ("x",))


result["mismatch_same_sharding"] = load_and_compare(template(as_saved))
result["mismatch_other_dim"] = load_and_compare(template(other_dim))
result["mismatch_2x2_mesh"] = load_and_compare(template(mesh_2x2))
result["mismatch_host"] = load_and_compare(template(lambda name, zeros: zeros))
result["mismatch_small_batch"] = load_and_compare(template(as_saved), tmp / "small")
# The folder is torch_xla's layout: its own planner loads it without xlakit.
result["mismatch_torch_xla_planner"] = load_and_compare(
    template(mesh_2x2), loader=lambda t, p: dcp.load(t, storage_reader=dcp.FileSystemReader(str(p)),
                                                      planner=SPMDLoadPlanner(), no_dist=True))

# mark_sharding returns torch_xla's XLAShardedTensor wrapper; it saves as the tensor it wraps.
wrapped = common.xs.mark_sharding(src["padded"][0].to(device), common.MESH_4, (None, "x"))
xlakit.dcp_save({"w": wrapped}, tmp / "wrapped")
back = {"w": torch.zeros(5, 7)}
xlakit.dcp_load(back, tmp / "wrapped")
result["wrapper_type"] = type(wrapped).__name__
result["wrapper_round_trip"] = common.same(back["w"], src["padded"][0])

result["timeout"] = common.timed_out_with_slow_shards(
    lambda: xlakit.dcp_save({"model": {"even": model["even"] * 0}}, path, timeout_s=0.5))
result["mismatch_after_timeout"] = load_and_compare(template(as_saved))
common.finish("dcp_sharded", result)
