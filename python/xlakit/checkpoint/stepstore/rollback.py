"""A manager's timeline: why a save at or below the latest step is refused, and what a rollback deletes.

Steps are found by their numbers, so a save below the latest committed step, beside the newer
steps of a run given up, forks the timeline: a restart resumes from the newest step (of the run
given up), and retention, by number, keeps those and drops the new steps first. Orbax refuses
such saves; so does the manager, naming the newer steps and `retire_steps_after`, the explicit
rollback. That call deletes the newer steps the way retention does (to the trash on disk,
deletion records on a bucket), on the same agreement: every rank proposes the same steps and
votes before rank 0 deletes anything. The step rolled back to must be committed, so a mistyped
step deletes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from xlakit.checkpoint.coordination import decisions
from xlakit.checkpoint.core.operation import Watch
from xlakit.checkpoint.stepstore.steps import Scan


def refuse_at_or_below_latest(step: int, committed: Collection[int], directory: Any, *,
                              retire_to: Collection[int] = ()) -> None:
    """Raise ValueError when `step` is committed or below a committed step, saying how to roll back
    (`retire_to`: other steps `retire_steps_after` takes, e.g. the persistent ones for a local tier)."""
    newer = sorted(s for s in committed if s > step)
    base = max((s for s in (*committed, *retire_to) if s < step), default=None)
    if not newer:
        if step in committed:
            again = (f"`mgr.retire_steps_after({base})` first (every rank; it deletes step {step})"
                     if base is not None else f"move step {step} out of {directory} first")
            raise ValueError(f"step {step} is already committed in {directory}; a manager never "
                             f"overwrites a step: go on with a later step, or, to save step {step} again "
                             f"from another state (a rollback), {again}; nothing was written")
        return
    shown = sorted(s for s in committed if s >= step)
    err = ValueError(f"cannot save step {step} into {directory}: the latest committed step is {newer[-1]} "
                     f"(committed at or after {step}: {shown}), so a restart would resume from {newer[-1]} "
                     f"and retention would keep it before step {step}; nothing was written")
    if base is not None:
        err.add_note(f"Rolling back? Retire the newer steps first, on every rank: "
                     f"`mgr.retire_steps_after({base})` deletes steps {sorted(s for s in committed if s > base)} "
                     f"(agreed by every rank), then save step {step}. To keep them, move them out of "
                     f"{directory} first, or save the new run into a folder of its own.")
    else:
        err.add_note(f"Every committed step is newer than {step}: save the new run into a folder of its "
                     f"own (or move those steps out of {directory}).")
    raise err


def retire(folder: Any, step: int, found: Scan, rescan: Callable[[Any], Scan], watch: Watch, *,
           held_locally: bool = False) -> list[int]:
    """Delete the steps of `found` newer than the committed `step` (interrupted saves too) once every
    rank agreed on them; the steps deleted. `rescan(op)` is the folder as it is now (rank 0 checks
    there that `step` is committed before anything is deleted, unless every rank's part of it is
    `held_locally`, in a manager's local tier)."""
    doomed = sorted(s for s in (*found.committed, *found.pending) if s > step)

    def check(op) -> None:
        now = rescan(op)
        if step not in now.committed and not held_locally:
            raise ValueError(f"cannot retire the steps after {step} in {folder.directory}: step {step} is "
                             f"not committed there (committed: {sorted(now.committed) or 'none'}) nor whole "
                             f"in a local tier; name the step to go on from, nothing was deleted")

    def discard() -> None:
        folder.renew()  # object storage: still this manager's to delete in (or it raises)
        folder.discard(doomed)

    decisions.decide("rollback", folder.identity(), {"after": step, "doomed": doomed}, watch,
                     prepare=check, act=discard if doomed else None)
    return doomed
