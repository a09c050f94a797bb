"""Memory per device from xlakit's PJRT wrapper, in whatever process loaded it (torch_xla, jax).

The wrapper sits on every PJRT call of the clients it wraps, so it can answer
for every device of them, on stock torch_xla under SPMD too, where torch_xla
itself cannot (csrc/pjrt_wrap/memory_accounting.h). Two answers per device:

* its own accounting of live buffers (`live_bytes`, `live_buffers`,
  `peak_bytes` since the last `reset_peaks()`), on every plugin: the bytes of
  the buffers the C API handed out and the framework has not freed;
* the plugin's `PJRT_Device_MemoryStats` (`plugin`: every field the plugin
  set), or in `plugin_unavailable` why there is none (CPU plugins answer
  UNIMPLEMENTED).

One C call returns every device: cheap enough for every training step (a
`/memory` endpoint). Devices are named as torch_xla names its raw runtime
devices: platform and global id (`TPU:18`, `CPU:3`).
"""

from __future__ import annotations

import ctypes
import functools
import json
from typing import Any

from xlakit.runtime import pjrt_wrap

_MEMORY = "xlakit_pjrt_wrap_memory"
_PLUGIN_STATS, _RESET_PEAKS = 1, 2
_capacity = 1 << 14  # grows to the largest report seen


@functools.cache
def _function():
    """The exported report function, or None where the wrapper was not built or predates it."""
    if not pjrt_wrap.LIBRARY.is_file():
        return None
    try:  # an already-loaded library is the same handle: the runtime's state, not a fresh copy
        fn = getattr(ctypes.CDLL(str(pjrt_wrap.LIBRARY)), _MEMORY)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def report(*, plugin_stats: bool = True) -> dict[str, Any]:
    """The wrapper's memory report as it gives it; never raises.

    Returns:
        `{"installed": False, ...}` where no runtime of this process loaded the
        wrapper (with `why_not`); else `installed`, `accounting` (False under
        `XLAKIT_PJRT_MEMORY_ACCOUNTING=0`), `unattributed_buffers` and
        `devices`: one dict per device of every live client (`platform`, `id`,
        `process`, `kind`, `live_bytes`, `live_buffers`, `peak_bytes`,
        `created_buffers`, and with `plugin_stats` the plugin's figures in
        `plugin` or why not in `plugin_unavailable`), each named in `device`.
    """
    global _capacity
    fn = _function()
    if fn is None:
        return {"installed": False, "devices": [],
                "why_not": f"this xlakit has no PJRT wrapper with {_MEMORY} at {pjrt_wrap.LIBRARY}"}
    flags = _PLUGIN_STATS if plugin_stats else 0
    while True:  # devices do not come and go while a step runs, but a client may be created between calls
        capacity = _capacity
        buf = ctypes.create_string_buffer(capacity)
        size = fn(buf, capacity, flags)
        if size < capacity:
            break
        _capacity = size + (1 << 12)
    out = json.loads(buf.value.decode("utf-8", "replace"))
    if not out["installed"]:
        out["why_not"] = "no runtime of this process loaded xlakit's PJRT wrapper"
    for d in out["devices"]:
        d["device"] = f"{d['platform'].upper()}:{d['id']}"
    return out


def by_device(*, plugin_stats: bool = True) -> dict[str, dict[str, Any]]:
    """Every device the wrapper knows, by runtime device name; {} where it is not loaded.

    Example:
        >>> for name, d in by_device().items():
        ...     print(name, d["live_bytes"], d["plugin"] or d["plugin_unavailable"])
    """
    found = report(plugin_stats=plugin_stats)
    return {d["device"]: {**d, "accounting": found.get("accounting", True)} for d in found["devices"]}


def reset_peaks() -> None:
    """Set every device's peak to its live bytes now (the peak then runs from here)."""
    fn = _function()
    if fn is not None:
        fn(None, 0, _RESET_PEAKS)
