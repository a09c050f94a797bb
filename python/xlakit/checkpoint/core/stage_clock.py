"""How long a save's parts took: transferring to the host, writing, and both at once.

An overlapped save (`file/overlap.py`) copies the next batch to the host while
it writes this one. Its `Operation` keeps a `StageClock`: each part is timed
by the one thread that runs it (`timing("transfer")` on the transfer thread,
`timing("write")` on the writer), and while both run the clock counts the
overlap too. `Progress` and `SaveHandle` report the three figures.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

PARTS = ("transfer", "write")


class StageClock:
    """Seconds spent in each part, and in both at once (`overlap_s`)."""

    def __init__(self) -> None:
        self.transfer_s = self.write_s = self.overlap_s = 0.0
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}
        self._both_since: float | None = None

    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        """Time `part` ("transfer" or "write") while the block runs (one thread per part)."""
        with self._lock:
            now = time.monotonic()
            self._since[part] = now
            if len(self._since) == len(PARTS):
                self._both_since = now
        try:
            yield
        finally:
            with self._lock:
                now = time.monotonic()
                setattr(self, f"{part}_s", getattr(self, f"{part}_s") + now - self._since.pop(part))
                if self._both_since is not None:
                    self.overlap_s += now - self._both_since
                    self._both_since = None

    def seconds(self) -> tuple[float, float, float]:
        """(transfer_s, write_s, overlap_s) of the parts that ended."""
        with self._lock:
            return self.transfer_s, self.write_s, self.overlap_s
