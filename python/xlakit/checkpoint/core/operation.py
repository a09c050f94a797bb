"""An operation: one save or load, owned by its caller, with one deadline and one commit point.

The work runs on a worker thread; the owner (the caller's thread, or an
asynchronous save's own thread) watches it: logs progress, warns on stalls,
calls the progress callback and enforces the deadline. A native call that
never returns (a hung device) therefore cannot hang the owner.

Ownership is the rule that makes a save trustworthy: *once the owner has seen
an exception, nothing of the operation may rename, commit or delete.* Any
exception on the owner's side (the deadline, Ctrl-C, a progress callback
that raises) cancels the operation. The worker notices at its next batch or
write boundary (`enter`, `advance`), stops and removes its temporary files;
the owner removes them too, at once. The commit (the rename over the final
name, a commit record, a folder exchange) happens only inside
`commit_point()`, which claims the operation's `Gate` (`gate.py`) under the same
lock that `cancel()` takes: the commit either happens entirely before the owner
gives up, or never. A gate can also be agreed across ranks (`agreed_gate.py`).

The worker threads themselves, and the clean exit, are `workers.py`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xlakit.checkpoint.core import workers
from xlakit.checkpoint.core.gate import CANCEL, COMMIT, DEADLINE_PASSED, NO_TIME_LEFT, STOPPED_ELSEWHERE, Gate
from xlakit.checkpoint.core.load_stats import LoadStats
from xlakit.checkpoint.core.stage_clock import StageClock
from xlakit.checkpoint.core.options import LoadOptions, Progress, ProgressCallback, SaveOptions
from xlakit.errors import CheckpointTimeoutError

log = logging.getLogger("xlakit")

_POLL_S = 0.05
_LOCK_WAIT_S = 5.0  # how long a cancel waits for a commit already under way


class Cancelled(Exception):
    """Raised inside a worker whose owner gave the operation up."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class Watch:
    """How the owner watches the worker."""

    timeout_s: float
    stall_warning_s: float
    progress_interval_s: float
    callback: ProgressCallback | None

    @classmethod
    def of(cls, opts: SaveOptions | LoadOptions) -> "Watch":
        return cls(opts.timeout_s, opts.stall_warning_s, opts.progress_interval_s,
                   opts.progress_callback)


class Operation:
    """One save or load: deadline, progress, cancellation, temporary files, commit point.

    Worker side: `enter`/`advance` report progress and raise `Cancelled` once the
    owner gave up; `own` registers temporary files; `commit_point()` is the only
    place the final name may change. Owner side: `run(work)`.
    """

    def __init__(self, kind: str, path: str | os.PathLike, watch: Watch, *, bytes_total: int = 0,
                 started: float | None = None, gate: Gate | None = None,
                 untouched: str | None = None, rank: int | None = None):
        self.kind, self.path, self.watch = kind, str(path), watch
        self.started = time.monotonic() if started is None else started
        self.deadline = self.started + watch.timeout_s
        self.gate = gate or Gate()
        self.rank = rank
        # What the failure left as it was, for the error's note.
        self.untouched = untouched or f"the previous checkpoint at {self.path}, if any, is untouched"
        self.stage, self.tensor = "start", None
        self.object: str | None = None  # the object-storage object a request is in flight for
        # The store's last transient failure while a request is being retried (cleared when it succeeds):
        # named by the deadline's error, which may fire while the retry waits.
        self.last_transient: BaseException | None = None
        self.bytes_done, self.bytes_total = 0, bytes_total
        self.stats = LoadStats()  # what a load read, counted where the bytes come in
        self.clock = StageClock()  # a save's transfer and write seconds, and their overlap
        self.last_progress = self.started
        self.background = False  # an asynchronous save's write: waited for at exit
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.cancel_reason: str | None = None  # why this rank gave it up first, for the worker's Cancelled
        self.result: Any = None
        self._temps: list[Path] = []  # scratch: never named by any commit
        self._pending: list[Path] = []  # complete parts a commit (another rank's) may name
        self._temps_lock = threading.Lock()

    # -- state ------------------------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self.gate.outcome == CANCEL

    @property
    def committed(self) -> bool:
        return self.gate.outcome == COMMIT

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def progress(self) -> Progress:
        return Progress(self.path, self.stage, self.tensor, self.bytes_done, self.bytes_total,
                        time.monotonic() - self.started, *self.clock.seconds())

    def describe(self) -> str:
        where = f"stage {self.stage!r}" + (f", tensor {self.tensor!r}" if self.tensor else "")
        return (f"{self.kind} of {self.path} ({where}, {human_bytes(self.bytes_done)} of "
                f"{human_bytes(self.bytes_total)}, started {time.monotonic() - self.started:.1f} s ago)")

    # -- worker side ------------------------------------------------------------------------
    def check(self) -> None:
        if self.cancelled:
            raise self._cancelled_in(self.stage)

    def _cancelled_in(self, stage: str) -> Cancelled:
        return Cancelled(f"the {self.kind} was cancelled ({self.cancel_reason or 'given up'}) in stage {stage!r}")

    def enter(self, stage: str, tensor: str | None = None) -> None:
        self.check()
        self.stage, self.tensor = stage, tensor
        self.last_progress = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.check()
        self.bytes_done += nbytes
        self.last_progress = time.monotonic()

    def own(self, path: Any, *, pending: bool = False) -> Any:
        """Register a file or folder this operation made, to remove unless it is committed
        (or an object-storage object: anything with a `remove()` that never blocks).

        A scratch file (the default) goes whenever the operation fails. A `pending` one
        (a shard, complete, that another rank's commit record may name) goes only once
        the operation is surely off (`Gate.may_discard`), never while that is unknown.
        """
        with self._temps_lock:
            (self._pending if pending else self._temps).append(path)
        return path

    def disown(self, path: Any) -> None:
        with self._temps_lock:
            self._temps = [p for p in self._temps if p != path]

    def discard_temps(self) -> None:
        with self._temps_lock:
            temps, self._temps = self._temps, []
            if self.gate.may_discard():
                temps, self._pending = temps + self._pending, []
        for p in temps:
            if isinstance(p, Path):
                remove_path(p)
            else:  # an object of an object store (storage.generations.Leftover): removed without waiting
                p.remove()

    @contextlib.contextmanager
    def commit_point(self) -> Iterator[None]:
        """The point of no return: the body runs only if the operation is still wanted.

        Raises `Cancelled` when the owner (or, for an agreed gate, any rank) gave up first, and
        `CheckpointTimeoutError` (stage "commit") when the deadline has passed: the owner looks at
        the clock only between polls, so a worker that reaches its commit after the deadline must
        not commit on its own (no late commit, whatever the save's size).
        """
        with self.gate.lock:
            if self.gate.outcome is None and time.monotonic() >= self.deadline:
                if self.gate.claim_cancel(DEADLINE_PASSED) != COMMIT:  # another rank may have decided
                    self.stage, self.tensor = "commit", None
                    raise self.timeout_error(
                        f"The deadline had passed when the {self.kind} reached its commit, so it did not "
                        f"commit: nothing was committed, {self.untouched}; its temporary files are removed.")
            if not self.gate.claim_commit():
                raise self._cancelled_in("commit")
            yield

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """A step that must not happen once the owner gave up (a rename that is not the commit)."""
        with self.gate.lock:
            self.check()
            yield

    # -- owner side -------------------------------------------------------------------------
    def cancel(self, reason: str) -> str:
        """Give the operation up, atomically with its commit point.

        Returns "cancel" (nothing will ever commit; temporary files are removed),
        "commit" (the commit was claimed first) or "committing" (a commit step is
        still running after a bounded wait, e.g. a rename on a hung file system).
        """
        if not self.gate.lock.acquire(timeout=_LOCK_WAIT_S):
            return "committing"
        try:
            outcome = self.gate.claim_cancel(reason)
        finally:
            self.gate.lock.release()
        if outcome == CANCEL:
            self.cancel_reason = self.cancel_reason or reason
            self.discard_temps()
        return outcome

    def run(self, work: Callable[["Operation"], Any]) -> Any:
        """Run `work(self)` on a worker thread and watch it; its result, or raise.

        Any exception on this side (the deadline, KeyboardInterrupt, a progress
        callback's error) cancels the operation before it propagates.
        """
        if time.monotonic() >= self.deadline:  # an earlier stage used it all
            self.gate.lock.acquire()
            self.gate.claim_cancel(NO_TIME_LEFT)
            self.gate.lock.release()
            workers.forget(self)  # an asynchronous save's write is tracked before it runs
            self.done.set()  # no worker will run: nothing waits for one
            raise self.timeout_error("Nothing was started; " + self.untouched + ".")
        try:
            self.start(work)  # inside: Ctrl-C can land in Thread.start() after the worker began
            result = self.watch_worker()
        except BaseException as e:
            self.abandon(e)
            raise
        # Handed over: an operation outlives its result (an asynchronous save's handle keeps its
        # staging operation), and that result may be the whole state's host copy.
        self.result = None
        return result

    def start(self, work: Callable[["Operation"], Any]) -> None:
        def never_started() -> None:  # no worker will set `done`: nothing may wait for one
            self.cancel("interrupted before its worker started")
            workers.forget(self)
            self.done.set()

        def target() -> None:
            try:
                self.result = work(self)
            except BaseException as e:  # noqa: BLE001 - handed to the owner
                if self.background:  # kept by a handle, maybe for long: not what its frames held
                    workers.let_go_of_frames(e)
                self.error = e
            finally:
                if self.gate.outcome != COMMIT:
                    self.discard_temps()
                workers.forget(self)
                self.done.set()

        workers.track(self)
        workers.start_thread(target, f"xlakit-{self.kind}", never_started=never_started)

    def watch_worker(self) -> Any:
        """Wait for the worker, reporting progress and enforcing the deadline."""
        watch = self.watch
        next_log = self.started + watch.progress_interval_s
        warned_at: float | None = None
        last_reported = -1
        while not self.done.wait(_POLL_S):
            now = time.monotonic()
            if now >= self.deadline:
                return self._expire()
            if self.gate.stopped_elsewhere():
                self._stop_for_another_rank()
            if now >= next_log:
                self._log_progress()
                next_log = now + watch.progress_interval_s
            if now - self.last_progress >= watch.stall_warning_s and warned_at != self.last_progress:
                warned_at = self.last_progress
                log.warning("xlakit: %s %s has made no progress for %.0f s in stage %r%s", self.kind,
                            self.path, now - self.last_progress, self.stage,
                            f" (tensor {self.tensor!r})" if self.tensor else "")
            if watch.callback is not None and self.bytes_done != last_reported:
                last_reported = self.bytes_done
                watch.callback(self.progress())
        if watch.callback is not None:
            watch.callback(self.progress())
        if self.error is not None:
            # Stopped because another rank gave the operation up (after every vote, at the commit point):
            # that rank's error, not the worker's internal signal.
            foreign = self.gate.foreign_error(blamed_too=True) if isinstance(self.error, Cancelled) else None
            raise foreign or self.error
        return self.result

    def _stop_for_another_rank(self) -> None:
        """Another rank gave the operation up and this rank's worker has not seen it: it waits in a
        collective that rank left (DCP's, a broadcast), which ends only at the deadline. Cancel, and
        raise that rank's error now; the worker stops when the collective returns."""
        if self.cancel(STOPPED_ELSEWHERE) != CANCEL:
            return  # it committed first, or is committing: the worker's own outcome decides
        error = self.gate.foreign_error(blamed_too=True)
        if error is not None:
            _note(error, self._cancel_note(self.done.wait(workers.STOP_GRACE_S)))
            raise _Expired(error)

    def _expire(self) -> Any:
        outcome = self.cancel(DEADLINE_PASSED)
        if outcome == CANCEL:
            raise _Expired(self.gate.foreign_error() or self.timeout_error(None))
        if self.done.wait(workers.STOP_GRACE_S) and self.error is None:
            return self.result  # committed in the last instant: its own outcome wins
        raise _Expired(self.timeout_error(
            f"The commit had been decided when the deadline passed, but it was not confirmed in "
            f"time: the checkpoint at {self.path} is either the new one or the previous one, both "
            f"whole (load it to see which)."))

    def abandon(self, e: BaseException) -> None:
        """Cancel after the owner saw `e`, and say in `e` what became of the operation."""
        if isinstance(e, _Expired):
            raise e.error from None
        if isinstance(e, Cancelled) or e is self.error:
            return  # the worker's own outcome, already final
        if self.done.is_set():  # the caller's own error (a progress callback) after the worker ended
            # Cancelling still matters: a later phase sharing the gate (an asynchronous save's write)
            # must not commit either.
            if self.gate.outcome == COMMIT or self.cancel(f"{type(e).__name__} in the caller") != CANCEL:
                _note(e, f"The {self.kind} of {self.path} had committed before this error: the "
                         f"checkpoint there is the new one.")
            else:
                _note(e, self._cancel_note(True))
            return
        outcome = self.cancel(f"{type(e).__name__} in the caller")
        stopped = self.done.wait(workers.STOP_GRACE_S)
        if outcome == CANCEL:
            _note(e, self._cancel_note(stopped))
        else:
            _note(e, f"The {self.kind} of {self.path} had already reached its commit when the caller "
                     f"gave up: the checkpoint there is the new one"
                     + ("" if stopped else " (its last step was still running)") + ".")

    def _cancel_note(self, stopped: bool) -> str:
        if stopped:
            return (f"The {self.kind} was cancelled: its worker stopped and removed its temporary "
                    f"files; nothing was committed, {self.untouched}.")
        return (f"The {self.kind} was cancelled: nothing will be committed and {self.untouched}. Its "
                f"worker is still in stage {self.stage!r} (inside the runtime); it stops and removes "
                f"its temporary files when that call returns (xlakit.wait_until_idle() waits for it).")

    def timeout_error(self, hint: str | None) -> CheckpointTimeoutError:
        elapsed = time.monotonic() - self.started
        waiting = self.gate.wait_note()
        err = CheckpointTimeoutError(
            f"{self.kind} of {self.path} timed out after {elapsed:.1f} s "
            f"(timeout_s={self.watch.timeout_s:g}) in stage {self.stage!r}"
            + (f" with tensor {self.tensor!r} in flight" if self.tensor else "")
            + (f"; a request for object {self.object} was in flight" if self.object else "")
            + f"; {human_bytes(self.bytes_done)} of {human_bytes(self.bytes_total)} done"
            + (f"; {waiting}" if waiting else ""),
            stage=self.stage, tensor=self.tensor, bytes_done=self.bytes_done, elapsed_s=elapsed,
            rank=self.gate.blame() if self.gate.blame() is not None else self.rank)
        err.add_note(hint or self._cancel_note(self.done.wait(workers.STOP_GRACE_S)))
        last = self.last_transient
        if last is not None:
            err.last_answer = last
            err.add_note(transient_note(last))
        if self.bytes_done and elapsed > 0:
            err.add_note(f"It was moving {human_bytes(self.bytes_done / elapsed)}/s; if the "
                         f"{self.kind} is merely slow, raise timeout_s.")
        return err

    def _log_progress(self) -> None:
        p = self.progress()
        eta = f", ETA {p.eta_s:.0f} s" if p.eta_s is not None else ""
        log.info("xlakit: %s %s: %s of %s at %s/s%s [%s%s]", self.kind, self.path,
                 human_bytes(p.bytes_done), human_bytes(p.bytes_total), human_bytes(p.rate_bytes_per_s),
                 eta, p.stage, f" {p.tensor}" if p.tensor else "")


def transient_note(last: BaseException) -> str:
    """The note that names the store's last transient answer in a deadline's error."""
    return f"The store's last answer was a transient failure: {type(last).__name__}: {last}"


class _Expired(Exception):
    """Carries the deadline's error out of the watch loop, past `abandon`."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _note(e: BaseException, note: str) -> None:
    try:
        e.add_note(note)
    except (AttributeError, TypeError):  # an exception type that refuses notes
        log.warning("xlakit: %s", note)


def remove_path(p: Path) -> None:
    """Remove a temporary file or folder; already gone is fine."""
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("xlakit: could not remove the temporary %s: %s", p, e)

