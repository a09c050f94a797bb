"""Preemption: SIGTERM on any rank becomes one step at which every rank saves, then stops.

A preempted TPU VM gets SIGTERM and a short grace before it is killed; a
checkpoint is useful only if every host saved the same step. The signal
handler only records that the signal came (and when). The rest happens in
the training loop's own calls (`should_save`, `save`, `reached_preemption`),
through the job's store:

1. The rank that got the signal posts a request (first one wins) carrying the
   grace deadline.
2. Every rank, at its first call that sees the request (one store look per
   step), posts the first step it can still reach: the step after the one it
   is at, since it may already have decided about this one.
3. The agreed step is the largest posted; the first step at or after it is
   saved on every rank, and `reached_preemption` is true from there on.

No rank ever blocks while another may be waiting for it: a rank waits for
the others' posts only when it reaches the step it posted; a rank that has
come that far in a loop of collectives has seen the request already, and a
rank waiting inside a coordinated save (for ranks that are blocked at their
posted step) posts from its wait loop (`answering`). Ranks must call
`should_save` or `reached_preemption` every step, as the loop does anyway. A rank that never posts within the
grace is named (`CheckpointTimeoutError`). Wall clocks of the hosts are
assumed in sync (NTP), as the coordinated save's deadlines are.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from xlakit.checkpoint.coordination.agreement import Coordination
from xlakit.errors import CheckpointTimeoutError

log = logging.getLogger("xlakit")
_POLL_S = 0.02


class Preemption:
    """One manager's preemption state; `board` is None outside a torch.distributed job."""

    def __init__(self, board: Coordination | None, grace_s: float):
        self.board, self.grace_s = board, grace_s
        self.signals = 0  # written by the handler only
        self.signalled_unix: float | None = None  # written by the handler only
        self.deadline_unix: float | None = None
        self.reach: int | None = None  # the step this rank posted
        self.step: int | None = None  # the agreed step, once known
        self._posted = False
        self._looked_at: int | None = None  # the last step whose call looked at the store
        self._previous: dict[int, Any] = {}
        self._logged_signals = 0

    # -- the handler ----------------------------------------------------------------------------
    def install(self, signals: tuple[int, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_preemption_handler() must be called from the main thread "
                               "(Python delivers signals there only)")
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            # None: a handler installed outside Python, which cannot be put back; the default then.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # Only record it: the agreement runs in the loop's next call.
        self.signals += 1
        if self.signalled_unix is None:
            self.signalled_unix = time.time()

    # -- the agreement ---------------------------------------------------------------------------
    def poll(self, step: int, *, deciding: bool) -> None:
        """Advance the agreement at `step`; `deciding`: this step's save is still to be decided."""
        if self.signals > self._logged_signals:
            log.warning("xlakit: preemption signal received (%d so far); every rank saves at an agreed "
                        "step, then reached_preemption() is true", self.signals)
            self._logged_signals = self.signals
        if self.step is not None:
            return
        if self.board is None:
            if self.signalled_unix is not None:
                self.deadline_unix = self.signalled_unix + self.grace_s
                self.step = step if deciding else step + 1
            return
        if self.signalled_unix is not None and not self._posted:
            self._looked_at = None  # this rank's own signal: look now
        if self._looked_at == step and (self.reach is None or step < self.reach):
            return  # one look at the store per step, until this rank must know
        self._looked_at = step
        self._post(step)
        if self.reach is not None:
            self._agree(step)

    def answering(self, step: int) -> Callable[[], None]:
        """What to do while this rank waits inside a coordinated operation at `step`: post too.

        Other ranks may be blocked at the step they posted, waiting for this rank's post,
        while this rank waits for them to join its save: answering breaks that cycle.
        """
        def answer() -> None:
            if self.board is not None and self.step is None and self.reach is None:
                self._post(step)
        return answer

    def _post(self, step: int) -> None:
        """Post this rank's own request if it got the signal, then its reach once a request is seen."""
        board = self.board
        if self.signalled_unix is not None and not self._posted:
            board.first("request", {"rank": board.rank, "deadline_unix": self.signalled_unix + self.grace_s})
            self._posted = True
        if self.reach is None:
            request = board.peek("request")
            if request is None:
                return
            self.deadline_unix = request["deadline_unix"]
            self.reach = step + 1
            board.publish(f"reach/{board.rank}", {"step": self.reach})

    def _agree(self, step: int) -> None:
        """The agreed step once every rank posted; waits for the posts at this rank's reach."""
        board = self.board
        names = {r: f"reach/{r}" for r in range(board.world)}
        posts = board.present(names)
        while len(posts) < board.world and step >= self.reach:
            # This rank may not pass the step it posted without knowing the agreed one.
            if time.time() >= self.deadline_unix:
                missing = sorted(set(names) - set(posts))
                raise CheckpointTimeoutError(
                    f"preemption (rank {board.rank} of {board.world}): rank(s) {missing} did not post "
                    f"the step they can reach within the grace ({self.grace_s:g} s); no agreed step, "
                    f"nothing was saved for the preemption", stage="preemption", rank=missing[0])
            time.sleep(_POLL_S)
            posts.update(board.present({r: n for r, n in names.items() if r not in posts}))
        if len(posts) == board.world:
            self.step = max(p["step"] for p in posts.values())

    def due(self, step: int) -> bool:
        return self.step is not None and step >= self.step

    def remaining_s(self) -> float:
        return max((self.deadline_unix or 0.0) - time.time(), 0.0)
