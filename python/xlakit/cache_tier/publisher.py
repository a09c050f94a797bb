"""Publishing what a job compiles to its shared tier: a thread in the job, or a process beside it.

The wrapper writes an entry into its local folder when a compile finishes
(atomically: a name in the folder is a whole entry). Publishing only reads
those files, on its own thread or process, so it never blocks a compile:

* in a job that called `xlakit.enable_persistent_cache("gs://...")`, a
  daemon thread publishes every `XLAKIT_CACHE_TIER_PUBLISH_INTERVAL_S`
  (30 s), and an exit hook publishes what is left at a clean exit, bounded by
  `XLAKIT_CACHE_TIER_EXIT_TIMEOUT_S` (30 s);
* for a job that runs no xlakit code, `xlakit pjrt env gs://...` starts
  `xlakit cache publish --follow PID` beside it (the shell that evaluated the
  exports): the same loop in a process of its own, which publishes a last
  time, bounded the same way, when the shell it follows ends or on SIGTERM.

A write reaches the bucket within about one interval of its compile (plus the
upload), and a killed job loses at most the last interval's entries.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time

from xlakit import _knobs
from xlakit.cache_tier.tier import Report, SharedTier
from xlakit.checkpoint.core import paths

log = logging.getLogger("xlakit.compile_cache")


def _said(tier: SharedTier, report: Report, when: str) -> None:
    if report.moved or report.refused:
        log.info("compile cache shared tier %s: %s published %d entries (%d bytes sent, %d of entries)%s", tier.url,
                 when, report.moved, report.bytes_moved, report.entry_bytes,
                 f"; {len(report.refused)} not publishable" if report.refused else "")
    if report.skipped and when == "at exit":
        log.warning("compile cache shared tier %s: %d entries were not published before the exit bound "
                    "(%s s, %s): the next run publishes them", tier.url, report.skipped,
                    tier.settings.exit_timeout_s, _knobs.CACHE_TIER_EXIT_TIMEOUT_S)


class Publisher:
    """Publishes `tier`'s new entries every `interval_s` on a daemon thread, and once more at a clean exit."""

    def __init__(self, tier: SharedTier, interval_s: float | None = None):
        self.tier = tier
        self.interval_s = interval_s or tier.settings.publish_interval_s
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="xlakit-cache-publisher", daemon=True)

    def start(self) -> "Publisher":
        self.thread.start()
        atexit.register(self.close)
        return self

    def _loop(self) -> None:
        while not self.stopping.wait(self.interval_s):
            try:
                _said(self.tier, self.tier.publish(self.interval_s), "")
            except Exception as e:  # noqa: BLE001 - a publisher never takes the job down
                log.warning("compile cache shared tier %s: publishing failed: %s", self.tier.url, e)

    def close(self) -> Report:
        """Stop the thread and publish what is left, bounded by `XLAKIT_CACHE_TIER_EXIT_TIMEOUT_S`."""
        self.stopping.set()
        self.thread.join(timeout=self.tier.settings.exit_timeout_s)  # a publish under way ends first
        try:
            report = self.tier.publish(self.tier.settings.exit_timeout_s)
            _said(self.tier, report, "at exit")
            return report
        except Exception as e:  # noqa: BLE001 - an exit hook never raises
            log.warning("compile cache shared tier %s: the last publish failed: %s", self.tier.url, e)
            return Report(error=str(e))
        finally:
            atexit.unregister(self.close)


def follow(tier: SharedTier, pid: int | None, interval_s: float | None = None) -> Report:
    """Publish every interval while process `pid` lives (until SIGTERM/SIGINT without one), then once more,
    bounded; the last publish's report. What `xlakit cache publish` runs."""
    interval_s = interval_s or tier.settings.publish_interval_s
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    next_at = time.monotonic() + interval_s
    while not stop.is_set() and (pid is None or paths.pid_alive(pid)):
        if time.monotonic() >= next_at:
            _said(tier, tier.publish(interval_s), "")
            next_at = time.monotonic() + interval_s
        stop.wait(min(1.0, interval_s))
    report = tier.publish(tier.settings.exit_timeout_s)
    _said(tier, report, "at exit")
    return report
