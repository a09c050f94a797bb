"""The commit gate of a coordinated operation: its decision claimed in the job's store, for every rank.

An operation's `Gate` decides once, under one lock, whether it commits or is
cancelled (`operation.py`). Across ranks that decision is one store key,
claimed with an atomic compare-and-set (`Coordination.claim`): the committing
rank claims "commit" only after every rank voted ready and before the earliest
deadline of all ranks; a rank that gives up claims "abort" with its reason.
Whichever claim comes first wins everywhere. A cancel waits a bounded time for
the store to confirm its abort; until it does, this rank's files are kept,
since a commit might still name them.

The gate is given the `Coordination` (agreement.py) it decides for and uses
only its methods, so this module does not import it.
"""

from __future__ import annotations

import threading
import time

from xlakit.checkpoint.core import workers
from xlakit.checkpoint.core.gate import CANCEL, COMMIT, DEADLINE_PASSED, NO_TIME_LEFT, Gate
from xlakit.errors import CheckpointPeerError

_POLL_S = 0.02
_CLAIM_WAIT_S = 2.0  # how long a cancel waits for the store to confirm its abort
_VERDICT_GRACE_S = 2.0  # at its deadline, how long a rank waits for the committer's verdict
STORE_HOST = 0  # the rank whose process serves the job's TCPStore when the job is not under torchrun
_LOOK_EVERY_S = 0.5  # how often an owner looks in the store for another rank's abort while its worker runs
_WORKER_FIRST_S = 3.0  # how long it then leaves the worker to see that abort itself (it polls the store;
                       # a collective another rank left does not return before its timeout)


class AgreedGate(Gate):
    """A commit gate whose decision is also claimed in the store, for every rank at once."""

    def __init__(self, coord):
        super().__init__()
        self.coord = coord
        self.held: dict | None = None
        self.confirmed = True
        self.store_silent = False
        self._next_look = time.monotonic() + _LOOK_EVERY_S
        self._looking = False
        self._seen: dict | None = None  # another rank's abort, as the owner's look found it in the store
        self._seen_at = 0.0

    def settle(self, held: dict) -> None:
        self.held = held
        self.outcome = COMMIT if held["decision"] == COMMIT else CANCEL

    def claim_commit(self) -> bool:
        if self.outcome is not None:
            return self.outcome == COMMIT
        c = self.coord
        if c._past_commit_time():
            late = f"rank {c.rank} reached its commit too close to the earliest deadline of the ranks to commit"
            self.settle(c.claim(c._abort_record(late, [c.rank], True, "commit")))
            if self.outcome == CANCEL and self.held.get("rank") == c.rank and c.op is not None:
                # Its own decision: its own error (the worker's internal Cancelled would reach the caller).
                c.op.stage, c.op.tensor = "commit", None
                raise c.op.timeout_error(
                    f"{late.capitalize()} before it (every rank had voted ready), so it gave the "
                    f"{c.op.kind} up on every rank: nothing was committed, {c.op.untouched}. If the "
                    f"{c.op.kind} is merely slow, raise timeout_s on every rank.")
        else:
            self.settle(c.claim({"decision": COMMIT, "rank": c.rank}))
        return self.outcome == COMMIT

    def claim_cancel(self, reason: str) -> str:
        if self.outcome is not None:
            return self.outcome
        if self._seen is not None:  # the store's decision, already read: final, nothing to claim
            self.settle(self._seen)
            return self.outcome
        c = self.coord
        waiting = list(c.waiting_for)
        stage = c.op.stage if c.op is not None else "start"
        # Out of time while waiting: the ranks waited for are to blame. Given up for its own reason
        # (Ctrl-C, a handle's cancel, the interpreter exiting), this rank is, however healthy they are.
        blamed = waiting if reason in (DEADLINE_PASSED, NO_TIME_LEFT) else []
        error = (f"rank {c.rank} gave up ({reason}) in stage {stage!r}"
                 + (f" while waiting for rank(s) {blamed} (stalled or died)" if blamed else
                    f" while waiting for rank(s) {waiting}" if waiting else ""))
        record = c._abort_record(error, blamed or [c.rank], reason in (DEADLINE_PASSED, NO_TIME_LEFT), stage)
        answer: list[dict] = []

        grace = _VERDICT_GRACE_S if c.rank != c.committer and c.committer in blamed else 0.0

        def ask() -> None:
            try:
                # Waiting on the committer: its verdict, due about now, names the real culprit.
                end = time.monotonic() + grace
                while time.monotonic() < end and c.decision() is None:
                    time.sleep(_POLL_S)
                answer.append(c.claim(record))
            except CheckpointPeerError:
                pass  # the store is gone: nobody can commit through it any more

        claimer = threading.Thread(target=ask, daemon=True, name="xlakit-abort-claim")
        claimer.start()
        claimer.join(_CLAIM_WAIT_S + grace)
        if answer:
            self.settle(answer[0])
        else:  # the store host does not answer: the request is queued there, ahead of any later claim
            c.waiting_for, self.store_silent = [STORE_HOST], True
            self.held = c._abort_record(
                f"rank {c.rank} gave up ({reason}) in stage {stage!r}: the job's store did not answer",
                [STORE_HOST], True, stage)
            self.outcome, self.confirmed = CANCEL, False
        return self.outcome

    def may_discard(self) -> bool:
        # Until the store confirms an abort, this rank's files might be named by a commit.
        return self.outcome == CANCEL and self.confirmed

    def stopped_elsewhere(self) -> bool:
        """Another rank's abort is in the store and this rank's worker has not ended `_WORKER_FIRST_S`
        after it was seen. The store is asked on a thread of its own, over a connection of its own
        (a stopped store host must not hold the owner, which enforces the deadline)."""
        now = time.monotonic()
        if self.outcome is not None:
            return False
        if self._seen is None:
            if not self._looking and now >= self._next_look:
                self._next_look, self._looking = now + _LOOK_EVERY_S, True
                workers.start_thread(self._look, "xlakit-abort-look", never_started=self._looked)
            return False
        return now >= self._seen_at + _WORKER_FIRST_S

    def _look(self) -> None:
        try:
            held = self.coord.decision_aside()
            if held is not None and held.get("decision") != COMMIT and held.get("rank") != self.coord.rank:
                self._seen_at, self._seen = time.monotonic(), held
        except Exception:  # noqa: BLE001 - a store that does not answer: the deadline decides
            pass
        finally:
            self._looked()

    def _looked(self) -> None:
        self._looking = False

    def foreign_error(self, *, blamed_too: bool = False) -> Exception | None:
        """The error for an abort another rank decided, if that is why this operation ended."""
        held = self.held
        if (held is not None and held.get("decision") != COMMIT and held.get("rank") != self.coord.rank
                and (blamed_too or self.coord.rank not in held.get("culprits", []))):
            return self.coord.peer_error(held)
        return None  # this rank's own failure: its own error says more

    def blame(self) -> int | None:
        if self.held is not None and self.held.get("decision") != COMMIT:
            return (self.held.get("culprits") or [None])[0]
        return self.coord.waiting_for[0] if self.coord.waiting_for else None

    def wait_note(self) -> str | None:
        if self.store_silent:
            return (f"rank {self.coord.rank} was waiting for the job's store, which did not answer: "
                    f"its host (rank {STORE_HOST}, unless the job runs under torchrun) stalled or died")
        waiting = self.coord.waiting_for
        return f"rank {self.coord.rank} was waiting for rank(s) {waiting} (stalled or died)" if waiting else None
