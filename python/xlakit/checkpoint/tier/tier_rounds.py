"""The local tier's rounds between ranks: through the job's store, on agreement.py's terms.

Why not collectives: a rank that stalls past the deadline (SIGSTOP, a swap
storm, a debugger) must learn, when it wakes, what the others decided without
it, at once. A collective it joins late waits instead for peers that left
(gloo's connect waits 30 s of its own), and every save after it falls out of
step. So each local save, each listing of the hosts' folders and each rollback
is one `Coordination` (fresh keys, taken in call order, alike on every rank)
run as an `Operation` under its deadline; the gloo group that moves the bytes
is made only once every rank is known to be there, and lives for one save.

A local save (`save`):

1. a rank that reaches a save already decided (it was stalled while the
   others gave up) drops it at once: it writes nothing;
2. each host's lowest rank tidies its host (`HostFolder.tidy`: saves given
   up, steps beyond `keep`); every rank writes its part and proposes its size,
   or its error (then every rank names it, and nothing more is done);
3. the copies (`peer_copy.py`); the xxh3 each sender read goes round the
   store; a copy is renamed into place only when it matches, before the
   deadline, while the save is on;
4. every rank votes its errors and learns everyone's; with none, rank 0 claims
   "commit" before the earliest deadline of all ranks; a rank that gives up,
   for any reason, claims "abort". The first claim holds everywhere.
5. After "commit", each host's lowest rank writes the step's marker
   (`local_tier.py`): only marked parts are counted or restored, so a save
   given up is never restored, whatever a late rank left on disk; the host's
   next save removes it.

An abort ends the save on every rank at the same moment (the claim), so a rank
that was late by less than the deadline is in step again at the next save; one
late by more drops each save already given up, at once, until it is.
"""

from __future__ import annotations

import dataclasses
import errno
import time
from typing import Any

from xlakit.checkpoint.coordination.agreed_gate import _CLAIM_WAIT_S, _VERDICT_GRACE_S
from xlakit.checkpoint.coordination.agreement import Coordination
from xlakit.checkpoint.core.gate import COMMIT
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.file import pipeline
from xlakit.checkpoint.tier import local_tier, peer_copy
from xlakit.errors import CheckpointError, CheckpointPeerError, CheckpointWriteError


_CLOCK_SLACK_S = 1.0  # hosts' clocks (NTP) agree far better: a give-up this much older came before this rank


class PartNotWritten(CheckpointError):
    """A rank could not write its own part (the message names the rank, its host and the fix)."""


class NotWhole(CheckpointError):
    """The save ended with errors on some ranks: every rank holds the same list."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclasses.dataclass
class Outcome:
    whole: bool
    error: str | None = None  # why not, with every rank and host it concerns


def _watch(run, seconds: float) -> Watch:
    return Watch(max(seconds, 0.0), run.options.stall_warning_s, run.options.progress_interval_s, None)


def exchange(run, kind: str, record: dict, *, error: BaseException | None = None) -> dict[int, dict]:
    """Every rank's `record`, by rank, within `LocalTier.timeout_s`. A rank's `error` is raised there
    and named on every other rank (`CheckpointPeerError`), as is a rank that never came."""
    coord = Coordination(kind, {"path": run.key})
    op = Operation(kind, run.key, _watch(run, run.tier.timeout_s), gate=coord.gate, rank=coord.rank,
                   untouched="nothing was changed")
    coord.op = op

    def work(op: Operation) -> dict[int, dict]:
        coord.agree(op, {"record": record}, error)
        return {r: p["record"] for r, p in coord.proposals.items()}

    try:
        return op.run(work)
    finally:
        coord.close()


def save(run, step: int, state: Any, deadline: float) -> Outcome:
    """This rank's part of the local save of `step`, with the others (see the module's docstring)."""
    coord = Coordination("local-tier save", {"path": run.key, "step": step}, agreed=("step",))
    kind, where = "local-tier save", run.folder.step_path(step)
    untouched = "the local tier's older steps are untouched"
    arrival = Operation(kind, where, _watch(run, deadline - time.monotonic()), rank=run.rank, untouched=untouched)
    late: list[dict] = []
    reached = time.time()

    def arrive(op: Operation) -> None:
        held = coord.decision()
        if held is not None:  # given up by the others while this rank was stalled: nothing to add
            late.append(held)
            raise coord.peer_error(held)
        if run.leader:  # no rank of this host is at a later save: this one is not decided
            run.folder.tidy(run.world, run.tier.keep, step)

    op = Operation(kind, where, _watch(run, deadline - time.monotonic()), gate=coord.gate, rank=coord.rank,
                   untouched=untouched)
    coord.op = op

    def work(op: Operation) -> None:
        with coord.giving_up(op):  # any failure is claimed: a rank leaves a save only once it is decided
            if error is not None and (held := coord.decision()) is not None:
                raise coord.peer_error(held)  # given up while this rank wrote (its folder may have gone too)
            coord.agree(op, {"size": size}, error)
            own = _copy(run, coord, op, step)
            coord.vote({"errors": own})
            errors = [e for _, v in sorted(coord.votes(op).items()) for e in v["errors"]]
            if errors:
                raise NotWhole(errors)
            if coord.rank != coord.committer:
                coord.expect_commit(op, f"the local-tier save of step {step}")
                return
            op.enter("commit")
            with op.commit_point():  # the claim is the decision, for every rank
                pass
            coord.finish({"ok": True})

    try:
        try:
            arrival.run(arrive)
        except Exception:
            if not late:  # claimed (bounded, as a cancel is), so that no rank of this host is left behind
                op.cancel("its arrival failed")  # in an undecided save while this one's host moves on
            raise
        size, error = write_part(run, step, state, deadline)
        op.run(work)
        return Outcome(True)
    except Exception as e:  # noqa: BLE001 - the local tier is a cache: said, never fatal
        if coord.gate.outcome == COMMIT:  # decided whole; only its confirmation came late here
            return Outcome(True)
        return Outcome(False, _why(run, coord, e, late, step, deadline, reached))
    except BaseException:  # Ctrl-C while writing the part: given up here, so given up everywhere
        if not late:
            op.cancel("interrupted")
        raise
    finally:
        coord.close()


def write_part(run, step: int, state: Any, deadline: float) -> tuple[int, PartNotWritten | None]:
    """Write this rank's part into its host's folder: (its size, None), or (-1, the error)."""
    path = run.folder.part_path(step, run.rank, run.world)
    try:
        run.folder.make()
        run.folder.make_step(step)
        run.folder.unmark(step)  # this step's folder no longer counts until the job decides it whole
        pipeline.save_file(local_tier.wrap(state, step, run.rank, run.world), path,
                           dataclasses.replace(run.options, timeout_s=max(deadline - time.monotonic(), 1e-3)))
        return path.stat().st_size, None
    except Exception as e:  # noqa: BLE001 - named on every rank
        return -1, PartNotWritten(f"rank {run.rank} on {run.host}: {described(e, path, run.tier, run.world)}")


def _copy(run, coord: Coordination, op: Operation, step: int) -> list[str]:
    """Send this rank's part to its peers, receive its sources' parts, rename those that arrived whole
    before the deadline; this rank's errors."""
    if not any(run.peers.values()):
        return []
    sizes = {r: p["size"] for r, p in coord.proposals.items()}
    path = run.folder.part_path(step, run.rank, run.world)
    sends = [peer_copy.Send(to, path, sizes[run.rank]) for to in run.peers[run.rank]]
    receives = [peer_copy.Receive(src, run.folder.part_path(step, src, run.world), sizes[src])
                for src in run.sources]
    own: list[str] = []
    sent: list[str] = []
    try:
        group = coord.group(op)
        op.enter("peer copy")
        coord.waiting_for = sorted({*run.peers[run.rank], *run.sources})  # named if this rank gives up now
        try:
            sent = peer_copy.transfer(group, sends, receives, op.deadline, f"the local-tier save of step {step}")
        except Exception as e:  # noqa: BLE001 - voted below: every rank names it
            own.append(f"rank {run.rank} on {run.host}: {type(e).__name__}: {e}{partners(run)}")
        coord.waiting_for = []
        coord.vote({"sent": sent[0] if sent and len(set(sent)) == 1 else None}, "sent")
        digests = {r: v["sent"] for r, v in coord.votes(op, "sent").items()}
        with op.guarded():  # no rename once this rank gave up
            if receives and time.monotonic() >= op.deadline:  # no late commit: nothing is renamed
                own.append(f"rank {run.rank} on {run.host}: the copies arrived after the save's deadline of "
                           f"{run.tier.timeout_s:g} s (LocalTier.timeout_s) and were discarded; raise "
                           f"timeout_s if copies take this long")
            else:
                peer_copy.settle(receives, digests)
    finally:
        peer_copy.discard(receives)
    return own + [f"the copy of rank {r.source}'s part on {run.host} (rank {run.rank}): {r.error}"
                  for r in receives if r.error]


def retire(run, step: int) -> list[int]:
    """(Every rank, after the persistent rollback was agreed.) Each host's lowest rank removes the
    local steps after `step`; every rank returns once every host did: the steps removed anywhere."""
    coord = Coordination("local-tier rollback", {"path": run.key, "after": step}, agreed=("after",))
    op = Operation("local-tier rollback", run.key, _watch(run, run.tier.timeout_s), gate=coord.gate,
                   rank=coord.rank, untouched="nothing was removed")
    coord.op = op

    def work(op: Operation) -> list[int]:
        coord.agree(op)  # every rank is here: none is writing a save any more
        removed, error = [], None
        if run.leader:
            try:
                removed = run.folder.retain_upto(step)
            except OSError as e:
                error = f"rank {run.rank} on {run.host}: {type(e).__name__}: {e}"
        coord.vote({"removed": removed, "error": error}, "retired")
        votes = coord.votes(op, "retired")
        failed = {r: v["error"] for r, v in votes.items() if v["error"]}
        if failed:
            raise CheckpointPeerError(f"the local tier's steps after {step} could not all be removed: "
                                      + "; ".join(failed.values()), rank=min(failed))
        return sorted({s for v in votes.values() for s in v["removed"]})

    try:
        return op.run(work)
    finally:
        coord.close()


def described(e: Exception, path, tier: LocalTier, world: int) -> str:
    """A failed write of a part, with the fix for a full tier."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or (
            isinstance(e, CheckpointWriteError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
        lower = [f"keep (now {tier.keep})"] if tier.keep > 1 else []
        lower += [f"peers (now {tier.peers})"] if tier.peers and world > 1 else []
        text = (f"the local tier is full: {path} could not be written ({text}). It holds at most keep+1 "
                f"steps of this host's parts" + (" and its peers' copies" if tier.peers and world > 1 else "")
                + "; " + (f"lower {' or '.join(lower)}, " if lower else "")
                + f"give {tier.directory} more room (/dev/shm: docker --shm-size, or the tmpfs size), "
                f"or use a local disk")
    return text


def partners(run) -> str:
    """Which ranks this rank copies with (one of them stalled or died), and where to look."""
    ranks = sorted({*run.peers[run.rank], *run.sources})
    if not ranks:
        return ""
    named = ", ".join(f"rank {r} on {run.hosts[r]}" for r in ranks)
    return (f". This rank copies with {named}: look there for a process that died or stalled (its log, "
            f"an OOM kill); the step is not kept in the local tier, the older steps stay")


def _why(run, coord: Coordination, e: Exception, late: list[dict], step: int, deadline: float,
         reached: float) -> str:
    """Why the save is not whole, with every rank and host concerned (alike on every rank where it can).

    `reached`: when this rank reached the save (time.time()). Another rank's give-up made well before it
    means this rank was stalled, though the claim may have reached the store only after this rank
    looked (its store host, this rank's process, was stopped with the claim queued)."""
    if isinstance(e, (NotWhole, PartNotWritten)):
        return str(e)
    failed = [p["error"].removeprefix(f"{PartNotWritten.__name__}: ") for _, p in sorted(coord.proposals.items())
              if "error" in p]
    if failed:
        return "; ".join(failed)
    text = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    held = getattr(e, "decision", None) or coord.gate.held or (late[0] if late else None)
    claimer = None
    if held and held.get("decision") != COMMIT:
        claimer = held.get("rank")
        culprits = [r for r in held.get("culprits", []) if isinstance(r, int) and 0 <= r < run.world
                    and r != claimer] if held.get("timeout") else []
        if culprits:  # several: one stalled, the others may have been copying with it
            named = ", ".join(f"rank {r} on {run.hosts[r]}" for r in culprits)
            who = "died or stalled" if len(culprits) == 1 else "each died, stalled, or was copying with one that did"
            text = (f"{named} did not answer within the deadline of {run.tier.timeout_s:g} s (LocalTier."
                    f"timeout_s): {who} (look at the logs, e.g. for an OOM kill); the step is not kept in the "
                    f"local tier, the older steps stay [{text}]")
        elif isinstance(claimer, int) and 0 <= claimer < run.world:
            reason = str(held.get("error")).removeprefix(f"{PartNotWritten.__name__}: ")
            text = f"rank {claimer} on {run.hosts[claimer]} gave the save up: {reason}"
    starts = {r: p["deadline_unix"] for r, p in coord.proposals.items() if "deadline_unix" in p}
    spread = max(starts.values()) - min(starts.values()) if starts else 0.0
    if spread > 1.0:  # one rank came late, not too late
        last = max(starts, key=starts.get)
        text += (f"; rank {last} on {run.hosts[last]} reached this save {spread:.1f} s after the first rank "
                 f"(stalled?), too late to finish before the first rank's deadline")
    overdue = time.monotonic() - deadline
    before = claimer is not None and claimer != run.rank and held.get("unix", reached) < reached - _CLOCK_SLACK_S
    if late or before or (overdue > _CLAIM_WAIT_S + _VERDICT_GRACE_S + 1 and claimer != run.rank):  # stalled
        text = (f"rank {run.rank} on {run.host} " + (f"reached the local-tier save of step {step} after the other "
                f"ranks had given it up" if late or before else f"came back {overdue:.1f} s after the deadline of the "
                f"local-tier save of step {step}, which the other ranks had given up")
                + " (it was stalled: SIGSTOP, swapping, a debugger?) and dropped it at once"
                + (", writing nothing" if late else "") + f"; {text}")
    return text
