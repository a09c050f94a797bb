"""An asynchronous save of SPMD-sharded state staged on the device: the device copies stay split as
their tensors are, and the values saved are those of the call while the next step updates them."""

import torch
import torch_xla

import common
import xlakit
from xlakit.checkpoint.file import device_staging, spmd

tmp = common.args()
src = common.sources()
state = {name: common.sharded(host, mesh, spec) for name, (host, mesh, spec) in src.items()}
torch_xla.sync()
copies = {}
real_copy = device_staging._copy


def recording(t):
    copy = real_copy(t)
    copies[len(copies)] = (spmd.is_sharded(t), spmd.is_sharded(copy),
                           torch_xla._XLAC._get_xla_sharding_spec(t) == torch_xla._XLAC._get_xla_sharding_spec(copy))
    return copy


device_staging._copy = recording
before = common.compiles()
handle = xlakit.save(state, tmp / "s.pt", asynchronous=True, staging="device")
for t in state.values():  # the next step: in place, while the save moves its copies to the host
    t.add_(1)
torch_xla.sync()
handle.result(timeout=120)
loaded = xlakit.load(tmp / "s.pt")
common.finish("device_staged", {
    "copies": len(copies),
    "sharded_copies_stay_sharded": all(copied == sharded for sharded, copied, _ in copies.values()),
    "same_specs": all(same for *_, same in copies.values()),
    "sharded": sum(sharded for sharded, *_ in copies.values()),
    "mismatch": [k for k, (host, _, _) in src.items() if not common.same(loaded[k], host)],
    "changed_after": all(not common.same(state[k].cpu(), host) for k, (host, _, _) in src.items()),
})
