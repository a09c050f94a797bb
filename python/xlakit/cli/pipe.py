"""A reader that went away (`xlakit doctor | head -3`): the command ends quietly, as a shell's tools do.

Python ignores SIGPIPE, so a write to a pipe whose reader has closed raises
BrokenPipeError where a C tool would die of the signal. `main` turns it into
the status those tools end with, 141 (128 + SIGPIPE), with nothing printed,
once `stdout_gone()` confirms the pipe is stdout's (a BrokenPipeError from a
connection of the command's own is an error like any other).
"""

from __future__ import annotations

import os
import select
import sys

STATUS = 128 + 13  # a process killed by SIGPIPE, as a shell reports it


def _gone(stream) -> bool:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def stdout_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone away."""
    return sys.stdout is not None and _gone(sys.stdout)


def quiet() -> int:
    """Point stdout (and stderr, when it went too) at /dev/null, so that the interpreter's last flush meets no
    closed pipe; the status to exit with."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and _gone(stream):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, stream.fileno())
            finally:
                os.close(devnull)
    return STATUS


def flush() -> None:
    """Flush stdout now, inside the command, rather than at the interpreter's exit where a closed pipe is
    reported as "Exception ignored"."""
    if sys.stdout is not None:
        sys.stdout.flush()
