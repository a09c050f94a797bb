"""Sharded XLA state through torch.distributed.checkpoint, committed atomically under one deadline.

DCP is the storage engine (its files, metadata and resharding on load);
xlakit wraps it the way `xlakit.save` wraps torch's zip format:

* *sync*: one step marker materialises every pending XLA tensor (transfer.py).
* *transfer*: the planner hands DCP's writer host data on demand, pulled in
  byte-capped batches: SPMD-sharded tensors as their distinct local shards
  (`spmd.py`: no replication program, replicas and padding dropped), other
  XLA tensors through the save's usual backend. Each shard is one DCP chunk,
  so the layout is the one torch_xla's `SPMDSavePlanner` writes (`dcp_plan.py`).
* *write* into a temporary folder beside the target; then *commit*: a commit
  record (`xlakit-commit.json`: every file with its size and xxh3-64) is written
  last, everything is fsynced and the folder takes the final name (an atomic
  exchange on Linux, so readers see the old checkpoint or the new one).

A folder without the commit record is refused on load and replaced by the
next save. Loading is in place, into a state whose tensors carry the target
sharding (any mesh or device count); DCP reads the overlapping chunks.

This module is DCP as the engine (the write and read of one process's part,
its storage reader and writer, its errors) and `LocalDcp`, the folder on disk;
`dcp_ranks.py` runs the one flow, alone or on every rank of a job around one
agreed commit, into a folder or a bucket (`bucket_dcp.py`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from xlakit.checkpoint.core import load_stats, operation, paths
from xlakit.checkpoint.file import matching, transfer
from xlakit.checkpoint.format import folders
from xlakit.checkpoint.torch_dcp import dcp_plan, one_pass
from xlakit.checkpoint.core.operation import Cancelled, Operation
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.errors import CheckpointCorruptError, CheckpointError, CheckpointIncompleteError, CheckpointPeerError

PARTLY_LOADED = "nothing on disk was changed; the state may be partly loaded"


def device_tensors(state: dict) -> list[torch.Tensor]:
    return [t for t in dcp_plan.tensors(state) if t.device.type != "cpu"]


def check_transfer(device: list[torch.Tensor], opts: SaveOptions) -> None:
    """Refuse a transfer backend this build lacks, before anything is written."""
    if any(t.device.type == "xla" for t in device):
        transfer.check_backend(opts.transfer_backend)


def check_parent(final: Path) -> None:
    if not final.parent.is_dir():
        raise paths.write_error(FileNotFoundError(2, "No such file or directory"), final, stage="open")


def new_folder(op: Operation, final: Path) -> Path:
    """Check `final` may be replaced, clear dead processes' leftovers, make the temporary folder."""
    check_parent(final)
    paths.recover_asides(final)  # first: the final name may get its checkpoint back
    folders.check_replaceable(final)
    paths.remove_stale_temps(final.parent, stem=final.name)
    tmp = op.own(paths.temp_path(final))
    tmp.mkdir()
    return tmp


def commit_folder(op: Operation, tmp: Path, final: Path) -> None:
    """The point of no return: the complete folder takes the final name; the old one goes after."""
    with op.commit_point():
        previous = paths.replace_folder(tmp, final)
        op.disown(tmp)
    paths.fsync_dir(final.parent)
    if previous is not None:
        operation.remove_path(previous)


def write_folder(op: Operation, state: dict, device: list[torch.Tensor], folder: Path | None,
                 opts: SaveOptions, group: Any = None, *, writer: "StagedWriter | None" = None) -> "StagedWriter":
    """Sync, then let DCP write this process's part of `state` into `folder`; the writer, which
    knows the files it wrote and their items.

    With `group` (several ranks) DCP's plan and metadata exchange run on it. `writer`
    replaces the file writer into `folder` (object storage: `bucket_dcp.py`).
    """
    if device:
        op.enter("sync")
        transfer.backend_for(device[0].device.type, device[0], mode=opts.transfer_backend).prepare(device)
    op.enter("plan")
    writer = writer or _Writer(op, folder)
    run_dcp(dcp.save, state, group, storage_writer=writer, planner=dcp_plan.SavePlanner(op, opts))
    return writer


def read_folder(op: Operation, state: dict, final: Path | None, group: Any = None, *,
                reader: "StagedReader | None" = None) -> None:
    """Let DCP fill `state` in place from the committed folder `final` (on `group` if given);
    `reader` replaces the file reader of `final` (object storage: `bucket_dcp.py`)."""
    device = device_tensors(state)
    if device:
        # The SPMD planner reads shard buffers of the targets: they must be materialised.
        op.enter("sync")
        transfer.backend_for(device[0].device.type, device[0]).prepare(device)
    op.enter("plan")

    class _LoadPlanner(dcp_plan.load_planner_base()):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            if metadata is not None:  # the optimizer state xlakit created that the checkpoint has none of
                matching.drop_absent(state_dict, metadata.state_dict_metadata)
            super().set_up_planner(state_dict, metadata, is_coordinator)

        def resolve_tensor(self, read_item):
            op.enter("read", read_item.dest_index.fqn)
            return super().resolve_tensor(read_item)

        def load_bytes(self, read_item, value):  # weights-only: the planners' own run pickled code
            fqn = read_item.dest_index.fqn
            dcp_plan.set_value(self, fqn, dcp_plan.load_value(value, fqn, str(op.path)))

    reader = reader or _Reader(op, final)
    reader.prepare()
    run_dcp(dcp.load, state, group, storage_reader=reader, planner=_LoadPlanner())


class StagedReader(one_pass.OnePassReader):
    """Mixed into a DCP storage reader (before it): marks where this rank reads and where it waits
    on the others, in `self.op`; reads in one pass where the commit record lists items."""

    op: Operation

    def read_data(self, plan, planner):
        self.op.enter("read")
        future = super().read_data(plan, planner)
        self.op.enter("finish")
        return future


class StagedWriter:
    """Mixed into a DCP storage writer (before it): marks the operation's stages in `self.op`, and
    remembers this rank's files in `self.files`, with the (offset, length) of their items in `self.ranges`."""

    op: Operation
    files: list[str]
    ranges: dict[str, list[tuple[int, int]]]

    def write_data(self, plan, planner):
        self.op.enter("write")
        future = super().write_data(plan, planner)
        self.ranges = one_pass.item_ranges(future.wait())
        self.files = sorted(self.ranges)
        # From here DCP waits on the other ranks (results gathered, metadata written by rank 0).
        self.op.enter("finish")
        return future


class _Reader(StagedReader, dcp.FileSystemReader):
    """DCP's file reader; in one pass given the commit record's `entries` (`one_pass.py`)."""

    def __init__(self, op: Operation, folder: Path, entries: dict[str, dict] | None = None, verify: bool = True):
        super().__init__(str(folder))
        self.op, self.entries, self.verify = op, entries, verify

    def open_raw(self, name: str) -> load_stats.CountedFile:
        """The file `name` of the commit record, its size checked against the record first (as
        `store.bucket.open_object` does an object's)."""
        try:
            f = load_stats.CountedFile(Path(self.path) / name, self.op.stats)
        except FileNotFoundError as e:
            raise CheckpointIncompleteError(f"{self.path}: {name} is listed in the commit record but missing") from e
        size, expected = os.fstat(f.fileno()).st_size, self.entries[name]["nbytes"]
        if size != expected:
            f.close()
            raise CheckpointCorruptError(f"{self.path}/{name}: expected {expected} bytes (its commit record), "
                                         f"found {size}; the file was replaced or damaged after the save committed")
        return f


class _Writer(StagedWriter, dcp.FileSystemWriter):
    """DCP's file writer, fsyncing."""

    def __init__(self, op: Operation, folder: Path):
        super().__init__(str(folder), single_file_per_rank=True, sync_files=True, thread_count=1)
        self.op, self.files, self.ranges = op, [], {}


class DcpStore(ABC):
    """Where a DCP checkpoint's files go and how they become the checkpoint (`dcp_ranks.py` runs
    the flow): a folder on disk (`LocalDcp`) or a generation of a URL (`bucket_dcp.BucketDcp`).

    Attributes:
        identity: what every rank must name alike; `name`: the checkpoint, in messages.
    """

    identity: str
    name: str

    def check(self, device: list[torch.Tensor], opts: SaveOptions) -> None:
        """(Every rank, before agreeing to save.) Refuse what cannot be written."""

    @abstractmethod
    def propose(self, op: Operation) -> dict:
        """(Rank 0, saving.) Where the files go."""

    @abstractmethod
    def adopt(self, proposal: dict) -> None:
        """(Every rank.) Rank 0's proposal."""

    def tidy(self, op: Operation) -> None:
        """(Rank 0, agreed.) Remove what no commit can name any more."""

    @abstractmethod
    def write(self, op: Operation, state: dict, device: list[torch.Tensor], opts: SaveOptions,
              group: Any) -> dict[str, dict]:
        """DCP writes this rank's files; each with its size and xxh3-64."""

    @abstractmethod
    def commit(self, op: Operation, entries: dict[str, dict]) -> None:
        """(Rank 0, every rank's files written.) The point of no return."""

    def after_commit(self, op: Operation) -> None:
        """(Rank 0.) Remove what the commit made obsolete."""

    @contextlib.contextmanager
    def writing(self, op: Operation) -> Iterator[None]:
        yield

    def pin(self, op: Operation) -> dict:
        """(Rank 0, loading.) Which commit every rank reads."""
        return {}

    @abstractmethod
    def files(self, op: Operation, pinned: dict) -> dict[str, dict]:
        """The files the commit `pinned` names, each with its size and xxh3-64."""

    @abstractmethod
    def verify(self, op: Operation, name: str, entry: dict) -> None:
        """Read the file `name` whole and check it against its entry."""

    @abstractmethod
    def reader(self, op: Operation, entries: dict[str, dict] | None, verify: bool) -> "StagedReader":
        """DCP's storage reader of the commit `files` read: in one pass given their `entries`
        (checked unless not `verify`), DCP's own otherwise."""


class LocalDcp(DcpStore):
    """A DCP folder: written into a temporary sibling, whose commit record (every file with its size and
    xxh3-64) is written last; then the folder takes the final name (an atomic exchange on Linux)."""

    def __init__(self, final: Path):
        self.final, self.tmp = final, final
        self.identity, self.name = os.path.abspath(final), str(final)

    def check(self, device: list[torch.Tensor], opts: SaveOptions) -> None:
        check_transfer(device, opts)
        check_parent(self.final)

    def propose(self, op: Operation) -> dict:
        return {"folder": new_folder(op, self.final).name}

    def adopt(self, proposal: dict) -> None:
        self.tmp = self.final.parent / proposal["folder"]

    def write(self, op: Operation, state: dict, device: list[torch.Tensor], opts: SaveOptions,
              group: Any) -> dict[str, dict]:
        writer = write_folder(op, state, device, self.tmp, opts, group)
        op.enter("checksum")
        return {name: one_pass.file_entry(self.tmp / name, writer.ranges[name]) for name in writer.files}

    def commit(self, op: Operation, entries: dict[str, dict]) -> None:
        op.enter("commit")
        folders.write_commit_record(self.tmp, entries)
        commit_folder(op, self.tmp, self.final)

    def writing(self, op: Operation):
        return paths.writing(self.final, op)

    def files(self, op: Operation, pinned: dict) -> dict[str, dict]:
        return folders.read_commit_record(self.final)["files"]

    def verify(self, op: Operation, name: str, entry: dict) -> None:
        op.enter("verify", name)
        folders.verify_file(self.final, name, entry)
        op.advance(entry["nbytes"])

    def reader(self, op: Operation, entries: dict[str, dict] | None, verify: bool) -> "StagedReader":
        return _Reader(op, self.final, entries, verify)


def run_dcp(fn, state: dict, group: Any, **kwargs):
    """Run a DCP entry point, alone or on `group`; its per-rank failure wrapper gives way.

    This rank's own failure is raised as itself. Under a group, failures of other
    ranks become a CheckpointPeerError naming them, and a failed collective one
    naming nobody (a peer died or stalled; the coordination names it).
    """
    rank = None if group is None else dist.get_rank(group)
    where = {"no_dist": True} if group is None else {"process_group": group}
    with warnings.catch_warnings():
        # Single-process use is the intent here, not an accident DCP should warn about; and
        # its file writer calls the deprecated TypedStorage API on every tensor.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        # torch_xla 2.9's XLAShard.unpadded_data indexes with a list of slices (still a tuple
        # index in torch 2.9, values verified by tests/multirank/test_dcp.py).
        warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional")
        try:
            return fn(state, **kwargs, **where)
        except CheckpointException as e:
            failures = {r: exc for r, (exc, _) in e.failures.items()}
            mine = failures.pop(rank, None) if rank is not None else None
            if rank is None and len(failures) == 1:
                mine = next(iter(failures.values()))
            if isinstance(mine, BaseException):
                raise mine from None
            if rank is not None and failures:
                lines = "; ".join(f"rank {r}: {type(x).__name__}: {x}"
                                  for r, x in sorted(failures.items()))
                raise CheckpointPeerError(f"torch.distributed.checkpoint failed on other ranks: {lines}",
                                          rank=min(failures)) from None
            raise RuntimeError(str(e)) from None
        except (CheckpointError, Cancelled):
            raise
        except Exception as e:
            if rank is None:
                raise
            # Raised by a collective itself (gloo: a closed connection or its timeout).
            raise CheckpointPeerError(f"a collective of torch.distributed.checkpoint failed on rank "
                                      f"{rank}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                      ) from e
