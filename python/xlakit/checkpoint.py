"""`save` and `load`: the synchronized, timeout-guarded checkpoint.

A save is four stages under one deadline: *sync* (one graph materialises all
pending XLA tensors), *transfer* (byte-capped batches to host), *write*
(streamed into a temporary file beside the target, checksummed) and *commit*
(fsync, rename, fsync the folder). Nothing touches the final name before
commit, so every failure, timeout or kill leaves the previous checkpoint.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import pickle
import time
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from xlakit import _archive, _job, _tree, atomic, transfer
from xlakit.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError
from xlakit.options import LoadOptions, SaveOptions, resolve

if TYPE_CHECKING:
    from xlakit.async_save import SaveHandle

log = logging.getLogger("xlakit")


def save(obj: Any, path: str | os.PathLike, *, options: SaveOptions | None = None,
         **overrides: Any) -> "SaveHandle | None":
    """Save a training state atomically, verified and within one deadline.

    Args:
        obj: nested state: dicts/lists/tuples of tensors (XLA, CUDA or CPU), numbers,
            strings, bools, None; e.g. ``{"model": m.state_dict(), "step": 10}``.
        path: the checkpoint file; its folder must exist.
        options: a `SaveOptions`; keyword overrides (``timeout_s=600``) win over it.
            ``layout="replicated"|"sharded"`` coordinates the ranks of a torch.distributed
            job; ``asynchronous=True`` returns once the state is on the host.

    Returns:
        None, or with ``asynchronous=True`` a `SaveHandle` whose ``result()`` raises
        what the background write raised.

    Raises:
        CheckpointTimeoutError: the deadline passed (stage, tensor and bytes named).
        CheckpointSerializationError: `obj` holds something a weights-only file cannot.
        CheckpointWriteError: no folder, no permission, disk full.
        CheckpointBusyError: a save abandoned at its deadline is still stuck in the runtime.

    Example:
        >>> import torch, xlakit
        >>> xlakit.save({"w": torch.ones(2)}, getfixture("tmp_path") / "ckpt.pt")
    """
    from xlakit import async_save

    opts: SaveOptions = resolve(SaveOptions, options, overrides)
    async_save.check_previous()  # an unfinished or failed background save speaks first
    if opts.layout != "single":
        from xlakit import distributed

        return distributed.save(obj, Path(path), opts)
    if opts.asynchronous:
        return async_save.start(obj, Path(path), opts)
    save_file(obj, Path(path), opts)
    return None


def prepare(obj: Any, final: Path) -> tuple[list[_tree.TensorEntry], bytes]:
    """Everything checked before a byte is written: the state's tensors, its pickle, the folder."""
    _job.check_no_abandoned_work()
    entries = _tree.collect(obj)
    pickled = _archive.pickle_state(obj, entries)
    if not final.parent.is_dir():
        raise atomic.write_error(FileNotFoundError(2, "No such file or directory"), final,
                                 stage="open")
    return entries, pickled


def save_file(obj: Any, final: Path, opts: SaveOptions, *, started: float | None = None) -> None:
    """One process, one file: the synchronous save (`started` shares an earlier deadline)."""
    entries, pickled = prepare(obj, final)
    write_file(entries, pickled, final, opts, stage_groups(entries), started=started)


def stage_groups(entries: list[_tree.TensorEntry]) -> list[tuple[list[_tree.TensorEntry], Any]]:
    """The entries grouped by device type, each group with its transfer backend."""
    groups = [list(g) for _, g in itertools.groupby(
        sorted(entries, key=lambda e: e.device_type), key=lambda e: e.device_type)]
    return [(g, transfer.backend_for(g[0].device_type, g[0].tensor)) for g in groups]


def host_batches(job: _job.Job, groups: list, opts: SaveOptions) -> Iterator[tuple]:
    """Sync every group once, then yield (backend, batch, host tensors) under the job's deadline.

    The caller drops each batch's host tensors before asking for the next, so
    at most one batch (`max_inflight_bytes`) is held at a time.
    """
    deadline = job.started + opts.timeout_s
    for group, backend in groups:
        job.enter("sync")
        backend.prepare([e.tensor for e in group])
    for group, backend in groups:
        for batch in transfer.batches(group, opts.max_inflight_bytes):
            job.enter("transfer", batch[0].path)
            remaining = max(deadline - time.monotonic(), 0.001)
            yield backend, batch, transfer.batch_to_host(backend, batch, timeout_s=remaining)


def write_file(entries: list[_tree.TensorEntry], pickled: bytes, final: Path, opts: SaveOptions,
               groups: list, *, started: float | None = None) -> None:
    """Transfer and write `groups` into `final` atomically, watched under the deadline."""
    atomic.remove_stale_temps(final)
    tmp = atomic.temp_path(final)
    job = _job.Job("save", str(final), sum(e.nbytes for e in entries))
    if started is not None:
        job.started = started

    def on_timeout(j: _job.Job) -> str:
        atomic.discard(tmp)
        return (f"The temporary file was removed; the previous checkpoint at {final}, if any, is "
                f"untouched. The abandoned {j.stage} continues in the background until the runtime "
                f"returns; the next save refuses to start while it is stuck.")

    _job.run(job, lambda j: _write(j, groups, pickled, tmp, final, opts), watch_for(opts),
             on_timeout)


def watch_for(opts: SaveOptions | LoadOptions) -> _job.Watch:
    return _job.Watch(opts.timeout_s, opts.stall_warning_s, opts.progress_interval_s,
                      opts.progress_callback)


def _write(job: _job.Job, groups: list, pickled: bytes, tmp: Path, final: Path,
           opts: SaveOptions) -> None:
    job.enter("open")
    try:
        f = open(tmp, "xb")
    except OSError as e:
        raise atomic.write_error(e, final, stage="open") from e
    committed = False
    try:
        with f, _archive.ArchiveWriter(f, compute_crc32=opts.compute_crc32) as writer:
            writer.write_header(pickled)
            for _, batch, hosts in host_batches(job, groups, opts):
                for entry, host in zip(batch, hosts):
                    job.enter("write", entry.path)
                    writer.write_tensor(entry, host)
                    job.advance(entry.nbytes)
                del hosts
            writer.finish()
            job.enter("commit")
            f.flush()
            os.fsync(f.fileno())
        with _job.commit_guard(job):
            atomic.commit(tmp, final)
            committed = True
    except OSError as e:
        if isinstance(e, CheckpointError):  # CheckpointTimeoutError is an OSError too
            raise
        raise atomic.write_error(e, final, stage=job.stage, bytes_done=job.bytes_done) from e
    finally:
        if not committed:
            atomic.discard(tmp)


def load(path: str | os.PathLike, *, options: LoadOptions | None = None, **overrides: Any) -> Any:
    """Load a checkpoint after verifying every checksum; tensors come back on the CPU.

    Weights-only: no pickled code is ever run. Move tensors to the device with
    ``model.load_state_dict(state)`` as usual.

    Args:
        path: a file written by `xlakit.save` (with ``verify=False``, any torch.save file),
            or the folder of a sharded checkpoint: inside the job each rank gets its own
            shard (all ranks load, or all raise); elsewhere pass ``shard=N``.
        options: a `LoadOptions`; keyword overrides (``verify=False``) win over it.

    Raises:
        CheckpointCorruptError: a checksum does not match (the tensor is named), or the
            file is truncated or not an archive.
        CheckpointFormatError: the file has no xlakit checksums and `verify` is on.
        CheckpointTimeoutError: the deadline passed.

    Example:
        >>> import torch, xlakit
        >>> p = getfixture("tmp_path") / "ckpt.pt"
        >>> xlakit.save({"w": torch.ones(2)}, p)
        >>> xlakit.load(p)["w"]
        tensor([1., 1.])
    """
    opts: LoadOptions = resolve(LoadOptions, options, overrides)
    final = Path(path)
    if final.is_dir() or opts.layout == "replicated":
        from xlakit import distributed

        if opts.shard is not None:
            return distributed.load_shard(final, opts.shard, opts)
        return distributed.load(final, opts)
    return load_file(final, opts)


def load_file(final: Path, opts: LoadOptions) -> Any:
    """Load and verify one checkpoint file in this process."""
    if not final.is_file():
        raise FileNotFoundError(2, f"no checkpoint at {final}", str(final))
    job = _job.Job("load", str(final), final.stat().st_size)
    return _job.run(job, lambda j: _read(j, final, opts), watch_for(opts),
                    lambda j: "Nothing was changed on disk.")


def _read(job: _job.Job, path: Path, opts: LoadOptions) -> Any:
    if opts.verify:
        job.enter("verify")
        verify_file(path, job)
    job.enter("read")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=opts.mmap)
    except pickle.UnpicklingError as e:
        err = CheckpointFormatError(f"{path} holds pickled objects that a weights-only load refuses "
                                    f"to run: {str(e).splitlines()[0]}")
        err.add_note("xlakit.load never executes pickled code. If you trust the file, load it with "
                     "torch.load(path, weights_only=False).")
        raise err from e
    except (RuntimeError, ValueError, KeyError, EOFError) as e:
        # The checked records were intact; damage elsewhere (names, headers) surfaces here.
        raise CheckpointCorruptError(f"{path}: the archive is damaged outside the checksummed "
                                     f"records and torch.load failed: {type(e).__name__}: {e}") from e


def verify_file(path: Path, job: _job.Job | None = None) -> None:
    """Check the pickle and every storage of `path` against its recorded checksums."""
    meta, reader = _archive.read_checksums(str(path))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        pk = meta["pickle"]
        _archive.verify_record(mapped, reader, "data.pkl", pk["nbytes"], pk[_archive.HASH],
                               "the pickled structure (data.pkl)", str(path), None)
        for check in _archive.iter_checks(meta):
            if job is not None:
                job.enter("verify", check.path)
            _archive.verify_record(mapped, reader, f"data/{check.key}", check.nbytes,
                                   check.expected, f"tensor {check.path!r}", str(path), check.path)
            if job is not None:
                job.advance(check.nbytes)
