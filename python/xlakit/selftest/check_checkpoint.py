"""The `checkpoint` check: a device-resident state saved and restored bit-exact, synchronously and in the background.

The state (about 256 MiB, 16 MiB with `--quick`: float32, bfloat16 and int64
tensors and a few plain values) is made on the host, put on the device (the
host-to-device bandwidth), read back (device-to-host), then:

* saved with `xlakit.save` and restored with `xlakit.restore` into zeroed
  tensors on the device, which must then hold the original bits;
* saved again with `asynchronous=True` (the time the caller is blocked, and
  the time to the commit) and read with `xlakit.load`, bit-exact too;
* and once more with `staging="device"` as well: the caller waits for a copy
  on the device rather than for the copy to the host (on a TPU, the figure
  to set against the one before).

Only the public API is used, as a training script would. The bandwidths are
set against the device's nominal link where one is known (`pcie.py`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from xlakit.selftest import pcie, report

NAME = "checkpoint"
MiB = 1 << 20


def host_state(nbytes: int, seed: int = 1234) -> dict[str, Any]:
    """A state of about `nbytes` on the host: different dtypes, 1024 columns, a few plain values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = max(8, nbytes // (1024 * 8))  # float32 half the bytes, bfloat16 a quarter, int64 a quarter
    return {"model": {"w": torch.randn(rows, 1024, generator=g),
                      "h": torch.randn(rows, 1024, generator=g).to(torch.bfloat16)},
            "optimizer": {"steps": torch.randint(-2**62, 2**62, (rows // 4, 1024), generator=g, dtype=torch.int64),
                          "lr": 0.001},
            "step": 1000}


def tensors(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every tensor of a nested state, by its path."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(tensors(v, f"{prefix}{k}/"))
        elif hasattr(v, "dtype"):
            out[f"{prefix}{k}"] = v
    return out


def map_tensors(state: dict[str, Any], fn) -> dict[str, Any]:
    """`state` with `fn` applied to each tensor (nested dicts followed; plain values kept)."""
    return {k: map_tensors(v, fn) if isinstance(v, dict) else fn(v) if hasattr(v, "dtype") else v
            for k, v in state.items()}


def differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Where `got` (any device) is not bit for bit `expected` (host); each named."""
    import torch

    out = []
    have = tensors(got)
    for name, want in tensors(expected).items():
        t = have.get(name)
        if t is None:
            out.append(f"{name} missing")
            continue
        t = t.cpu()
        if t.dtype != want.dtype or t.shape != want.shape:
            out.append(f"{name}: {t.dtype} {tuple(t.shape)}, expected {want.dtype} {tuple(want.shape)}")
        elif not torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            out.append(f"{name}: the bytes differ")
    return out


def op_timeout_s(nbytes: int, left_s: float) -> float:
    """The deadline of one save or restore of `nbytes`: two minutes plus the bytes at 20 MB/s, within what is
    left, so that a save that hangs fails named in minutes, not at the end of the whole self-test's deadline."""
    return max(1.0, min(left_s, 120.0 + nbytes / 20e6))


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds if seconds > 0 else float("inf")


def measure(backend: dict[str, Any], dev, nbytes: int, folder: Path, timeout_s: float) -> dict[str, Any]:
    """The check, in the device child: `dev` the started device, `folder` a fresh folder for the files."""
    import xlakit

    state = host_state(nbytes)
    total = sum(t.numel() * t.element_size() for t in tensors(state).values())
    timeout_s = op_timeout_s(total, timeout_s)
    t0 = time.perf_counter()
    on_device = map_tensors(state, dev.put)
    timings = {"host_to_device": time.perf_counter() - t0}
    t0 = time.perf_counter()
    back = map_tensors(on_device, lambda t: t.cpu())
    timings["device_to_host"] = time.perf_counter() - t0
    problems = [f"round trip through the device: {d}" for d in differences(state, back)]
    del back

    t0 = time.perf_counter()
    xlakit.save(on_device, folder / "sync.pt", timeout_s=timeout_s)
    timings["save"] = time.perf_counter() - t0
    template = map_tensors(on_device, lambda t: t.new_zeros(t.shape))
    dev.sync()
    t0 = time.perf_counter()
    restored = xlakit.restore(folder / "sync.pt", template, timeout_s=timeout_s)
    dev.sync()
    timings["restore"] = time.perf_counter() - t0
    problems += [f"synchronous save and restore: {d}" for d in differences(state, restored)]
    if restored.get("step") != state["step"] or restored["optimizer"].get("lr") != state["optimizer"]["lr"]:
        problems.append("synchronous save and restore: the plain values came back changed")
    del restored, template

    t0 = time.perf_counter()
    handle = xlakit.save(on_device, folder / "async.pt", asynchronous=True, timeout_s=timeout_s)
    timings["async_save_blocked"] = time.perf_counter() - t0
    handle.result(timeout=timeout_s)
    timings["async_save_committed"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded = xlakit.load(folder / "async.pt", timeout_s=timeout_s)
    timings["load"] = time.perf_counter() - t0
    problems += [f"asynchronous save and load: {d}" for d in differences(state, loaded)]
    del loaded

    # Staged on the device (opt-in): the caller waits for a copy on the device, not for the copy to the host.
    t0 = time.perf_counter()
    handle = xlakit.save(on_device, folder / "async_device.pt", asynchronous=True, staging="device",
                         timeout_s=timeout_s)
    timings["async_device_staged_blocked"] = time.perf_counter() - t0
    handle.result(timeout=timeout_s)
    timings["async_device_staged_committed"] = time.perf_counter() - t0
    problems += [f"asynchronous save staged on the device: {d}"
                 for d in differences(state, xlakit.load(folder / "async_device.pt", timeout_s=timeout_s))]

    nominal = pcie.nominal(backend["name"], getattr(dev.device, "index", None) or 0)
    rates = {"host_to_device_bytes_per_s": _rate(total, timings["host_to_device"]),
             "device_to_host_bytes_per_s": _rate(total, timings["device_to_host"])}
    details = {"state_bytes": total, "tensors": len(tensors(state)), "device": str(dev.device), **rates,
               "nominal": nominal}
    if problems:
        return report.failed(NAME, "; ".join(problems), "do not trust checkpoints on this backend until it is "
                             "understood: attach this report to an issue", timings_s=timings, details=details)
    gb = 1e9
    speeds = (f"host to device {rates['host_to_device_bytes_per_s'] / gb:.2f} GB/s, device to host "
              f"{rates['device_to_host_bytes_per_s'] / gb:.2f} GB/s")
    if "bytes_per_s" in nominal:
        share = max(rates.values()) / nominal["bytes_per_s"]
        speeds += f" (nominal {nominal['bytes_per_s'] / gb:.1f} GB/s, {nominal['link']}; the faster at {share:.0%})"
        details["share_of_nominal"] = share
    else:
        speeds += f"; no nominal figure: {nominal['why_not']}"
    blocked = (f"the background saves blocked {timings['async_save_blocked']:.3f} s, with staging='device' "
               f"{timings['async_device_staged_blocked']:.3f} s")
    return report.check(NAME, report.PASS, f"{total / MiB:.0f} MiB on {dev.device} saved and restored bit-exact, "
                        f"synchronously and in the background; {speeds}; {blocked}", timings_s=timings,
                        details=details)
