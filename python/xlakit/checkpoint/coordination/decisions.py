"""Job-wide decisions that are not saves, on a coordinated save's terms.

A manager's step folder, the steps its retention deletes: rank 0 acts on
files every rank depends on, so it acts only as a coordinated save commits.
Every rank proposes the same thing (or the odd rank is named everywhere and
nothing happens), rank 0 prepares, every rank votes ready, and rank 0 acts at
the commit point of an agreed gate: once every rank voted, never after any rank
gave up (agreement.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xlakit.checkpoint.coordination.agreement import Coordination, world_size
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.errors import CheckpointPeerError, XlakitError


def decide(kind: str, path: str, proposal: dict[str, Any], watch: Watch, *,
           prepare: Callable[[Operation], None] | None = None, act: Callable[[], None] | None = None) -> None:
    """One decision of the whole job, on the terms of a coordinated save.

    Every rank proposes `proposal` (each field must match on every rank, or the
    odd rank is named everywhere and nothing happens). Rank 0 first runs
    `prepare(op)` (a rename there goes through `op.guarded()`): if it fails,
    every rank raises, naming it. With `act`, every rank
    then votes ready and rank 0 runs `act()` at the commit point: once every rank
    voted, never after any rank gave up. Outside a torch.distributed job,
    `prepare` and `act` run here under the same deadline and commit point.
    """
    if world_size() == 1:
        def alone(op: Operation) -> None:
            if prepare is not None:
                prepare(op)
            if act is not None:
                op.enter("commit")
                with op.commit_point():
                    act()

        Operation(kind, path, watch).run(alone)
        return
    coord = Coordination(kind, {"path": path, **proposal}, agreed=tuple(proposal))
    op = Operation(kind, path, watch, gate=coord.gate, rank=coord.rank)
    coord.op = op

    def work(op: Operation) -> None:
        error = None
        if coord.rank == coord.committer and prepare is not None:
            try:
                prepare(op)
            except (XlakitError, OSError, ValueError, TypeError) as e:
                error = e  # published with the proposal: every rank learns it at once
        coord.agree(op, None, error)
        if act is None:
            return
        with coord.giving_up(op):
            coord.vote({})
            if coord.rank != coord.committer:
                final = coord.outcome(op)
                if not final.get("ok"):
                    raise CheckpointPeerError(f"rank {coord.committer} could not carry out the "
                                              f"{kind} of {path}: {final.get('error')}",
                                              rank=coord.committer)
                return
            coord.votes(op)
            op.enter("commit")
            with op.commit_point():
                act()
            coord.finish({"ok": True})

    op.run(work)
