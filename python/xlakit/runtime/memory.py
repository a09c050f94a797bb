"""Device memory telemetry per raw runtime device (`TPU:18`), under SPMD too.

Stock torch_xla answers memory questions only for a torch device (`xla:0`),
so under SPMD, where the one torch device is virtual, no chip can be asked;
and on the CPU client it raises an opaque `Bad StatusOr access`. Sources, in
order: the patch series' `_xla_runtime_memory_info(raw_device)`; else xlakit's
PJRT wrapper where the runtime loaded it (`wrap_memory`: the plugin's own
statistics and the wrapper's live-buffer accounting, on stock torch_xla, under
SPMD too); else the stock `_xla_memory_info` through the torch device that
maps to the raw one (non-SPMD only). Where the wrapper is loaded its live
buffer figures are added whatever answered. Where nothing can answer, the
result says why instead of raising: telemetry is read by loggers and
dashboards, which should show "not supported: <reason>" rather than crash a
training step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xlakit import _knobs
from xlakit.runtime import features, pjrt_wrap, torchtpu, wrap_memory

STOCK_MEMORY_INFO = "_xla_memory_info"
PJRT_WRAP = "pjrt_wrap"


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one raw runtime device; byte counts are None where unknown.

    `source` names what answered (a binding, or `pjrt_wrap`: xlakit's PJRT
    wrapper); when nothing could, it is None and `unsupported` says why (and
    what would make it work). `bytes_used`, `bytes_limit` and
    `peak_bytes_used` are the allocator's (the plugin's); through the wrapper
    on a plugin that keeps no statistics they are None and
    `plugin_unavailable` says why. `live_bytes`, `live_buffers` and
    `peak_live_bytes` are the wrapper's accounting of the buffers the runtime
    holds on the device (None where the wrapper is not loaded, or where
    `XLAKIT_PJRT_MEMORY_ACCOUNTING=0` turned the count off: `live_unavailable`
    then says so).
    """

    device: str
    bytes_used: int | None = None
    bytes_limit: int | None = None
    peak_bytes_used: int | None = None
    source: str | None = None
    unsupported: str | None = None
    live_bytes: int | None = None
    live_buffers: int | None = None
    peak_live_bytes: int | None = None
    plugin_unavailable: str | None = None
    live_unavailable: str | None = None

    @property
    def supported(self) -> bool:
        return self.unsupported is None


def _xlac():
    return features.require_xlac("memory telemetry")


def _from_dict(device: str, stats: dict, source: str) -> MemoryInfo:
    return MemoryInfo(device, bytes_used=stats.get("bytes_used"), bytes_limit=stats.get("bytes_limit"),
                      peak_bytes_used=stats.get("peak_bytes_used"), source=source)


def _unsupported_reason(message: str) -> str | None:
    if "GetAllocatorStats" in message or "UNIMPLEMENTED" in message:
        return (f"this PJRT client keeps no allocator statistics ({message.removeprefix('Bad StatusOr access: ')});"
                " memory telemetry needs a TPU or GPU client")
    return None


def _with_wrapper(info: MemoryInfo, w: dict | None) -> MemoryInfo:
    """`info` with the wrapper's live-buffer figures added, where the wrapper knows the device."""
    if w is None:
        return info
    if not w.get("accounting", True):  # zeros from a count that was never taken are not figures
        return dataclasses.replace(info, live_unavailable=f"{_knobs.PJRT_MEMORY_ACCOUNTING}=0 turned the wrapper's "
                                                          "count of live buffers off")
    return dataclasses.replace(info, live_bytes=w["live_bytes"], live_buffers=w["live_buffers"],
                               peak_live_bytes=w["peak_bytes"])


def _from_wrapper(device: str, w: dict) -> MemoryInfo:
    plugin = w.get("plugin") or {}
    return _with_wrapper(MemoryInfo(device, bytes_used=plugin.get("bytes_in_use"),
                                    bytes_limit=plugin.get("bytes_limit"),
                                    peak_bytes_used=plugin.get("peak_bytes_in_use"), source=PJRT_WRAP,
                                    plugin_unavailable=w.get("plugin_unavailable")), w)


def _one(xlac, device: str, wrapped: dict[str, dict]) -> MemoryInfo:
    w = wrapped.get(device)
    if w is not None and not hasattr(xlac, features.RUNTIME_MEMORY_INFO):
        return _from_wrapper(device, w)
    return _with_wrapper(_binding(xlac, device), w)


def _binding(xlac, device: str) -> MemoryInfo:
    if hasattr(xlac, features.RUNTIME_MEMORY_INFO):
        try:
            return _from_dict(device, getattr(xlac, features.RUNTIME_MEMORY_INFO)(device),
                              features.RUNTIME_MEMORY_INFO)
        except RuntimeError as e:  # the binding's contract: RuntimeError where stats are unsupported
            return MemoryInfo(device, unsupported=str(e))
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return MemoryInfo(device, unsupported=(
            "under SPMD stock torch_xla can only ask the virtual SPMD device, not a chip; "
            f"xlakit's PJRT wrapper answers per chip (xlakit.enable_persistent_cache() or `xlakit pjrt env DIR` "
            f"loads it), as does the {features.RUNTIME_MEMORY_INFO} binding: install the xlakit wheels"))
    torch_devices = list(xlac._xla_get_devices())
    if device not in torch_devices:  # only SPMD separates the two lists; be sure anyway
        return MemoryInfo(device, unsupported=f"no torch device maps to {device} (torch devices: {torch_devices})")
    try:
        return _from_dict(device, xlac._xla_memory_info(f"xla:{torch_devices.index(device)}"), STOCK_MEMORY_INFO)
    except RuntimeError as e:
        reason = _unsupported_reason(str(e))
        if reason is None:
            raise
        return MemoryInfo(device, unsupported=reason)


def memory_info(device: str | None = None) -> MemoryInfo | list[MemoryInfo]:
    """Used, limit and peak bytes of one raw runtime device, or of every local one.

    Args:
        device: A raw runtime device such as `TPU:18` (see
            `torch_xla._XLAC._xla_get_runtime_devices()`); None for all local ones.

    Returns:
        A `MemoryInfo` for `device`, or a list of them (one per local device,
        from one call into the wrapper: cheap enough for every step). Where
        the runtime cannot report memory (the CPU client or SPMD on a stock
        build, without xlakit's PJRT wrapper) `info.supported` is False and
        `info.unsupported` says why.

    Raises:
        ValueError: `device` is not a local runtime device; lists the valid ones.
        RuntimeFeatureError: torch_xla cannot be imported.

    Example:
        >>> import xlakit
        >>> for info in xlakit.memory_info():
        ...     print(info.device, info.bytes_used if info.supported else info.unsupported)
    """
    if torchtpu.in_use():  # TorchTPU: torch.accelerator's statistics, per `tpu:N`
        return _torchtpu_info(device)
    xlac = _xlac()
    local = list(xlac._xla_get_runtime_devices())
    if device is not None and device not in local:
        elsewhere = device in xlac._xla_get_all_runtime_devices()
        raise ValueError(
            f"expected a runtime device local to this process, one of {', '.join(local)}; found {device!r}"
            + (" (it belongs to another process)" if elsewhere else ""))
    wrapped = wrap_memory.by_device()
    if device is None:
        return [_one(xlac, d, wrapped) for d in local]
    return _one(xlac, device, wrapped)




def _torchtpu_info(device: str | None) -> MemoryInfo | list[MemoryInfo]:
    hazard = torchtpu.start_hazard()
    if not hazard and not torchtpu.loaded():
        torchtpu.import_torch()  # imports torch_tpu, which registers `tpu` on a TPU host
    if hazard or not torchtpu.started():
        info = MemoryInfo(device or "tpu", unsupported=hazard or (
            "TorchTPU's `tpu` device is not started in this process: it registers itself only on a TPU host "
            "(on a PJRT plugin, see docs/torchtpu.md); ask from the training process"))
        return info if device else [info]
    import torch

    names = [f"tpu:{i}" for i in range(torch.accelerator.device_count())]
    if device is not None and device not in names:
        raise ValueError(f"expected a TorchTPU device, one of {', '.join(names)}; found {device!r}")
    infos = []
    for i, name in enumerate(names):
        stats = torchtpu.memory_stats(i)
        infos.append(MemoryInfo(name, unsupported=stats["note"]) if "note" in stats else MemoryInfo(
            name, bytes_used=stats["bytes_in_use"], peak_bytes_used=stats["peak_bytes_in_use"],
            source=stats["source"]))
    return infos if device is None else infos[names.index(device)]


def availability(wrap_status: dict | None = None, device_type: str | None = None) -> dict:
    """Whether this process can read memory per raw runtime device, and from where; never raises.

    `wrap_status` is `pjrt_wrap.status()` if the caller has it, `device_type`
    the runtime's (`PJRT_DEVICE`). Returns `{"per_device": bool, "source":
    str | None, ...}` with `why_not` (and `fix`) when it cannot, and for the
    wrapper whether it counts live buffers.
    """
    if torchtpu.in_use():  # TorchTPU's own allocator statistics, per chip; torch_xla is never imported there
        stats = torchtpu.memory_stats()
        if "source" not in stats or "note" in stats:
            return {"per_device": False, "source": stats.get("source"),
                    "why_not": stats.get("note") or stats.get("why_not"), "fix": None}
        return {"per_device": True, "source": stats["source"]}
    if features.has_binding(features.RUNTIME_MEMORY_INFO):
        return {"per_device": True, "source": features.RUNTIME_MEMORY_INFO}
    r = wrap_memory.report(plugin_stats=False)
    if r["installed"]:
        return {"per_device": True, "source": PJRT_WRAP, "accounting": r["accounting"],
                "devices": len(r["devices"])}
    if (device_type or "").upper() == "CPU":
        return {"per_device": False, "source": None,
                "why_not": "torch_xla's built-in CPU client keeps no allocator statistics and is no PJRT plugin "
                           "xlakit's wrapper could count buffers in", "fix": None}
    if not _knobs.xla_flag(_knobs.XLA_USE_SPMD):
        return {"per_device": True, "source": STOCK_MEMORY_INFO, "note": "one torch device per chip outside SPMD"}
    s = wrap_status if wrap_status is not None else pjrt_wrap.status()
    return {"per_device": False, "source": None,
            "why_not": f"stock torch_xla answers only for a torch device, never per chip under SPMD, and "
                       f"{'the PJRT wrapper is not loaded in this process' if s.get('built') else s.get('why_not')}",
            "fix": "load xlakit's PJRT wrapper (xlakit.enable_persistent_cache(), or `xlakit pjrt env DIR`), "
                   f"or install the xlakit wheels ({features.RUNTIME_MEMORY_INFO})"}
