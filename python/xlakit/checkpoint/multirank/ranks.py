"""Saves and loads coordinated across the ranks of a torch.distributed job.

Layouts: *replicated* (every rank passes the same state; `writer_rank` writes
the file, every rank learns the outcome) and *sharded* (each rank writes
`shard-RRRRR-of-WWWWW.<id>.pt` in a folder; rank 0 writes the commit record
`xlakit-commit.json` last, atomically, once every shard is durable). A folder
without a commit record naming its shards is never loaded; shards no commit
names, and temporaries of dead processes under any shard name, are removed
by the next committed save.

Each save runs as one operation per rank under `agreement.Coordination`:
agree (same path, layout, world and options everywhere, else nothing is
touched), write this rank's part, vote ready, and only then the one commit,
claimed against every rank's abort. Asynchronous saves agree and stage on the
caller's thread and write, vote and commit in the background.

The flow is written once, over a destination (`store/`): a local file or folder
(`store/local.py`, the default) or a bucket (`store/bucket.py`, for a URL:
`bucket_ranks.py`), which names the parts and makes the commit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xlakit.checkpoint.core import workers
from xlakit.checkpoint.file import background, loading, pipeline
from xlakit.checkpoint.format import folders
from xlakit.checkpoint.coordination.agreement import Coordination
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.store import local
from xlakit.checkpoint.store.base import FILE, Destination, Parts
from xlakit.checkpoint.store.local import index_digest
from xlakit.errors import CheckpointError, CheckpointIncompleteError, RuntimeFeatureError

SHARD_PREFIX = "shard-"
SHARDS = Parts("shard", "shards", folder_record={"format": folders.SHARDED_FORMAT, "version": 1},
               object_record={"kind": "sharded"})
Store = Callable[[Any, Parts], Destination]  # a path and the parts -> where they are written


class CoordinatedSave:
    """One rank's part of a replicated or sharded save, into the destination `store` gives."""

    def __init__(self, obj: Any, path: Path, opts: SaveOptions, *, store: Store = local.destination):
        self.opts, self.target = opts, path
        replicated = opts.layout == "replicated"
        self.committer = opts.writer_rank if replicated else 0
        self.dest = store(path, self.parts())
        self.coord = Coordination("save", {
            "path": self.dest.identity, "layout": opts.layout, "asynchronous": opts.asynchronous,
            "writer_rank": opts.writer_rank if replicated else None},
            committer=self.committer)
        self.rank, self.world = self.coord.rank, self.coord.world
        self.error: BaseException | None = None
        self.job: pipeline.FileSave | None = None
        try:
            workers.check_idle()
            if opts.layout == "replicated" and opts.writer_rank >= self.world:
                raise ValueError(f"writer_rank={opts.writer_rank} is not a rank of this job "
                                 f"(0..{self.world - 1})")
            self.job = self._prepare(obj)
        except (CheckpointError, RuntimeFeatureError, OSError, ValueError, TypeError) as e:
            self.error = e  # published with the proposal, so every rank learns it at once

    def parts(self) -> Parts:
        """What this layout's parts are: the one file (replicated) or a shard per rank."""
        return FILE if self.opts.layout == "replicated" else SHARDS

    def _prepare(self, obj: Any) -> pipeline.FileSave | None:
        if self.opts.layout == "replicated" and self.rank != self.opts.writer_rank:
            return None
        if self.rank == self.committer:
            self.dest.check_target()
        # A part's name is known once the committing rank's proposal is: planned here, named after agreeing.
        return pipeline.prepare(obj, self.dest.label(self.rank, self.world), self.opts, check_target=False)

    def operation(self, kind: str) -> Operation:
        nbytes = self.job.plan.nbytes if self.job else 0
        op = Operation(kind, self.target, Watch.of(self.opts), bytes_total=nbytes, gate=self.coord.gate,
                       rank=self.rank)
        self.coord.op = op
        return op

    # -- phases ---------------------------------------------------------------------------------
    def agree(self, op: Operation) -> None:
        """Every rank the same operation, or nothing is touched; then name this rank's part."""
        prepared, error = {}, self.error
        if error is None and self.rank == self.committer:
            try:
                prepared = self.dest.propose(op)  # a folder made and a save id; a generation and a token
            except (CheckpointError, OSError, ValueError) as e:
                error = e
        self.coord.agree(op, prepared, error)
        self.dest.adopt(self.coord.proposals[self.committer])
        if self.job is not None:
            self.job.final = self.dest.label(self.rank, self.world)

    def stage(self, op: Operation) -> Any:
        """Phase one of an asynchronous save (the caller's thread): agree, copy to the host."""
        with self.coord.giving_up(op):
            self.agree(op)
            return background.stage(op, self.job) if self.job else []

    def write(self, op: Operation, items: Any) -> None:
        """Write this rank's part, vote, and commit (or learn the outcome)."""
        self.coord.op = op
        with self.coord.giving_up(op):
            if self.parts().name:
                self._write_parts(op, items)
            else:
                self._write_one(op, items)

    def run(self, op: Operation) -> None:
        """The synchronous save: agree, then transfer and write on the fly."""
        with self.coord.giving_up(op):
            self.agree(op)
        self.write(op, pipeline.device_batches(op, self.job.plan, self.opts) if self.job else [])

    def _write_one(self, op: Operation, items: Any) -> None:
        """One file, written by the committing rank (`writer_rank`) once every rank is ready."""
        dest, committing = self.dest, self.rank == self.committer
        dest.tidy(op, committing)
        self.coord.vote({})
        if not committing:
            self.coord.expect_commit(op, self.target)
            return
        with dest.writing(op):
            entry = pipeline.write_part(op, self.job, items, dest, self.rank, self.world)
            self.coord.votes(op)  # every rank still wants it
            dest.commit(op, {self.rank: entry})
        self.coord.finish({"ok": True})
        dest.after_commit(op)

    def _write_parts(self, op: Operation, items: Any) -> None:
        """Every rank writes its part and votes its entry; the committing rank commits them all."""
        dest, committing = self.dest, self.rank == self.committer
        dest.tidy(op, committing)
        with dest.writing(op):
            entry = pipeline.write_part(op, self.job, items, dest, self.rank, self.world)
        self.coord.vote(entry)
        if not committing:
            self.coord.expect_commit(op, self.target)
            return
        with dest.writing(op):  # the commit record's write errors as xlakit's, as the parts'
            dest.commit(op, self.coord.votes(op))
        self.coord.finish({"ok": True})
        dest.after_commit(op)


def save(obj: Any, path: Path, opts: SaveOptions, *, saver: type[CoordinatedSave] = CoordinatedSave,
         store: Store = local.destination) -> background.SaveHandle | None:
    """`xlakit.save` with layout 'replicated' or 'sharded' (see the module docstring); `saver`
    is this rank's part (replica-parallel: `replicas.py`), `store` where it goes (a bucket:
    `store.bucket.destination`)."""
    save_ = saver(obj, path, opts, store=store)
    if opts.asynchronous:
        job = save_.job or pipeline.FileSave(path, opts, _empty_plan(), b"", b"")
        return background.start(job, save_.stage, save_.write, gate=save_.coord.gate, rank=save_.rank, path=path)
    op = save_.operation("save")
    op.run(save_.run)
    return None


def _empty_plan():
    from xlakit.checkpoint.format.state import Plan

    return Plan({}, [])


# -- loading ----------------------------------------------------------------------------------

def read_commit(folder: Path) -> dict:
    """The commit record of a sharded checkpoint; refuses a folder that has none."""
    record = folders.read_json_record(folder)
    if record is None:
        err = CheckpointIncompleteError(f"{folder} has no commit record ({folders.COMMIT_RECORD}): "
                                        f"the sharded save that wrote it never finished, so it is "
                                        f"not a checkpoint ({folders.describe_folder(folder)})")
        err.add_note("Load the previous checkpoint; the next save into this folder removes the "
                     "uncommitted shards.")
        raise err
    if record.get("format") != folders.SHARDED_FORMAT:
        raise loading_format_error(folder, record)
    return record


def loading_format_error(folder: Path, record: dict) -> Exception:
    from xlakit.errors import CheckpointFormatError

    if record.get("format") == folders.DCP_FORMAT:
        return CheckpointFormatError(f"{folder} is a torch.distributed.checkpoint folder written by "
                                     f"xlakit.dcp_save; load it with xlakit.dcp_load(state, path)")
    return CheckpointFormatError(f"{folder} has a commit record of format {record.get('format')!r}, "
                                 f"not {folders.SHARDED_FORMAT!r}; it is not a checkpoint xlakit.load reads")


def shard_path(folder: Path, record: dict, shard: int) -> tuple[Path, loading.CheckIndex]:
    if not 0 <= shard < record["world"]:
        raise ValueError(f"{folder} has shards 0..{record['world'] - 1}, not {shard}")
    return checked_part(folder, record["shards"][shard], f"shard {shard}")


def checked_part(folder: Path, entry: dict, what: str) -> tuple[Path, loading.CheckIndex]:
    """A part of a folder checkpoint (a shard, a share), checked against its commit record's entry:
    present at the size it names; and the check, for a verifying load, that it holds the checksums the
    entry names (run on the index the load reads, so that no byte is read twice)."""
    path = folder / entry["file"]
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        raise CheckpointIncompleteError(f"{folder}: {what} ({entry['file']}) is missing or not the size "
                                        f"the commit record names ({entry['bytes']} bytes)")

    def check_index(index: dict) -> None:
        if index_digest(index) != entry["checksums"]:
            raise CheckpointIncompleteError(f"{folder}: {what} ({entry['file']}) is not the one the commit "
                                            f"record names")

    return path, check_index


def load_shard(folder: Path, shard: int, opts: LoadOptions) -> Any:
    """One verified shard of a committed sharded checkpoint, without coordination."""
    path, check_index = shard_path(folder, read_commit(folder), shard)
    return loading.load_file(path, opts, check_index)


def load(path: Path, opts: LoadOptions) -> Any:
    """Every rank loads its part, or every rank raises the same error naming the failed ranks."""
    sharded = path.is_dir()
    coord = Coordination("load", {"path": os.path.abspath(path),
                                  "layout": "sharded" if sharded else "replicated"})
    op = Operation("load", path, Watch.of(opts), gate=coord.gate, rank=coord.rank,
                   untouched=loading.NOTHING_CHANGED)
    coord.op = op

    def part() -> Any:
        if sharded:
            record = read_commit(path)
            check_world(path, record["world"], coord.world)
            shard, check_index = shard_path(path, record, coord.rank)
            return loading.read_file(op, shard, opts, check_index)
        return loading.read_file(op, path, opts)

    def work(op: Operation) -> Any:
        coord.agree(op)
        return coord.all_or_none(op, part)

    return op.run(work)


def check_world(where: object, saved: int, world: int) -> None:
    """A sharded checkpoint loads in a job of the world size that saved it."""
    if saved != world:
        raise ValueError(f"{where} was saved by {saved} ranks and this job has {world}; load one shard "
                         f"with shard=N, or save with xlakit.dcp_save to reshard")
