"""Moving tensors to host memory: one sync, then byte-capped batches, no device copies.

One backend per device type, chosen once per save:

* XLA: every pending tensor is materialised by a single step marker (one
  graph, one compile), then copied in batches. The patched binding
  `_xla_transfer_to_host` is preferred (deadline-bounded, GIL released,
  sharded data assembled on the host). On stock torch_xla the CPU PJRT client
  exports its buffers through DLPack zero-copy (its `_xla_get_cpu_tensors`
  copies at ~0.1-0.2 GB/s); other clients use `_xla_get_cpu_tensors`.
  SPMD-sharded tensors go to `spmd.py` (local shards, assembled on the host)
  unless the patched binding is there to do it.
* CUDA (and other accelerators with storages): each storage is copied whole
  into a host buffer (the plan hands whole storages as uint8 tensors), so
  nothing is ever cloned on the device.
* TorchTPU (device `tpu`, runtime/torchtpu.py): one `torch.accelerator.synchronize()`,
  then each whole storage copied into a host buffer, with non-blocking copies
  (and one synchronisation per batch) where the PJRT client has a host
  allocator, blocking copies where it has none (the CPU plugin); the deadline
  is checked before every copy.
* CPU: used in place.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from xlakit import _knobs
from xlakit.runtime import features, host_heap
from xlakit.checkpoint.file import spmd
from xlakit.checkpoint.format.state import StorageEntry
from xlakit.errors import CheckpointTimeoutError, RuntimeFeatureError

log = logging.getLogger("xlakit")


class HostTransfer:
    """Base backend: `prepare` once for all tensors, then `to_host` per batch."""

    name = "cpu"
    copies = False  # True when to_host copies bytes (worth overlapping with the write: file/overlap.py)
    # True when to_host returns views of memory the training loop may change in place
    # (CPU tensors); an asynchronous save copies those into its staging arena. XLA
    # buffers exported zero-copy are immutable: a step writes new buffers, and PJRT
    # refuses to donate a buffer while an external (DLPack) reference holds it.
    returns_mutable_views = True

    def prepare(self, tensors: Sequence[torch.Tensor]) -> None:
        """Materialise pending values (one sync for all of them)."""

    def to_host(self, tensors: Sequence[torch.Tensor], *, timeout_s: float) -> list[torch.Tensor]:
        """Contiguous CPU tensors with the values of `tensors`, in order."""
        return [t.detach().contiguous() for t in tensors]

    def entries_to_host(self, entries: Sequence[StorageEntry], *, timeout_s: float) -> list[HostBytes]:
        """Each entry's bytes on the host: a contiguous CPU tensor or a CPU storage, in order."""
        return self.to_host([e.tensor for e in entries], timeout_s=timeout_s)


HostBytes = torch.Tensor | torch.UntypedStorage  # contiguous, on the CPU: `data_ptr()` is its first byte


class CpuTransfer(HostTransfer):
    """CPU storages are already on the host: each entry's storage is used as it is."""

    def entries_to_host(self, entries, *, timeout_s):
        return [e.storage if e.storage is not None else e.tensor.detach().contiguous() for e in entries]


class TensorsOf(Sequence):
    """The entries' tensors, each made when asked for: a CPU storage's uint8 view costs
    microseconds, and the CPU backend never asks (with 100,000 storages, that adds up)."""

    def __init__(self, entries: Sequence[StorageEntry]):
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [e.tensor for e in self._entries[i]]
        return self._entries[i].tensor


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """Copy a contiguous device tensor into a new host tensor, never cloning it on its device."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    host.copy_(t.detach())
    return host


class DeviceTransfer(HostTransfer):
    """CUDA and other storage-backed accelerators."""

    name = "device-copy"
    copies = True
    returns_mutable_views = False

    def to_host(self, tensors, *, timeout_s):
        hosts = [copy_to_host(t) for t in tensors]
        if tensors and tensors[0].device.type == "cuda":
            torch.cuda.synchronize(tensors[0].device)
        return hosts


class TpuTransfer(HostTransfer):
    """TorchTPU tensors (device `tpu`): plain storages behind a PJRT client, no lazy graph."""

    name = "tpu"
    copies = True
    returns_mutable_views = False

    def __init__(self, mode: str = "auto"):
        # "auto": try one non-blocking copy, fall back to blocking copies for good when the client
        # has no PJRT host allocator (NotImplementedError, the CPU plugin); "blocking": never try.
        self.non_blocking = mode != "blocking"

    def prepare(self, tensors):
        # TorchTPU runs ops asynchronously: one synchronisation of each device makes every value final.
        for index in device_indices(tensors):
            torch.accelerator.synchronize(index)

    def to_host(self, tensors, *, timeout_s):
        deadline = time.monotonic() + timeout_s
        hosts = []
        for t in tensors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(hosts)} of {len(tensors)} tensors of the batch copied when "
                                   f"the deadline ({timeout_s:.3g} s for the batch) passed")
            hosts.append(self._copy(t.detach()))
        if self.non_blocking and hosts:
            for index in device_indices(tensors):  # the batch's non-blocking copies have landed
                torch.accelerator.synchronize(index)
        return hosts

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if self.non_blocking:
            try:
                return t.to("cpu", non_blocking=True)
            except NotImplementedError as e:  # "host memory allocator is not implemented for this client"
                log.info("xlakit: TorchTPU's client has no host allocator (%s); blocking copies", e)
                self.non_blocking = False
        return copy_to_host(t)


def device_indices(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    return sorted({t.device.index for t in tensors}, key=lambda i: -1 if i is None else i)


class XlaTransfer(HostTransfer):
    """torch_xla tensors; picks the best copy the running build offers."""

    def __init__(self, mode: str):
        self.mode = mode
        self.name = f"xla-{mode}"
        self.returns_mutable_views = False
        self.copies = mode != "dlpack"  # the CPU client's DLPack export is zero-copy

    def prepare(self, tensors):
        import torch_xla

        # One step marker, as torch_xla.sync() does but without running the user's step
        # closures: every pending tensor in one graph, with the buffer donation of in-place
        # updates, so the device holds the new state in place of (not beside) the old one.
        # Measured on the 16-layer pending state: 167-203 MiB peak RSS against 329-339 MiB
        # for _xla_sync_multi of the state tensors, which cannot donate.
        device = torch_xla._XLAC._xla_get_default_device()
        torch_xla._XLAC._xla_step_marker(device, [], wait=True)
        torch_xla._XLAC._set_all_reduce_token(device, None)
        # Tensors on other devices than the default one, if any (torch_xla syncs one device at a time).
        for group in by_device(list(tensors)):
            torch_xla._XLAC._xla_sync_multi(group, devices=[], wait=True, sync_xla_data=False)
        if self.mode == "dlpack":
            # Tensors materialised earlier by an asynchronous torch_xla.sync() hold buffers
            # that may still be in flight; exporting one of those aborts the process
            # (dl_convertor.cpp "Could not get a valid pjrt_buffer").
            torch_xla._XLAC._xla_wait_device_ops(devices=[])

    def to_host(self, tensors, *, timeout_s):
        import torch_xla

        tensors = list(tensors)
        if len({t.device for t in tensors}) > 1:  # torch_xla's copies take one device's tensors at a time
            deadline = time.monotonic() + timeout_s
            return in_order(tensors, lambda group: self.to_host(
                group, timeout_s=max(deadline - time.monotonic(), 0.001)))
        if self.mode != "patched" and spmd.has_sharded(tensors):
            # Stock `.cpu()` of sharded data compiles a replication program per call.
            return spmd.to_host(tensors, timeout_s=timeout_s,
                                others=lambda ts: self.to_host(ts, timeout_s=timeout_s))
        if self.mode == "patched":
            fn = getattr(torch_xla._XLAC, features.TRANSFER_TO_HOST)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            return list(fn(tensors, max_inflight_bytes=max(nbytes, 1), timeout_s=timeout_s))
        if self.mode == "dlpack":
            return [_dlpack_view(t) for t in tensors]
        return [h.contiguous() for h in torch_xla._XLAC._xla_get_cpu_tensors(tensors)]


def by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by device, each group in its order (a state placed on several devices of one
    process, xla:0 and xla:1: torch_xla's syncs and copies refuse to mix them, "'CPU:0' vs 'CPU:1'")."""
    return [[tensors[i] for i in places] for places in _places_by_device(tensors)]


def in_order(tensors: list[torch.Tensor], fn: Callable[[list[torch.Tensor]], list]) -> list:
    """`fn` of each device's tensors (`by_device`), the results put back in the order of `tensors`."""
    out: list = [None] * len(tensors)
    for places in _places_by_device(tensors):
        for i, result in zip(places, fn([tensors[i] for i in places])):
            out[i] = result
    return out


def _places_by_device(tensors: list[torch.Tensor]) -> list[list[int]]:
    at: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        at.setdefault(t.device, []).append(i)
    return list(at.values())


def _dlpack_view(t: torch.Tensor) -> torch.Tensor:
    """A zero-copy host view of a CPU-PJRT buffer; a real copy where DLPack refuses."""
    import torch_xla
    from torch.utils.dlpack import from_dlpack

    try:
        host = from_dlpack(torch_xla._XLAC._to_dlpack(t))
    except RuntimeError as e:  # sharded or otherwise non-exportable data
        log.debug("xlakit: DLPack export refused (%s); copying instead", e)
        return torch_xla._XLAC._xla_get_cpu_tensors([t])[0].contiguous()
    if host.device.type != "cpu":
        return torch_xla._XLAC._xla_get_cpu_tensors([t])[0].contiguous()
    return host.contiguous()


def available_backends() -> list[str]:
    """The `transfer_backend` values this torch_xla build can run."""
    return ["auto", *(["patched"] if features.has_binding(features.TRANSFER_TO_HOST) else []),
            "dlpack", "stock"]


def check_backend(mode: str) -> None:
    """Refuse, before anything is written, a backend this build does not have."""
    if mode != "patched" or features.has_binding(features.TRANSFER_TO_HOST):
        return
    source = (f"set by {_knobs.TRANSFER_BACKEND}" if os.environ.get(_knobs.TRANSFER_BACKEND) == mode
              else "passed as an option")
    err = RuntimeFeatureError(
        f"transfer_backend='patched' ({source}) needs xlakit's patched torch_xla build, whose "
        f"{features.TRANSFER_TO_HOST} binding this torch_xla does not have "
        f"({features.xla_import_error() or 'a stock build'}); nothing was written. Transfer backends "
        f"this build has: {', '.join(available_backends())}")
    err.add_note(f"Use transfer_backend='auto' (or unset {_knobs.TRANSFER_BACKEND}) to take the best one "
                 f"available, or install the xlakit wheels for the patched binding.")
    raise err


def _xla_mode(sample: torch.Tensor, mode: str) -> str:
    if mode != "auto":
        check_backend(mode)
        return mode
    if features.has_binding(features.TRANSFER_TO_HOST):
        return "patched"
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    # Under SPMD every buffer is sharded data, which DLPack refuses: each export would fail
    # and fall back one tensor at a time.
    if xr.is_spmd():
        return "stock"
    return "dlpack" if xm.xla_device_hw(sample.device) == "CPU" else "stock"


def backend_for(device_type: str, sample: torch.Tensor, *, mode: str = "auto") -> HostTransfer:
    """The transfer backend for tensors of `device_type` (tests replace this function).

    `mode` is the save's `transfer_backend`; it chooses among the XLA backends.
    """
    if device_type == "cpu":
        return CpuTransfer()
    backend = (XlaTransfer(_xla_mode(sample, mode)) if device_type == "xla" else
               TpuTransfer() if device_type == "tpu" else DeviceTransfer())
    if backend.copies:
        host_heap.keep_if_asked()  # XLAKIT_KEEP_HOST_HEAP: each batch's copies reuse the last one's pages
    return backend


def batch_to_host(backend: HostTransfer, batch: Sequence[StorageEntry], *,
                  timeout_s: float) -> list[HostBytes]:
    """`backend.entries_to_host`; a runtime's own deadline error names the batch's tensors."""
    try:
        return backend.entries_to_host(batch, timeout_s=timeout_s)
    except CheckpointTimeoutError:
        raise
    except TimeoutError as e:  # the patched binding's DEADLINE_EXCEEDED
        names = ", ".join(repr(x.path) for x in batch[:3]) + (" ..." if len(batch) > 3 else "")
        raise CheckpointTimeoutError(
            f"the device-to-host copy of {names} passed its deadline in the runtime: {e}",
            stage="transfer", tensor=batch[0].path) from e


def batches(entries: Sequence[StorageEntry], max_bytes: int) -> Iterator[list[StorageEntry]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor travels alone)."""
    batch: list[StorageEntry] = []
    size = 0
    for e in entries:
        if batch and size + e.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += e.nbytes
    if batch:
        yield batch
