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
In a multi-process torch.distributed job both hand over to `dcp_ranks.py`,
which runs the same writing and reading on every rank around one commit.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from xlakit import _dirs, _job, dcp_plan, transfer
from xlakit.errors import CheckpointError, CheckpointPeerError
from xlakit.options import LoadOptions, SaveOptions, resolve

COMMIT_RECORD = _dirs.COMMIT_RECORD


def dcp_save(state: dict, path: str | os.PathLike, *, options: SaveOptions | None = None,
             **overrides: Any) -> None:
    """Save (sharded) XLA state as a torch.distributed.checkpoint folder, atomically.

    Args:
        state: a (nested) state dict; tensors may be SPMD-sharded XLA tensors,
            other XLA tensors or CPU tensors, beside plain values.
        path: the checkpoint folder; its parent must exist. An existing checkpoint
            there (committed or not) is replaced only once the new one is durable.
            Under torch.distributed every rank passes the same path, on storage
            every rank sees; rank 0 commits once every rank's files are durable.
        options: a `SaveOptions` (``compute_crc32`` does not apply); keyword overrides win.

    Raises:
        CheckpointTimeoutError: the deadline passed (stage and tensor named).
        CheckpointWriteError: no folder, no permission, disk full, or `path` holds
            files that are not a checkpoint's (they are never deleted).
        CheckpointPeerError: (several ranks) another rank failed; it is named. A rank
            that died or stalled is named by a CheckpointTimeoutError instead.

    Example:
        >>> import torch, xlakit
        >>> xlakit.dcp_save({"w": torch.ones(2)}, getfixture("tmp_path") / "ckpt")
    """
    opts: SaveOptions = resolve(SaveOptions, options, overrides)
    if opts.compute_crc32:
        raise ValueError("compute_crc32 applies to xlakit.save's zip files, not to DCP folders")
    final = Path(path)
    if _world() > 1:
        from xlakit import dcp_ranks

        return dcp_ranks.save(state, final, opts)
    _job.check_no_abandoned_work()
    check_parent(final)
    _dirs.check_replaceable(final)
    _dirs.remove_stale_temps(final)
    tmp = _dirs.temp_dir(final)
    device = [t for t in dcp_plan.tensors(state) if t.device.type != "cpu"]
    job = _job.Job("dcp save", str(final), sum(t.numel() * t.element_size() for t in device))
    watch = _job.Watch(opts.timeout_s, opts.stall_warning_s, opts.progress_interval_s,
                       opts.progress_callback)
    _job.run(job, lambda j: _save(j, state, device, tmp, final, opts), watch,
             lambda j: (f"The temporary folder {tmp.name} is removed when the abandoned {j.stage} "
                        f"returns; the previous checkpoint at {final}, if any, is untouched."))


def _save(job: _job.Job, state: dict, device: list[torch.Tensor], tmp: Path, final: Path,
          opts: SaveOptions) -> None:
    committed = False
    try:
        tmp.mkdir()
        write_folder(job, state, device, tmp, opts)
        job.enter("commit")
        _dirs.write_commit_record(tmp)
        with _job.commit_guard(job):
            _dirs.replace(tmp, final)
            committed = True
    except OSError as e:
        if isinstance(e, CheckpointError):  # CheckpointTimeoutError is an OSError too
            raise
        raise _dirs.write_error(e, final, stage=job.stage, bytes_done=job.bytes_done) from e
    finally:
        if not committed:
            _dirs.discard(tmp)


def check_parent(final: Path) -> None:
    if not final.parent.is_dir():
        raise _dirs.write_error(FileNotFoundError(2, "No such file or directory"), final,
                               stage="open")


def write_folder(job: _job.Job, state: dict, device: list[torch.Tensor], folder: Path,
                 opts: SaveOptions, group: Any = None) -> list[str]:
    """Sync, then let DCP write this process's part of `state` into `folder`; its file names.

    With `group` (several ranks) DCP's plan and metadata exchange run on it.
    """
    if device:
        job.enter("sync")
        transfer.backend_for(device[0].device.type, device[0]).prepare(device)
    job.enter("plan")
    writer = _Writer(job, folder)
    _run_dcp(dcp.save, state, group, storage_writer=writer, planner=dcp_plan.SavePlanner(job, opts))
    return writer.files


def dcp_load(state: dict, path: str | os.PathLike, *, options: LoadOptions | None = None,
             **overrides: Any) -> None:
    """Load a folder written by `dcp_save` into `state`, in place, resharding as needed.

    Each tensor of `state` receives the saved values in its own placement: an
    SPMD-sharded XLA tensor keeps its sharding (which may differ from the saved
    one, on another mesh or device count), a CPU tensor is filled on the host.
    Under torch.distributed every rank calls it; the job may have another world
    size than the one that saved, and DTensors another mesh and placement.

    Args:
        state: the template: a state dict with tensors of the saved shapes and dtypes.
        path: the checkpoint folder.
        options: a `LoadOptions` (``mmap`` does not apply); ``verify`` checks every
            file against the commit record first.

    Raises:
        CheckpointIncompleteError: the folder has no commit record (an interrupted
            save, or one not written by xlakit).
        CheckpointCorruptError: a file is missing, truncated or fails its checksum.
        CheckpointTimeoutError: the deadline passed; `state` may be partly loaded.
        CheckpointPeerError: (several ranks) another rank failed; it is named.

    Example:
        >>> import torch, xlakit
        >>> p = getfixture("tmp_path") / "ckpt"
        >>> xlakit.dcp_save({"w": torch.ones(2)}, p)
        >>> state = {"w": torch.zeros(2)}
        >>> xlakit.dcp_load(state, p)
        >>> state["w"]
        tensor([1., 1.])
    """
    opts: LoadOptions = resolve(LoadOptions, options, overrides)
    if opts.mmap:
        raise ValueError("mmap applies to xlakit.load's zip files, not to DCP folders")
    final = Path(path)
    if _world() > 1:
        from xlakit import dcp_ranks

        return dcp_ranks.load(state, final, opts)
    record = _dirs.read_commit_record(final)
    job = _job.Job("dcp load", str(final), sum(f["nbytes"] for f in record["files"].values()))
    watch = _job.Watch(opts.timeout_s, opts.stall_warning_s, opts.progress_interval_s,
                       opts.progress_callback)
    _job.run(job, lambda j: _load(j, state, final, record, opts), watch,
             lambda j: "Nothing was changed on disk; the state may be partly loaded.")


def _load(job: _job.Job, state: dict, final: Path, record: dict, opts: LoadOptions) -> None:
    if opts.verify:
        verify_files(job, final, record, list(record["files"]))
    read_folder(job, state, final)


def verify_files(job: _job.Job, final: Path, record: dict, names: list[str]) -> None:
    for name in names:
        expected = record["files"][name]
        job.enter("verify", name)
        _dirs.verify_file(final, name, expected)
        job.advance(expected["nbytes"])


def read_folder(job: _job.Job, state: dict, final: Path, group: Any = None) -> None:
    """Let DCP fill `state` in place from the committed folder `final` (on `group` if given)."""
    device = [t for t in dcp_plan.tensors(state) if t.device.type != "cpu"]
    if device:
        # The SPMD planner reads shard buffers of the targets: they must be materialised.
        job.enter("sync")
        transfer.backend_for(device[0].device.type, device[0]).prepare(device)
    job.enter("plan")

    class _LoadPlanner(dcp_plan.load_planner_base()):
        def resolve_tensor(self, read_item):
            job.enter("read", read_item.dest_index.fqn)
            return super().resolve_tensor(read_item)

    _run_dcp(dcp.load, state, group, storage_reader=_Reader(job, final), planner=_LoadPlanner())


class _Reader(dcp.FileSystemReader):
    """DCP's file reader; it marks where this rank reads and where it waits on the others."""

    def __init__(self, job: _job.Job, folder: Path):
        super().__init__(str(folder))
        self.job = job

    def read_data(self, plan, planner):
        self.job.enter("read")
        future = super().read_data(plan, planner)
        self.job.enter("finish")
        return future


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, fsyncing; it marks the job's stages and remembers the files it wrote."""

    def __init__(self, job: _job.Job, folder: Path):
        super().__init__(str(folder), single_file_per_rank=True, sync_files=True, thread_count=1)
        self.job, self.files = job, []

    def write_data(self, plan, planner):
        self.job.enter("write")
        future = super().write_data(plan, planner)
        self.files = sorted({r.storage_data.relative_path for r in future.wait()})
        # From here DCP waits on the other ranks (results gathered, metadata written by rank 0).
        self.job.enter("finish")
        return future


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _run_dcp(fn, state: dict, group: Any, **kwargs):
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
        # index in torch 2.9, values verified by tests/test_dcp.py).
        warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional")
        try:
            return fn(state, **kwargs, **where)
        except CheckpointException as e:
            failures = {r: exc for r, (exc, _) in e.failures.items()}
            mine = failures.pop(rank, None) if rank is not None else None
            if rank is None and len(failures) == 1:
                mine = next(iter(failures.values()))
            if isinstance(mine, Exception):
                raise mine from None
            if rank is not None and failures:
                lines = "; ".join(f"rank {r}: {type(x).__name__}: {x}"
                                  for r, x in sorted(failures.items()))
                raise CheckpointPeerError(f"torch.distributed.checkpoint failed on other ranks: {lines}",
                                          rank=min(failures)) from None
            raise RuntimeError(str(e)) from None
        except (CheckpointError, _job.Cancelled):
            raise
        except Exception as e:
            if rank is None:
                raise
            # Raised by a collective itself (gloo: a closed connection or its timeout).
            raise CheckpointPeerError(f"a collective of torch.distributed.checkpoint failed on rank "
                                      f"{rank}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                      ) from e
