"""Sharded XLA state through torch.distributed.checkpoint, committed atomically under one deadline.

DCP is the storage engine (its files, metadata and resharding on load);
xlakit wraps it the way `xlakit.save` wraps torch's zip format:

* *sync*: one step marker materialises every pending XLA tensor (transfer.py).
* *transfer*: the planner hands DCP's writer host data on demand, pulled in
  byte-capped batches: SPMD-sharded tensors as their distinct local shards
  (`spmd.py`: no replication program, replicas and padding dropped), other
  XLA tensors through the save's usual backend. Each shard is one DCP chunk,
  so the layout is the one torch_xla's `SPMDSavePlanner` writes.
* *write* into a temporary folder beside the target; then *commit*: a commit
  record (`xlakit-commit.json`: every file with its size and xxh3-64) is written
  last, everything is fsynced and the folder takes the final name (an atomic
  exchange on Linux, so readers see the old checkpoint or the new one).

A folder without the commit record is refused on load and replaced by the
next save. Loading is in place, into a state whose tensors carry the target
sharding (any mesh or device count); DCP reads the overlapping chunks.
This drives one process (single-host SPMD); a multi-process job needs the
coordinated commit of `xlakit.save` and is refused here.
"""

from __future__ import annotations

import io
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.utils._pytree import tree_leaves

from xlakit import _dirs, _features, _job, spmd, transfer
from xlakit._tree import TensorEntry
from xlakit.errors import CheckpointError, RuntimeFeatureError
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
        options: a `SaveOptions` (``compute_crc32`` does not apply); keyword overrides win.

    Raises:
        CheckpointTimeoutError: the deadline passed (stage and tensor named).
        CheckpointWriteError: no folder, no permission, disk full, or `path` holds
            files that are not a checkpoint's (they are never deleted).
        RuntimeFeatureError: torch.distributed runs more than one process.

    Example:
        >>> import torch, xlakit
        >>> xlakit.dcp_save({"w": torch.ones(2)}, getfixture("tmp_path") / "ckpt")
    """
    opts: SaveOptions = resolve(SaveOptions, options, overrides)
    if opts.compute_crc32:
        raise ValueError("compute_crc32 applies to xlakit.save's zip files, not to DCP folders")
    _single_process("dcp_save")
    final = Path(path)
    _job.check_no_abandoned_work()
    if not final.parent.is_dir():
        raise _dirs.write_error(FileNotFoundError(2, "No such file or directory"), final,
                               stage="open")
    _dirs.check_replaceable(final)
    _dirs.remove_stale_temps(final)
    tmp = _dirs.temp_dir(final)
    device = [t for t in _tensors(state) if t.device.type != "cpu"]
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
        if device:
            job.enter("sync")
            transfer.backend_for(device[0].device.type, device[0]).prepare(device)
        job.enter("write")
        tmp.mkdir()
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True,
                                      thread_count=1)
        _quiet(dcp.save, state, storage_writer=writer, planner=_SavePlanner(job, opts), no_dist=True)
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


def dcp_load(state: dict, path: str | os.PathLike, *, options: LoadOptions | None = None,
             **overrides: Any) -> None:
    """Load a folder written by `dcp_save` into `state`, in place, resharding as needed.

    Each tensor of `state` receives the saved values in its own placement: an
    SPMD-sharded XLA tensor keeps its sharding (which may differ from the saved
    one, on another mesh or device count), a CPU tensor is filled on the host.

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
    _single_process("dcp_load")
    final = Path(path)
    record = _dirs.read_commit_record(final)
    job = _job.Job("dcp load", str(final), sum(f["nbytes"] for f in record["files"].values()))
    watch = _job.Watch(opts.timeout_s, opts.stall_warning_s, opts.progress_interval_s,
                       opts.progress_callback)
    _job.run(job, lambda j: _load(j, state, final, record, opts), watch,
             lambda j: "Nothing was changed on disk; the state may be partly loaded.")


def _load(job: _job.Job, state: dict, final: Path, record: dict, opts: LoadOptions) -> None:
    if opts.verify:
        for name, expected in record["files"].items():
            job.enter("verify", name)
            _dirs.verify_file(final, name, expected)
            job.advance(expected["nbytes"])
    device = [t for t in _tensors(state) if t.device.type != "cpu"]
    if device:
        # The SPMD planner reads shard buffers of the targets: they must be materialised.
        job.enter("sync")
        transfer.backend_for(device[0].device.type, device[0]).prepare(device)
    job.enter("read")

    class _LoadPlanner(_load_planner_base()):
        def resolve_tensor(self, read_item):
            job.enter("read", read_item.dest_index.fqn)
            return super().resolve_tensor(read_item)

    reader = dcp.FileSystemReader(str(final))
    _quiet(dcp.load, state, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner, with device tensors written as local shards pulled in batches."""

    def __init__(self, job: _job.Job, opts: SaveOptions):
        super().__init__()
        self.job, self.opts = job, opts
        self.staged: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        # Flattened as torch_xla's planners do, so that its SPMDLoadPlanner finds every key;
        # DCP's own flattening also splits containers that hold no tensor.
        flat, self.mappings = _flatten(state_dict)
        self.state_dict = {k: _unwrap(v) for k, v in flat.items()}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        host = {k: v for k, v in self.state_dict.items() if not _on_device(v)}
        items = create_default_local_save_plan(host, self.is_coordinator).items
        self.order = [k for k, v in self.state_dict.items() if _on_device(v)]
        self.position = {k: i for i, k in enumerate(self.order)}
        for fqn in self.order:
            t = self.state_dict[fqn]
            indices = ([idx for _, idx in spmd.unique_shard_indices(t)] if spmd.is_sharded(t)
                       else [tuple(slice(0, n) for n in t.shape)])
            items += [_shard_item(fqn, i, idx, t) for i, idx in enumerate(indices)]
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if not _on_device(self.state_dict.get(fqn)):
            return super().resolve_data(write_item)
        key = (fqn, tuple(write_item.index.offset))
        if key not in self.staged:
            self._stage_from(fqn)
        self.job.enter("write", fqn)
        host = self.staged.pop(key)
        self.job.advance(host.numel() * host.element_size())
        return host

    def _stage_from(self, fqn: str) -> None:
        """Copy `fqn` and the device tensors after it, up to the byte cap, to the host."""
        batch, size = [], 0
        for name in self.order[self.position[fqn]:]:
            nbytes = self.state_dict[name].numel() * self.state_dict[name].element_size()
            if batch and size + nbytes > self.opts.max_inflight_bytes:
                break
            batch.append(name)
            size += nbytes
        self.job.enter("transfer", fqn)
        plain = [n for n in batch if not spmd.is_sharded(self.state_dict[n])]
        for name in batch:
            if name not in plain:
                for data, idx in spmd.local_shards(self.state_dict[name]):
                    self.staged[(name, tuple(s.start for s in idx))] = data
        if plain:
            entries = [TensorEntry(i, n, self.state_dict[n]) for i, n in enumerate(plain)]
            backend = transfer.backend_for(entries[0].device_type, entries[0].tensor)
            left = max(self.job.started + self.opts.timeout_s - time.monotonic(), 0.001)
            for name, host in zip(plain, transfer.batch_to_host(backend, entries, timeout_s=left)):
                self.staged[(name, (0,) * host.dim())] = host


def _shard_item(fqn: str, i: int, index: tuple[slice, ...], t: torch.Tensor) -> WriteItem:
    offsets = torch.Size(s.start for s in index)
    sizes = torch.Size(s.stop - s.start for s in index)
    return WriteItem(
        index=MetadataIndex(fqn, offsets, i), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            # is_pinned() is not defined for XLA tensors; device data is never pinned.
            properties=TensorProperties(dtype=t.dtype, requires_grad=t.requires_grad),
            size=t.size()))


def _flatten(state: dict) -> tuple[dict, dict]:
    if _features.xlac() is not None:
        from torch_xla.experimental.distributed_checkpoint._helpers import flatten_state_dict
    else:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    return flatten_state_dict(state)


def _load_planner_base() -> type:
    if _features.xlac() is not None:
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        return SPMDLoadPlanner
    return dcp.DefaultLoadPlanner


def _unwrap(v: Any) -> Any:
    """The XLA tensor inside torch_xla's `XLAShardedTensor` wrapper (saved as that tensor)."""
    inner = getattr(v, "global_tensor", None)
    return inner if isinstance(v, torch.Tensor) and isinstance(inner, torch.Tensor) else v


def _on_device(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type != "cpu"


def _tensors(state: Any) -> list[torch.Tensor]:
    return [_unwrap(t) for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def _single_process(what: str) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        err = RuntimeFeatureError(f"xlakit.{what} drives one process (single-host SPMD); this job "
                                  f"runs {dist.get_world_size()} under torch.distributed")
        err.add_note("A multi-process save needs every rank to agree on one temporary folder and "
                     "commit together; use torch.distributed.checkpoint directly meanwhile.")
        raise err


def _quiet(fn, *args, **kwargs):
    """Run a DCP entry point; its per-rank failure wrapper gives way to the original error."""
    with warnings.catch_warnings():
        # Single-process use is the intent here, not an accident DCP should warn about; and
        # its file writer calls the deprecated TypedStorage API on every tensor.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        # torch_xla 2.9's XLAShard.unpadded_data indexes with a list of slices (still a tuple
        # index in torch 2.9, values verified by tests/test_dcp.py).
        warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional")
        try:
            return fn(*args, **kwargs)
        except CheckpointException as e:
            failures = [exc for exc, _ in e.failures.values()]
            if len(failures) == 1 and isinstance(failures[0], Exception):
                raise failures[0] from None
            raise RuntimeError(str(e)) from None
