"""Transfer and write at once: the device-to-host copy of the next batch runs while this one is written.

A save moves its storages to the host in batches and writes them. One after
the other, it takes the sum of the two; here a transfer thread copies batch
k+1 while the operation's worker writes batch k, so the save takes about the
slower of the two, plus one batch of the other.

The memory bound is the same `max_inflight_bytes`: the host copies held at
once never exceed it. Batches are at most half of it, and the transfer thread
takes a batch's bytes from a budget of `max_inflight_bytes` before it copies
the batch; the writer gives them back once the batch is written and dropped.
So at most one batch is being written while the next one is being copied. A
storage larger than half the budget waits until nothing else is held and
travels alone, as without overlap (the bound is then that one storage). A
small state is cut into at least `MIN_BATCHES` batches (as far as its
storages allow), so that its transfer overlaps its write too.

Only backends that copy (`HostTransfer.copies`: the patched binding,
torch_xla's stock copy, CUDA, TorchTPU) get the thread: CPU storages and the
CPU PJRT client's DLPack export have nothing to overlap and stay on the worker.

One deadline, one owner: the thread copies with what is left of the
operation's deadline and stops before its next batch once the operation is
cancelled; it never writes, renames or commits. The writer waits for each
batch with the operation's checks, so a cancel or the deadline reaches it as
before. When the writer stops, for any reason, it waits for the copy in flight
to return: a runtime call that hangs keeps the operation's worker alive, so the
next save refuses to queue behind it (`workers.check_idle`), as without overlap.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from xlakit.checkpoint.core import workers
from xlakit.checkpoint.core.operation import Operation
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.checkpoint.file import transfer
from xlakit.checkpoint.format.state import StorageEntry

MIN_BATCHES = 8
_POLL_S = 0.05
_DONE = object()

Groups = list[tuple[list[StorageEntry], transfer.HostTransfer]]


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class _Budget:
    """Bytes of host copies held (copied, not yet written), at most `total` unless one batch alone."""

    def __init__(self, total: int):
        self.total, self.held = total, 0
        self._cond = threading.Condition()

    def take(self, nbytes: int, stopped) -> bool:
        """Wait until `nbytes` fit (or nothing else is held); False when `stopped()` first."""
        with self._cond:
            while self.held and self.held + nbytes > self.total:
                if stopped():
                    return False
                self._cond.wait(_POLL_S)
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()


def batch_bytes(groups: Groups, opts: SaveOptions) -> int:
    """The cap of one batch: half the budget, smaller for a small state (`MIN_BATCHES`)."""
    total = sum(e.nbytes for group, _ in groups for e in group)
    return max(min(opts.max_inflight_bytes // 2, -(-total // MIN_BATCHES)), 1)


def batches(op: Operation, groups: Groups, opts: SaveOptions) -> Iterator[
        tuple[list[StorageEntry], list[transfer.HostBytes], transfer.HostTransfer]]:
    """(batch, host copies, backend) of every group, in order, each copied while the one before is
    written. The consumer drops each batch's host copies before asking for the next."""
    budget, cap = _Budget(opts.max_inflight_bytes), batch_bytes(groups, opts)
    ready: queue.Queue = queue.Queue()
    stop, finished = threading.Event(), threading.Event()
    copying: list[str | None] = [None]  # the first tensor of the batch being copied

    def stopped() -> bool:
        return stop.is_set() or op.cancelled

    def copy_all() -> None:
        try:
            for group, backend in groups:
                for batch in transfer.batches(group, cap):
                    nbytes = sum(e.nbytes for e in batch)
                    if not budget.take(nbytes, stopped) or stopped():
                        return
                    copying[0] = batch[0].path
                    with op.clock.timing("transfer"):
                        hosts = transfer.batch_to_host(backend, batch, timeout_s=max(op.remaining(), 0.001))
                    ready.put((batch, hosts, backend, nbytes))
                    del hosts
            ready.put(_DONE)
        except BaseException as e:  # noqa: BLE001 - raised by the writer
            ready.put(_Failed(e))
        finally:
            finished.set()

    workers.start_thread(copy_all, f"xlakit-transfer ({op.path})", never_started=finished.set)
    try:
        while True:
            item = _next(op, ready, copying)
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            batch, hosts, backend, nbytes = item
            del item
            yield batch, hosts, backend
            del hosts  # the writer has dropped its own reference: the copy is freed here
            budget.give(nbytes)
    finally:
        stop.set()
        while not finished.wait(_POLL_S):  # the copy in flight returns (a hung one keeps the worker)
            _drain(ready)
        _drain(ready)


def _next(op: Operation, ready: queue.Queue, copying: list[str | None]):
    """The next item of the transfer thread; the operation's checks while it is being copied."""
    try:
        return ready.get_nowait()
    except queue.Empty:
        pass
    op.enter("transfer", copying[0])  # the writer waits for the copy: that is the stage now
    while True:
        try:
            return ready.get(timeout=_POLL_S)
        except queue.Empty:
            op.check()


def _drain(ready: queue.Queue) -> None:
    """Drop the copies nobody will write."""
    while True:
        try:
            ready.get_nowait()
        except queue.Empty:
            return
