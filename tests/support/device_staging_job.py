"""An asynchronous save staged on the device, on torch_xla's TPU route, its device memory counted (tests only).

Run as a fresh process: stock torch_xla with `PJRT_DEVICE=TPU`, `TPU_LIBRARY_PATH`
xlakit's PJRT wrapper and `XLAKIT_PJRT_PLUGIN` xla-cpu-pjrt's plugin standing in
for libtpu (the test sets the environment). The save takes the route's own
transfer backend (`auto`). Prints one JSON line: the wrapper's live device bytes
above the state when the save returned, after each training step once the
runtime has freed what the step dropped ("settled"), and after the save; the
transfer backend taken; whether the values saved are the call's while training
steps donated the state's buffers.

The peak over the save is not a measure of the save: a step's old buffers are
freed when the runtime gets to it, so under load the next step's outputs can
meet them (a peak of copies + up to two states of the steps' own).
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch_xla

import xlakit
from xlakit.checkpoint.file import transfer
from xlakit.runtime import wrap_memory

TENSORS, NUMEL = 8, 1 << 18  # 8 MiB of float32
STATE_BYTES = TENSORS * NUMEL * 4


def live() -> int:
    return sum(d["live_bytes"] for d in wrap_memory.report(plugin_stats=False)["devices"])


def settled(base: int, bound: int) -> int:
    """Live bytes above `base` once they are at most `bound`, or the last seen after 10 s: the
    runtime frees a dropped buffer once its last use is done, later under load."""
    for _ in range(200):
        extra = live() - base
        if extra <= bound:
            return extra
        time.sleep(0.05)
    return extra


def main() -> dict:
    device = torch_xla.device()
    state = {f"w{i}": torch.full((NUMEL,), float(i), device=device) for i in range(TENSORS)}
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    backends = []
    real = transfer.backend_for
    transfer.backend_for = lambda *a, **k: backends.append(real(*a, **k).name) or real(*a, **k)
    gc.collect()
    base = live()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.pt"
        handle = xlakit.save(state, path, asynchronous=True, staging=sys.argv[2], transfer_backend=sys.argv[1])
        returned = live()
        steps = []
        for _ in range(3):  # training steps: in-place updates, their buffers donated
            for t in state.values():
                t.add_(1.0)
            torch_xla.sync()
            torch_xla._XLAC._xla_wait_device_ops(devices=[])
            steps.append(settled(base, STATE_BYTES if sys.argv[2] == "device" else 0))
        handle.result(timeout=120)
        torch_xla._XLAC._xla_wait_device_ops(devices=[])
        gc.collect()
        after = settled(base, 0)
        loaded = xlakit.load(path)
        saved_the_call = all(torch.equal(loaded[f"w{i}"], torch.full((NUMEL,), float(i))) for i in range(TENSORS))
    return {"state_bytes": STATE_BYTES, "returned_extra": returned - base, "settled_extra": steps,
            "after_extra": after, "backends": sorted(set(backends)), "saved_the_call": saved_the_call,
            "device_hw": torch_xla._XLAC._xla_real_devices([str(device)])[0], "staging": sys.argv[2]}


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
