"""The `memory` check: per-device memory figures move by what an allocation holds, and fall back when freed.

Two kinds of figure, each where the backend has it: the plugin's own
allocator statistics (`PJRT_Device_MemoryStats`: libtpu, a GPU plugin; torch's
CUDA allocator; TorchTPU's `torch.accelerator` figures) and the count xlakit's
PJRT wrapper keeps of the buffers the runtime holds on each device (`live`).
One buffer of known size is put on the device (sharded over every device
under SPMD, so each holds its share); each figure of each device holding part
of it must rise by at least that part (the wrapper's count by it exactly,
within a small slack for the scalars a framework keeps), and fall back by it
once freed. An allocator may round up, so only its lower bound is checked.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from xlakit.selftest import devices, report

NAME = "memory"
MiB = 1 << 20
_FIGURES = ("live", "used")  # the wrapper's count; the plugin's (or allocator's) bytes in use


def _snap_xla() -> dict[str, dict[str, Any]]:
    import xlakit

    no_wrapper = "xlakit's PJRT wrapper is not loaded" + (
        " (PJRT_DEVICE=CPU is torch_xla's built-in client: no PJRT plugin to wrap)"
        if os.environ.get("PJRT_DEVICE", "").upper() == "CPU" else "")
    return {i.device: {"live": i.live_bytes, "used": i.bytes_used, "limit": i.bytes_limit, "source": i.source,
                       "why_no_used": i.plugin_unavailable or i.unsupported,
                       "why_no_live": i.live_unavailable or (None if i.live_bytes is not None else no_wrapper)}
            for i in xlakit.memory_info()}


def _snap_wrapper() -> dict[str, dict[str, Any]]:
    from xlakit.runtime import wrap_memory

    out = {}
    for name, d in wrap_memory.by_device().items():
        plugin = d.get("plugin") or {}
        out[name] = {"live": d["live_bytes"] if d.get("accounting", True) else None,
                     "used": plugin.get("bytes_in_use"), "limit": plugin.get("bytes_limit"), "source": "pjrt_wrap",
                     "why_no_used": d.get("plugin_unavailable"), "why_no_live": None}
    return out


def _moved_most(before, after) -> str:
    """The device whose figures rose most: the one a plain buffer went to."""
    def rise(d: str) -> int:
        return max(((after[d][f] or 0) - ((before.get(d) or {}).get(f) or 0) for f in _FIGURES))

    return max(sorted(after), key=rise)


def _torch_xla(dev, nbytes: int):
    import torch

    before = _snap_xla()
    names = list(before)
    if dev.spmd:  # rows sharded over a 1-D mesh of every device: each holds its share
        import numpy as np
        import torch_xla.distributed.spmd as xs

        n = len(names)
        t = torch.zeros(n * max(8, nbytes // (4096 * n)), 1024).to(dev.device)
        xs.mark_sharding(t, xs.Mesh(np.arange(n), (n,), ("x",)), ("x", None))
        dev.sync()
        expected = {d: t.numel() * 4 // n for d in names}
    else:
        t = dev.put(torch.zeros(max(8, nbytes // 4096), 1024))
        expected = None
    after = _snap_xla()
    expected = expected or {_moved_most(before, after): t.numel() * 4}  # the device torch's xla:0 maps to
    del t
    gc.collect()
    dev.sync()
    return before, after, _snap_xla(), expected


def _torchtpu(dev, nbytes: int):
    import torch

    from xlakit.runtime import torchtpu

    def snap():
        s = torchtpu.memory_stats(0)
        return {"tpu:0": {"used": s.get("bytes_in_use"), "live": None, "limit": None, "source": s.get("source"),
                          "why_no_used": s.get("note") or s.get("why_not"), "why_no_live": "TorchTPU loads no wrapper"}}

    before = snap()
    t = dev.put(torch.zeros(nbytes // 4))
    after = snap()
    del t
    gc.collect()
    dev.sync()
    freed = snap()
    if before["tpu:0"]["why_no_used"]:
        for s in (before, after, freed):
            s["tpu:0"]["used"] = None  # all zeros: figures the plugin does not keep
    return before, after, freed, {"tpu:0": nbytes // 4 * 4}


def _cuda(dev, nbytes: int):
    import torch

    name = f"cuda:{dev.device.index}"

    def snap():
        free, total = torch.cuda.mem_get_info(dev.device)
        return {name: {"used": torch.cuda.memory_allocated(dev.device), "limit": total, "live": None,
                       "source": "torch.cuda", "why_no_used": None, "why_no_live": "torch's own CUDA allocator"}}

    before = snap()
    t = torch.zeros(nbytes // 4, device=dev.device)
    dev.sync()
    after = snap()
    del t
    dev.sync()
    return before, after, snap(), {name: nbytes // 4 * 4}


def _jax(plugin: str, nbytes: int):
    import numpy as np

    jax = devices.start_jax(plugin, None)
    before = _snap_wrapper()
    x = jax.device_put(np.zeros(nbytes, dtype=np.uint8), jax.devices()[0])
    x.block_until_ready()
    after = _snap_wrapper()
    name = _moved_most(before, after)
    del x
    gc.collect()
    freed = _snap_wrapper()
    # A device the wrapper had not seen before held nothing.
    before = {d: before.get(d) or {**after[d], "live": 0, "used": 0 if after[d]["used"] is not None else None}
              for d in after}
    return before, after, freed, {name: nbytes}


def _judge(before, after, freed, expected) -> tuple[list[str], dict[str, Any], list[str]]:
    """(problems, per-device figures, why a figure is missing)"""
    problems, rows, missing = [], {}, set()
    for d, want in expected.items():
        row: dict[str, Any] = {"expected_bytes": want, "source": after[d]["source"], "limit": after[d]["limit"]}
        for fig in _FIGURES:
            b, a, f = before[d][fig], after[d][fig], freed[d][fig]
            if None in (b, a, f):
                missing.add(f"{'the plugin' if fig == 'used' else 'the live count'}: {after[d][f'why_no_{fig}']}")
                continue
            row[fig] = {"before": b, "with": a, "freed": f}
            what = "xlakit's live count" if fig == "live" else f"the allocator's bytes in use ({after[d]['source']})"
            slack = 64 << 10
            if a - b < want - (slack if fig == "used" else 0) or (fig == "live" and a - b > want * 1.02 + slack):
                problems.append(f"{d}: {what} moved by {a - b} bytes for a buffer of {want}")
            elif a - f < want - (slack if fig == "used" else 0):
                problems.append(f"{d}: {what} fell by {a - f} bytes when the {want}-byte buffer was freed")
        rows[d] = row
    return problems, rows, sorted(missing)


def measure(backend: dict[str, Any], dev, nbytes: int) -> dict[str, Any]:
    """The check, in the device child (`dev` the started device, None on the cpu backend)."""
    name = backend["name"]
    plugin = backend.get("plugin") if backend.get("cache_route") == "jax" else None
    runs = []
    if name == "torch_xla":
        runs.append(_torch_xla(dev, nbytes))
    elif name == "torchtpu":
        runs.append(_torchtpu(dev, nbytes))
    elif name == "cuda":
        runs.append(_cuda(dev, nbytes))
    if plugin:  # jax through the wrapper: its live count, and on a GPU the plugin's own statistics
        runs.append(_jax(plugin, nbytes))
    if not runs:
        return report.skipped(NAME, "no accelerator: the CPU backend's memory is the host's, and no PJRT plugin for "
                              "jax is installed to count buffers in (pip install lammps-jax-pjrt-cpu)")
    problems, rows, missing = [], {}, []
    for run in runs:
        p, r, m = _judge(*run)
        problems, missing = problems + p, missing + m
        rows.update(r)
    counted = sorted({fig for r in rows.values() for fig in _FIGURES if fig in r})
    details = {"devices": rows, "buffer_bytes": nbytes, "unavailable": missing}
    if problems:
        return report.failed(NAME, "; ".join(problems), "attach this report to an issue; until then read memory "
                             "figures on this backend with care", details=details)
    if not counted:
        return report.skipped(NAME, "no per-device memory figure on this backend: " + "; ".join(missing),
                              details=details)
    said = {"live": "xlakit's live-buffer count", "used": "the allocator's bytes in use"}
    summary = (f"{' and '.join(said[f] for f in counted)} moved by the buffer on {', '.join(sorted(rows))} "
               f"({nbytes / MiB:.0f} MiB in all) and fell back when it was freed")
    if missing:
        summary += "; not available: " + "; ".join(missing)
    return report.check(NAME, report.PASS, summary, details=details)
