"""Starting the XLA runtime for a report: a runtime that cannot start is a finding, never a traceback.

`manifest`, `log_manifest` and `doctor` start the runtime to list devices,
and a start fails in ways no caller can list: a plugin raises `OSError`
("libtpu not found"), the client `RuntimeError`, a broken torch_xla anything
at import. Each comes back as `{"why_not", "fix"}`. The failures torch_xla
explains worst (a TPU run without libtpu, or torch_xla itself broken) are
recognised before anything starts, so their fix can be exact: the libtpu
version is the newest the pinned `tpu` profile allows, read from the pins.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from xlakit import _knobs
from xlakit.runtime import features, pins as _pins


def blocker(pins: str | os.PathLike | None = None) -> dict[str, str] | None:
    """Why the runtime cannot start, known without starting it (`{"why_not", "fix"}`), or None."""
    if features.xlac() is None:  # imports torch_xla, which looks for libtpu and records where
        return {"why_not": f"cannot import torch_xla: {features.xla_import_error()}",
                "fix": "repair or reinstall torch_xla for this torch (the error above is what its import raised; "
                       "`python -c 'import torch_xla'` shows it whole)"}
    if os.environ.get(_knobs.PJRT_DEVICE) != "TPU":
        return None
    given = os.environ.get(_knobs.TPU_LIBRARY_PATH)
    if given and not Path(given).is_file():
        return {"why_not": f"{_knobs.PJRT_DEVICE}=TPU but {_knobs.TPU_LIBRARY_PATH}={given} is not a file",
                "fix": f"point {_knobs.TPU_LIBRARY_PATH} at libtpu.so, or unset it to use the installed libtpu"}
    if given or os.environ.get(_knobs.PTXLA_TPU_LIBRARY_PATH):
        return None
    pin = _pins.newest_pinned("libtpu", _pins.TPU_PROFILE, pins)
    return {"why_not": f"{_knobs.PJRT_DEVICE}=TPU but libtpu is not installed (torch_xla found no libtpu package, "
                       f"no bundled libtpu.so, and {_knobs.TPU_LIBRARY_PATH} is unset)",
            "fix": f"pip install libtpu=={pin} (the newest the pinned {_pins.TPU_PROFILE} profile allows), or "
                   f"point {_knobs.TPU_LIBRARY_PATH} at a libtpu.so; on a host without TPUs, "
                   f"export {_knobs.PJRT_DEVICE}=CPU"}


def failure(error: Exception) -> dict[str, str]:
    """A runtime start that raised, as a finding."""
    device = os.environ.get(_knobs.PJRT_DEVICE)
    return {"why_not": f"the runtime did not start: {type(error).__name__}: {error}",
            "fix": f"check that {_knobs.PJRT_DEVICE}={device} names hardware this host has, that its plugin "
                   "is installed and that no other process holds the devices (the error is torch_xla's)"}


def start(*, contract_ok: bool, pins: str | os.PathLike | None = None) -> dict[str, Any]:
    """Start the runtime unless something forbids it, and describe it; a failure holds `why_not` (and `fix`)."""
    found = blocker(pins)
    if found:
        return found
    xlac = features.xlac()
    if not contract_ok and not xlac._xla_runtime_is_initialized():
        return {"why_not": "not started: the run contract is broken (see contract)"}
    try:
        import torch_xla.runtime as xr

        local = list(xlac._xla_get_runtime_devices())
        return {
            "device_type": xr.device_type(),
            "platform_version": xlac._xla_get_platform_version(),
            "spmd": xr.is_spmd(),
            "local_devices": len(local),
            "global_devices": xr.global_runtime_device_count(),
            "runtime_devices": local,
        }
    # A plugin may raise anything while the client starts (OSError, RuntimeError, ValueError, ...): whatever
    # it is, it is what this report is for.
    except Exception as e:
        return failure(e)
