"""Device memory telemetry per raw runtime device (`TPU:18`), under SPMD too.

Stock torch_xla answers memory questions only for a torch device (`xla:0`),
so under SPMD, where the one torch device is virtual, no chip can be asked;
and on the CPU client it raises an opaque `Bad StatusOr access`. The patch
series adds `_xla_runtime_memory_info(raw_device)`; it is used when present.
Otherwise the stock `_xla_memory_info` is asked through the torch device that
maps to the raw one (non-SPMD only). Where neither can answer, the result says
why instead of raising: telemetry is read by loggers and dashboards, which
should show "not supported: <reason>" rather than crash a training step.
"""

from __future__ import annotations

from dataclasses import dataclass

from xlakit.runtime import features, torchtpu

STOCK_MEMORY_INFO = "_xla_memory_info"


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of one raw runtime device; byte counts are None where unknown.

    `source` names the binding that answered; when nothing could, it is None
    and `unsupported` says why (and what would make it work).
    """

    device: str
    bytes_used: int | None = None
    bytes_limit: int | None = None
    peak_bytes_used: int | None = None
    source: str | None = None
    unsupported: str | None = None

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


def _one(xlac, device: str) -> MemoryInfo:
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
            f"the {features.RUNTIME_MEMORY_INFO} binding of the xlakit wheels answers per chip: install them"))
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
        A `MemoryInfo` for `device`, or a list of them (one per local device).
        Where the runtime cannot report memory (the CPU client; SPMD on a stock
        build) `info.supported` is False and `info.unsupported` says why.

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
    if device is None:
        return [_one(xlac, d) for d in local]
    if device not in local:
        elsewhere = device in xlac._xla_get_all_runtime_devices()
        raise ValueError(
            f"expected a runtime device local to this process, one of {', '.join(local)}; found {device!r}"
            + (" (it belongs to another process)" if elsewhere else ""))
    return _one(xlac, device)




def _torchtpu_info(device: str | None) -> MemoryInfo | list[MemoryInfo]:
    hazard = torchtpu.start_hazard()
    if not hazard and not torchtpu.loaded():
        import torch  # noqa: F401  (imports torch_tpu, which registers `tpu` on a TPU host)
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
