"""The threads xlakit starts and the operations they run, process-wide.

Every operation's worker (and an asynchronous save's writer) is started here,
safe against a Ctrl-C that lands inside `Thread.start()`, and tracked until it
returns. From that record come the checks before new work (`check_idle`: a
cancelled worker still stuck in the runtime, or an asynchronous save still
writing, refuses a new save), `wait_until_idle`, and the exit hook.

Interpreter exit is clean: the hook waits for asynchronous saves still
writing (bounded by their deadlines), cancels everything else, then joins
every thread xlakit started, with a bound. Waiting for an operation's `done`
is not enough: its thread goes on after it, freeing the tensors its frames
held (native code), and a daemon thread caught in native code by the
interpreter's finalization aborts the process.

Operations are tracked by what they offer (`done`, `cancelled`, `committed`, `error`, `background`,
`cancel`, `describe`, `remaining`), so this module imports none of
`operation.py`, which is built on it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from xlakit.errors import CheckpointBusyError

log = logging.getLogger("xlakit")

STOP_GRACE_S = 0.5  # how long an owner waits, after cancelling, to say whether the worker stopped
BUSY_WAIT_S = 5.0  # how long a new operation waits for a cancelled worker before refusing
EXIT_GRACE_S = 5.0  # how long the exit hook waits for cancelled workers
START_WAIT_S = 1.0  # how long an interrupted start waits to learn whether its thread began
_settlers: list[Callable[[float], None]] = []  # `settle_at_exit`
_lost_above: list[bool] = []  # `lost_at_exit`: whether each was interrupted

_live: set[Any] = set()  # operations whose worker has not returned
_threads: set[threading.Thread] = set()  # threads `start_thread` started and nobody saw end yet
_live_lock = threading.Lock()


def track(op: Any) -> None:
    """`op`'s worker is about to start: it counts as live until `forget(op)`."""
    with _live_lock:
        _live.add(op)


def forget(op: Any) -> None:
    """`op`'s worker returned (or never started)."""
    with _live_lock:
        _live.discard(op)


def start_thread(target: Callable[[], None], name: str, *, never_started: Callable[[], None]) -> None:
    """Start a daemon thread running `target`, safe against an interruption of the start itself.

    Ctrl-C can land inside `Thread.start()`: after the thread was launched (it waits there for
    the thread to begin) or just before. The exception propagates either way; when the thread
    has not begun within a second, `never_started()` runs first, so that nothing waits for it.
    """
    began = threading.Event()

    def run() -> None:
        began.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _live_lock:  # known before it runs, so that the exit hook joins it
        _threads.difference_update([t for t in _threads if t.ident is not None and not t.is_alive()])
        _threads.add(thread)
    try:
        thread.start()
    except BaseException:
        if not began.wait(START_WAIT_S):
            never_started()
        if thread.ident is None:  # never launched: nothing to join
            with _live_lock:
                _threads.discard(thread)
        raise


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cycle collector off while a synchronous operation's caller waits for it.

    With many tensors a save, load or restore allocates several objects per tensor, none of
    them cyclic garbage, and the collector's passes over them cost a quarter of the work.
    Whatever happens, it is on again after (if it was on before). Not for an asynchronous
    save's background phase: the training loop runs meanwhile.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def live_operations() -> list[Any]:
    with _live_lock:
        return list(_live)


def check_idle(*, wait_s: float = BUSY_WAIT_S, exclude: Any = None,
               writing_ok: bool = False) -> None:
    """Before a new save: wait briefly for cancelled workers; refuse if work is still running.

    `exclude` is the operation asking (when it checks from its own worker). With
    `writing_ok` (a restore), an asynchronous save that is writing its file is no
    obstacle: only a cancelled worker stuck in the runtime is.

    Raises:
        CheckpointBusyError: an asynchronous save is still writing, or a cancelled
            worker is still blocked inside the runtime after `wait_s`.
    """
    end = time.monotonic() + wait_s
    others = [op for op in live_operations() if op is not exclude]
    for op in others:
        if op.cancelled:
            op.done.wait(max(end - time.monotonic(), 0.0))
    busy = [op for op in others if not op.done.is_set() and not (writing_ok and not op.cancelled)]
    if not busy:
        return
    op = busy[0]
    if op.cancelled:
        err = CheckpointBusyError(
            f"cannot start: the {op.describe()} was given up and its worker is still blocked inside "
            f"the runtime after {wait_s:g} s; starting another transfer over it could hang the same way")
        err.add_note("The device or runtime is probably hung. Saving works again as soon as that call "
                     "returns (xlakit.wait_until_idle() waits for it); if it never does, the process "
                     "must be restarted. The last committed checkpoint is intact.")
    else:
        err = CheckpointBusyError(f"cannot start: the asynchronous {op.describe()} is still writing; a "
                                  f"new save would compete with it for host memory and disk")
        err.add_note("Call handle.result() on the previous save's handle (or xlakit.wait_until_idle()) "
                     "before saving again.")
    raise err


def seconds_to_wait(timeout: Any, name: str = "timeout") -> float | None:
    """A caller's wait bound, checked before anything waits: None (or inf) is as long as it takes; a
    bad value is refused here, not met inside the wait (an interrupted wait cancels a save)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None (as long as it takes), not {timeout!r}")
    if timeout != timeout or timeout < 0:
        raise ValueError(f"{name} must be 0 or more seconds, or None (as long as it takes), not {timeout!r}")
    return None if timeout > threading.TIMEOUT_MAX else float(timeout)


def wait_until_idle(timeout_s: float | None = None) -> bool:
    """Wait for every live operation's worker; False if some still run after `timeout_s`."""
    timeout_s = seconds_to_wait(timeout_s, "timeout_s")
    end = None if timeout_s is None else time.monotonic() + timeout_s
    for op in live_operations():
        left = None if end is None else max(end - time.monotonic(), 0.0)
        if not op.done.wait(left):
            return False
    return True


def settle_at_exit(settle: Callable[[float], None]) -> None:
    """Have the exit hook call `settle(seconds)` once every operation has ended: a layer's work that
    outlives its operation (an object store's removals, started without waiting) finishes there,
    within the hook's grace."""
    _settlers.append(settle)


def lost_at_exit(*, interrupted: bool) -> None:
    """A layer's own exit hook (a manager's, which runs first) waited for an asynchronous save that did
    not commit: the process exits nonzero (130 when Ctrl-C abandoned it), as for one this hook waits for."""
    _lost_above.append(interrupted)


def _settle(end: float) -> bool:
    """Call each `settle_at_exit` function within the time left; whether Ctrl-C cut them short."""
    for settle in _settlers:
        try:
            settle(max(end - time.monotonic(), 0.0))
        except KeyboardInterrupt:
            return True  # Ctrl-C at exit: what is left is removed by the next save
        except Exception as e:  # noqa: BLE001 - the exit hook goes on whatever one layer does
            log.warning("xlakit: at exit, %s failed: %s: %s", getattr(settle, "__name__", settle), type(e).__name__, e)
    return False


def let_go_of_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames `error` holds in its traceback, and its causes' and
    contexts' too (an error raised from one while another was handled has both).

    An asynchronous save's handle keeps its error; the frames of its failed write held the state's
    staged host copies as long as the handle (device copies: `device_staging.write` drops them).
    """
    seen, pending = set(), [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # a frame still running is left as it is
        pending += [error.__cause__, error.__context__]
        if isinstance(error, BaseExceptionGroup):
            pending += error.exceptions


def _at_exit() -> None:
    """Let asynchronous saves commit, cancel the rest, and never leave a worker in native code.

    An asynchronous save that was still writing at exit and did not commit (it failed, ran out of
    time, or Ctrl-C abandoned it) makes the process exit with a nonzero status: a script whose
    last checkpoint was lost must not end as a success.
    """
    waited: list[Any] = []
    interrupted = False
    try:
        for op in live_operations():
            if op.background and not op.cancelled and not op.done.is_set():
                waited.append(op)
                log.warning("xlakit: waiting for the asynchronous %s to commit before exiting "
                            "(at most %.0f s; Ctrl-C abandons it)", op.describe(), op.remaining())
                op.done.wait(op.remaining() + STOP_GRACE_S)
    except KeyboardInterrupt:
        interrupted = True
    for op in live_operations():
        op.cancel("the interpreter is exiting")
    lost = [op for op in waited if not op.committed]
    interrupted = interrupted or any(_lost_above)
    lost_any = bool(lost or _lost_above)
    for op in lost:
        log.error("xlakit: the asynchronous %s did not commit before the interpreter exited%s; the "
                  "process exits with a nonzero status", op.describe(),
                  f" ({type(op.error).__name__}: {op.error})" if op.error is not None else "")
    end = time.monotonic() + EXIT_GRACE_S
    for op in live_operations():
        _wait_through_ctrl_c(op.done.wait, end)
    stuck = [op for op in live_operations() if not op.done.is_set()]
    if not stuck:
        with _live_lock:
            threads = [t for t in _threads if t.ident is not None]
        for thread in threads:  # ended operations' threads are still freeing what they held
            _wait_through_ctrl_c(lambda left, t=thread: t.join(left) or not t.is_alive(), end)
        if not any(t.is_alive() for t in threads):
            interrupted = _settle(end) or interrupted
            if lost_any:
                _exit_now(130 if interrupted else 1)
            return
        what = next(t.name for t in threads if t.is_alive())
        log.error("xlakit: exiting without waiting for the thread %s: it is still inside the runtime "
                  "after %.0f s", what, EXIT_GRACE_S)
    else:
        log.error("xlakit: exiting without waiting for the %s: its worker is blocked inside the runtime; "
                  "nothing was committed", stuck[0].describe())
    # A worker inside native code would abort the interpreter's shutdown (its thread is
    # torn down under C++ frames); leave before that, with the status Python would give.
    _exit_now(130 if interrupted or isinstance(getattr(sys, "last_value", None), KeyboardInterrupt) else 1)


def _exit_now(status: int) -> None:
    """Leave the process with `status` from the exit hook (the only way it can set one)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _wait_through_ctrl_c(wait: Callable[[float], bool], end: float) -> None:
    """`wait(seconds left)` until it returns True or `end`; Ctrl-C does not cut the wait short.

    At exit the waits are bounded and short; an interrupt escaping the exit hook would let the
    interpreter finalize under the very threads being waited for.
    """
    while True:
        try:
            if wait(max(end - time.monotonic(), 0.0)) or time.monotonic() >= end:
                return
        except KeyboardInterrupt:
            continue


atexit.register(_at_exit)
