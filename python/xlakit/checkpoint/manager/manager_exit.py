"""What happens at interpreter exit to the CheckpointManagers nobody closed.

An asynchronous save nobody waited for still commits (operation.py's exit hook
waits for it); a one-process manager then applies its retention. This module
registers its hook when the manager imports it, after operation.py registered
its own, so it runs first and its saves still commit.
"""

from __future__ import annotations

import atexit
import logging
import weakref

from xlakit.checkpoint.core import operation  # noqa: F401 - its exit hook is registered first
from xlakit.checkpoint.core import workers

log = logging.getLogger("xlakit")
_open: "weakref.WeakSet" = weakref.WeakSet()  # managers finished at exit if nobody closed them


def track(manager) -> None:
    _open.add(manager)


@atexit.register  # after operation.py's hook is registered, so it runs before it (and its saves still commit)
def _finish_at_exit() -> None:
    """An asynchronous save nobody waited for commits at exit; its manager then applies retention."""
    for manager in list(_open):
        if manager._closed or manager._pending is None:
            continue
        if manager._world > 1:  # retention is agreed by every rank, and the others may be gone
            log.warning("xlakit: the asynchronous save of step %d into %s commits at exit, but the manager "
                        "was not closed: retention did not run (it runs after the next save; call close())",
                        manager._pending[0], manager.directory)
            continue
        if not manager._pending[1].done():
            log.warning("xlakit: waiting for the asynchronous save of step %d into %s to commit before exiting, "
                        "then applying retention (Ctrl-C abandons it)", manager._pending[0], manager.directory)
        step, handle = manager._pending
        try:
            manager.close()
        except BaseException as e:  # noqa: BLE001 - nobody is left to raise it to
            interrupted = isinstance(e, KeyboardInterrupt)
            log.error("xlakit: closing the checkpoint manager of %s at exit failed: %s", manager.directory,
                      f"interrupted (Ctrl-C) while waiting for the asynchronous save of step {step}" if interrupted
                      else f"{type(e).__name__}: {e}")
            if not handle.committed:  # the last checkpoint was lost: the job must not end as a success
                log.error("xlakit: the asynchronous save of step %d into %s did not commit before the interpreter "
                          "exited; the process exits with a nonzero status", step, manager.directory)
                workers.lost_at_exit(interrupted=interrupted)
