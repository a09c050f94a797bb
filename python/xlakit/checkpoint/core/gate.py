"""The commit gate of an operation: decides, once, whether it commits or is cancelled.

`Operation.commit_point()` claims the commit and `Operation.cancel()` the
cancel, both under the gate's `lock`: whichever comes first is the outcome.
Across ranks the decision is also claimed in the job's store
(`coordination/agreed_gate.py`).
"""

from __future__ import annotations

import threading

COMMIT, CANCEL = "commit", "cancel"
# Reasons to give an operation up that are running out of time: in a job, the ranks it waited for are to blame.
DEADLINE_PASSED, NO_TIME_LEFT = "the deadline passed", "no time left"
STOPPED_ELSEWHERE = "another rank gave it up"


class Gate:
    """Decides, once, whether an operation commits or is cancelled.

    `lock` is held by whoever decides; subclasses add agreement across ranks
    (the decision is then also claimed in the job's store).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcome: str | None = None

    def claim_commit(self) -> bool:
        """With `lock` held: True when this operation may commit (nobody cancelled it)."""
        if self.outcome is None:
            self.outcome = COMMIT
        return self.outcome == COMMIT

    def claim_cancel(self, reason: str) -> str:
        """With `lock` held: cancel unless the commit was claimed first; the outcome."""
        if self.outcome is None:
            self.outcome = CANCEL
        return self.outcome

    def may_discard(self) -> bool:
        """Whether files a commit could still name may go: only once the operation is surely off."""
        return self.outcome == CANCEL

    def foreign_error(self, *, blamed_too: bool = False) -> Exception | None:
        """Where another rank decided the operation's end: the error that names it (`blamed_too`: also
        where that rank blamed this one, which has no error of its own to say more)."""
        return None

    def stopped_elsewhere(self) -> bool:
        """Whether another party gave the operation up while its worker, still running, has not
        seen it (asked by the owner at each poll; never blocks)."""
        return False

    def blame(self) -> int | None:
        """The rank a failure is due to, where ranks are involved."""
        return None

    def wait_note(self) -> str | None:
        """What the operation was waiting for when it gave up, where that explains the failure."""
        return None
