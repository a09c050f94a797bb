"""Replica-parallel saves and broadcast loads of `layout="replicated"` (`replica_parallel=True`).

Every rank holds the same state, so instead of one rank writing it all, each
of the R ranks writes a disjoint share of about 1/R of the bytes
(`replica_plan.py`: split by storages, balanced by size) into a folder, as
`share-RRRRR-of-WWWWW.<id>.pt`, each an ordinary xlakit file. The commit is
the sharded layout's: every rank agrees, writes, fsyncs and hashes its share
and votes; the writing rank (`writer_rank`) writes `xlakit-commit.json`
(format `xlakit-replicated`, folder format version 2) last, atomically, under
the one decision every rank's abort can pre-empt. A rank killed mid-save
leaves the previous commit record, and so the previous checkpoint, in place;
shares no commit names are removed after the next commit.

A load inside the job reads each byte once: every rank reads and verifies the
shares `readers` gives it (its own, when the job has the saving job's world
size; with fewer ranks some read several, with more some read none), then each
share's reader broadcasts its storages to the others over a fresh gloo group
(`Coordination.group`), and every rank rebuilds the whole state. Outside the
job `xlakit.load(folder)` reads every share. Single-file replicated
checkpoints (the layout's format 1) are read as before.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from xlakit.checkpoint.file import loading, pipeline
from xlakit.checkpoint.format import folders
from xlakit.checkpoint.multirank import replica_plan
from xlakit.checkpoint.coordination.agreement import Coordination, dist
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.multirank.ranks import CoordinatedSave, checked_part
from xlakit.checkpoint.store.base import Parts
from xlakit.errors import CheckpointFormatError, CheckpointIncompleteError

REPLICATED_FORMAT = folders.REPLICATED_FORMAT
VERSION = 2  # of the replicated layout: 1 was one archive file, 2 a folder of shares
SHARE_PREFIX = "share-"
PROPOSED_LAYOUT = "replicated/shares"  # a rank saving the old way disagrees, and is named


def shares(writer_rank: int) -> Parts:
    """A replica-parallel checkpoint's parts: a share per rank, committed by `writer_rank`."""
    return Parts("share", "shares", folder_record={"format": REPLICATED_FORMAT, "version": VERSION},
                 object_record={"kind": "replicated", "layout_version": VERSION}, writer_rank=writer_rank,
                 not_a_folder="A replica-parallel save writes a folder; this path holds a single-file "
                              "checkpoint (or another file): save to a new path.")


class ReplicaSave(CoordinatedSave):
    """One rank's share of a replica-parallel save (into a folder, or a bucket's generation)."""

    def __init__(self, obj: Any, path: Path, opts: SaveOptions, **kwargs: Any):
        super().__init__(obj, path, opts, **kwargs)
        self.coord.proposal["layout"] = PROPOSED_LAYOUT
        self.coord.agreed += (replica_plan.AGREED_FIELD,)

    def parts(self) -> Parts:
        return shares(self.opts.writer_rank)

    def _prepare(self, obj: Any) -> pipeline.FileSave:
        self.coord.proposal[replica_plan.AGREED_FIELD] = replica_plan.digest(obj, self.world)
        mine = replica_plan.share(obj, self.rank, self.world, self.opts.writer_rank)
        return pipeline.prepare(mine, self.dest.label(self.rank, self.world), self.opts, check_target=False)


def save(obj: Any, path: Path, opts: SaveOptions, **kwargs: Any):
    """`xlakit.save(..., replica_parallel=True)` on every rank (`kwargs`: `ranks.save`'s `store`)."""
    from xlakit.checkpoint.multirank import ranks

    return ranks.save(obj, path, opts, saver=ReplicaSave, **kwargs)


# -- loading ----------------------------------------------------------------------------------

def is_replicated(record: dict | None) -> bool:
    return record is not None and record.get("format") == REPLICATED_FORMAT


def read_record(folder: Path) -> dict:
    record = folders.read_json_record(folder)
    if record is None:
        raise CheckpointIncompleteError(f"{folder} has no commit record ({folders.COMMIT_RECORD}): the "
                                        f"save that wrote it never finished, so it is not a checkpoint "
                                        f"({folders.describe_folder(folder)})")
    if not is_replicated(record):
        raise CheckpointFormatError(f"{folder} has a commit record of format {record.get('format')!r}, "
                                    f"not {REPLICATED_FORMAT!r}")
    return record


def share_path(folder: Path, record: dict, rank: int, opts: LoadOptions) -> Path:
    """Share `rank`'s file, checked against the commit record (size; digest when verifying)."""
    return checked_part(folder, record["shares"][rank], f"share {rank}", opts)


def assemble(shares: dict[int, dict]) -> Any:
    tensors: dict[int, torch.Tensor] = {}
    skeleton = paths_ = None
    for part in shares.values():
        tensors.update(part[replica_plan.TENSORS])
        if replica_plan.SKELETON in part:
            skeleton, paths_ = part[replica_plan.SKELETON], part[replica_plan.PATHS]
    return replica_plan.assemble(skeleton, paths_, tensors)


def load_all(folder: Path, opts: LoadOptions) -> Any:
    """Outside the job: every share, read and verified here, as the whole state."""
    record = read_record(folder)
    return assemble({r: loading.load_file(share_path(folder, record, r, opts), opts)
                      for r in range(record["world"])})


def readers(shares: int, world: int) -> dict[int, int]:
    """The rank of a job of `world` ranks that reads each of `shares` shares: share s is read by rank
    s % world. The saving job's world size does not matter: with fewer ranks some read several
    shares, with more some read none; every share is read once, by someone."""
    return {s: s % world for s in range(shares)}


def load(folder: Path, opts: LoadOptions) -> Any:
    """Inside the job: each share is read once (by `readers`); its reader broadcasts it; all get the state."""
    coord = Coordination("load", {"path": os.path.abspath(folder), "layout": PROPOSED_LAYOUT})
    op = Operation("load", folder, Watch.of(opts), gate=coord.gate, rank=coord.rank,
                   untouched=loading.NOTHING_CHANGED)
    coord.op = op

    def part() -> tuple[tuple, dict]:
        record = read_record(folder)
        return (record["id"], record["world"]), {
            s: loading.read_file(op, share_path(folder, record, s, opts), opts)
            for s, reader in readers(record["world"], coord.world).items() if reader == coord.rank}

    def work(op: Operation) -> Any:
        coord.agree(op)
        return broadcast_all(coord, op, *coord.all_or_none(op, part))

    try:
        return op.run(work)
    finally:
        coord.close()


def restore(folder: Path, template: Any, opts: LoadOptions, load_whole: Any = None) -> Any:
    """`xlakit.restore` of a replica-parallel checkpoint: loaded whole (in the job, each share read
    once and broadcast), then copied into the template as a plain file's state is; one deadline."""
    from xlakit.checkpoint.file import restoring
    from xlakit.checkpoint.coordination.agreement import world_size
    from xlakit.checkpoint.file.matching import match

    start = time.monotonic()
    if load_whole is None:
        load_whole = load if world_size() > 1 else load_all
    saved = load_whole(folder, opts)
    left = dataclasses.replace(opts, timeout_s=max(opts.timeout_s - (time.monotonic() - start), 1e-3))
    op = Operation("restore", folder, Watch.of(left), untouched=restoring.PARTLY)

    def work(op: Operation) -> Any:
        targets, restored = match(saved, template, folder, opts, None)
        op.enter("copy")
        restoring.apply_pairs(op, [(t, t.source) for t in targets])
        return restored

    return op.run(work)


def broadcast_all(coord: Coordination, op: Operation, of: tuple, mine: dict[int, dict]) -> Any:
    """(Every rank, the shares it reads read and verified, every rank agreed.) The whole state, each
    share broadcast by its reader (`readers`) over a fresh gloo group; then every rank votes it has it.
    `of` is (the commit's id or generation, its share count) as this rank read it: every rank must
    have read the same commit (a save that committed between their reads is refused, on every rank)."""
    with coord.giving_up(op, waiting=lambda e: op.stage == "broadcast"):
        group = coord.group(op)
        op.enter("broadcast")
        seen = [None] * coord.world
        dist().all_gather_object(seen, list(of), group=group)
        if any(s != seen[0] for s in seen):
            raise CheckpointIncompleteError(
                f"the ranks read different commits of {op.path} (commit id or generation and share count, "
                f"by rank: {seen}), expected one: a save committed there while this load ran; load again "
                f"once no save is writing to it")
        shares = {}
        for s, reader in readers(of[1], coord.world).items():
            shares[s] = broadcast_share(mine[s] if reader == coord.rank else None, reader, group)
        state = assemble(shares)
    coord.vote({}, "read")
    coord.votes(op, "read")
    return state


def broadcast_share(part: dict | None, owner: int, group) -> dict:
    """`owner`'s share on every rank: its layout as a small object, then each storage's bytes."""
    d = dist()
    if part is not None:
        storages: list[torch.UntypedStorage] = []
        index: dict[int, int] = {}
        specs = {}
        for slot, t in part[replica_plan.TENSORS].items():
            s = t.untyped_storage()
            if s._cdata not in index:
                index[s._cdata] = len(storages)
                storages.append(s)
            specs[slot] = (index[s._cdata], t.storage_offset(), tuple(t.shape), t.stride(),
                           str(t.dtype).removeprefix("torch."), t.requires_grad)
        layout = {"sizes": [s.nbytes() for s in storages], "specs": specs,
                  "rest": {k: v for k, v in part.items() if k != replica_plan.TENSORS}}
    else:
        storages, layout = [], None
    box = [layout]
    d.broadcast_object_list(box, src=owner, group=group)
    layout = box[0]
    if part is None:
        storages = [torch.UntypedStorage(n) for n in layout["sizes"]]
    for s in storages:
        if s.nbytes():
            d.broadcast(torch.empty(0, dtype=torch.uint8).set_(s), src=owner, group=group)
    if part is not None:
        return part
    tensors = {}
    for slot, (i, offset, shape, stride, dtype, grad) in layout["specs"].items():
        t = torch.empty(0, dtype=getattr(torch, dtype)).set_(storages[i], offset, shape, stride)
        tensors[slot] = t.requires_grad_() if grad else t
    return {replica_plan.TENSORS: tensors, **layout["rest"]}

