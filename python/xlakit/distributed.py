"""Saves and loads coordinated across the ranks of a torch.distributed job.

xlakit never coordinates through the training collectives (their default
timeouts are short, and `xm.rendezvous` has none). It owns a gloo process
group, created on first use with the operation's deadline as its timeout,
whose monitored barrier names the ranks that did not arrive; outcomes travel
through the job's c10d store as small JSON records under a per-operation
prefix, read with explicit timeouts. So every rank learns, within the
deadline plus a small margin, whether the checkpoint committed, and if not,
which rank failed and why. Ranks must call coordinated operations in the same
order (as they do collectives).

Layouts: *replicated* (one rank writes the file, every rank gets its outcome)
and *sharded* (each rank writes `shard-RRRRR-of-WWWWW.<id>.pt` in a folder;
rank 0 writes `xlakit-commit.json` last, atomically, once every shard is
durable). A folder without a commit record naming its shards is never
loaded; shards no commit names are removed by the next committed save.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from xlakit import _archive, atomic, checkpoint
from xlakit.errors import (CheckpointError, CheckpointFormatError, CheckpointIncompleteError, CheckpointPeerError,
                           CheckpointTimeoutError, XlakitError)
from xlakit.options import LoadOptions, SaveOptions

COMMIT_RECORD = "xlakit-commit.json"  # also names the commit record of dcp folders
SHARDED_FORMAT = "xlakit-sharded"
# Past the deadline, rank 0 waits _REPORT_S for shard reports (a rank whose own save timed
# out reports just after it), and the other ranks wait _MARGIN_S for rank 0's verdict.
_REPORT_S = 1.0
_MARGIN_S = 5.0
_group = None
_sequence: dict[str, int] = {}  # per kind of operation, so each gets its own store prefix


def _dist():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise XlakitError("a coordinated checkpoint (layout='replicated' or 'sharded') needs "
                          "torch.distributed initialised: call dist.init_process_group() first, or "
                          "use layout='single'")
    return dist


class _Round:
    """One coordinated operation: a store prefix, this rank, and the shared deadline."""

    def __init__(self, what: str, path: Path, timeout_s: float):
        global _group
        dist = _dist()
        self.dist, self.what, self.path = dist, what, path
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        _sequence[what] = _sequence.get(what, 0) + 1
        self.prefix = f"xlakit/{what}/{_sequence[what]}"
        self.store = dist.distributed_c10d._get_default_store()
        if _group is None:
            _group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def group(self):
        """xlakit's gloo group, its collective timeout set to what is left of this deadline.

        For collectives run by others on our behalf (torch.distributed.checkpoint):
        a peer that never joins fails them near the deadline, not after gloo's default.
        """
        self.dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.remaining()), _group)
        return _group

    def remaining(self, extra: float = 0.0) -> float:
        return max(self.deadline + extra - time.monotonic(), 0.001)

    def publish(self, name: str, value: dict) -> None:
        self.store.set(f"{self.prefix}/{name}", json.dumps(value))

    def read(self, name: str, *, extra: float = _MARGIN_S) -> dict | None:
        """The record `name`, waiting until the deadline (+extra); None if it never came."""
        key = f"{self.prefix}/{name}"
        try:
            self.store.wait([key], timedelta(seconds=self.remaining(extra)))
        except RuntimeError:  # DistStoreError: the wait timed out
            return None
        return json.loads(self.store.get(key))

    def gather(self, name: str) -> tuple[dict[int, dict], list[int]]:
        """Every rank's record `name` (rank -> record) and the ranks that never wrote one."""
        records = {r: self.read(f"{name}/{r}", extra=0.0 if r == self.rank else _REPORT_S)
                   for r in range(self.world)}
        return {r: v for r, v in records.items() if v is not None}, [
            r for r, v in records.items() if v is None]

    def barrier(self) -> None:
        """All ranks present, or a timeout naming those that are not."""
        try:
            self.dist.monitored_barrier(group=_group, timeout=timedelta(seconds=self.remaining()),
                                        wait_all_ranks=True)
            return
        except RuntimeError as e:
            reason = str(e).splitlines()[0]
            if self.rank == 0:
                self.publish("abort", {"error": reason})
            else:
                told = self.read("abort", extra=_MARGIN_S)
                reason = told["error"] if told else f"rank 0 did not answer ({reason})"
            raise self.timeout(f"not every rank arrived: {reason}", stage="barrier") from e

    def timeout(self, message: str, *, stage: str, rank: int | None = None) -> CheckpointTimeoutError:
        elapsed = time.monotonic() - self.started
        err = CheckpointTimeoutError(f"coordinated {self.what} of {self.path} (rank {self.rank} of "
                                     f"{self.world}): {message}", stage=stage, elapsed_s=elapsed,
                                     rank=rank)
        err.add_note("The last committed checkpoint is untouched. A rank that stalls or died must "
                     "be restarted; raise timeout_s if the ranks are merely slow.")
        return err


def _outcome(fn) -> tuple[dict, BaseException | None]:
    try:
        return {"ok": True, **(fn() or {})}, None
    except (CheckpointError, OSError, XlakitError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}, e


def save(obj: Any, path: Path, opts: SaveOptions) -> None:
    """`xlakit.save` with layout 'replicated' or 'sharded' (see the module docstring)."""
    rnd = _Round("save", path, opts.timeout_s)
    rnd.barrier()
    if opts.layout == "replicated":
        return _save_replicated(obj, path, opts, rnd)
    return _save_sharded(obj, path, opts, rnd)


def _save_replicated(obj: Any, path: Path, opts: SaveOptions, rnd: _Round) -> None:
    writer = opts.writer_rank
    if not 0 <= writer < rnd.world:
        raise ValueError(f"writer_rank={writer} is not a rank of this job (0..{rnd.world - 1})")
    if rnd.rank == writer:
        outcome, error = _outcome(lambda: checkpoint.save_file(obj, path, opts, started=rnd.started))
        rnd.publish("outcome", outcome)
        if error is not None:
            raise error
        return
    outcome = rnd.read("outcome")
    if outcome is None:
        raise rnd.timeout(f"the writer, rank {writer}, did not report within the deadline (it "
                          f"stalled or died)", stage="write", rank=writer)
    if not outcome["ok"]:
        raise CheckpointPeerError(f"rank {writer} failed to save {path}: {outcome['error']}",
                                  rank=writer)


def _shard_name(rank: int, world: int, save_id: str) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.{save_id}.pt"


def _save_sharded(obj: Any, folder: Path, opts: SaveOptions, rnd: _Round) -> None:
    if rnd.rank == 0:
        started, error = _outcome(lambda: folder.mkdir(exist_ok=True))
        rnd.publish("id", {**started, "id": f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"})
        if error is not None:
            raise atomic.write_error(error, folder, stage="mkdir") from error
    told = rnd.read("id")
    if told is None:
        raise rnd.timeout("rank 0 did not start the save", stage="start", rank=0)
    if not told["ok"]:
        raise CheckpointPeerError(f"rank 0 could not create {folder}: {told['error']}", rank=0)
    shard = folder / _shard_name(rnd.rank, rnd.world, told["id"])

    def write_shard() -> dict:
        checkpoint.save_file(obj, shard, opts, started=rnd.started)
        return {"file": shard.name, "bytes": shard.stat().st_size, "checksums": _shard_digest(shard)}

    outcome, error = _outcome(write_shard)
    rnd.publish(f"shard/{rnd.rank}", outcome)
    if rnd.rank == 0:
        final = _commit_or_explain(folder, told["id"], rnd)
        rnd.publish("final", final)
    else:
        final = rnd.read("final")
        if final is None:
            raise rnd.timeout("rank 0 did not report whether the checkpoint committed (it stalled "
                              "or died)", stage="commit", rank=0)
    if error is not None:
        raise error
    if not final["ok"]:
        culprits = final.get("ranks") or []
        if final.get("timeout"):
            raise rnd.timeout(final["error"], stage="commit", rank=culprits[0] if culprits else None)
        raise CheckpointPeerError(final["error"], rank=culprits[0] if culprits else None)


def _shard_digest(shard: Path) -> str:
    """xxh3 of a shard's checksum record: it covers the digest of every byte of the shard."""
    meta, _ = _archive.read_checksums(str(shard))
    return _archive.digest(json.dumps(meta, sort_keys=True).encode())


def _commit_or_explain(folder: Path, save_id: str, rnd: _Round) -> dict:
    records, missing = rnd.gather("shard")
    if missing:
        return {"ok": False, "timeout": True, "ranks": missing,
                "error": f"rank(s) {missing} did not report their shard within the deadline (stalled "
                         f"or died); nothing was committed"}
    failed = {r: v["error"] for r, v in records.items() if not v["ok"]}
    if failed:
        lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        return {"ok": False, "ranks": sorted(failed), "error": f"shard(s) failed, nothing was "
                                                               f"committed: {lines}"}
    commit = {"format": SHARDED_FORMAT, "version": 1, "id": save_id, "world": rnd.world,
              "shards": [{"rank": r, **{k: records[r][k] for k in ("file", "bytes", "checksums")}}
                         for r in range(rnd.world)]}
    _write_commit(folder, commit)
    _remove_uncommitted(folder, {s["file"] for s in commit["shards"]})
    return {"ok": True}


def _write_commit(folder: Path, commit: dict) -> None:
    final = folder / COMMIT_RECORD
    tmp = atomic.temp_path(final)
    with open(tmp, "x") as f:
        json.dump(commit, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    atomic.commit(tmp, final)


def _remove_uncommitted(folder: Path, keep: set[str]) -> None:
    for p in folder.glob("shard-*.pt"):
        if p.name not in keep:
            p.unlink(missing_ok=True)


def read_commit(folder: Path) -> dict:
    """The commit record of a sharded checkpoint; refuses a folder that has none."""
    record = folder / COMMIT_RECORD
    if not record.is_file():
        err = CheckpointIncompleteError(f"{folder} has no commit record ({COMMIT_RECORD}): the "
                                        f"sharded save that wrote it never finished, so its shards "
                                        f"are not a checkpoint")
        err.add_note("Load the previous checkpoint; the next save into this folder removes the "
                     "uncommitted shards.")
        raise err
    try:
        commit = json.loads(record.read_text())
    except ValueError as e:
        raise CheckpointIncompleteError(f"{record} is unreadable ({e})") from e
    if commit.get("format") != SHARDED_FORMAT:
        raise CheckpointFormatError(f"{folder} is a {commit.get('format')!r} checkpoint, not one "
                                    f"written by xlakit.save(layout='sharded'); load it with "
                                    f"xlakit.dcp_load")
    return commit


def load_shard(folder: Path, shard: int, opts: LoadOptions) -> Any:
    """One verified shard of a committed sharded checkpoint, without coordination."""
    commit = read_commit(folder)
    if not 0 <= shard < commit["world"]:
        raise ValueError(f"{folder} has shards 0..{commit['world'] - 1}, not {shard}")
    entry = commit["shards"][shard]
    path = folder / entry["file"]
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        raise CheckpointIncompleteError(f"{folder}: shard {shard} ({entry['file']}) is missing or "
                                        f"not the size the commit record names")
    if opts.verify and _shard_digest(path) != entry["checksums"]:
        raise CheckpointIncompleteError(f"{folder}: shard {shard} ({entry['file']}) is not the one "
                                        f"the commit record names")
    return checkpoint.load_file(path, opts)


def load(path: Path, opts: LoadOptions) -> Any:
    """Every rank loads its part, or every rank raises the same error naming the failed ranks."""
    import torch.distributed as dist

    if path.is_dir() and not (dist.is_available() and dist.is_initialized()):
        raise XlakitError(f"{path} is a sharded checkpoint: inside the job that wrote it each rank "
                          f"loads its own shard; elsewhere pass shard=N to read one")
    rnd = _Round("load", path, opts.timeout_s)
    sharded = path.is_dir()

    def load_mine():
        if sharded:
            world = read_commit(path)["world"]
            if world != rnd.world:
                raise ValueError(f"{path} was saved by {world} ranks and this job has {rnd.world}; "
                                 f"load one shard with shard=N, or save with xlakit's DCP layout "
                                 f"to reshard")
            return load_shard(path, rnd.rank, opts)
        return checkpoint.load_file(path, opts)

    result: list[Any] = []
    outcome, error = _outcome(lambda: result.append(load_mine()))
    rnd.publish(f"loaded/{rnd.rank}", outcome)
    records, missing = rnd.gather("loaded")
    failed = {r: v["error"] for r, v in records.items() if not v["ok"]}
    if error is not None:
        raise error
    if missing:
        raise rnd.timeout(f"rank(s) {missing} did not report loading within the deadline",
                          stage="load", rank=missing[0])
    if failed:
        lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        raise CheckpointPeerError(f"loading {path} failed on other ranks: {lines}",
                                  rank=min(failed))
    return result[0]
