"""The device checks in a child: start the backend, then the memory check and the checkpoint check in it.

They run in the compile cache's second process once its programs have run
(one process start fewer: a framework's import takes seconds), or in a
process of their own where there is no cache to check or where the cache
counts compiles only per process (TorchTPU). On torch_xla over a PJRT plugin
the device is started with the cache on, which is what loads xlakit's PJRT
wrapper and so its count of live buffers; elsewhere nothing is turned on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xlakit.selftest import check_checkpoint, check_memory, devices

NAMES = ("memory", "checkpoint")


def run_parts(backend: dict[str, Any], dev, params: dict[str, Any], results) -> None:
    """The memory and checkpoint parts asked for in `params`, on the started device `dev`."""
    if "memory" in params["checks"]:
        with results.part("memory") as got:
            got["check"] = check_memory.measure(backend, dev, params["memory_bytes"])
    if "checkpoint" in params["checks"]:
        with results.part("checkpoint") as got:
            folder = Path(params["folder"])
            folder.mkdir(mode=0o700)
            got["check"] = check_checkpoint.measure(backend, dev, params["checkpoint_bytes"], folder,
                                                    params["timeout_s"])


def child(params: dict[str, Any], results) -> None:
    backend = params["backend"]
    with results.part("start") as got:
        cache = Path(params["cache_dir"]) if backend.get("cache_route") == "pjrt-wrap" else None
        dev = devices.start(backend["name"], cache_dir=cache)
        got["device"] = str(dev.device)
    if "error" not in got:
        run_parts(backend, dev, params, results)
