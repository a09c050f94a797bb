"""Restoring from the fastest tier: every rank agrees on one step and where each part comes from.

1. Each rank lists its host's local folder (which parts of which steps it
   holds, by name and size) and every rank learns every list, with rank 0's
   list of committed persistent steps (`peer_copy.gather`).
2. Every rank computes the same plan from the same lists (`choose`): the
   newest step for which every rank's part has a source, each part from the
   fastest: its own host's copy ("local"), else a copy on another host
   ("peer": that host's lowest rank sends the file, the receiving rank writes
   it into its own host's folder and, once every rank restored, its host's
   lowest rank marks it there, so a recreated host is filled again), else
   the persistent tier. Every part of the plan is of that one step: parts of
   different steps are never mixed.
3. Every rank loads its part, verifying every checksum, and the ranks
   exchange outcomes. A copy that fails (torn, truncated, altered) is named
   on every rank and left out; the plan is made again without it, so that
   part comes from the next tier, or an older step is taken. A copy that
   failed never counts again in this restore.
4. The persistent tier last: a sharded step's missing shards are read by
   their ranks alone; any other layout is read by every rank together, as
   the manager reads it without a local tier.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Any

from xlakit.checkpoint.stepstore import readonly, steps
from xlakit.checkpoint.tier import peer_copy
from xlakit.checkpoint.core.operation import remove_path
from xlakit.errors import CheckpointError

log = logging.getLogger("xlakit")
LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"


def choose(lists: list[dict], persistent: list[int], world: int, bad: set, step: int | None
           ) -> tuple[int, dict[int, tuple[str, int | None]]] | None:
    """(step, {rank: (source, sending rank)}) of the newest step every part can come from; None: none.

    `lists[r]` is rank r's {"host", "held": {step: {part: bytes}}}; `bad` holds (host, step, part)
    copies that failed their verification.
    """
    hosts = [x["host"] for x in lists]
    first = {h: hosts.index(h) for h in hosts}
    holders: dict[tuple[int, int], list[str]] = {}
    for h, r in first.items():
        for s, parts in lists[r]["held"].items():
            for part in parts:
                if (h, int(s), int(part)) not in bad:
                    holders.setdefault((int(s), int(part)), []).append(h)
    candidates = {s for s, _ in holders} | set(persistent)
    for s in sorted(candidates if step is None else candidates & {step}, reverse=True):
        plan: dict[int, tuple[str, int | None]] = {}
        for part in range(world):
            held = holders.get((s, part), [])
            if hosts[part] in held:
                plan[part] = (LOCAL, part)
            elif held:
                plan[part] = (PEER, first[held[0]])
            elif s in persistent:
                plan[part] = (PERSISTENT, None)
            else:
                break
        else:
            return s, plan
    return None


def restore(run, found: steps.Scan, step: int | None, template: Any, options, directory) -> tuple[Any, dict]:
    """This rank's state from the agreed step, and the report of where every part came from."""
    world, rank = run.world, run.rank
    mine = {"host": run.host, "held": run.folder.inventory(world)}
    persistent = sorted(found.committed)
    deadline = time.monotonic() + run.tier.timeout_s  # the local and peer reads; the persistent has its own
    group = peer_copy.fresh_group(run.tier.timeout_s) if world > 1 else None
    try:
        if group is not None:
            lists = peer_copy.gather(group, {**mine, "persistent": persistent if rank == 0 else None})
            persistent = lists[0]["persistent"]
        else:
            lists = [mine]
        bad: set = set()
        damaged: list[str] = []
        for _ in range(world * (run.tier.peers + 2) + 2):  # each round rules out at least one copy
            chosen = choose(lists, persistent, world, bad, step)
            if chosen is None:
                raise _nothing(step, persistent, damaged, directory, run)
            s, plan = chosen
            layout = found.committed[s].layout if s in found.committed else None
            if any(src == PERSISTENT for src, _ in plan.values()) and layout != "sharded" and world > 1:
                plan = {r: (PERSISTENT, None) for r in plan}  # read together, as the layout wants
            state, failures = _read_local(run, group, lists, s, plan, template, options, deadline)
            if not failures:
                if plan[rank][0] == PERSISTENT:
                    together = layout != "sharded" or all(src == PERSISTENT for src, _ in plan.values())
                    state = readonly.read_step(found.committed[s], template, options=options,
                                               shard=None if together else rank, replicated=together and world > 1)
                _mark_received(run, s, plan, deadline)
                report = {"step": s, "parts": {r: src for r, (src, _) in plan.items()},
                          "hosts": {r: lists[sender]["host"] if sender is not None else None
                                    for r, (_, sender) in plan.items()},
                          "persistent": str(directory), "damaged": damaged}
                if rank == 0:
                    log.info("xlakit: restored step %d: %s", s, _summary(report))
                return state, report
            for part, (host, why) in failures.items():
                bad.add((host, s, part))
                damaged.append(f"{run.folder.path.parent / host / str(s) / _name(part, world)}: {why}")
                if rank == 0:
                    log.warning("xlakit: the local-tier copy of rank %d's part of step %d on host %s is not "
                                "trusted: %s; it is not used, the next tier is", part, s, host, why)
        raise _nothing(step, persistent, damaged, directory, run)
    finally:
        if group is not None:
            peer_copy.close_group(group)


def _read_local(run, group, lists: list[dict], s: int, plan: dict, template: Any, options, deadline: float
                ) -> tuple[Any, dict]:
    """Copy the peer parts, load this rank's local part; every rank's failures {part: (host, why)}."""
    from xlakit import checkpoint

    rank, world = run.rank, run.world
    source, sender = plan[rank]
    failure = None
    if group is not None and any(src == PEER for src, _ in plan.values()):
        sends = [peer_copy.Send(r, run.folder.part_path(s, r, world), lists[rank]["held"][s][r])
                 for r, (src, by) in plan.items() if src == PEER and by == rank]
        receives = []
        if source == PEER:
            run.folder.make()
            run.folder.make_step(s)
            receives = [peer_copy.Receive(sender, run.folder.part_path(s, rank, world),
                                          lists[sender]["held"][s][rank])]
        try:
            peer_copy.transfer(group, sends, receives, deadline, f"the restore of step {s} from the local tier")
            peer_copy.settle(receives, None)  # the load below verifies every record's checksum
            failure = receives[0].error if receives else None
        except Exception as e:  # noqa: BLE001 - gathered below
            failure = f"the copy from rank {sender} failed ({type(e).__name__}: {e})"
        finally:
            peer_copy.discard(receives)
    state = None
    path = run.folder.part_path(s, rank, world)
    if source in (LOCAL, PEER) and failure is None:
        from xlakit.checkpoint.tier import local_tier

        try:
            got = (checkpoint.load(path, options=options) if template is None
                   else checkpoint.restore(path, local_tier.wrap(template, s, rank, world), options=options))
            state = local_tier.unwrap(got, s, rank, world)  # not a part moved from another step
        except (CheckpointError, OSError, ValueError) as e:
            failure = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            if source == PEER:
                remove_path(path)  # the copy this rank just wrote: never left to be trusted later
    mine = None if failure is None else (run.hosts[sender] if source == PEER else run.host, failure)
    everyone = peer_copy.gather(group, mine) if group is not None else [mine]
    return state, {r: f for r, f in enumerate(everyone) if f is not None}


def _name(part: int, world: int) -> str:
    from xlakit.checkpoint.tier.local_tier import part_name

    return part_name(part, world)


def _mark_received(run, s: int, plan: dict, deadline: float) -> None:
    """(The host's lowest rank, once every rank restored.) The parts copied into this host's folder
    count from now on: the step's marker lists them (a recreated host is filled again)."""
    here = [r for r, (src, _) in plan.items() if src == PEER and run.hosts[r] == run.host]
    if not (here and run.leader) or time.monotonic() >= deadline:
        return
    try:
        run.folder.mark(s, run.world, here)
    except OSError as e:  # only this refill is lost: the parts are restored, their source holds them
        log.warning("xlakit: the copies of step %d restored into %s are not kept as a step there: %s",
                    s, run.folder.path, e)


def _summary(report: dict) -> str:
    return ", ".join(f"rank {r}: {src} ({report['hosts'][r] or report['persistent']})"
                     for r, src in sorted(report["parts"].items()))


def _nothing(step: int | None, persistent: list[int], damaged: list[str], directory, run) -> FileNotFoundError:
    what = f"step {step}" if step is not None else "a step"
    err = FileNotFoundError(errno.ENOENT, f"no tier holds {what} that every rank can restore: the persistent "
                            f"tier {directory} has steps {persistent}, the local tier {run.tier.directory} no "
                            f"step with every rank's part whole", str(directory))
    if damaged:
        err.add_note("Copies not trusted: " + "; ".join(damaged))
    return err
