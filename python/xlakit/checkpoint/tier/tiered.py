"""A CheckpointManager's local tier at work: when it saves, the save with its peer copies, retention.

The manager owns one `TierRun` when given `local=LocalTier(...)`. A local save
(every `interval_steps`, and at an agreed preemption step before the
persistent save) runs on every rank, in the order the ranks call the manager:

1. each rank saves its part (what it passed to `save`: its shard, or the whole
   replicated state) as an ordinary xlakit file into its host's folder;
2. over a fresh gloo group whose timeout is what is left of the deadline, the
   ranks exchange sizes, then each rank's file goes to its peers on other
   hosts (`peer_copy.py`); each copy is renamed into place only when its xxh3
   is the one its sender read while sending;
3. the ranks exchange outcomes; before the deadline, and only when the step
   is whole on every rank (every rank's errors empty), each host's lowest rank
   applies retention, so the newest whole step always stays. A failed step's
   folder is removed from each host (it is never counted as a step).

A local save at or below the newest whole local step is refused, as the
persistent saves are (`rollback.py`): a rollback first retires the newer steps.

A local save never stops training: a failure (a full `/dev/shm`, a peer that
did not answer in time) is logged as an error on every rank, named in
`last_error`, and the step is simply not restorable from the local tier; the
persistent saves go on. Restores are `tier_restore.py`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from datetime import timedelta
from typing import Any

from xlakit.checkpoint.file import pipeline
from xlakit.checkpoint.stepstore import rollback
from xlakit.checkpoint.tier import local_tier, peer_copy, tier_restore
from xlakit.checkpoint.tier.local_tier import HostFolder, LocalTier
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.errors import CheckpointWriteError

log = logging.getLogger("xlakit")


class TierRun:
    """One manager's local tier: this host's folder, the peer plan, the last outcomes.

    Attributes:
        host: this process's host (`XLAKIT_HOST_ID`, else the hostname).
        hosts: every rank's host, by rank.
        peers: {rank: the ranks holding a copy of its part}.
        restored_from: after `restore`, {"step", "parts": {rank: "local"|"peer"|"persistent"},
            "hosts": {rank: the host its bytes came from}, "damaged": [what was not trusted, and why]}.
        last_error: why the last local save was not whole everywhere (None: it was).
    """

    def __init__(self, tier: LocalTier, *, world: int, rank: int, layout: str, options: SaveOptions, run):
        if not isinstance(tier, LocalTier):
            raise TypeError(f"local must be a LocalTier, got {type(tier).__name__}")
        if layout == "dcp":
            raise ValueError("a local tier saves each rank's part as an xlakit file; layout='dcp' has no such "
                             "part: use layout='sharded' or 'replicated' with local=")
        self.tier, self.world, self.rank = tier, world, rank
        self.options = dataclasses.replace(options, layout="single", asynchronous=False,
                                           replica_parallel=False, timeout_s=tier.timeout_s)
        self.folder = HostFolder(tier, run)  # `run`: the persistent folder; its steps only
        self.host = self.folder.host
        self.folder.make()
        lists = self._lists()
        self.hosts = [x["host"] for x in lists]
        self.whole = _whole(lists, world)  # the local steps every rank's part of is held (agreed)
        self.peers = peer_copy.peers_of(self.hosts, tier.peers)
        self.sources = [r for r, to in self.peers.items() if rank in to]  # whose copies this rank keeps
        self.leader = self.hosts.index(self.host) == rank
        if tier.peers and world > 1 and len(set(self.hosts)) < 2:
            log.warning("xlakit: the local tier at %s has peers=%d, but every rank runs on host %r: no copy "
                        "to another host is made (set XLAKIT_HOST_ID per host if the hostnames are alike)",
                        tier.directory, tier.peers, self.host)
        if self.leader:
            self.folder.clean()
        self.last_step: int | None = None
        self.saves = 0
        self.last_error: str | None = None
        self.restored_from: dict | None = None

    def due(self, step: int, preempt: bool = False) -> bool:
        return step != self.last_step and (preempt or step % self.tier.interval_steps == 0)

    def _lists(self) -> list[dict]:
        """Every rank's {"host", "held": {step: {part: bytes}}} (a collective with several ranks)."""
        mine = {"host": self.host, "held": self.folder.inventory(self.world)}
        if self.world == 1:
            return [mine]
        group = peer_copy.fresh_group(self.tier.timeout_s)
        try:
            return peer_copy.gather(group, mine)
        finally:
            peer_copy.close_group(group)

    def holds(self, step: int) -> bool:
        """True when the local tier holds every rank's part of `step` (every rank calls it)."""
        return step in _whole(self._lists(), self.world)

    def save_before_persistent(self, step: int, state: Any, preempt: bool,
                               timeout_s: float | None) -> ValueError | None:
        """The local save that comes before a persistent one. Its refusal (`step` below the newest local
        step) is raised, except at a preemption, the job's last chance: there it is returned, for the
        manager to raise once the persistent step is saved."""
        try:
            self.save(step, state, timeout_s=timeout_s)
        except ValueError as e:  # refused: nothing was written
            if not preempt:
                raise
            e.add_note(f"At this preemption the persistent step {step} is saved all the same; until "
                       f"retire_steps_after({step}) retires the local tier's newer steps, a restore prefers them.")
            return e
        return None

    def save(self, step: int, state: Any, *, timeout_s: float | None = None) -> bool:
        """Save this rank's part of `step`, copy it to its peers; True when whole on every rank.

        Raises:
            ValueError: `step` is at or below the newest whole local step (`retire_steps_after`).
        """
        rollback.refuse_at_or_below_latest(step, self.whole, f"the local tier {self.folder.path.parent}")
        # At a preemption, what is left of the grace (a spent grace: the save times out at once, named).
        timeout_s = self.tier.timeout_s if timeout_s is None else max(min(timeout_s, self.tier.timeout_s), 1e-3)
        deadline = time.monotonic() + timeout_s
        self.last_step = step
        self.saves += 1  # the same count on every rank: names this save's keys in the job's store
        mine: dict = {"error": None, "size": -1}
        path = self.folder.part_path(step, self.rank, self.world)
        try:
            self.folder.make()
            self.folder.make_step(step)
            pipeline.save_file(local_tier.wrap(state, step, self.rank, self.world), path,
                               dataclasses.replace(self.options, timeout_s=timeout_s))
            mine["size"] = path.stat().st_size
        except Exception as e:  # noqa: BLE001 - the local tier is a cache: said, never fatal
            mine["error"] = _described(e, path, self.tier, self.world)
        errors = [] if mine["error"] is None else [f"rank {self.rank} on {self.host}: {mine['error']}"]
        agreed = True
        if self.world > 1:
            errors, agreed = self._copy(step, mine, deadline)
        if not errors:
            self.whole.add(step)
        notes = self._settle_folder(step, errors, agreed, deadline) if self.leader else []
        self.last_error = "; ".join(errors) or None
        if errors:
            log.error("xlakit: the local-tier save of step %d is not whole (%s); it will not be restored from "
                      "the local tier, and the persistent saves go on", step, self.last_error)
        elif notes:  # the step is whole; the older steps stay a while longer
            log.warning("xlakit: the local-tier save of step %d is whole, but %s", step, "; ".join(notes))
        return not errors

    def _settle_folder(self, step: int, errors: list[str], agreed: bool, deadline: float) -> list[str]:
        """(The host's lowest rank.) Before the deadline only (then nothing is deleted): retention after
        a whole step, else the failed step's folder goes (all of it once every rank agreed it failed).
        What went wrong."""
        if time.monotonic() >= deadline:  # a failed step's folder stays too (counted, not restored whole)
            return [] if errors else [f"retention on {self.host} did not run: the save's deadline of {self.tier.timeout_s:g} s "
                    f"(LocalTier.timeout_s) had passed; the older steps stay until the next save"]
        try:
            if errors:
                if agreed:
                    self.folder.remove_step(step)  # not whole anywhere it counts: never restored or counted
                else:
                    self.folder.drop_if_empty(step)
                return []
            self.folder.retain(self.tier.keep)
        except OSError as e:
            return [f"retention of {self.folder.path} on {self.host}: {e}"]
        return []

    def _copy(self, step: int, mine: dict, deadline: float) -> tuple[list[str], bool]:
        """Exchange sizes, copy the parts to the peers, exchange outcomes: every rank's errors, and
        whether every rank has the same list (False: a rank could not reach the others)."""
        group = None
        try:
            group = peer_copy.fresh_group(deadline - time.monotonic())
            infos = peer_copy.gather(group, mine)
            path = self.folder.part_path(step, self.rank, self.world)
            sends = [peer_copy.Send(to, path, mine["size"]) for to in self.peers[self.rank]
                     if mine["error"] is None]
            receives = [peer_copy.Receive(src, self.folder.part_path(step, src, self.world), infos[src]["size"])
                        for src in self.sources if infos[src]["error"] is None]
            copy_error, sent = None, []
            try:
                sent = peer_copy.transfer(group, sends, receives, deadline, f"the local-tier save of step {step}")
            except Exception as e:  # noqa: BLE001 - gathered below, as every rank's
                copy_error = f"{type(e).__name__}: {e}{_partners(self, sends, receives)}"
            try:  # each copy kept only if it arrived with the xxh3 its sender read while sending
                digests = peer_copy.gather(group, sent[0] if sent and len(set(sent)) == 1 else None)
                if receives and time.monotonic() >= deadline:  # no late commit: nothing is renamed
                    copy_error = copy_error or (
                        f"the copies arrived after the save's deadline of {self.tier.timeout_s:g} s "
                        f"(LocalTier.timeout_s) and were discarded; raise timeout_s if copies take this long")
                else:
                    peer_copy.settle(receives, dict(enumerate(digests)))
            finally:
                peer_copy.discard(receives)
            own = [f"rank {self.rank} on {self.host}: {mine['error']}"] if mine["error"] else []
            own += [f"the copy of rank {r.source}'s part on {self.host} (rank {self.rank}): {r.error}"
                    for r in receives if r.error]
            if copy_error:
                own.append(f"rank {self.rank} on {self.host}: {copy_error}")
            return [e for errs in peer_copy.gather(group, own) for e in errs], True
        except Exception as e:  # noqa: BLE001 - a rank that died or stalled: the step is not whole
            silent = _silent(self, deadline)
            named = ", ".join(f"rank {r} on {self.hosts[r]}" for r in silent)
            why = (f". {named} did not answer (died or stalled: look at its log, e.g. for an OOM kill); the "
                   f"step is not kept in the local tier, the older steps stay; restart the job if it died "
                   f"(restore() takes the newest whole step)") if silent else _partners(self, [], [])
            return [f"rank {self.rank} on {self.host} could not reach the other ranks ({type(e).__name__}: "
                    f"{e}){why}"], False
        finally:
            if group is not None:
                peer_copy.close_group(group)

    def restore(self, found, step: int | None, template: Any, options, directory) -> Any:
        """This rank's state of `step` (default: the newest every rank can restore), from the fastest tiers."""
        state, self.restored_from = tier_restore.restore(self, found, step, template, options, directory)
        return state

    def retire_after(self, step: int) -> None:
        """(After a rollback to `step`.) This host's lowest rank removes the local steps after it."""
        if self.leader:
            self.folder.retain_upto(step)
        self.whole = {s for s in self.whole if s <= step}
        self.last_step = None

    def bytes_used(self) -> int:
        """Bytes this host's folder of the local tier holds now."""
        return self.folder.bytes_used()


def _whole(lists: list[dict], world: int) -> set[int]:
    """The steps of which every rank's part is held on some host."""
    held: dict[int, set[int]] = {}
    for x in lists:
        for s, parts in x["held"].items():
            held.setdefault(int(s), set()).update(int(p) for p in parts)
    return {s for s, parts in held.items() if len(parts) == world}


def _silent(run: TierRun, deadline: float) -> list[int]:
    """The ranks that did not say they are alive in the job's store by the deadline and a grace of
    2 s (a rank blocked on a dead one answers when its own wait times out, at the deadline): after a
    failed copy, the ones that died or stalled. [] when it cannot tell."""
    try:
        import torch.distributed as d

        store = d.distributed_c10d._get_default_store()
        key = f"xlakit/local-tier/{run.folder.path.parent.name}/{run.saves}/alive/"
        store.set(key + str(run.rank), "1")
        try:
            store.wait([key + str(r) for r in range(run.world)],
                       timedelta(seconds=max(deadline - time.monotonic(), 0.0) + 2.0))
        except Exception:  # noqa: BLE001 - some did not answer: named below
            pass
        return [r for r in range(run.world) if not store.check([key + str(r)])]
    except Exception:  # noqa: BLE001 - a diagnostic never fails the save's report
        return []


def _partners(run: TierRun, sends, receives) -> str:
    """Which ranks this rank was copying with (one of them stalled or died), and the fix."""
    ranks = sorted({*run.peers[run.rank], *run.sources} if not (sends or receives)
                   else {*(s.to for s in sends), *(r.source for r in receives)})
    if not ranks:
        return ""
    named = ", ".join(f"rank {r} on {run.hosts[r]}" for r in ranks)
    return (f". This rank copies with {named}: look there for a process that died or stalled (its log, "
            f"an OOM kill); the step is not kept in the local tier, the older steps stay")


def _described(e: Exception, path, tier: LocalTier, world: int) -> str:
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
