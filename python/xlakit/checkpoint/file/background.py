"""Asynchronous saves: block only while the state reaches host memory, write in the background.

An asynchronous save is one operation in two phases sharing one deadline and
one commit gate. The caller's thread runs the first: the sync and the
device-to-host copies (and, for coordinated layouts, the agreement between
ranks). CPU tensors, which the training loop updates in place, are copied
into a host staging arena that later saves reuse (fresh host memory costs
several times more to touch than reused memory); nothing is cloned on the
device unless the save asks for it (`staging="device"`: `device_staging.py`,
where the caller waits for device copies and the background moves them). XLA
buffers exported zero-copy on the CPU PJRT client are kept as they are: XLA
buffers are immutable (a step writes new ones) and PJRT will not donate a
buffer to a step while a DLPack reference holds it. A background
thread then owns the second phase, the write and the commit, under what is
left of the deadline.

Errors are never dropped: `SaveHandle.result()` raises them, and the next save
raises one nobody asked for (`CheckpointAsyncError`). Ctrl-C while waiting in
`result()`, or `cancel()`, cancels the save: it then never commits, and as the
caller asked for that, it is no failure to report (`result()` then raises
`concurrent.futures.CancelledError`, as a future's does).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import torch

from xlakit.checkpoint.file import device_staging, pipeline
from xlakit.checkpoint.core.gate import CANCEL, Gate
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core import workers
from xlakit.checkpoint.core.workers import start_thread
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.checkpoint.format.state import StorageEntry
from xlakit.errors import CheckpointAsyncError

log = logging.getLogger("xlakit")
_ALIGN = 64
_PIECE = 8 << 20  # staging copies at least this large are split into pieces of it, over threads
_COPY_THREADS = 4
_HANDOVER_S = 5.0  # how long a new save waits for an ended save's owner to record its outcome
_lock = threading.Lock()
_pending: "SaveHandle | None" = None
_arena: torch.Tensor | None = None

Staged = list[tuple[list[StorageEntry], list[torch.Tensor], None]]


class SaveHandle:
    """A save whose write and commit run in the background.

    Attributes:
        path: the checkpoint being written.
        blocked_s: how long `xlakit.save` blocked the caller (sync + copies to host).
        transfer_s, write_s, overlap_s: seconds spent copying storages to the host (while the
            caller waited), writing them (in the background), and both at once, so far.
    """

    def __init__(self, path: Path, blocked_s: float, op: Operation, staged: Operation | None = None):
        self.path, self.blocked_s = path, blocked_s
        self._op = op
        self._ops = [o for o in (staged, op) if o is not None]
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._error_tb: list = []  # the traceback the save left `_error`, once asked
        self._seen = False
        self._cancelled = False  # the caller gave it up (cancel(), or an interrupt in result())

    @property
    def transfer_s(self) -> float:
        return sum(o.clock.seconds()[0] for o in self._ops)

    @property
    def write_s(self) -> float:
        return sum(o.clock.seconds()[1] for o in self._ops)

    @property
    def overlap_s(self) -> float:
        return sum(o.clock.seconds()[2] for o in self._ops)

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._finished.is_set()

    @property
    def committed(self) -> bool:
        """True once the save's commit was decided (it may still be finishing)."""
        return self._op.committed

    def result(self, timeout: float | None = None) -> None:
        """Wait for the save to commit; raise what it raised.

        Ctrl-C (any exception) while waiting cancels the save: it will not commit.

        Raises:
            TimeoutError: still running after `timeout` seconds (the save goes on).
            CheckpointError: the background write failed (timeout, disk full, ...).
            concurrent.futures.CancelledError: the save was cancelled through `cancel()`.
            TypeError, ValueError: `timeout` is no number of seconds (refused before waiting: the
                save goes on).
        """
        timeout = workers.seconds_to_wait(timeout)
        try:
            finished = self._finished.wait(timeout)
        except BaseException as e:
            self._cancelled = self._seen = True  # the caller has its exception: nothing more to say
            self._op.abandon(e)
            raise
        if not finished:
            raise TimeoutError(f"the asynchronous save of {self.path} is still running after "
                               f"{timeout} s; it continues in the background")
        self._seen = True
        if self._error is not None:
            # With the save's own traceback each time: a raise adds its caller's frames to the kept
            # error, and they (a training step's tensors) would live as long as the handle.
            if not self._error_tb:
                self._error_tb.append(self._error.__traceback__)
            raise self._error.with_traceback(self._error_tb[0])

    def cancel(self) -> bool:
        """Cancel the save unless its commit was decided; True when it will never commit.

        Returns within about `STOP_GRACE_S` (a second or so) once cancelled, even when the write is
        stuck (a hung file system): its worker stops when that call returns, and commits nothing.
        False when the commit came first, or is under way and could not be stopped.
        """
        self._cancelled = True
        if self._op.cancel("cancelled through its handle") != CANCEL:
            self._cancelled = False
            return False
        self._seen = True  # asked for: no failure for the next save to raise
        self._finished.wait(workers.STOP_GRACE_S)
        return True

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveHandle {self.path} {state}, blocked {self.blocked_s:.3f} s>"


def check_previous() -> None:
    """Raise, once, the failure of an earlier asynchronous save whose handle was never asked."""
    global _pending
    wait_for_handle(_HANDOVER_S)
    with _lock:
        prev = _pending
        if prev is None or not prev.done():
            return
        _pending = None
    if prev._error is not None and not prev._seen:
        prev._seen = True
        raise CheckpointAsyncError(f"the previous asynchronous save of {prev.path} failed and its "
                                   f"handle was never asked: {prev._error}") from prev._error


def wait_for_handle(timeout_s: float | None) -> bool:
    """Once the last asynchronous save's worker has ended, wait (at most `timeout_s`) for its owner to put
    the outcome in its handle: a save or `wait_until_idle()` right after must see the failure."""
    with _lock:
        prev = _pending
    if prev is None or prev.done():
        return True
    return (prev._op.done.is_set() or timeout_s is None) and prev._finished.wait(timeout_s)


def _arena_views(entries: list[StorageEntry]) -> list[torch.Tensor]:
    """Host buffers for `entries` (bytes), carved from the reused staging arena."""
    global _arena
    offsets, total = [], 0
    for e in entries:
        offsets.append(total)
        total += -(-e.nbytes // _ALIGN) * _ALIGN
    if _arena is None or _arena.numel() < total:
        _arena = None  # free the old one before touching the new one
        _arena = torch.empty(total, dtype=torch.uint8)
    return [_arena[off:off + e.nbytes] for e, off in zip(entries, offsets)]


def copy_all(copies: list[tuple[int, int, int]]) -> None:
    """memmove each (destination, source, bytes); the bytes of large ones split over a few threads
    (ctypes lets the GIL go during the copy): on two cores the caller waits about half as long."""
    pieces = []
    for dst, src, n in copies:
        if n < _PIECE:
            ctypes.memmove(dst, src, n)
            continue
        pieces += [(dst + at, src + at, min(_PIECE, n - at)) for at in range(0, n, _PIECE)]
    lanes = min(os.cpu_count() or 1, _COPY_THREADS, len(pieces))
    if lanes <= 1:
        for piece in pieces:
            ctypes.memmove(*piece)
        return
    finished = [threading.Event() for _ in range(lanes - 1)]

    def lane(i: int) -> None:
        try:
            for piece in pieces[i::lanes]:
                ctypes.memmove(*piece)
        finally:
            if i:
                finished[i - 1].set()

    for i in range(1, lanes):
        start_thread(lambda i=i: lane(i), "xlakit-stage-copy", never_started=finished[i - 1].set)
    try:
        lane(0)
    finally:
        for event in finished:  # a copy is bounded: waited for even when the caller is interrupted
            event.wait()


def stage(op: Operation, job: pipeline.FileSave) -> Staged | device_staging.Staged:
    """Sync and copy every storage to memory the training loop cannot touch: host memory, or with
    `staging="device"` copies on the device for the groups whose backend copies."""
    groups = pipeline.synced_groups(op, job.plan, job.opts)
    on_device = []
    if job.opts.staging == "device":
        on_device = [(g, device_staging.copy_group(op, g, b)) for g, b in groups if b.copies]
        groups = [(g, b) for g, b in groups if not b.copies]
    staged: dict[int, torch.Tensor] = {}
    viewed: list[StorageEntry] = []
    # Nothing is written while staging: every batch is kept, so there is nothing to overlap with.
    for batch, hosts, backend in pipeline.host_batches(op, groups, job.opts, overlap=False):
        for e, h in zip(batch, hosts):
            staged[e.index] = h
            if backend.returns_mutable_views:
                viewed.append(e)
            op.advance(e.nbytes)
    if viewed:
        op.enter("stage", viewed[0].path)
    copies = []
    for e, dst in zip(viewed, _arena_views(viewed)):
        if e.nbytes:  # contiguous host bytes (a CPU storage or tensor) into the arena
            copies.append((dst.data_ptr(), staged[e.index].data_ptr(), e.nbytes))
        staged[e.index] = dst
    with op.clock.timing("transfer"):
        copy_all(copies)
    storages = [e for e in job.plan.storages if e.index in staged]
    on_host = [(storages, [staged[e.index] for e in storages], None)] if storages else []
    return device_staging.Staged(on_host, on_device, job.opts) if on_device else on_host


def start(job: pipeline.FileSave, stage_phase: Callable[[Operation], Any],
          write_phase: Callable[[Operation, Any], None], *, gate: Gate | None = None,
          rank: int | None = None, path: Path | None = None) -> SaveHandle:
    """Run `stage_phase` on the caller's thread, then `write_phase` in the background; the handle is of
    `path`, the checkpoint the caller named (default `job.final`; a rank's shard file is only its part)."""
    global _pending
    watch = Watch.of(job.opts)
    first = Operation("save (staging)", job.final, watch, bytes_total=job.plan.nbytes, gate=gate,
                      rank=rank)
    staged = first.run(stage_phase)
    second = Operation("save", job.final, watch, bytes_total=job.plan.nbytes, started=first.started,
                       gate=first.gate, rank=rank)
    second.background = True
    handle = SaveHandle(path or job.final, time.monotonic() - first.started, second, first)

    # The owner waits until the caller holds its handle: a thread that starts running Python
    # at once keeps the GIL for up to its switch interval (5 ms) while the caller waits to return.
    # A lock, not an Event: its release is one C call, which a Ctrl-C can only follow, never
    # precede (Event.set is Python, and a Ctrl-C at its entry left the owner waiting forever).
    go = threading.Lock()
    go.acquire()

    alive = threading.Event()

    def owner() -> None:
        nonlocal staged
        alive.set()
        go.acquire()
        try:
            second.run(lambda op: device_staging.write(op, staged, write_phase))
        except BaseException as e:  # noqa: BLE001 - kept for result() and the next save
            # Cancelled as asked, whatever ended the worker after that (a stuck write meets the deadline):
            # no failure to report.
            if handle._cancelled and not second.committed:
                handle._seen = True
                handle._error = CancelledError(f"the asynchronous save of {handle.path} was cancelled; "
                                               f"nothing was committed")
            else:
                handle._error = e
                log.error("xlakit: asynchronous save of %s failed: %s", handle.path, e)
        finally:
            staged = None  # the host copies go before result() returns, not while this thread ends
            handle._finished.set()

    def never_started() -> None:
        handle._error = CheckpointAsyncError(f"the asynchronous save of {handle.path} was interrupted "
                                             f"before its write began; nothing was written")
        second.done.set()  # no worker will: the write is over before it began
        workers.forget(second)
        handle._finished.set()

    try:
        try:
            with _lock:  # inside: a Ctrl-C right after must not leave a handle nobody finishes
                _pending = handle
            # Live before save() returns (the owner only starts it after): a save, a restore,
            # wait_until_idle() and the exit hook that come next must see it writing.
            workers.track(second)
            start_thread(owner, "xlakit-async-save", never_started=never_started)
        finally:
            go.release()
    except BaseException as e:  # Ctrl-C while starting the write: the caller saw it, so no commit
        handle._seen = True  # and nothing of this save speaks again at the next one
        second.abandon(e)
        if not handle._finished.is_set() and not alive.wait(workers.START_WAIT_S):  # no owner will end it
            never_started()
        raise
    return handle


def save_file(obj: Any, final: Path, opts: SaveOptions) -> SaveHandle:
    """The asynchronous save of one file; see `xlakit.save`."""
    job = pipeline.prepare(obj, final, opts)
    return start(job, lambda op: stage(op, job),
                 lambda op, staged: pipeline.write(op, job, staged))
