"""What the command says where the library speaks to a Python caller: hints and client libraries' logs.

An error's hints name the Python API's fix ("raise timeout_s"), which the
command has no flag for: `for_the_command` says it with the environment
variables that bound the command's deadlines. gcsfs logs each request it gives
up on with its traceback (`logger.exception`); while a command runs
(`one_line_client_logs`), its records are one line each on stderr, with no
traceback. Outside the command (a library user's program) nothing changes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from xlakit import _knobs

_CLIENT_LOGGERS = ("gcsfs",)


def _deadline() -> str:
    defaults = _knobs.DEFAULTS
    return (f"raise {_knobs.OBJECT_REQUEST_TIMEOUT_S} (seconds a request to the store and its retries may take, "
            f"default {defaults[_knobs.OBJECT_REQUEST_TIMEOUT_S]:g}) or, for a whole checkpoint read or written, "
            f"{_knobs.SAVE_TIMEOUT_S} (default {defaults[_knobs.SAVE_TIMEOUT_S]:g}) in the environment")


def for_the_command(error: BaseException) -> BaseException:
    """`error`, its hints naming what the command has in place of the Python API's `timeout_s`."""
    notes = getattr(error, "__notes__", None)
    if notes:
        error.__notes__ = [note.replace("raise timeout_s", _deadline()) for note in notes]
    return error


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.name}: {record.getMessage()}"  # no exc_info, no stack: never a traceback


@contextlib.contextmanager
def one_line_client_logs() -> Iterator[None]:
    """Inside, a client library's log records reach stderr as one line each; outside, as before."""
    changed = []
    for name in _CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:  # configured already (GCSFS_DEBUG, or the program's own): left as it is
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(_OneLine())
        changed.append((logger, handler, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False  # a root handler (logging.basicConfig) would print the traceback
    try:
        yield
    finally:
        for logger, handler, propagate in changed:
            logger.removeHandler(handler)
            logger.propagate = propagate
