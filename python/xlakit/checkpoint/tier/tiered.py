"""A CheckpointManager's local tier at work: when it saves, the save with its peer copies, retention.

The manager owns one `TierRun` when given `local=LocalTier(...)`. A local save
(every `interval_steps`, and at an agreed preemption step before the
persistent save) runs on every rank, in the order the ranks call the manager:
each rank saves its part (what it passed to `save`: its shard, or the whole
replicated state) as an ordinary xlakit file into its host's folder, the parts
go to their peers on other hosts (`peer_copy.py`), and the job decides, once,
whether the step is whole; only then is it marked, counted and restorable.
That agreement, what a rank that stalled past the deadline finds, and the
rollback are `tier_rounds.py`'s; the folders and their markers `local_tier.py`'s.

A local save at or below the newest whole local step is refused, as the
persistent saves are (`rollback.py`): a rollback first retires the newer steps.

A local save never stops training: a failure (a full `/dev/shm`, a peer that
did not answer in time) is logged as an error on every rank, named in
`last_error`, and the step is simply not restorable from the local tier; the
persistent saves go on. Restores are `tier_restore.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection
from typing import Any

from xlakit.checkpoint.core.options import SaveOptions
from xlakit.checkpoint.stepstore import rollback
from xlakit.checkpoint.tier import peer_copy, tier_restore, tier_rounds
from xlakit.checkpoint.tier.local_tier import HostFolder, LocalTier
from xlakit.errors import CheckpointWriteError

log = logging.getLogger("xlakit")


def config_of(local: object) -> dict | None:
    """What every rank must set alike of a manager's `local=` (None: no local tier)."""
    if local is not None and not isinstance(local, LocalTier):
        raise TypeError(f"local must be an xlakit.LocalTier (or None), got {local!r} "
                        f"({type(local).__name__}): e.g. local=xlakit.LocalTier('/dev/shm/ckpt')")
    return None if local is None else local.config()


class TierRun:
    """One manager's local tier: this host's folder, the peer plan, the last outcomes.

    Attributes:
        host: this process's host (`XLAKIT_HOST_ID`, else the hostname).
        hosts: every rank's host, by rank.
        peers: {rank: the ranks holding a copy of its part}.
        copies: how many other hosts hold a copy of each part (`LocalTier.peers`, at most the
            number of other hosts).
        restored_from: after `restore`, {"step", "parts": {rank: "local"|"peer"|"persistent"},
            "hosts": {rank: the host its bytes came from; None for a persistent part},
            "persistent": the persistent tier, "damaged": [what was not trusted, and why]}.
        last_error: why the last local save was not whole everywhere (None: it was).
    """

    def __init__(self, tier: LocalTier, *, world: int, rank: int, layout: str, options: SaveOptions, run):
        if not isinstance(tier, LocalTier):
            raise TypeError(f"local must be a LocalTier, got {type(tier).__name__}")
        if layout == "dcp":
            raise ValueError("a local tier saves each rank's part as an xlakit file; layout='dcp' has no such "
                             "part: use layout='sharded' or 'replicated' with local=")
        self.tier, self.world, self.rank = tier, world, rank
        self.options = dataclasses.replace(options, layout="single", asynchronous=False, staging="host",
                                           replica_parallel=False, timeout_s=tier.timeout_s)
        self.folder = HostFolder(tier, run)  # `run`: the persistent folder; its steps only
        self.host = self.folder.host
        self.key = str(self.folder.path.parent)  # the run's folder: names its rounds in the job's store
        self.hosts = [self.host]
        error = None
        try:
            self.folder.make()
        except CheckpointWriteError as e:  # named on every rank, with this host and rank
            e.add_note(f"This is rank {rank} of {world}; every rank of the job is told.")
            error = e
        lists = self._lists(error)
        self.hosts = [x["host"] for x in lists]
        self.whole = _whole(lists, world)  # the local steps every rank's part of is held (agreed)
        self.peers = peer_copy.peers_of(self.hosts, tier.peers)
        self.copies = min(tier.peers, len(set(self.hosts)) - 1)
        self.sources = [r for r, to in self.peers.items() if rank in to]  # whose copies this rank keeps
        self.leader = self.hosts.index(self.host) == rank
        on_host = {r for r, h in enumerate(self.hosts) if h == self.host}
        # The parts this host holds of a whole step: its ranks' own and the copies its ranks receive.
        self.held_here = sorted(on_host | {src for src, to in self.peers.items() if on_host & set(to)})
        if self.copies < tier.peers and world > 1 and rank == 0:
            log.warning("xlakit: the local tier at %s has peers=%d, but the job runs on %d host(s): each part is "
                        "copied to %d other host(s) (the most there are; set XLAKIT_HOST_ID per host if the "
                        "hostnames are alike)", tier.directory, tier.peers, len(set(self.hosts)), self.copies)
        if self.leader:  # what killed saves, and saves given up, left before this start
            try:
                self.folder.clean()
                self.folder.tidy(world, tier.keep, None)
            except OSError as e:
                log.warning("xlakit: tidying the local tier %s failed (%s); what is left is never counted",
                            self.folder.path, e)
        if world > 1:  # no rank saves before every host is tidied
            tier_rounds.exchange(self, "local-tier start", {})
        self.last_step: int | None = None
        self.last_error: str | None = None
        self.restored_from: dict | None = None

    def due(self, step: int, preempt: bool = False) -> bool:
        return step != self.last_step and (preempt or step % self.tier.interval_steps == 0)

    def _lists(self, error: BaseException | None = None) -> list[dict]:
        """Every rank's {"host", "held": {step: {part: bytes}}}, by rank (agreed through the job's store)."""
        mine = {"host": self.host, "held": {} if error else self.folder.inventory(self.world)}
        if self.world == 1:
            if error is not None:
                raise error
            return [mine]
        got = tier_rounds.exchange(self, "local-tier listing", mine, error=error)
        return [{"host": got[r]["host"], "held": {int(s): {int(p): n for p, n in parts.items()}
                                                  for s, parts in got[r]["held"].items()}} for r in range(self.world)]

    def holds(self, step: int) -> bool:
        """True when the local tier holds every rank's part of `step` (every rank calls it)."""
        self.whole = _whole(self._lists(), self.world)
        return step in self.whole

    def latest(self, persistent: int | None = None) -> int | None:
        """The newest step saved whole in the local tier (agreed; no collective), or `persistent` if newer."""
        return max((s for s in (*self.whole, persistent) if s is not None), default=None)

    def save_before_persistent(self, step: int, state: Any, preempt: bool, timeout_s: float | None,
                               persistent: Collection[int] = ()) -> ValueError | None:
        """The local save that comes before a persistent one. Its refusal (`step` below the newest local
        step) is raised, except at a preemption, the job's last chance: there it is returned, for the
        manager to raise once the persistent step is saved."""
        try:
            self.save(step, state, timeout_s=timeout_s, persistent=persistent)
        except ValueError as e:  # refused: nothing was written
            if not preempt:
                raise
            e.add_note(f"At this preemption the persistent step {step} is saved all the same; until "
                       f"retire_steps_after({step}) retires the local tier's newer steps, a restore prefers them.")
            return e
        return None

    def save(self, step: int, state: Any, *, timeout_s: float | None = None, persistent: Collection[int] = ()
             ) -> bool:
        """Save this rank's part of `step`, copy it to its peers; True when whole on every rank.

        Raises:
            ValueError: `step` is at or below the newest whole local step (`retire_steps_after`, which
                also takes the `persistent` steps).
        """
        rollback.refuse_at_or_below_latest(step, self.whole, f"the local tier {self.key}", retire_to=persistent)
        # At a preemption, what is left of the grace (a spent grace: the save times out at once, named).
        timeout_s = self.tier.timeout_s if timeout_s is None else max(min(timeout_s, self.tier.timeout_s), 1e-3)
        deadline = time.monotonic() + timeout_s
        self.last_step = step
        if self.world > 1:
            outcome = tier_rounds.save(self, step, state, deadline)
        else:
            self.folder.tidy(1, self.tier.keep, step)
            _, error = tier_rounds.write_part(self, step, state, deadline)
            outcome = tier_rounds.Outcome(error is None and time.monotonic() < deadline,
                                          None if error is None else str(error))
            if error is None and not outcome.whole:
                outcome.error = (f"the part was written after the save's deadline of {timeout_s:g} s "
                                 f"(LocalTier.timeout_s) and is not kept")
        if outcome.whole:
            self.whole = set(sorted(self.whole | {step})[-self.tier.keep:])
        notes = self._settle_folder(step, outcome.whole, deadline) if self.leader else []
        self.last_error = outcome.error
        if not outcome.whole:
            log.error("xlakit: the local-tier save of step %d is not whole (%s); it will not be restored from "
                      "the local tier, and the persistent saves go on", step, self.last_error)
        elif notes:  # the step is whole; the older steps stay a while longer
            log.warning("xlakit: the local-tier save of step %d is whole, but %s", step, "; ".join(notes))
        return outcome.whole

    def _settle_folder(self, step: int, whole: bool, deadline: float) -> list[str]:
        """(The host's lowest rank.) A whole step is marked (the job decided it); then, before the
        deadline only (else nothing is deleted), retention. A failed step's folder, never counted, goes
        at this host's next save (another rank of the host may still be writing into it) or, alone,
        now. What went wrong."""
        notes = []
        try:
            if whole:
                self.folder.mark(step, self.world, self.held_here)
        except OSError as e:  # this host's copies of the step do not count; the other hosts' do
            notes.append(f"its marker on {self.host} could not be written ({e}): this host's parts of it "
                         f"are not counted")
        if time.monotonic() >= deadline:  # a failed step's folder stays too (unmarked: never counted)
            return notes + ([] if not whole else [
                f"retention on {self.host} did not run: the save's deadline of {self.tier.timeout_s:g} s "
                f"(LocalTier.timeout_s) had passed; the older steps stay until the next save"])
        try:
            self.folder.tidy(self.world, self.tier.keep, step + (0 if whole or self.world > 1 else 1))
        except OSError as e:
            notes.append(f"retention of {self.folder.path} on {self.host}: {e}")
        return notes

    def restore(self, found, step: int | None, template: Any, options, directory) -> Any:
        """This rank's state of `step` (default: the newest every rank can restore), from the fastest tiers."""
        state, self.restored_from = tier_restore.restore(self, found, step, template, options, directory)
        return state

    def retire_after(self, step: int) -> list[int]:
        """(After a rollback to `step`, every rank.) Each host's lowest rank removes the local steps after
        it; every rank returns once every host did. The local steps removed, on any host."""
        removed = tier_rounds.retire(self, step) if self.world > 1 else self.folder.retain_upto(step)
        self.whole = {s for s in self.whole if s <= step}
        self.last_step = None
        return removed

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
