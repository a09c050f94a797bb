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
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from xlakit.checkpoint.core import paths, workers
from xlakit.checkpoint.file import background, loading, pipeline
from xlakit.checkpoint.format import archive, folders
from xlakit.checkpoint.multirank.agreement import Coordination
from xlakit.checkpoint.core.operation import Operation, Watch, remove_path
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.errors import CheckpointError, CheckpointIncompleteError, CheckpointPeerError, RuntimeFeatureError

SHARD_PREFIX = "shard-"
_SHARD_NAME = re.compile(r"shard-\d{5}-of-\d{5}\.\d{8}T\d{6}-[0-9a-f]{6}\.pt")


def _shard_name(rank: int, world: int, save_id: str) -> str:
    return f"{SHARD_PREFIX}{rank:05d}-of-{world:05d}.{save_id}.pt"


def shard_digest(shard: Path) -> str:
    """xxh3 of a shard's index: it covers the digest of every byte of the shard."""
    meta, _ = archive.read_index(str(shard))
    return archive.digest(json.dumps(meta, sort_keys=True).encode())


class CoordinatedSave:
    """One rank's part of a replicated or sharded save."""

    def __init__(self, obj: Any, path: Path, opts: SaveOptions):
        self.opts, self.target = opts, path
        replicated = opts.layout == "replicated"
        self.coord = Coordination("save", {
            "path": self.identity(path), "layout": opts.layout, "asynchronous": opts.asynchronous,
            "writer_rank": opts.writer_rank if replicated else None},
            committer=opts.writer_rank if replicated else 0)
        self.rank, self.world = self.coord.rank, self.coord.world
        self.prepared: dict = {}
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

    @staticmethod
    def identity(path: Path) -> str:
        """What every rank must name alike (object storage: the URL, bucket_ranks.py)."""
        return os.path.abspath(path)

    def _prepare(self, obj: Any) -> pipeline.FileSave | None:
        if self.opts.layout == "replicated":
            if self.rank != self.opts.writer_rank:
                return None
            return pipeline.prepare(obj, self.target, self.opts)
        folder = self.target
        if self.rank == 0:
            if folder.exists() and not folder.is_dir():
                raise paths.write_error(FileExistsError(17, "File exists"), folder, stage="mkdir")
            try:
                folder.mkdir(exist_ok=True)
            except OSError as e:
                raise paths.write_error(e, folder, stage="mkdir") from e
            self.prepared["id"] = f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
        # The shard's name is known once rank 0's id is: planned here, named after agreeing.
        return pipeline.prepare(obj, folder / "shard.pt", self.opts, check_target=False)

    def operation(self, kind: str) -> Operation:
        nbytes = self.job.plan.nbytes if self.job else 0
        op = Operation(kind, self.target, Watch.of(self.opts), bytes_total=nbytes, gate=self.coord.gate,
                       rank=self.rank)
        self.coord.op = op
        return op

    # -- phases ---------------------------------------------------------------------------------
    def agree(self, op: Operation) -> None:
        """Every rank the same operation, or nothing is touched; then name this rank's file."""
        self.coord.agree(op, self.prepared, self.error)
        if self.opts.layout == "sharded":
            save_id = self.coord.proposals[0]["id"]
            self.job.final = self.target / _shard_name(self.rank, self.world, save_id)

    def stage(self, op: Operation) -> Any:
        """Phase one of an asynchronous save (the caller's thread): agree, copy to the host."""
        with self.coord.giving_up(op):
            self.agree(op)
            return background.stage(op, self.job) if self.job else []

    def write(self, op: Operation, items: Any) -> None:
        """Write this rank's part, vote, and commit (or learn the outcome)."""
        self.coord.op = op
        with self.coord.giving_up(op):
            if self.opts.layout == "replicated":
                self._write_replicated(op, items)
            else:
                self._write_sharded(op, items)

    def run(self, op: Operation) -> None:
        """The synchronous save: agree, then transfer and write on the fly."""
        with self.coord.giving_up(op):
            self.agree(op)
        self.write(op, pipeline.device_batches(op, self.job.plan, self.opts) if self.job else [])

    # -- replicated -----------------------------------------------------------------------------
    def _write_replicated(self, op: Operation, items: Any) -> None:
        writer = self.opts.writer_rank
        if self.rank != writer:
            self.coord.vote({})
            self._expect_commit(op, writer)
            return
        self.coord.vote({})

        def commit(op: Operation, tmp: Path, final: Path) -> None:
            self.coord.votes(op)  # every rank still wants it
            op.enter("commit")
            pipeline.commit_file(op, tmp, final)

        pipeline.write(op, self.job, items, commit=commit)
        self.coord.finish({"ok": True})

    # -- sharded --------------------------------------------------------------------------------
    def _write_sharded(self, op: Operation, items: Any) -> None:
        folder = self.target
        paths.remove_stale_temps(folder, stem_prefix=SHARD_PREFIX)
        paths.remove_stale_temps(folder, stem=folders.COMMIT_RECORD)
        pipeline.write(op, self.job, items, commit=_rename_shard)
        shard = self.job.final
        self.coord.vote({"file": shard.name, "bytes": shard.stat().st_size,
                         "checksums": shard_digest(shard)})
        if self.rank != 0:
            self._expect_commit(op, 0)
            return
        votes = self.coord.votes(op)
        record = {"format": folders.SHARDED_FORMAT, "version": 1,
                  "id": self.coord.proposals[0]["id"], "world": self.world,
                  "shards": [{"rank": r, **{k: votes[r][k] for k in ("file", "bytes", "checksums")}}
                             for r in range(self.world)]}
        self.commit_record(op, folder, record, "shards", _SHARD_NAME)

    def commit_record(self, op: Operation, folder: Path, record: dict, parts: str, part_name: re.Pattern) -> None:
        """The committing rank's last step: `record` written durably and committed as the folder's
        commit record, the other ranks told, then the parts of earlier saves (names `part_name`
        matches that `record[parts]` does not name) removed: committed and agreed, they can go."""
        final = folder / folders.COMMIT_RECORD
        tmp = op.own(paths.temp_path(final))
        with open(tmp, "x") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        op.enter("commit")
        pipeline.commit_file(op, tmp, final)
        self.coord.finish({"ok": True})
        keep = {s["file"] for s in record[parts]}
        for name in os.listdir(folder):
            if part_name.fullmatch(name) and name not in keep:
                remove_path(folder / name)

    def _expect_commit(self, op: Operation, committer: int) -> None:
        final = self.coord.outcome(op)
        if not final.get("ok"):
            raise CheckpointPeerError(f"rank {committer} could not commit {self.target}: "
                                      f"{final.get('error')}", rank=committer)


def _rename_shard(op: Operation, tmp: Path, final: Path) -> None:
    """A shard's rename is not the commit (the commit record is), but it too stops once cancelled."""
    with op.guarded():
        os.replace(tmp, final)
        op.disown(tmp)
    op.own(final, pending=True)  # removed once this save is surely off; the next commit otherwise


def save(obj: Any, path: Path, opts: SaveOptions, *,
         saver: type[CoordinatedSave] = CoordinatedSave) -> background.SaveHandle | None:
    """`xlakit.save` with layout 'replicated' or 'sharded' (see the module docstring); `saver`
    is this rank's part (object storage: `bucket_ranks.py`)."""
    save_ = saver(obj, path, opts)
    if opts.asynchronous:
        job = save_.job or pipeline.FileSave(path, opts, _empty_plan(), b"", b"")
        return background.start(job, save_.stage, save_.write, gate=save_.coord.gate, rank=save_.rank)
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


def shard_path(folder: Path, record: dict, shard: int, opts: LoadOptions) -> Path:
    if not 0 <= shard < record["world"]:
        raise ValueError(f"{folder} has shards 0..{record['world'] - 1}, not {shard}")
    return checked_part(folder, record["shards"][shard], f"shard {shard}", opts)


def checked_part(folder: Path, entry: dict, what: str, opts: LoadOptions) -> Path:
    """A part of a folder checkpoint (a shard, a share), checked against its commit record's entry:
    present at the size it names, and with the checksums it names when verifying."""
    path = folder / entry["file"]
    if not path.is_file() or path.stat().st_size != entry["bytes"]:
        raise CheckpointIncompleteError(f"{folder}: {what} ({entry['file']}) is missing or not the size "
                                        f"the commit record names ({entry['bytes']} bytes)")
    if opts.verify and shard_digest(path) != entry["checksums"]:
        raise CheckpointIncompleteError(f"{folder}: {what} ({entry['file']}) is not the one the commit "
                                        f"record names")
    return path


def load_shard(folder: Path, shard: int, opts: LoadOptions) -> Any:
    """One verified shard of a committed sharded checkpoint, without coordination."""
    return loading.load_file(shard_path(folder, read_commit(folder), shard, opts), opts)


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
            return loading.read_file(op, shard_path(path, record, coord.rank, opts), opts)
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
