"""Asynchronous save: block only while the state reaches host memory.

The caller's thread runs the sync and the device-to-host copies (bounded by
the deadline, as a synchronous save); CPU tensors, which the training loop
updates in place, are copied into a host staging arena. Nothing is ever
cloned on the device. XLA buffers exported zero-copy on the CPU PJRT client
are kept as they are: XLA buffers are immutable (a step writes new ones) and
PJRT will not donate a buffer to a step while a DLPack reference holds it. A background thread then writes
and commits under what is left of the same deadline. The arena is kept and
reused by the next save when it is large enough: fresh host memory costs
several times more to touch than reused memory.

Errors are never dropped: `SaveHandle.result()` raises them, and the next
save refuses to start while one is running or failed unseen.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from xlakit import _job, _tree, checkpoint, transfer
from xlakit.errors import CheckpointAsyncError, CheckpointBusyError
from xlakit.options import SaveOptions

log = logging.getLogger("xlakit")
_ALIGN = 64
_lock = threading.Lock()
_pending: "SaveHandle | None" = None
_arena: torch.Tensor | None = None


class SaveHandle:
    """A save whose write runs in the background.

    Attributes:
        path: the checkpoint being written.
        blocked_s: how long `xlakit.save` blocked the caller (sync + copies to host).
    """

    def __init__(self, path: Path, blocked_s: float, thread: threading.Thread):
        self.path, self.blocked_s = path, blocked_s
        self._thread = thread
        self._error: BaseException | None = None
        self._seen = False

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the write to commit; raise what it raised.

        Raises:
            TimeoutError: still running after `timeout` seconds (the save goes on).
            CheckpointError: the background write failed (timeout, disk full, ...).
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the asynchronous save of {self.path} is still running after "
                               f"{timeout} s; it continues in the background")
        self._seen = True
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveHandle {self.path} {state}, blocked {self.blocked_s:.3f} s>"


def check_previous() -> None:
    """Refuse a new save over a running background save or one that failed unseen."""
    global _pending
    with _lock:
        prev = _pending
        if prev is not None and prev.done():
            _pending = None
    if prev is None:
        return
    if not prev.done():
        err = CheckpointBusyError(f"the asynchronous save of {prev.path} is still writing; "
                                  f"a new save would compete with it for host memory and disk")
        err.add_note("Call handle.result() on the previous save's handle before saving again.")
        raise err
    if prev._error is not None and not prev._seen:
        prev._seen = True
        raise CheckpointAsyncError(f"the previous asynchronous save of {prev.path} failed and its "
                                   f"handle was never asked: {prev._error}") from prev._error


def _arena_views(entries: list[_tree.TensorEntry]) -> list[torch.Tensor]:
    """Host tensors for `entries`, carved from the reused staging arena."""
    global _arena
    offsets, total = [], 0
    for e in entries:
        offsets.append(total)
        total += -(-e.nbytes // _ALIGN) * _ALIGN
    if _arena is None or _arena.numel() < total:
        _arena = None  # free the old one before touching the new one
        _arena = torch.empty(total, dtype=torch.uint8)
    views = []
    for e, off in zip(entries, offsets):
        raw = _arena[off:off + e.nbytes]
        views.append(raw.view(e.tensor.dtype).view(e.tensor.shape) if e.nbytes else
                     torch.empty(e.tensor.shape, dtype=e.tensor.dtype))
    return views


def _stage(job: _job.Job, entries: list[_tree.TensorEntry], opts: SaveOptions) -> list:
    """Sync and copy every tensor to host memory the training loop cannot touch."""
    staged: dict[int, torch.Tensor] = {}
    viewed = []
    for backend, batch, hosts in checkpoint.host_batches(job, checkpoint.stage_groups(entries), opts):
        for e, h in zip(batch, hosts):
            staged[e.index] = h
            if backend.returns_mutable_views:
                viewed.append(e)
            job.advance(e.nbytes)
    for e, dst in zip(viewed, _arena_views(viewed)):
        job.enter("stage", e.path)
        dst.copy_(staged[e.index])
        staged[e.index] = dst
    host_entries = [dataclasses.replace(e, tensor=staged[e.index]) for e in entries]
    return [(host_entries, transfer.HostTransfer())] if host_entries else []


def start(obj: Any, final: Path, opts: SaveOptions) -> SaveHandle:
    """Stage `obj` on the host, then write it in the background; see `xlakit.save`."""
    global _pending
    started = time.monotonic()
    with _lock:
        entries, pickled = checkpoint.prepare(obj, final)
        job = _job.Job("save (staging)", str(final), sum(e.nbytes for e in entries))
        groups = _job.run(job, lambda j: _stage(j, entries, opts), checkpoint.watch_for(opts),
                          lambda j: "Nothing was written; the previous checkpoint is untouched.")
        handle: SaveHandle

        def write() -> None:
            try:
                host_entries = groups[0][0] if groups else []
                checkpoint.write_file(host_entries, pickled, final, opts, groups, started=started)
            except BaseException as e:  # noqa: BLE001 - kept for result() and the next save
                handle._error = e
                log.error("xlakit: asynchronous save of %s failed: %s", final, e)

        # Not a daemon: interpreter exit waits for the commit (bounded by the deadline).
        thread = threading.Thread(target=write, name="xlakit-async-save")
        handle = SaveHandle(final, time.monotonic() - started, thread)
        _pending = handle
        thread.start()
    return handle
