"""Saving one checkpoint file: plan, sync, transfer, write, commit, in that order.

* **plan** (`prepare`, on the caller's thread, before anything is written):
  the state's tensors and storages (`state.plan`), its pickle (refused here
  if `torch.load(weights_only=True)` could not read it back), the target.
* **sync**: one step marker materialises every pending XLA tensor (one graph,
  one compile), per device type (`transfer.backend_for`).
* **transfer**: storages reach the host in batches of at most
  `max_inflight_bytes`; the writer drops each batch before the next is copied.
* **write**: streamed (`archive.ArchiveWriter`: each storage hashed from the
  bytes written) into the checkpoint's part at its destination (`store/`): a
  temporary sibling file, flushed and fsynced; or an object's upload.
* **commit**: the rename over the final name (or, in a bucket, the create-only
  commit record of a new generation), inside the operation's commit point.

All of it but the plan runs in one `Operation`: one deadline, cancelled by any
exception its owner sees; nothing touches the final name before the commit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xlakit.checkpoint.core import paths, workers
from xlakit.checkpoint.file import overlap as overlapped, transfer
from xlakit.checkpoint.format import archive, pickled, state, structure
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.checkpoint.format.state import Plan, StorageEntry
from xlakit.checkpoint.store import local
from xlakit.checkpoint.store.base import Destination

HostItems = Iterable[tuple[list[StorageEntry], list[torch.Tensor]]]


@dataclass
class FileSave:
    """One checkpoint file, planned, pickled and described; nothing written yet."""

    final: Path
    opts: SaveOptions
    plan: Plan
    pickled: bytes  # for torch.load
    structure: bytes  # for xlakit's reader (structure.py)


# -- plan ---------------------------------------------------------------------------------------

def prepare(obj: Any, final: Path, opts: SaveOptions, *, check_target: bool = True) -> FileSave:
    """Everything checked before a byte is written: the target, the state's storages, its pickle."""
    if check_target:
        paths.check_target(final)
    with workers.collection_paused():
        plan = state.plan(obj)
        if any(s.device_type == "xla" for s in plan.storages):
            transfer.check_backend(opts.transfer_backend)
        return FileSave(final, opts, plan, pickled.pickle_state(obj, plan), structure.encode(obj, plan))


# -- sync and transfer --------------------------------------------------------------------------

def stage_groups(storages: list[StorageEntry], opts: SaveOptions
                 ) -> list[tuple[list[StorageEntry], transfer.HostTransfer]]:
    """The storages grouped by device type, each group with its transfer backend."""
    groups = [list(g) for _, g in itertools.groupby(
        sorted(storages, key=lambda e: e.device_type), key=lambda e: e.device_type)]
    return [(g, transfer.backend_for(g[0].device_type, g[0].tensor, mode=opts.transfer_backend))
            for g in groups]


def synced_groups(op: Operation, plan: Plan, opts: SaveOptions
                  ) -> list[tuple[list[StorageEntry], transfer.HostTransfer]]:
    """`stage_groups` of the plan's storages, each device synced once (every pending value final)."""
    groups = stage_groups(plan.storages, opts)
    for group, backend in groups:
        op.enter("sync")
        backend.prepare(transfer.TensorsOf(group))
    return groups


def device_batches(op: Operation, plan: Plan, opts: SaveOptions, *, overlap: bool = True) -> Iterator[
        tuple[list[StorageEntry], list[torch.Tensor], transfer.HostTransfer]]:
    """Sync every device once, then yield (batch, host tensors, backend) under the deadline.

    The consumer drops each batch's host tensors before asking for the next, so at most
    `max_inflight_bytes` of them are held at a time. Where a backend copies (and `overlap`),
    the next batch is copied while the consumer writes this one (`overlap.py`, same bound).
    """
    yield from host_batches(op, synced_groups(op, plan, opts), opts, overlap=overlap)


def host_batches(op: Operation, groups: list[tuple[list[StorageEntry], transfer.HostTransfer]],
                 opts: SaveOptions, *, overlap: bool = True) -> Iterator[
        tuple[list[StorageEntry], list[torch.Tensor], transfer.HostTransfer]]:
    """`device_batches` of groups already synced."""
    if overlap and any(backend.copies for _, backend in groups):
        yield from overlapped.batches(op, groups, opts)
        return
    for group, backend in groups:
        for batch in transfer.batches(group, opts.max_inflight_bytes):
            op.enter("transfer", batch[0].path)
            with op.clock.timing("transfer"):
                hosts = transfer.batch_to_host(backend, batch, timeout_s=max(op.remaining(), 0.001))
            yield batch, hosts, backend
            del hosts


# -- write and commit ---------------------------------------------------------------------------

def write(op: Operation, job: FileSave, items: HostItems, dest: Destination | None = None) -> None:
    """Write the archive from `items` (batches of host tensors) as a checkpoint's one part, then commit.

    `dest` is where (`store/`): by default the file `job.final`, through a temporary sibling
    renamed over it at the operation's commit point; a bucket's commits a new generation.
    """
    dest = dest or local.LocalFile(job.final)
    dest.adopt(dest.propose(op))
    dest.tidy(op, committer=True)
    with dest.writing(op):
        dest.commit(op, {0: write_part(op, job, items, dest, 0, 1)})
    dest.after_commit(op)


def write_part(op: Operation, job: FileSave, items: HostItems, dest: Destination, rank: int,
               world: int) -> dict:
    """Stream the archive of `job` into `rank`'s part of `dest`; the part's entry, once complete."""
    part = dest.open_part(op, rank, world)
    try:
        write_archive(op, job, part, items)
        return part.finish()
    except BaseException:
        part.abort()
        raise


def write_archive(op: Operation, job: FileSave, f: Any, items: HostItems) -> None:
    """Stream the archive of `job` into the writable binary `f` (a file, or an object's upload)."""
    writer = archive.ArchiveWriter(f, compute_crc32=job.opts.compute_crc32)
    writer.write_header(job.pickled, job.structure)
    try:
        for batch, hosts, *_ in items:
            with op.clock.timing("write"):
                write_batch(op, writer, batch, hosts)
            del hosts
    finally:
        close = getattr(items, "close", None)
        if close is not None:  # the transfer thread of an overlapped save stops now, not when collected
            close()
    writer.finish()


def write_batch(op: Operation, writer: archive.ArchiveWriter, batch: list[StorageEntry],
                hosts: list[Any]) -> None:
    """Write one batch's storages: runs of small ones together (progress and a check for
    cancellation every `archive.CHUNK_BYTES`), large ones chunk by chunk."""
    def progress(nbytes: int, path: str) -> None:
        op.advance(nbytes)
        op.tensor = path

    small = archive.SMALL_RECORD
    start = 0
    while start < len(batch):
        end = start
        while end < len(batch) and batch[end].nbytes <= small:
            end += 1
        if end > start:
            op.enter("write", batch[start].path)
            writer.write_small_storages(batch[start:end], hosts[start:end], progress)
        if end < len(batch):
            entry = batch[end]
            op.enter("write", entry.path)
            writer.write_storage(entry, archive.host_view(hosts[end], entry.nbytes), on_chunk=op.advance)
            end += 1
        start = end


# -- the synchronous save of one file ----------------------------------------------------------

def save_file(obj: Any, final: Path, opts: SaveOptions) -> None:
    """Plan on the caller's thread, then sync, transfer, write and commit under one deadline."""
    with workers.collection_paused():  # the caller waits for all of it
        job = prepare(obj, final, opts)
        op = Operation("save", final, Watch.of(opts), bytes_total=job.plan.nbytes)
        op.run(lambda op: write(op, job, device_batches(op, job.plan, opts)))
