"""xlakit.save of SPMD-sharded state: compile counts against stock .cpu(), values after a round trip."""

import torch

import common
import xlakit
from xlakit.checkpoint.file import spmd
from xlakit.checkpoint.format import archive

tmp = common.args()
src = common.sources()
state = {name: common.sharded(host, mesh, spec) for name, (host, mesh, spec) in src.items()}
state["pending"] = state["even"] * 2 + 1  # not yet executed: the save's one sync runs it
state["unsharded"] = torch.arange(5.0).to(state["even"].device)
state["host"] = torch.ones(3)
expected = {name: host for name, (host, _, _) in src.items()}
expected.update(pending=src["even"][0] * 2 + 1, unsharded=torch.arange(5.0), host=torch.ones(3))


def mismatches(loaded: dict) -> list[str]:
    bad = [k for k in expected if k not in loaded]
    for k, want in expected.items():
        got = loaded.get(k)
        if got is None or got.dtype != want.dtype or got.shape != want.shape or bytes(
                archive.tensor_bytes(got.contiguous())) != bytes(archive.tensor_bytes(want)):
            bad.append(k)
    return bad


result = {}
before = common.compiles()
xlakit.save(state, tmp / "s.pt")
result["first_save_compiles"] = common.compiles() - before
result["sharded"] = sorted(k for k, t in state.items() if spmd.is_sharded(t))
resaves = []
for _ in range(3):
    before = common.compiles()
    xlakit.save(state, tmp / "s.pt")
    resaves.append(common.compiles() - before)
result["resave_compiles"] = resaves
result["mismatch_xlakit_load"] = mismatches(xlakit.load(tmp / "s.pt"))
result["mismatch_torch_load"] = mismatches(torch.load(tmp / "s.pt", map_location="cpu",
                                                      weights_only=True))

# Byte cap below any tensor: one tensor per batch, each sharded one assembled on its own.
with common.counting_calls(spmd, "assemble") as calls:
    before = common.compiles()
    xlakit.save(state, tmp / "small.pt", max_inflight_bytes=16)
    result["small_batch_compiles"] = common.compiles() - before
result["small_batch_assembled"] = len(calls)
result["mismatch_small_batch"] = mismatches(xlakit.load(tmp / "small.pt"))

# The contrast: stock .cpu() of the same sharded tensor compiles a replication program each time.
cpu = []
for _ in range(3):
    before = common.compiles()
    state["even"].cpu()
    cpu.append(common.compiles() - before)
result["cpu_compiles"] = cpu
common.finish("save_sharded", result)
