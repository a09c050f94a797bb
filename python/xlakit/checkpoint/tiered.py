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
3. the ranks exchange outcomes; each host's lowest rank applies retention.

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
from typing import Any

from xlakit.checkpoint import peer_copy, pipeline, tier_restore
from xlakit.checkpoint.local_tier import HostFolder, LocalTier
from xlakit.checkpoint.options import SaveOptions
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

    def __init__(self, tier: LocalTier, *, world: int, rank: int, layout: str, options: SaveOptions):
        if not isinstance(tier, LocalTier):
            raise TypeError(f"local must be a LocalTier, got {type(tier).__name__}")
        if layout == "dcp":
            raise ValueError("a local tier saves each rank's part as an xlakit file; layout='dcp' has no such "
                             "part: use layout='sharded' or 'replicated' with local=")
        self.tier, self.world, self.rank = tier, world, rank
        self.options = dataclasses.replace(options, layout="single", asynchronous=False,
                                           replica_parallel=False, timeout_s=tier.timeout_s)
        self.folder = HostFolder(tier)
        self.host = self.folder.host
        self.folder.make()
        if world > 1:
            group = peer_copy.fresh_group(tier.timeout_s)
            try:
                self.hosts = peer_copy.gather(group, self.host)
            finally:
                peer_copy.close_group(group)
        else:
            self.hosts = [self.host]
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
        self.last_error: str | None = None
        self.restored_from: dict | None = None

    def due(self, step: int, preempt: bool = False) -> bool:
        return step != self.last_step and (preempt or step % self.tier.interval_steps == 0)

    def save(self, step: int, state: Any, *, timeout_s: float | None = None) -> bool:
        """Save this rank's part of `step`, copy it to its peers; True when whole on every rank."""
        # At a preemption, what is left of the grace (a spent grace: the save times out at once, named).
        timeout_s = self.tier.timeout_s if timeout_s is None else max(min(timeout_s, self.tier.timeout_s), 1e-3)
        deadline = time.monotonic() + timeout_s
        self.last_step = step
        mine: dict = {"error": None, "size": -1}
        path = self.folder.part_path(step, self.rank, self.world)
        try:
            self.folder.make()
            self.folder.make_step(step)
            pipeline.save_file(state, path, dataclasses.replace(self.options, timeout_s=timeout_s))
            mine["size"] = path.stat().st_size
        except Exception as e:  # noqa: BLE001 - the local tier is a cache: said, never fatal
            mine["error"] = _described(e, path, self.tier)
        errors = [] if mine["error"] is None else [f"rank {self.rank} on {self.host}: {mine['error']}"]
        if self.world > 1:
            errors = self._copy(step, mine, deadline)
        if self.leader:
            try:
                self.folder.retain(self.tier.keep)
            except OSError as e:
                errors.append(f"retention of {self.folder.path} on {self.host}: {e}")
        self.last_error = "; ".join(errors) or None
        if errors:
            log.error("xlakit: the local-tier save of step %d is not whole (%s); it will not be restored from "
                      "the local tier, and the persistent saves go on", step, self.last_error)
        return not errors

    def _copy(self, step: int, mine: dict, deadline: float) -> list[str]:
        """Exchange sizes, copy the parts to the peers, exchange outcomes: every rank's errors."""
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
                copy_error = f"{type(e).__name__}: {e}"
            try:  # each copy kept only if it arrived with the xxh3 its sender read while sending
                digests = peer_copy.gather(group, sent[0] if sent and len(set(sent)) == 1 else None)
                peer_copy.settle(receives, dict(enumerate(digests)))
            finally:
                peer_copy.discard(receives)
            own = [f"rank {self.rank} on {self.host}: {mine['error']}"] if mine["error"] else []
            own += [f"the copy of rank {r.source}'s part on {self.host} (rank {self.rank}): {r.error}"
                    for r in receives if r.error]
            if copy_error:
                own.append(f"rank {self.rank} on {self.host}: {copy_error}")
            return [e for errs in peer_copy.gather(group, own) for e in errs]
        except Exception as e:  # noqa: BLE001 - a rank that died or stalled: the step is not whole
            return [f"rank {self.rank} could not reach the other ranks ({type(e).__name__}: {e})"]
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
        self.last_step = None

    def bytes_used(self) -> int:
        """Bytes this host's folder of the local tier holds now."""
        return self.folder.bytes_used()


def _described(e: Exception, path, tier: LocalTier) -> str:
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or (
            isinstance(e, CheckpointWriteError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
        text = (f"the local tier is full: {path} could not be written ({text}). It holds at most keep+1 "
                f"steps of this host's parts and its peers' copies; lower keep (now {tier.keep}) or peers "
                f"(now {tier.peers}), give {tier.directory} more room (/dev/shm: docker --shm-size, or the "
                f"tmpfs size), or use a local disk")
    return text
