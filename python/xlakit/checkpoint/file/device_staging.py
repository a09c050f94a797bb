"""Staging on the device (`SaveOptions.staging="device"`): the caller waits for a device copy only.

An asynchronous save must hold the state's values as they were when it was
called, because the training loop goes on and its next step replaces them
(on torch_xla it donates the old buffers to its in-place updates). By default
(`staging="host"`) the caller waits until every device tensor is copied to
host memory: on a TPU that copy crosses PCIe, and the caller waits for all of
it.

With `staging="device"` the caller waits for a copy on the device instead,
made at device-memory speed in one program (torch_xla: one graph of copies,
run and waited for, so an out-of-memory error is the save's and not the next
step's). The copies are the save's own: no step can donate or change them.
The background write then moves them to the host batch by batch, the copy of
batch k+1 overlapping the write of batch k (`overlap.py`, same host bound
`max_inflight_bytes`), and drops each batch's device copies once they are on
the host. The device holds at most one extra copy of the state's device
tensors, for less time the further the write goes.

Groups whose backend does not copy (CPU storages, the CPU client's zero-copy
DLPack export, which already holds immutable buffers) are staged as with
`staging="host"`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from xlakit.checkpoint.core.operation import Operation, human_bytes
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.checkpoint.file import pipeline, spmd, transfer
from xlakit.checkpoint.format.state import StorageEntry
from xlakit.errors import CheckpointError

_OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM")

Groups = list[tuple[list[StorageEntry], transfer.HostTransfer]]


class Copies(transfer.HostTransfer):
    """The device copies of one group, each moved to the host by the group's own backend and
    dropped from the device once it is there."""

    copies = True
    returns_mutable_views = False

    def __init__(self, backend: transfer.HostTransfer, copies: dict[int, torch.Tensor]):
        self.backend, self._copies = backend, copies
        self.name = f"{backend.name} (staged on the device)"

    def entries_to_host(self, entries, *, timeout_s):
        hosts = self.backend.to_host([self._copies[e.index] for e in entries], timeout_s=timeout_s)
        for e in entries:
            del self._copies[e.index]
        return hosts

    def release(self) -> None:
        """Drop the copies not yet moved: the write stopped."""
        self._copies.clear()


class Staged:
    """What the caller's thread staged: host batches, and device copies the write moves to the host."""

    def __init__(self, on_host: list, on_device: Groups, opts: SaveOptions):
        self.on_host, self.on_device, self.opts = on_host, on_device, opts

    def items(self, op: Operation) -> Iterator[tuple[list[StorageEntry], list, transfer.HostTransfer]]:
        """The batches of the write phase, under its operation `op`."""
        yield from self.on_host
        yield from pipeline.host_batches(op, self.on_device, self.opts)

    def release(self) -> None:
        for _, copies in self.on_device:
            copies.release()


def write(op: Operation, staged, write_phase: Callable[[Operation, Any], None]) -> None:
    """`write_phase(op, batches)` of what `background.stage` returned; device copies not yet moved
    go when it stops, however it stops: a failed write's error, kept by its handle, holds frames
    (the transfer thread's, which may still be ending when the error is handed over) that would
    hold the copies as long as the handle lives."""
    if not isinstance(staged, Staged):
        write_phase(op, staged)
        return
    try:
        write_phase(op, staged.items(op))
    finally:
        staged.release()


def copy_group(op: Operation, group: list[StorageEntry], backend: transfer.HostTransfer) -> Copies:
    """Copy `group`'s tensors on their device and wait for the copies; nothing is read from
    them after this returns but the copies."""
    op.enter("device copy", group[0].path)
    device_type = group[0].device_type
    try:
        copies = {e.index: _copy(e.tensor) for e in group}
        _wait(device_type, list(copies.values()))
    except RuntimeError as e:
        if not any(s in str(e) for s in _OUT_OF_MEMORY):
            raise
        nbytes = sum(e.nbytes for e in group)
        raise CheckpointError(
            f"staging='device' needs room on the device for a copy of the state's {device_type} "
            f"tensors ({human_bytes(nbytes)}), and the device ran out of memory: {str(e).rstrip('.')}. Nothing "
            f"was written. Save with staging='host' (the default), which holds nothing extra on "
            f"the device") from e
    for e in group:
        op.advance(e.nbytes)
    return Copies(backend, copies)


def _copy(t: torch.Tensor) -> torch.Tensor:
    copy = t.detach().clone()
    if t.device.type == "xla" and spmd.is_sharded(t):  # the copy stays split as the tensor is
        import torch_xla

        torch_xla._XLAC._xla_mark_sharding(copy, torch_xla._XLAC._get_xla_op_sharding(t))
    return copy


def _wait(device_type: str, copies: list[torch.Tensor]) -> None:
    """Run the copies and wait for them: an error (out of memory) is the save's, not the next step's."""
    if device_type == "xla":
        import torch_xla

        # One graph of copies. The next step runs after it on the device (torch_xla's device
        # lock), so its in-place updates, which donate the old buffers, never meet it half done.
        for group in transfer.by_device(copies):
            torch_xla._XLAC._xla_sync_multi(group, devices=[], wait=True, sync_xla_data=False)
    elif device_type == "tpu":
        for index in transfer.device_indices(copies):
            torch.accelerator.synchronize(index)
    elif device_type == "cuda":
        for index in transfer.device_indices(copies):
            torch.cuda.synchronize(index)
