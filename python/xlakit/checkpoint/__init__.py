"""Checkpoints: the public entry points, on top of the pipeline they drive.

Reading order, top-down, one sub-package per concern (each imports only the ones below it;
tests/test_architecture.py keeps the order):

* here: `save`, `load`, `restore`, `dcp_save`, `dcp_load`, `wait_until_idle`
  (options resolved, then handed to the layout that runs them; a `gs://` / `s3://`
  URL to the object-storage sibling of that layout);
* `multirank/`: the coordinated layouts, replicated and sharded (`ranks.py`) and
  replica-parallel (`replicas.py`), and their bucket siblings;
* `torch_dcp/`: torch.distributed.checkpoint folders, alone or on every rank;
* `coordination/`: what every rank agrees on before anything is deleted or committed;
* `file/`: one file saved through plan, sync, transfer, write, commit (`pipeline.py`),
  in the background (`background.py`), read (`loading.py`) and restored into a
  template (`restoring.py`); device to host (`transfer.py`, `spmd.py`);
* `store/`: where the bytes go, a local file or folder or a bucket, behind one
  interface the save flows are written against;
* `format/`: the archive, its pickle and structure, a folder's commit record;
* `objstore/`: objects, prefixes and the commit protocol without a rename;
* `core/`: options, threads, the `Operation` (deadline, cancellation, commit point)
  and atomic paths.

On top of the entry points: `stepstore/` (a manager's folder of steps, on disk or in a
bucket), `tier/` (its local tier), `manager/` (`CheckpointManager`), and `inspect/`
(what `xlakit ckpt` reads). docs/architecture.md draws the whole package.

Nothing heavy is imported until a function is called, so `import xlakit`
works where torch is missing or broken.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xlakit.checkpoint import objstore
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions, check_staging, resolve

if TYPE_CHECKING:
    from xlakit.checkpoint.file.background import SaveHandle


def save(obj: Any, path: str | os.PathLike, *, options: SaveOptions | None = None,
         **overrides: Any) -> "SaveHandle | None":
    """Save a training state atomically, verified and within one deadline.

    The save is owned by the caller: if the caller sees any exception while it
    runs (its deadline, Ctrl-C, a progress callback that raises), it is
    cancelled and never commits; the previous checkpoint stays.

    Args:
        obj: nested state: dicts/lists/tuples of tensors (XLA, CUDA or CPU), numbers,
            strings, bools, None; e.g. ``{"model": m.state_dict(), "step": 10}``.
            Tensors sharing a storage are written once and load back sharing it.
        path: the checkpoint file (its folder must exist), or with ``layout="sharded"``
            (or ``replica_parallel=True``) the checkpoint folder; or a ``gs://`` / ``s3://`` URL, any layout
            (docs/object-storage.md).
        options: a `SaveOptions`; keyword overrides (``timeout_s=600``) win over it.
            ``layout="replicated"|"sharded"`` coordinates the ranks of a torch.distributed
            job (``replica_parallel=True``: each rank writes a share of a replicated
            state); ``asynchronous=True`` returns once the state is on the host (with
            ``staging="device"``, once a copy of it is on the device).

    Returns:
        None, or with ``asynchronous=True`` a `SaveHandle` whose ``result()`` raises
        what the background write raised.

    Raises:
        CheckpointTimeoutError: the deadline passed (stage, tensor and bytes named).
        CheckpointSerializationError: `obj` holds something a weights-only file cannot.
        CheckpointWriteError: a folder as target, no folder, no permission, disk full.
        CheckpointPeerError: (coordinated) another rank failed or disagrees; it is named.
        CheckpointBusyError: an asynchronous save is still writing, or a cancelled one
            is stuck in the runtime.
        CheckpointAsyncError: an earlier asynchronous save failed and nobody asked.

    Example:
        >>> import torch, xlakit
        >>> xlakit.save({"w": torch.ones(2)}, getfixture("tmp_path") / "ckpt.pt")
    """
    from xlakit.checkpoint.core import workers
    from xlakit.checkpoint.file import background, pipeline

    opts: SaveOptions = resolve(SaveOptions, options, overrides)
    check_staging(opts)
    objstore.check_url(path)
    background.check_previous()  # an unseen background failure speaks first
    if objstore.is_url(path):
        return _save_url(obj, path, opts)
    final = Path(path)
    if opts.replica_parallel:
        from xlakit.checkpoint.multirank import replicas

        return replicas.save(obj, final, opts)
    if opts.layout != "single":
        from xlakit.checkpoint.multirank import ranks

        return ranks.save(obj, final, opts)  # checks for busy work on every rank, and tells them
    workers.check_idle()
    if opts.asynchronous:
        return background.save_file(obj, final, opts)
    pipeline.save_file(obj, final, opts)
    return None


def _save_url(obj: Any, url: str, opts: SaveOptions) -> "SaveHandle | None":
    from xlakit.checkpoint.core import workers
    from xlakit.checkpoint.file import bucket_file
    from xlakit.checkpoint.multirank import bucket_ranks

    if opts.replica_parallel:
        from xlakit.checkpoint.multirank import bucket_replicas

        return bucket_replicas.save(obj, url, opts)
    if opts.layout != "single":
        return bucket_ranks.save(obj, url, opts)
    workers.check_idle()
    return bucket_file.save_file(obj, url, opts)


def load(path: str | os.PathLike, *, options: LoadOptions | None = None, **overrides: Any) -> Any:
    """Load a checkpoint after verifying every checksum; tensors come back on the CPU.

    Weights-only: no pickled code is ever run. Move tensors to the device with
    ``model.load_state_dict(state)`` as usual.

    Args:
        path: a file written by `xlakit.save` (with ``verify=False``, any torch.save file),
            or the folder of a sharded checkpoint: inside the job each rank gets its own
            shard (all ranks load, or all raise); elsewhere pass ``shard=N``. A
            replica-parallel folder loads whole (in the job each share read once, broadcast). Or the
            ``gs://`` / ``s3://`` URL it was saved to (its newest committed save).
        options: a `LoadOptions`; keyword overrides (``verify=False``) win over it.

    Raises:
        CheckpointCorruptError: a checksum does not match (the tensor is named), or the
            file is truncated or not an archive.
        CheckpointFormatError: the file has no xlakit checksums and `verify` is on, was
            written by a newer xlakit, or the folder is a DCP checkpoint.
        CheckpointIncompleteError: the folder has no commit record (an interrupted save).
        CheckpointTimeoutError: the deadline passed.

    Example:
        >>> import torch, xlakit
        >>> p = getfixture("tmp_path") / "ckpt.pt"
        >>> xlakit.save({"w": torch.ones(2)}, p)
        >>> xlakit.load(p)["w"]
        tensor([1., 1.])
    """
    from xlakit.checkpoint.file import loading

    opts: LoadOptions = resolve(LoadOptions, options, overrides)
    if not opts.strict:
        raise ValueError("strict=False applies to xlakit.restore (a template that lacks some of the "
                         "checkpoint's entries); xlakit.load returns every entry")
    objstore.check_url(path)
    if objstore.is_url(path):
        from xlakit.checkpoint.multirank import bucket_replicas

        return bucket_replicas.load(path, opts)  # a replica-parallel checkpoint; else bucket_ranks
    final = Path(path)
    if final.is_dir():
        return _load_folder(final, opts)
    if opts.shard is not None:
        raise ValueError(f"shard={opts.shard} reads one shard of a sharded checkpoint folder; {final} "
                         f"is {'a file' if final.exists() else 'missing'}")
    if opts.layout == "replicated":
        from xlakit.checkpoint.multirank import ranks

        return ranks.load(final, opts)
    return loading.load_file(final, opts)


def _load_folder(folder: Path, opts: LoadOptions) -> Any:
    from xlakit.checkpoint.format import folders
    from xlakit.checkpoint.coordination import agreement
    from xlakit.checkpoint.multirank import ranks, replicas

    if replicas.is_replicated(folders.read_json_record(folder)):
        if opts.shard is not None:
            raise ValueError(f"{folder} is a replicated checkpoint (a folder of shares); load it "
                             f"whole, without shard=N")
        return replicas.load_all(folder, opts) if agreement.world_size() == 1 else replicas.load(folder, opts)
    ranks.read_commit(folder)  # refuses what is not a committed sharded checkpoint, saying what it is
    if opts.shard is not None:
        return ranks.load_shard(folder, opts.shard, opts)
    if agreement.world_size() == 1:
        from xlakit.errors import CheckpointFormatError

        raise CheckpointFormatError(f"{folder} is a sharded checkpoint: inside the job that wrote it "
                                    f"each rank loads its own shard; elsewhere pass shard=N to read one")
    return ranks.load(folder, opts)


def restore(path: str | os.PathLike, template: Any = None, *, model: Any = None, optimizer: Any = None,
            options: LoadOptions | None = None, **overrides: Any) -> Any:
    """Restore a checkpoint into the tensors of `template`, in place, on their devices.

    The fast way to resume: each tensor of `template` (a state dict as your model
    and optimizer have it now: on the CPU, a CUDA, XLA or TorchTPU device,
    SPMD-sharded or not) receives the saved values where it is, keeping its
    device, dtype and sharding. The template may hold the live model and
    optimizer themselves (or pass them as ``model=`` / ``optimizer=``): the
    module's parameters and buffers are filled in place, and the optimizer's state
    (AdamW's moments, SGD's momentum buffers) is created if it has none yet, filled
    on its devices and loaded with the saved hyper-parameters.

    The file is read once, record by record, each hashed as it is read, in
    batches of at most ``max_inflight_bytes`` that go to their devices (one
    batched host-to-device transfer per batch on XLA) before the next is read, so
    the host never holds more than one batch. Every difference between checkpoint
    and template (missing or extra keys, shapes, dtypes, tied template tensors the
    checkpoint holds different values for) is reported at once, before anything
    is changed.

    Args:
        path: a file written by `xlakit.save`, or with ``verify=False`` any torch.save
            file (it has no checksums to verify; it is read whole); a sharded folder's
            shard with ``shard=N`` (inside the job, this rank's by default); a DCP folder
            is restored through `dcp_load`. Any of these by its
            ``gs://`` / ``s3://`` URL.
        template: the state to fill, e.g. ``{"model": model, "optimizer": opt,
            "epoch": 0}``: state dicts, tensors and plain values, where any
            `torch.nn.Module` or `torch.optim.Optimizer` stands for its state dict
            (an optimizer's created first if it has none).
        model: the entry ``"model"`` of the template (a module, or a state dict).
        optimizer: the entry ``"optimizer"`` of the template (an optimizer, or a state dict).
        options: a `LoadOptions` (``mmap`` does not apply); keyword overrides win.
            ``strict=False`` restores part of a checkpoint: its entries the template
            lacks are skipped (not read, not in the result), logged and passed to
            ``extra_keys_callback``.

    Returns:
        The restored state: the checkpoint's structure with the template's own tensors
        (filled in place) and the checkpoint's other values (step counters, learning
        rates); a module's or optimizer's entry is its restored state dict (an
        optimizer has loaded it already; a template of state dicts needs
        ``opt.load_state_dict(state["optimizer"])``).

    Raises:
        CheckpointMismatchError: the checkpoint does not fit the template (`.problems`
            lists every difference); nothing was changed.
        CheckpointFormatError: a file without xlakit checksums, with `verify` on.
        CheckpointCorruptError: a record fails its checksum (the tensor is named);
            tensors restored before it hold the checkpoint's values.
        CheckpointTimeoutError: the deadline passed.

    Example:
        >>> import torch, xlakit
        >>> p = getfixture("tmp_path") / "ckpt.pt"
        >>> xlakit.save({"w": torch.ones(2), "step": 7, "optimizer": {"lr": 0.1}}, p)
        >>> template = {"w": torch.zeros(2), "step": 0}
        >>> xlakit.restore(p, template, strict=False)["step"], template["w"]
        (7, tensor([1., 1.]))
    """
    from xlakit.checkpoint.file import live

    opts: LoadOptions = resolve(LoadOptions, options, overrides)
    if opts.mmap:
        raise ValueError("mmap does not apply to restore: the values go into the template's own memory")
    objstore.check_url(path)
    template, objects = live.template_of(template, model=model, optimizer=optimizer)
    if template is None:
        raise TypeError("restore needs something to fill: a template, model= or optimizer= (xlakit.load "
                        "reads a checkpoint without one)")
    return live.fill(objects, lambda: _restore(path, template, opts))


def _restore(path: str | os.PathLike, template: Any, opts: LoadOptions) -> Any:
    from xlakit.checkpoint.file import restoring

    if objstore.is_url(path):
        from xlakit.checkpoint.multirank import bucket_replicas

        return bucket_replicas.restore(path, template, opts)  # a replica-parallel one; else bucket_ranks
    final = Path(path)
    if final.is_dir():
        return _restore_folder(final, template, opts)
    if opts.shard is not None:
        raise ValueError(f"shard={opts.shard} reads one shard of a sharded checkpoint folder; {final} "
                         f"is {'a file' if final.exists() else 'missing'}")
    return restoring.restore(final, template, opts)


def _restore_folder(folder: Path, template: Any, opts: LoadOptions) -> Any:
    import dataclasses

    from xlakit.checkpoint.file import restoring
    from xlakit.checkpoint.format import folders
    from xlakit.checkpoint.coordination import agreement
    from xlakit.checkpoint.multirank import ranks, replicas

    record = folders.read_json_record(folder)
    if replicas.is_replicated(record):
        if opts.shard is not None:
            raise ValueError(f"{folder} is a replicated checkpoint (a folder of shares); restore it "
                             f"whole, without shard=N")
        return replicas.restore(folder, template, opts)
    if record is not None and record.get("format") == folders.DCP_FORMAT:
        dcp_load(template, folder, options=dataclasses.replace(opts, shard=None, layout="auto"))
        return template
    commit = ranks.read_commit(folder)
    shard = opts.shard
    if shard is None:
        if agreement.world_size() == 1:
            raise ValueError(f"{folder} is a sharded checkpoint: pass shard=N (inside the job that "
                             f"wrote it, each rank restores its own shard)")
        shard = agreement.dist().get_rank()
    path, check_index = ranks.shard_path(folder, commit, shard)
    return restoring.restore(path, template, opts, check_index)


def dcp_save(state: dict, path: str | os.PathLike, *, options: SaveOptions | None = None,
             **overrides: Any) -> None:
    """Save (sharded) XLA state as a torch.distributed.checkpoint folder, atomically.

    Args:
        state: a (nested) state dict; tensors may be SPMD-sharded XLA tensors,
            other XLA tensors or CPU tensors, beside plain values.
        path: the checkpoint folder; its parent must exist. An existing checkpoint
            there (committed or not) is replaced only once the new one is durable.
            Under torch.distributed every rank passes the same path, on storage
            every rank sees; rank 0 commits once every rank's files are durable. A
            ``gs://`` / ``s3://`` URL works too (docs/object-storage.md).
        options: a `SaveOptions` (``compute_crc32``, ``asynchronous`` and ``layout``
            do not apply); keyword overrides win.

    Raises:
        CheckpointTimeoutError: the deadline passed (stage and tensor named).
        CheckpointWriteError: no folder, no permission, disk full, or `path` holds
            files that are not a checkpoint's (they are never deleted).
        CheckpointSerializationError: a non-tensor value that `dcp_load` could not read
            back weights-only (nothing is written).
        CheckpointPeerError: (several ranks) another rank failed or disagrees; it is
            named. A rank that died or stalled is named by a CheckpointTimeoutError.

    Example:
        >>> import torch, xlakit
        >>> xlakit.dcp_save({"w": torch.ones(2)}, getfixture("tmp_path") / "ckpt")
    """
    opts: SaveOptions = resolve(SaveOptions, options, overrides)
    for name, given in (("compute_crc32", opts.compute_crc32), ("asynchronous", opts.asynchronous),
                        ("layout", opts.layout != "single"), ("staging", opts.staging != "host")):
        if given:
            raise ValueError(f"{name} applies to xlakit.save, not to dcp_save (DCP folders are "
                             f"always sharded by rank and written synchronously)")
    from xlakit.checkpoint.file import background
    from xlakit.checkpoint.torch_dcp import dcp_ranks

    background.check_previous()
    dcp_ranks.save(state, _dcp_store(path), opts)  # alone or on every rank, on disk or in a bucket
    return None


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
        path: the checkpoint folder, or the ``gs://`` / ``s3://`` URL it was saved to.
        options: a `LoadOptions` (``mmap``, ``layout`` and ``shard`` do not apply);
            ``verify`` checks every file against the commit record first.

    Raises:
        CheckpointIncompleteError: the folder has no commit record (an interrupted
            save, or one not written by xlakit).
        CheckpointCorruptError: a file is missing, truncated or fails its checksum.
        CheckpointFormatError: a non-tensor value holds pickled objects other than
            DCP's ``io.BytesIO`` values; values load weights-only, never running code.
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
    for name, given in (("mmap", opts.mmap), ("layout", opts.layout != "auto"),
                        ("shard", opts.shard is not None)):
        if given:
            raise ValueError(f"{name} applies to xlakit.load's files, not to DCP folders")
    from xlakit.checkpoint.torch_dcp import dcp_ranks

    dcp_ranks.load(state, _dcp_store(path), opts)
    return None


def _dcp_store(path: str | os.PathLike):
    """Where a DCP checkpoint is: a folder, or a generation of a URL."""
    objstore.check_url(path)
    if objstore.is_url(path):
        from xlakit.checkpoint.torch_dcp import bucket_dcp

        return bucket_dcp.BucketDcp(path)
    from xlakit.checkpoint.torch_dcp import dcp

    return dcp.LocalDcp(Path(path))


def wait_until_idle(timeout_s: float | None = None) -> bool:
    """Wait until no xlakit worker is running: asynchronous saves, cancelled workers.

    A save cancelled while its worker was inside the runtime (a hung device) stops
    once that call returns; a new save waits for it briefly, then refuses
    (`CheckpointBusyError`). This waits for it explicitly.

    Args:
        timeout_s: how long to wait at most; None waits as long as it takes.

    Returns:
        True when every worker has returned (and an asynchronous save's handle holds its outcome:
        `handle.done()`, and the next save raises a failure nobody asked for), False if some still
        run after `timeout_s`.

    Raises:
        TypeError, ValueError: `timeout_s` is no number of seconds (None and inf wait as long as it takes).

    Example:
        >>> import xlakit
        >>> xlakit.wait_until_idle(1.0)
        True
    """
    from xlakit.checkpoint.core import workers
    from xlakit.checkpoint.file import background

    timeout_s = workers.seconds_to_wait(timeout_s, "timeout_s")
    end = None if timeout_s is None else time.monotonic() + timeout_s
    return workers.wait_until_idle(timeout_s) and background.wait_for_handle(
        None if end is None else max(end - time.monotonic(), 0.0))
