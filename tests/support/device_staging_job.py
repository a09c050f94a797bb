"""An asynchronous save staged on the device, on torch_xla's TPU route, its device memory counted (tests only).

Run as a fresh process: stock torch_xla with `PJRT_DEVICE=TPU`, `TPU_LIBRARY_PATH`
xlakit's PJRT wrapper and `XLAKIT_PJRT_PLUGIN` xla-cpu-pjrt's plugin standing in
for libtpu (the test sets the environment). The save takes the route's own
transfer backend (`auto`). Prints one JSON line: the wrapper's live device bytes
above the state when the save returned, its peak above the state over the save,
and after it; the transfer backend taken; whether the values saved are the
call's while training steps donated the state's buffers.
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


def live() -> tuple[int, int]:
    devices = wrap_memory.report(plugin_stats=False)["devices"]
    return sum(d["live_bytes"] for d in devices), sum(d["peak_bytes"] for d in devices)


def main() -> dict:
    device = torch_xla.device()
    state = {f"w{i}": torch.full((NUMEL,), float(i), device=device) for i in range(TENSORS)}
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    backends = []
    real = transfer.backend_for
    transfer.backend_for = lambda *a, **k: backends.append(real(*a, **k).name) or real(*a, **k)
    gc.collect()
    wrap_memory.reset_peaks()
    base, _ = live()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.pt"
        handle = xlakit.save(state, path, asynchronous=True, staging=sys.argv[2], transfer_backend=sys.argv[1])
        returned, _ = live()
        for _ in range(3):  # training steps: in-place updates, their buffers donated
            for t in state.values():
                t.add_(1.0)
            torch_xla.sync()
            torch_xla._XLAC._xla_wait_device_ops(devices=[])  # one step at a time: its peak, not several's
        handle.result(timeout=120)
        torch_xla._XLAC._xla_wait_device_ops(devices=[])
        gc.collect()
        for _ in range(100):  # the runtime frees a dropped buffer once its last use is done: give it 5 s
            after, peak = live()
            if after <= base:
                break
            time.sleep(0.05)
        loaded = xlakit.load(path)
        saved_the_call = all(torch.equal(loaded[f"w{i}"], torch.full((NUMEL,), float(i))) for i in range(TENSORS))
    return {"state_bytes": TENSORS * NUMEL * 4, "returned_extra": returned - base, "peak_extra": peak - base,
            "after_extra": after - base, "backends": sorted(set(backends)), "saved_the_call": saved_the_call,
            "device_hw": torch_xla._XLAC._xla_real_devices([str(device)])[0], "staging": sys.argv[2]}


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
