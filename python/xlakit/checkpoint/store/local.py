"""A checkpoint on a local (or shared) file system: a file committed by its rename, or a folder of
parts committed by the rename of its commit record.

* `LocalFile` (layouts single and replicated): the one part is written into a temporary sibling
  (`paths.temp_path`: named with its host and pid, so a dead process's is recognised), fsynced,
  and renamed over the final name at the operation's commit point; then the folder is fsynced.
* `LocalFolder` (sharded, and replicated saved replica-parallel): the committing rank makes the
  folder and proposes the save's id; each rank writes its part
  `<name>-RRRRR-of-WWWWW.<id>.pt` the same way and renames it to that name (not the commit: it
  stops once the operation is cancelled), then votes its name, size and the xxh3-64 of its index
  (which covers the digest of every record). The committing rank writes `xlakit-commit.json`
  last, atomically, at the commit point; parts of earlier saves that it does not name go after.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

from xlakit.checkpoint.core import paths
from xlakit.checkpoint.core.operation import remove_path
from xlakit.checkpoint.format import archive, folders
from xlakit.checkpoint.store.base import FILE, Destination, Parts

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation


def commit_file(op: "Operation", tmp: Path, final: Path) -> None:
    """The point of no return of a file save: rename, if the save is still wanted; fsync the folder."""
    with op.commit_point():
        os.replace(tmp, final)
        op.disown(tmp)
    paths.fsync_dir(final.parent)


def _rename_shard(op: "Operation", tmp: Path, final: Path) -> None:
    """A part's rename is not the commit (the commit record is), but it too stops once cancelled."""
    with op.guarded():
        os.replace(tmp, final)
        op.disown(tmp)
    op.own(final, pending=True)  # removed once this save is surely off; the next commit otherwise


def shard_digest(shard: Path) -> str:
    """xxh3 of a part's index: it covers the digest of every byte of the part."""
    meta, _ = archive.read_index(str(shard))
    return index_digest(meta)


def index_digest(index: dict) -> str:
    """xxh3 of an index as parsed (`shard_digest` of the file it was read from)."""
    return archive.digest(json.dumps(index, sort_keys=True).encode())


class LocalPart:
    """A part written into its temporary sibling; `finish` fsyncs it (and, in a folder, renames it)."""

    def __init__(self, op: "Operation", final: Path, *, in_folder: bool):
        self.op, self.final, self.in_folder = op, final, in_folder
        self.tmp = op.own(paths.temp_path(final))
        op.enter("open")
        self.f = open(self.tmp, "xb")

    @property
    def name(self) -> str:
        """The temporary file's name, as the file object's."""
        return self.f.name

    def write(self, data) -> int:
        return self.f.write(data)

    def finish(self) -> dict:
        self.op.enter("commit")
        with self.f:
            self.f.flush()
            os.fsync(self.f.fileno())
        if not self.in_folder:
            return {}  # the file itself is the checkpoint: its rename is the commit
        _rename_shard(self.op, self.tmp, self.final)
        return {"file": self.final.name, "bytes": self.final.stat().st_size, "checksums": shard_digest(self.final)}

    def abort(self) -> None:
        self.f.close()  # the temporary is the operation's to remove


class _Local(Destination):
    target: Path

    def writing(self, op: "Operation"):
        return paths.writing(self.target, op)


class LocalFile(_Local):
    """A checkpoint file, committed by the rename of its temporary sibling."""

    def __init__(self, final: Path):
        self.target = Path(final)
        self.identity = os.path.abspath(final)
        self._part: LocalPart | None = None

    def check_target(self) -> None:
        paths.check_target(self.target)

    def label(self, rank: int, world: int) -> Path:
        return self.target

    def tidy(self, op: "Operation", committer: bool) -> None:
        if committer:  # the writing rank
            paths.remove_stale_temps(self.target.parent, stem=self.target.name)

    def open_part(self, op: "Operation", rank: int, world: int) -> LocalPart:
        self._part = LocalPart(op, self.target, in_folder=False)
        return self._part

    def commit(self, op: "Operation", votes: dict[int, dict]) -> None:
        op.enter("commit")
        commit_file(op, self._part.tmp, self.target)


class LocalFolder(_Local):
    """A folder of parts, one per rank, committed by the rename of its commit record."""

    def __init__(self, folder: Path, parts: Parts):
        self.target, self.parts = Path(folder), parts
        self.identity = os.path.abspath(folder)
        self.id = ""
        self.record: dict | None = None
        self.writing_to: Path | None = None  # what this rank writes now: its part, then the commit record
        self._part_name = re.compile(rf"{re.escape(parts.name)}-\d{{5}}-of-\d{{5}}\.\d{{8}}T\d{{6}}-[0-9a-f]{{6}}\.pt")

    def part_path(self, rank: int, world: int) -> Path:
        return self.target / f"{self.parts.name}-{rank:05d}-of-{world:05d}.{self.id}.pt"

    def label(self, rank: int, world: int) -> Path:
        return self.part_path(rank, world) if self.id else self.target / f"{self.parts.name}.pt"

    def propose(self, op: "Operation") -> dict:
        folder = self.target
        if folder.exists() and not folder.is_dir():
            err = paths.write_error(FileExistsError(17, "File exists"), folder, stage="mkdir")
            if self.parts.not_a_folder:
                err.add_note(self.parts.not_a_folder)
            raise err
        try:
            folder.mkdir(exist_ok=True)
        except OSError as e:
            raise paths.write_error(e, folder, stage="mkdir") from e
        return {"id": f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"}

    def adopt(self, proposal: dict) -> None:
        self.id = proposal["id"]

    def tidy(self, op: "Operation", committer: bool) -> None:
        paths.remove_stale_temps(self.target, stem_prefix=f"{self.parts.name}-")
        paths.remove_stale_temps(self.target, stem=folders.COMMIT_RECORD)

    def open_part(self, op: "Operation", rank: int, world: int) -> LocalPart:
        self.writing_to = self.part_path(rank, world)
        return LocalPart(op, self.writing_to, in_folder=True)

    def writing(self, op: "Operation"):
        """A write error names the part being written, so its folder is the one diagnosed (a
        folder this rank cannot see, or cannot write)."""
        return paths.writing(lambda: self.writing_to or self.target, op)

    def commit(self, op: "Operation", votes: dict[int, dict]) -> None:
        """The commit record, written durably, then renamed into place at the commit point."""
        parts, world = self.parts, len(votes)
        writer = {} if parts.writer_rank is None else {"writer_rank": parts.writer_rank}
        self.record = {**parts.folder_record, "id": self.id, "world": world, **writer,
                       parts.listed_as: [{"rank": r, **{k: votes[r][k] for k in ("file", "bytes", "checksums")}}
                                         for r in range(world)]}
        final = self.writing_to = self.target / folders.COMMIT_RECORD
        tmp = op.own(paths.temp_path(final))
        with open(tmp, "x") as f:
            json.dump(self.record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        op.enter("commit")
        commit_file(op, tmp, final)

    def after_commit(self, op: "Operation") -> None:
        """Parts of earlier saves the new record does not name: committed and agreed, they can go."""
        keep = {s["file"] for s in self.record[self.parts.listed_as]}
        for name in os.listdir(self.target):
            if self._part_name.fullmatch(name) and name not in keep:
                remove_path(self.target / name)


def destination(path: Path, parts: Parts = FILE) -> LocalFile | LocalFolder:
    """Where a checkpoint of `parts` at `path` is written on a file system."""
    return LocalFile(path) if not parts.name else LocalFolder(path, parts)
