"""`CheckpointManager`: when to save, which steps to keep, where to resume, what to do on SIGTERM.

The manager adds policy, not a new way to write: each step is one
`xlakit.save` (or `dcp_save`) into `<directory>/<step>/`, committed by that
save's own commit point, and the steps are whatever `steps.scan` finds
committed on disk (see `steps.py` for the layout and why a crash at any moment
leaves a consistent view; `bucket_steps.py` for the same on object storage,
where a lease replaces the folder's lock). In a torch.distributed job every
decision goes through the job's agreement (`decisions.decide`): the
configuration when the managers start, the step before each save (rank 0
writes its record, or every rank learns why it could not), and the set of
steps to delete after each commit or at a rollback (`rollback.py`; rank 0
moves them to the trash only once every rank proposed the same set and voted).
Ranks call the manager's methods in the same order, as they call collectives.

Asynchronous saves run one at a time; the next `save`, `wait`, `restore` or
`close` waits for the one in flight and raises its error, and runs retention
once it committed; at interpreter exit a manager nobody closed does the same
(in a one-process job: with several ranks retention needs them all, so it
waits for the next save). Preemption (`install_preemption_handler`) is agreed as
described in `preemption.py`; the save at the agreed step is synchronous and
bounded by what is left of the grace. A local tier (`local=LocalTier(...)`,
`tiered.py`) adds frequent saves to host RAM with peer copies, saved first at
a preemption, and restores each part from the fastest tier (`tier_restore.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import time
import weakref
from collections.abc import Mapping
from typing import Any

from xlakit import _knobs
from xlakit.checkpoint.manager import manager_exit
from xlakit.checkpoint.coordination import agreement, decisions
from xlakit.checkpoint.stepstore import readonly, retention, rollback, steps
from xlakit.checkpoint.tier import tiered
from xlakit.checkpoint.tier.local_tier import LocalTier
from xlakit.checkpoint.core.operation import Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions, _bool, _count, _seconds, manager_options
from xlakit.checkpoint.manager.preemption import Preemption
from xlakit.checkpoint.stepstore.step_folders import folder_at
from xlakit.errors import CheckpointTimeoutError

log = logging.getLogger("xlakit")
_managers = itertools.count()  # managers made by this process: every rank counts the same


class CheckpointManager:
    """Saves a training state every few steps, keeps the steps a policy names, resumes from them.

    Args:
        directory: the manager folder (made if missing); each step is `<directory>/<step>/`. A
            `gs://` or `s3://` URL keeps the steps in a bucket (docs/object-storage.md).
        max_to_keep: keep the N most recent steps (None: all). The latest step, the best
            step and a step being written are never deleted.
        keep_every_n_steps: also keep every step divisible by N.
        save_interval_steps: `should_save(step)` is true every N steps.
        best_metric: keep the step whose `metrics[best_metric]` is best (`best_mode`).
        best_mode: "min" or "max".
        layout: "single" (one process), "replicated", "sharded" (`xlakit.save` layouts) or
            "dcp" (`xlakit.dcp_save`; restores need a template).
        asynchronous: saves return once the state is on the host (not with "dcp").
        replica_parallel: (layout "replicated") each rank writes a share of every step, and a
            restore reads each share once and broadcasts it (`xlakit.save`'s option, docs/manager.md).
        options: `SaveOptions` for every save (timeout_s, ...); layout and asynchronous
            are the manager's.
        local: a `LocalTier`: frequent saves to host RAM or a local disk, copied to peer hosts;
            `restore` then takes each part from the fastest tier (docs/manager.md, the local tier).
            `manager.local` is its `tiered.TierRun` (`restored_from`, `last_error`).

    Example:
        >>> import torch, xlakit
        >>> with xlakit.CheckpointManager(getfixture("tmp_path"), max_to_keep=2) as mgr:
        ...     for step in range(1, 5):
        ...         _ = mgr.save(step, {"w": torch.full((2,), float(step))})
        ...     mgr.all_steps(), mgr.restore()["w"]
        ([3, 4], tensor([4., 4.]))
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None,
                 keep_every_n_steps: int | None = None, save_interval_steps: int = 1,
                 best_metric: str | None = None, best_mode: str = "min", layout: str = "single",
                 asynchronous: bool = False, replica_parallel: bool = False, options: SaveOptions | None = None,
                 local: LocalTier | None = None):
        self.policy = retention.Retention(max_to_keep, keep_every_n_steps, best_metric, best_mode)
        local_config = tiered.config_of(local)  # a TypeError before anything is made
        _count("save_interval_steps", save_interval_steps, minimum=1)
        if layout not in steps.LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, steps.LAYOUTS))}, got {layout!r}")
        _bool("asynchronous", asynchronous)
        self._folder = folder_at(directory)
        self.directory, self.layout, self.asynchronous = self._folder.directory, layout, asynchronous
        self.save_interval_steps = save_interval_steps
        self._options = manager_options(options, layout, asynchronous, replica_parallel)
        self._world = agreement.world_size()
        if layout in ("replicated", "sharded") or self._world > 1:
            self._rank = agreement.dist().get_rank()  # refuses a coordinated layout outside a job
        else:
            self._rank = 0
        if layout == "single" and self._world > 1:
            raise ValueError(f"layout='single' writes from one process, and this job has {self._world} "
                             f"ranks; use 'replicated' (one writer), 'sharded' or 'dcp'")
        self._prefix = f"xlakit/manager/{next(_managers)}"
        self._folder.make()
        self._lock = None  # rank 0's hold on the folder (see _hold_folder)
        self._damage_told: set[tuple[int, str]] = set()
        found = self._scan()
        self._steps = set(found.committed)
        self._last = found.latest  # the highest step saved or being saved
        self._pending: tuple[int, Any] | None = None  # an asynchronous save in flight
        self._preemption: Preemption | None = None
        self._preempt_saved = False
        self._closed = False
        config = {"layout": layout, "asynchronous": asynchronous, "interval": save_interval_steps,
                  "replica_parallel": replica_parallel,
                  **dataclasses.asdict(self.policy), "local": local_config}
        try:
            decisions.decide("manager start", self._path(), {"config": config, "latest": self._last,
                                                             "steps": sorted(self._steps),
                                                             "manager": self._prefix}, self._watch(),
                             prepare=self._hold_folder)
            self.local = None if local is None else tiered.TierRun(local, world=self._world, rank=self._rank,
                                                                   layout=layout, options=self._options,
                                                                   run=self.directory)
        except BaseException:
            self._release()
            raise
        if self._rank == 0:
            self._folder.clean()  # what a killed retention or save left
        manager_exit.track(self)

    # -- queries ----------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """The committed steps, oldest first (read from the folder; the persistent tier's only)."""
        return sorted(self._scan().committed)

    def latest_step(self) -> int | None:
        """The newest committed step, or None; with `local=`, the newest of either tier (docs/manager.md)."""
        return self.local.latest(self._scan().latest) if self.local is not None else self._scan().latest

    def best_step(self) -> int | None:
        """The committed step with the best `best_metric`; None without one (or without a metric)."""
        return retention.best(self._scan().committed, self.policy)

    def should_save(self, step: int) -> bool:
        """True when `step` is to be saved: every `save_interval_steps` (or local interval), at a preemption.

        A step already committed (or being saved) is not saved again; one whose save failed is,
        and after a rollback every step below the latest (its `save` refused, naming
        `retire_steps_after`). Call it (or `save`) every step: a preemption is agreed there.
        """
        self._check_open()
        step = steps.check_step(step)
        self._folder.renew()  # object storage: the lease, renewed once half of it is spent
        return self._preempting(step, deciding=True) or self._regular(step) or self._local_due(step, False)

    def reached_preemption(self, step: int) -> bool:
        """True from the agreed preemption step on (on every rank alike): save there, then stop."""
        self._check_open()
        step = steps.check_step(step)
        if self._preemption is None:
            return False
        self._preemption.poll(step, deciding=False)
        return self._preemption.due(step)

    # -- saving -----------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, metrics: Mapping[str, float] | None = None,
             force: bool = False) -> bool:
        """Save `state` as `step` if `should_save(step)` (or `force`); True when it saved.

        Raises what the previous asynchronous save raised, first. After the save
        commits, steps outside the kept set are deleted.

        Raises:
            ValueError: `step` is at or below the latest step (`retire_steps_after`); no `best_metric`.
            CheckpointWriteError: `<directory>/<step>` exists and is not the manager's.
            CheckpointError: what the save raised (see `xlakit.save`).
        """
        self._check_open()
        step = steps.check_step(step)
        metrics = retention.check_metrics(metrics, self.policy.best_metric)
        _bool("force", force)
        preempt = self._preempting(step, deciding=True)
        local = self._local_due(step, preempt)  # at a preemption: the local tier first (docs/manager.md)
        if not (force or preempt or self._regular(step)):
            return local and self.local.save(step, state, persistent=self._steps)
        with self._answering(step):
            refused = local and self.local.save_before_persistent(
                step, state, preempt, self._preemption.remaining_s() if preempt else None, self._steps)
            saved = self._save(step, state, metrics, preempt)
            if refused:
                raise refused
            return saved

    def _save(self, step: int, state: Any, metrics: dict, preempt: bool) -> bool:
        self._finish_pending()
        rollback.refuse_at_or_below_latest(step, self._steps, self.directory)  # the same on every rank
        opts = self._options
        if preempt:
            left = self._preemption.remaining_s()
            if left <= 0:
                raise CheckpointTimeoutError(
                    f"the preemption save of step {step} into {self.directory} did not start: the grace of "
                    f"{self._preemption.grace_s:g} s after SIGTERM ran out first; nothing was written",
                    stage="preemption")
            opts = dataclasses.replace(opts, timeout_s=min(opts.timeout_s, left))
        record = {"format": steps.STEP_FORMAT, "step": step, **steps.record_fields(self.layout, opts.replica_parallel),
                  "metrics": metrics, "best_metric": self.policy.best_metric,
                  "best_mode": self.policy.best_mode, "world": self._world, "time_unix": time.time()}

        def prepare(op) -> None:
            self._folder.renew(op, opts.timeout_s)  # object storage: the lease covers the save
            rollback.refuse_at_or_below_latest(step, self._scan(op).committed, self.directory)  # now
            self._folder.prepare(op, step, record)

        decisions.decide("manager save", self._folder.identity(step), {"step": step}, Watch.of(opts),
                         prepare=prepare)
        previous, self._last = self._last, step if self._last is None else max(self._last, step)
        target = self._folder.target(step, record)
        from xlakit import checkpoint  # (the package imports this module)
        try:
            if self.layout == "dcp":
                checkpoint.dcp_save(state, target, options=opts)
            else:
                background = self.asynchronous and not preempt
                handle = checkpoint.save(state, target, options=dataclasses.replace(
                    opts, asynchronous=background, staging=opts.staging if background else "host"))
                if background:
                    self._pending = (step, handle)
                    return True
        except BaseException as e:
            self._last = previous  # nothing was saved: `should_save(step)` is true again, a retry saves
            if isinstance(e, (TypeError, ValueError)) and self._world == 1:  # refused: no step left (`withdraw`)
                self._folder.withdraw(step, record)
            raise
        self._preempt_saved = self._preempt_saved or preempt
        self._committed(step)
        return True

    def wait(self) -> None:
        """Wait for the asynchronous save in flight; raise its error; then apply retention."""
        self._check_open()
        self._finish_pending()

    def retire_steps_after(self, step: int) -> list[int]:
        """Roll back to the committed (or local-tier) `step`: delete every newer step, to go on from it.

        The explicit rollback (a save below the latest step is refused), after `restore(step)`:
        the newer steps go as retention's do, once every rank agreed (`rollback.py`).

        Returns:
            The steps deleted, oldest first (empty when `step` is the latest), local ones (any host) too.

        Raises:
            ValueError: `step` is not committed, nor whole in the local tier; nothing is deleted.
            CheckpointPeerError: the ranks disagree on what to delete; nothing is deleted.

        Example:
            >>> import torch, xlakit
            >>> with xlakit.CheckpointManager(getfixture("tmp_path")) as mgr:
            ...     _ = [mgr.save(s, {"w": torch.full((2,), float(s))}) for s in (10, 20, 100)]
            ...     _ = mgr.restore(20)            # roll back, then train on from step 21
            ...     mgr.retire_steps_after(20), mgr.save(30, {"w": torch.zeros(2)}), mgr.all_steps()
            ([100], True, [10, 20, 30])
        """
        self._check_open()
        step = steps.check_step(step)
        self._finish_pending()
        found = self._scan()
        held = self.local is not None and self.local.holds(step)  # a step restored from the local tier
        doomed = rollback.retire(self._folder, step, found, self._scan, self._watch(), held_locally=held)
        self._steps = set(found.committed).difference(doomed)
        removed = self.local.retire_after(step) if self.local is not None else []  # and before a save
        self._last = max(self._steps, default=None)
        if self._rank == 0:
            self._folder.clean()  # the retired steps' trash
        return sorted(set(doomed) | set(removed))

    # -- restoring --------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, template: Any = None, model: Any = None,
                optimizer: Any = None, options: LoadOptions | None = None) -> Any:
        """The state saved at `step` (default: the latest), verified.

        Without `template`, `model` or `optimizer`: `xlakit.load`'s result (CPU tensors; a sharded
        step gives each rank its shard). With them: `xlakit.restore`'s (`model=`, `optimizer=`:
        the template's entries "model", "optimizer"). A "dcp" step needs a template and returns
        it. `options` go to the load (`LoadOptions(strict=False)`: part of the saved state).

        Raises:
            FileNotFoundError: no committed step (or not this one); the steps found are named.
            ValueError: a "dcp" step without a template.
        """
        from xlakit.checkpoint.file import live
        self._check_open()
        self._finish_pending()
        template, objects = live.template_of(template, model=model, optimizer=optimizer)
        return live.fill(objects, lambda: self._restore(step, template, options))

    def _restore(self, step: int | None, template: Any, options: LoadOptions | None) -> Any:
        found = self._scan()
        self._steps = set(found.committed)  # what is on disk now: a rollback may follow
        if self.local is not None:  # each part from the fastest tier that holds it (tier_restore.py)
            return self.local.restore(found, step, template, options, self.directory)
        chosen = readonly.choose_step(found, step, self.directory, self._folder.step_path)
        return readonly.read_step(chosen, template, replicated=self._world > 1, options=options)

    # -- preemption -------------------------------------------------------------------------------
    def install_preemption_handler(self, *, grace_s: float | None = None) -> None:
        """Turn SIGTERM (on any rank) into one agreed step that every rank saves.

        After the signal, `should_save(step)` is true at the first step every rank can
        reach (the same step everywhere); that save is synchronous and must end before
        the grace runs out; then `reached_preemption(step)` is true on every rank. The
        handler only records the signal; `close()` puts the previous handler back.

        Args:
            grace_s: seconds from the signal to the end of the save (default
                `XLAKIT_PREEMPTION_GRACE_S`, 30: what a preempted TPU VM gets).
        """
        self._check_open()
        grace_s = _knobs.get_float(_knobs.PREEMPTION_GRACE_S) if grace_s is None else grace_s
        _seconds("grace_s", grace_s)
        if self._preemption is not None:
            raise RuntimeError("install_preemption_handler() was already called on this manager")
        board = None
        if self._world > 1:
            board = agreement.Coordination("preemption", {"path": self._path()},
                                           prefix=f"{self._prefix}/preemption")
        preemption = Preemption(board, grace_s)
        preemption.install((signal.SIGTERM,))
        self._preemption = preemption

    # -- closing ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight (raising its error), then restore the signal handler."""
        if self._closed:
            return
        try:
            self._finish_pending()
        finally:
            self._closed = True
            if self._preemption is not None:
                self._preemption.uninstall()
            self._release()

    def _hold_folder(self, op) -> None:
        """(Rank 0, which deletes.) Lock the folder: a second manager or job on it is refused."""
        # A manager dropped without close() releases it when collected (or at exit).
        self._lock = weakref.finalize(self, self._folder.hold(op))

    def _release(self) -> None:
        if self._lock is not None:
            self._lock()  # the folder's lock is released
            self._lock = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001 - the block's own exception goes first
            exc.add_note(f"Closing the checkpoint manager also failed: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return (f"<CheckpointManager {self.directory} layout={self.layout!r} "
                f"{'closed' if self._closed else f'last={self._last}'}>")

    # -- internals --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the checkpoint manager of {self.directory} is closed")

    def _path(self) -> str:
        return self._folder.identity()

    def _watch(self) -> Watch:
        return Watch.of(self._options)

    def _regular(self, step: int) -> bool:
        in_flight = self._pending is not None and self._pending[0] == step
        below = bool(self._steps) and step < max(self._steps)  # a rollback: due, its save says how
        return step % self.save_interval_steps == 0 and (below or step not in self._steps) and not in_flight

    def _scan(self, op=None) -> steps.Scan:
        """The folder as it is now; a step with a damaged record is named (once), never left out silently."""
        found = self._folder.scan(op)  # object storage: within `op`'s deadline
        for step, why in sorted(found.damaged.items()):
            if (step, why) not in self._damage_told:
                self._damage_told.add((step, why))
                log.warning("xlakit: %s is not a step of the manager: its %s is damaged (%s). %s",
                            self._folder.step_path(step), steps.STEP_RECORD, why,
                            steps.damage_note(self._folder.step_path(step)))
        return found

    def _local_due(self, step: int, preempt: bool) -> bool:
        return self.local is not None and self.local.due(step, preempt)

    def _preempting(self, step: int, *, deciding: bool) -> bool:
        if self._preemption is None or self._preempt_saved:
            return False
        self._preemption.poll(step, deciding=deciding)
        return self._preemption.due(step)

    def _answering(self, step: int):
        """While this rank waits for the others at `step`, it answers a preemption notice."""
        if self._preemption is None:
            return contextlib.nullcontext()
        return agreement.answering(self._preemption.answering(step))

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, handle = self._pending
        self._pending = None
        try:
            handle.result()
        except BaseException as e:
            e.add_note(f"This was the asynchronous save of step {step} into {self.directory}; it was "
                       f"not committed. Committed steps: {sorted(self._steps)}.")
            raise
        self._committed(step)

    def _committed(self, step: int) -> None:
        self._steps.add(step)
        found = self._scan()
        doomed = retention.doomed(found, self.policy, saved=step)

        def discard() -> None:
            self._folder.renew()  # object storage: still this manager's to delete in (or it raises)
            self._folder.discard(doomed)

        decisions.decide("retention", self._path(), {"after": step, "doomed": doomed}, self._watch(),
                         act=discard if doomed else None)
        self._steps.difference_update(doomed)
        if self._rank == 0 and not self._preempt_saved:  # preempted: the grace is for the save
            self._folder.clean()


