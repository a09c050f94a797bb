"""`XlakitCheckpointIO`: Lightning's checkpoints written and read by xlakit.

    trainer = Trainer(plugins=[xlakit.lightning.XlakitCheckpointIO(asynchronous=True)])

Every checkpoint Lightning saves goes through `xlakit.save` (atomic, verified,
one deadline; XLA tensors synced once and copied in byte-capped batches) and
every resume through `xlakit.load` (checksums first, no pickled code run).
With `asynchronous=True` the state is staged in host memory and written in
the background: nothing is cloned on the device (Lightning's
`AsyncCheckpointIO` clones every tensor where it lives), and a background
failure is raised by the next save or at teardown, never dropped.

Lightning's checkpoint dict is stored as weights-only data: containers that
are dicts or sequences in disguise (`AttributeDict` hyper-parameters, an
`argparse.Namespace`, a `defaultdict`) become plain dicts, lists and tuples,
enum members and numpy scalars their values;
anything else a weights-only load could not rebuild (a module, a class, a
function among the hyper-parameters) is refused before anything is written,
naming its key. Pickled code is never stored. The file is a normal torch
checkpoint: `LightningModule.load_from_checkpoint` reads it too.

This module imports Lightning; `import xlakit` does not.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import XLACheckpointIO

from xlakit.checkpoint.core import paths
from xlakit.checkpoint.format import archive
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions, _bool
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointSerializationError

log = logging.getLogger("xlakit.lightning")  # the public module path, which users filter by

_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.Size, torch.device)


def weights_only_state(value: Any, path: str = "") -> Any:
    """`value` as containers a weights-only load rebuilds; raises naming the first key it cannot store."""
    if isinstance(value, torch.Tensor) or type(value) in _SCALARS:
        return value
    if isinstance(value, enum.Enum):
        return weights_only_state(value.value, path)
    for base in (bool, int, float, str):  # subclasses (numpy.float64 is a float) as the base type
        if isinstance(value, base):
            return base(value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()  # a numpy scalar (numpy.int64 is no int)
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise _refuse(f"{path}/{key!r}" if path else repr(key), key, "dict keys must be strings or numbers")
            out[key] = weights_only_state(item, f"{path}/{key}" if path else str(key))
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise _refuse(path, value, "a named tuple is rebuilt by its class, which a weights-only load refuses")
    for kind in (list, tuple, set, frozenset):
        if isinstance(value, kind):  # a frozenset becomes a set: torch.load(weights_only=True) reads no frozenset
            return (set if kind is frozenset else kind)(
                weights_only_state(item, f"{path}/{i}") for i, item in enumerate(value))
    raise _refuse(path, value, "a weights-only checkpoint holds tensors, numbers, strings and containers")


def _refuse(path: str, value: Any, why: str) -> CheckpointSerializationError:
    err = CheckpointSerializationError(f"cannot store {path or 'the checkpoint'} in an xlakit checkpoint: "
                                       f"it is a {type(value).__module__}.{type(value).__qualname__}; {why}")
    if path.startswith(("hyper_parameters", "datamodule_hyper_parameters")):
        name = path.split("/")[1] if "/" in path else path
        err.add_note(f"Pass plain values as hyper-parameters, or leave it out: "
                     f"self.save_hyperparameters(ignore=[{name!r}]).")
    else:
        err.add_note("Return plain dicts of tensors and numbers from state_dict() / on_save_checkpoint().")
    return err


class XlakitCheckpointIO(XLACheckpointIO):
    """Lightning `CheckpointIO` that saves with `xlakit.save` and loads with `xlakit.load`.

    It derives from Lightning's `XLACheckpointIO` only because Lightning's XLA strategies
    accept no other plugin; every method is xlakit's own, and it works with every strategy
    (CPU, CUDA, XLA) and without torch_xla.

    Args:
        asynchronous: stage each checkpoint in host memory and write it in the background;
            a failure is raised by the next save, load or `teardown()`.
        options: `xlakit.SaveOptions` for every save (timeout_s, max_inflight_bytes, ...).
        load_options: `xlakit.LoadOptions` for every load.

    Example:
        >>> import lightning.pytorch as pl, xlakit.lightning
        >>> trainer = pl.Trainer(plugins=[xlakit.lightning.XlakitCheckpointIO()], logger=False)
    """

    def __init__(self, *, asynchronous: bool = False, options: SaveOptions | None = None,
                 load_options: LoadOptions | None = None):
        _bool("asynchronous", asynchronous)
        for name, value, cls in (("options", options, SaveOptions), ("load_options", load_options, LoadOptions)):
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"{name} must be an xlakit.{cls.__name__}, got {type(value).__name__}")
        if options is not None and (options.layout != "single" or options.asynchronous):
            raise ValueError("Lightning saves from its global rank 0 only: options.layout must be 'single', "
                             "and asynchrony is the plugin's asynchronous=")
        if options is not None and options.staging != "host" and not asynchronous:
            raise ValueError(f"options.staging={options.staging!r} applies to asynchronous saves: pass "
                             f"XlakitCheckpointIO(asynchronous=True) or drop staging")
        if load_options is not None and not load_options.strict:
            raise ValueError("load_options.strict=False applies to xlakit.restore; the plugin loads whole "
                             "checkpoints with xlakit.load (Lightning picks what it needs from them)")
        # Not XLACheckpointIO.__init__: it insists on torch_xla, which this plugin does not need.
        self.asynchronous = asynchronous
        self.options = options or SaveOptions()
        self.load_options = load_options or LoadOptions()
        self._pending = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("XlakitCheckpointIO takes no storage_options; give the plugin options=SaveOptions(...)")
        self._finish_pending()
        state = weights_only_state(checkpoint)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)  # as Lightning's own TorchCheckpointIO does
        from xlakit import checkpoint as ckpt

        self._pending = ckpt.save(state, target, options=self.options, asynchronous=self.asynchronous)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load and verify a checkpoint; tensors on the CPU (or moved to a device `map_location`).

        The load is always weights-only, whatever `weights_only` says: xlakit never runs
        pickled code, and its checkpoints hold none.
        """
        self._finish_pending()
        from xlakit import checkpoint as ckpt

        try:
            state = ckpt.load(path, options=self.load_options)
        except CheckpointFormatError as e:  # its fix, as a Lightning user can apply it
            notes = getattr(e, "__notes__", [])
            if archive.NO_CHECKSUMS_NOTE in notes:
                notes[notes.index(archive.NO_CHECKSUMS_NOTE)] = (
                    "If you trust it (a checkpoint of Lightning's default CheckpointIO, or one edited by "
                    "hand), resume with the plugin reading it unverified: XlakitCheckpointIO("
                    "load_options=xlakit.LoadOptions(verify=False)).")
            raise
        if map_location is None or isinstance(map_location, (str, torch.device)):
            device = torch.device(map_location or "cpu")
            if device.type != "cpu":
                state = _to(state, device)
            return state
        raise TypeError(f"map_location={map_location!r}: XlakitCheckpointIO maps to one device (a "
                        f"torch.device or a string); Lightning then moves the state where the model is")

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete a checkpoint this plugin wrote; anything else is left in place, with a warning.

        Lightning removes checkpoints as it rotates them (`ModelCheckpoint(save_top_k=...)`); a run
        resumed with this plugin may rotate out files another CheckpointIO wrote. Those are not
        deleted (xlakit deletes only what it knows it wrote) and training goes on.
        """
        target = Path(path)
        if self._pending is not None and self._pending.path == target:
            self._finish_pending()
        if not target.exists():
            return
        if not target.is_file():
            _keep(target, "it is not a file, and XlakitCheckpointIO writes (and removes) one file per checkpoint")
            return
        try:
            archive.read_index(str(target))
        except (CheckpointFormatError, CheckpointCorruptError) as e:
            _keep(target, f"it is not a checkpoint xlakit wrote ({str(e).splitlines()[0]})")
            return
        os.unlink(target)
        paths.remove_stale_temps(target.parent, stem=target.name)
        paths.fsync_dir(target.parent)

    def teardown(self) -> None:
        """Wait for the checkpoint being written; raise its error."""
        self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def _keep(target: Path, why: str) -> None:
    log.warning("XlakitCheckpointIO: not removing %s: %s. Delete it yourself if it is not needed.", target, why)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value
