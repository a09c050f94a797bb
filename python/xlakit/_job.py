"""Run one long operation under one deadline, watched from the caller's thread.

The work runs on a worker thread and reports its stage, the tensor in flight
and bytes done; the caller's thread waits on it, logs progress of long runs,
warns on stalls and enforces the deadline. A native call that never returns
(a hung device) therefore cannot hang the caller: at the deadline the caller
raises `CheckpointTimeoutError` while the worker is abandoned. An abandoned
worker still stuck in the runtime is remembered, so the next operation says
so plainly instead of queueing behind it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from xlakit.errors import CheckpointBusyError, CheckpointTimeoutError
from xlakit.options import Progress, ProgressCallback

log = logging.getLogger("xlakit")

_POLL_S = 0.05
_abandoned: list["Job"] = []
_abandoned_lock = threading.Lock()


class Cancelled(Exception):
    """Raised inside the worker when the caller gave up on it."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


@dataclass(frozen=True)
class Watch:
    """How the caller watches the worker."""

    timeout_s: float
    stall_warning_s: float
    progress_interval_s: float
    callback: ProgressCallback | None


class Job:
    """Shared state between the worker and the watching caller."""

    def __init__(self, what: str, path: str, bytes_total: int):
        self.what, self.path, self.bytes_total = what, path, bytes_total
        self.stage, self.tensor = "start", None
        self.bytes_done = 0
        self.started = time.monotonic()
        self.last_progress = self.started
        self.cancelled = False
        self.lock = threading.Lock()  # held by the worker while it commits
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: object = None

    # worker side
    def enter(self, stage: str, tensor: str | None = None) -> None:
        if self.cancelled:
            raise Cancelled(stage)
        self.stage, self.tensor = stage, tensor
        self.last_progress = time.monotonic()

    def advance(self, nbytes: int) -> None:
        if self.cancelled:
            raise Cancelled(self.stage)
        self.bytes_done += nbytes
        self.last_progress = time.monotonic()

    # caller side
    def progress(self) -> Progress:
        return Progress(self.path, self.stage, self.tensor, self.bytes_done, self.bytes_total,
                        time.monotonic() - self.started)

    def describe(self) -> str:
        where = f"stage {self.stage!r}" + (f", tensor {self.tensor!r}" if self.tensor else "")
        return (f"{self.what} of {self.path} ({where}, {human_bytes(self.bytes_done)} of "
                f"{human_bytes(self.bytes_total)}, started {time.monotonic() - self.started:.1f} s ago)")


@contextlib.contextmanager
def commit_guard(job: Job) -> Iterator[None]:
    """Hold the job's lock while its result is made visible; refuse if the caller gave up.

    The caller's deadline handler takes the same lock, so a commit either
    happens entirely before the timeout is declared or not at all.
    """
    with job.lock:
        if job.cancelled:
            raise Cancelled("commit")
        yield


def check_no_abandoned_work() -> None:
    """Refuse to start while a worker abandoned at a deadline is still stuck in the runtime."""
    with _abandoned_lock:
        _abandoned[:] = [j for j in _abandoned if not j.done.is_set()]
        stuck = list(_abandoned)
    if stuck:
        err = CheckpointBusyError(
            f"cannot start: the {stuck[0].describe()} timed out and its worker is still blocked "
            f"inside the runtime; starting another transfer over it could hang the same way")
        err.add_note("The device or runtime is probably hung. Saving works again as soon as that "
                     "call returns; if it never does, the process must be restarted (the last "
                     "committed checkpoint is intact).")
        raise err


def wait_for_abandoned(timeout_s: float) -> bool:
    """Wait until every abandoned worker has returned; False if some are still stuck."""
    deadline = time.monotonic() + timeout_s
    with _abandoned_lock:
        stuck = list(_abandoned)
    return all(j.done.wait(max(deadline - time.monotonic(), 0)) for j in stuck)


def _log_progress(job: Job) -> None:
    p = job.progress()
    eta = f", ETA {p.eta_s:.0f} s" if p.eta_s is not None else ""
    log.info("xlakit: %s %s: %s of %s at %s/s%s [%s%s]", job.what, job.path, human_bytes(p.bytes_done),
             human_bytes(p.bytes_total), human_bytes(p.rate_bytes_per_s), eta, p.stage,
             f" {p.tensor}" if p.tensor else "")


def run(job: Job, work: Callable[[Job], object], watch: Watch,
        on_timeout: Callable[[Job], str]) -> object:
    """Run `work(job)` on a worker thread; return its result or raise its error.

    On the deadline the job is cancelled and `on_timeout(job)` (which must not
    block) cleans up and returns a sentence for the error's hint.
    """

    def target() -> None:
        try:
            job.result = work(job)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            job.error = e
        finally:
            job.done.set()

    deadline = job.started + watch.timeout_s
    if time.monotonic() >= deadline:  # an earlier stage used it all (asynchronous saves)
        raise _timeout_error(job, watch, "Nothing was started; the previous checkpoint is untouched.")
    worker = threading.Thread(target=target, name=f"xlakit-{job.what}", daemon=True)
    worker.start()
    next_log = job.started + watch.progress_interval_s
    warned_at: float | None = None
    last_reported = -1
    while not job.done.wait(_POLL_S):
        now = time.monotonic()
        if now >= deadline:
            _expire(job, watch, on_timeout)
        if now >= next_log:
            _log_progress(job)
            next_log = now + watch.progress_interval_s
        if now - job.last_progress >= watch.stall_warning_s and warned_at != job.last_progress:
            warned_at = job.last_progress
            log.warning("xlakit: %s %s has made no progress for %.0f s in stage %r%s", job.what,
                        job.path, now - job.last_progress, job.stage,
                        f" (tensor {job.tensor!r})" if job.tensor else "")
        if watch.callback is not None and job.bytes_done != last_reported:
            last_reported = job.bytes_done
            watch.callback(job.progress())
    if watch.callback is not None:
        watch.callback(job.progress())
    if job.error is not None:
        raise job.error
    return job.result


def _expire(job: Job, watch: Watch, on_timeout: Callable[[Job], str]) -> None:
    got_lock = job.lock.acquire(timeout=1.0)
    try:
        if job.done.is_set():
            return  # finished in the last instant: its own outcome wins
        job.cancelled = True
        hint = on_timeout(job)
    finally:
        if got_lock:
            job.lock.release()
    with _abandoned_lock:
        _abandoned.append(job)
    raise _timeout_error(job, watch, hint)


def _timeout_error(job: Job, watch: Watch, hint: str) -> CheckpointTimeoutError:
    elapsed = time.monotonic() - job.started
    err = CheckpointTimeoutError(
        f"{job.what} of {job.path} timed out after {elapsed:.1f} s (timeout_s={watch.timeout_s:g}) in "
        f"stage {job.stage!r}" + (f" with tensor {job.tensor!r} in flight" if job.tensor else "")
        + f"; {human_bytes(job.bytes_done)} of {human_bytes(job.bytes_total)} done",
        stage=job.stage, tensor=job.tensor, bytes_done=job.bytes_done, elapsed_s=elapsed)
    err.add_note(hint)
    if job.bytes_done:
        err.add_note(f"It was moving {human_bytes(job.bytes_done / elapsed)}/s; if the save is merely "
                     f"slow, raise timeout_s.")
    return err
