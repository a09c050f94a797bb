"""Reading a manager folder from another process while its training job writes it.

An evaluation job beside training wants the steps the trainer committed, as
they appear, without disturbing it. `ReadOnlyCheckpointManager` is that
reader. It never writes, renames or deletes anything (not even the trash a
killed manager left, nor a lock file), and never takes the folder's lock, so
the trainer starts and runs as if it were alone; any number of readers may
watch one folder.

What it sees is what `steps.scan` sees: only committed steps, since a step
exists only once its checkpoint's own commit (a rename, a commit record) is
in place, and retention takes a step out of every listing at once (a rename to
a trash name) before deleting it. The one race left is a step deleted while
it is being read: a single file opened before the deletion still reads whole
(the file system keeps it until it is closed), but a folder checkpoint may
lose files midway. A read that fails is therefore judged by whether its step
is still committed: if it is, the error is the checkpoint's and is raised; if
retention took it, `restore()` of the latest step reads the new latest, and
`restore(step)` says the step was deleted.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any

from xlakit.checkpoint import objstore
from xlakit.checkpoint.stepstore import retention, step_folders, steps
from xlakit.checkpoint.core.options import LoadOptions, _seconds
from xlakit.errors import CheckpointCorruptError, CheckpointIncompleteError

_ATTEMPTS = 5  # reads of the latest step, each after retention took the one before
_LONGEST_SLEEP_S = 3600.0  # time.sleep() refuses what the platform's time_t cannot hold


def choose_step(found: steps.Scan, step: int | None, directory: Any,
                step_path: Callable[[int], Any]) -> steps.StepFolder:
    """The committed step to read: `step`, or the latest; raises naming what the folder holds.
    `step_path(step)` is where a step lives (a folder, or a prefix on object storage)."""
    if step is None:
        step = found.latest
        if step is None:
            raise FileNotFoundError(errno.ENOENT, f"no committed step in {directory} ({found.describe()})",
                                    str(directory))
    step = steps.check_step(step)
    if step not in found.committed:
        if step in found.damaged:
            err = CheckpointCorruptError(f"step {step} in {directory} is not a step: its {steps.STEP_RECORD} "
                                         f"is damaged ({found.damaged[step]}); committed: {sorted(found.committed)}")
            err.add_note(steps.damage_note(step_path(step)))
            raise err
        if step in found.pending:
            raise CheckpointIncompleteError(f"step {step} in {directory} was never committed: "
                                            f"{found.pending[step].problem}; committed: {sorted(found.committed)}")
        raise FileNotFoundError(errno.ENOENT, f"no committed step {step} in {directory}; committed: "
                                f"{sorted(found.committed)}", str(step_path(step)))
    return found.committed[step]


def read_step(chosen: steps.StepFolder, template: Any = None, *, shard: int | None = None,
              replicated: bool = False, options: LoadOptions | None = None) -> Any:
    """A committed step's state: `xlakit.load`'s (or, with `template`, `xlakit.restore`'s) result.

    A "dcp" step needs the template and returns it; `shard` picks one shard of a "sharded" step
    outside its job; `replicated` loads a "replicated" step on every rank of a job; `options`
    (LoadOptions: `strict=False` for part of a state, timeouts) go to the load.
    """
    from xlakit import checkpoint

    if chosen.layout == "dcp":
        if template is None:
            raise ValueError(f"step {chosen.step} was saved with layout='dcp': a DCP checkpoint loads into "
                             f"a template, restore({chosen.step}, template=state) with tensors of the saved "
                             f"shapes (placed and sharded as wanted now)")
        checkpoint.dcp_load(template, chosen.checkpoint, options=options)
        return template
    where = {} if shard is None else {"shard": shard}
    if template is not None:
        return checkpoint.restore(chosen.checkpoint, template, options=options, **where)
    if replicated and chosen.layout == "replicated":
        return checkpoint.load(chosen.checkpoint, layout="replicated", options=options)
    return checkpoint.load(chosen.checkpoint, options=options, **where)


class ReadOnlyCheckpointManager:
    """Lists and restores the committed steps of a `CheckpointManager` folder, never changing it.

    For a process beside the one that trains (evaluation, export): it takes no
    lock, writes, renames and deletes nothing, and sees only committed steps even
    while the trainer saves and retention deletes (see the module docstring).

    Args:
        directory: the manager folder (it must exist), or its gs:// or s3:// URL.

    Example:
        >>> import torch, xlakit
        >>> folder = getfixture("tmp_path")
        >>> with xlakit.CheckpointManager(folder) as writer:
        ...     _ = writer.save(1, {"w": torch.ones(2)})
        ...     reader = xlakit.ReadOnlyCheckpointManager(folder)   # while the writer holds the folder
        ...     reader.latest_step(), reader.restore()["w"]
        (1, tensor([1., 1.]))
    """

    def __init__(self, directory: str | os.PathLike):
        self._folder = step_folders.folder_at(directory)
        self.directory = self._folder.directory
        if not objstore.is_url(directory) and not self.directory.is_dir():
            what = "is a file" if self.directory.exists() else "does not exist"
            raise FileNotFoundError(errno.ENOENT, f"{self.directory} {what}; a read-only manager reads an "
                                    f"existing CheckpointManager folder (it never creates one)",
                                    str(self.directory))

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self._scan().committed)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return self._scan().latest

    def best_step(self, best_metric: str | None = None, best_mode: str | None = None) -> int | None:
        """The committed step with the best metric: by default the `best_metric`/`best_mode` the
        writer recorded with its newest step; None without a metric or a step that has it."""
        committed = self._scan().committed
        if not committed:
            return None
        newest = committed[max(committed)].record
        policy = retention.Retention(best_metric=best_metric or newest.get("best_metric"),
                                     best_mode=best_mode or newest.get("best_mode", "min"))
        return retention.best(committed, policy)

    def metrics(self, step: int) -> dict:
        """The metrics recorded with committed step `step`."""
        return choose_step(self._scan(), step, self.directory, self._folder.step_path).metrics

    def restore(self, step: int | None = None, *, template: Any = None, model: Any = None,
                optimizer: Any = None, shard: int | None = None, options: LoadOptions | None = None) -> Any:
        """The state saved at `step` (default: the latest), verified; as `CheckpointManager.restore`.

        With `template`, its tensors are filled in place (`xlakit.restore`; `model=` and
        `optimizer=` are its entries "model" and "optimizer", live objects filled as
        `xlakit.restore` fills them); a "dcp" step needs one. `shard=N` reads one shard
        of a "sharded" step; `options` as for `xlakit.restore` (e.g.
        `LoadOptions(strict=False)` to restore part of the state). The latest step is
        read even while retention deletes it: the reader moves on to the new latest.

        Raises:
            FileNotFoundError: no committed step (or not this one), or this step was deleted
                by the writer's retention while it was read; the steps committed now are named.
            CheckpointIncompleteError: `step` was never committed (an interrupted save).
        """
        from xlakit.checkpoint.file import live

        template, objects = live.template_of(template, model=model, optimizer=optimizer)
        return live.fill(objects, lambda: self._restore(step, template, shard, options))

    def _restore(self, step: int | None, template: Any, shard: int | None, options: LoadOptions | None) -> Any:
        for _ in range(_ATTEMPTS):
            chosen = choose_step(self._scan(), step, self.directory, self._folder.step_path)
            try:
                return read_step(chosen, template, shard=shard, options=options)
            except Exception as e:  # noqa: BLE001 - raised again unless retention took the step
                found = self._scan()
                if chosen.step in found.committed:
                    raise
                if step is not None:
                    raise FileNotFoundError(errno.ENOENT, f"step {step} of {self.directory} was deleted by the "
                                            f"writer's retention while it was read; committed now: "
                                            f"{sorted(found.committed)}", str(chosen.path)) from e
        raise FileNotFoundError(errno.ENOENT, f"the latest step of {self.directory} was deleted by the writer's "
                                f"retention {_ATTEMPTS} times while it was read; read a kept step "
                                f"(keep_every_n_steps) or retry", str(self.directory))

    def wait_for_step(self, after: int | None = None, *, timeout_s: float, poll_interval_s: float = 1.0
                      ) -> int | None:
        """Wait until a step newer than `after` is committed; that step, or None after `timeout_s`.

        Example:
            >>> import xlakit
            >>> reader = xlakit.ReadOnlyCheckpointManager(getfixture("tmp_path"))
            >>> reader.wait_for_step(timeout_s=0.1, poll_interval_s=0.05) is None
            True
        """
        _seconds("timeout_s", timeout_s)  # inf: wait until a step comes
        _seconds("poll_interval_s", poll_interval_s)
        if after is not None:
            after = steps.check_step(after)
        end = time.monotonic() + timeout_s
        while True:
            latest = self.latest_step()
            if latest is not None and (after is None or latest > after):
                return latest
            left = end - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(poll_interval_s, left, _LONGEST_SLEEP_S))

    def _scan(self) -> steps.Scan:
        return self._folder.scan()

    def close(self) -> None:
        """Nothing to release (kept for symmetry with `CheckpointManager`)."""

    def __enter__(self) -> "ReadOnlyCheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ReadOnlyCheckpointManager {self.directory}>"
