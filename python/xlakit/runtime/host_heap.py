"""Host memory that device-to-host copies reuse: glibc's malloc asked to keep freed blocks (opt-in).

A save that copies device tensors to host (torch_xla's stock and patched copies, TorchTPU's, a
CUDA device's) allocates each batch's host tensors anew, and torch_xla's stock copy allocates
twice (an XLA literal, then the tensor). glibc serves every block above its mmap threshold (at
most 32 MiB; a model's large weights are above it) with a fresh mapping and unmaps it when it is
freed, so every byte of every save is faulted in and zeroed by the kernel again, on the cores the
write needs. Measured on the 2-core dev machine, 2 GiB of 64 MiB tensors through torch_xla's stock
copy: 1.05 M minor page faults a save, 2.0 s of system time; the transfer alone takes 1.9 s, the save
2.8 s (writing the same bytes from CPU tensors: 1.1 s). With the heap kept, the transfer alone takes
0.6 s and the save, once the heap has grown, 1.4 s (`bench/bench_overlap.py`, its `stock+heap` rows;
docs/checkpoints.md has the table: faster from 1 GiB, not below).

`XLAKIT_KEEP_HOST_HEAP=1` in the process's environment has xlakit, when it is imported, set glibc's
M_ARENA_MAX to 1 and its M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to 2 GiB - 1: every thread allocates
from the main heap, large blocks come from it too, and freed memory stays there for the next batch.
It has to be early. A thread keeps the glibc arena it allocated from first, and a new thread takes
the arena of one that has ended before any other; the copies of a save run on threads of their own,
and a large block in any arena but the main one is a fresh mapping whatever the thresholds say. Set
at import, before the runtime's threads allocate, the setting holds for every later thread
(measured, 2 GiB of 64 MiB tensors: 375 k faults in the first save, at most 16 k in each later one; on
a loaded machine the second save may still grow the heap). Set
later (the variable put into `os.environ` by the program), it is applied at the first copying save
and may change nothing: in one measured process, 1.05 M faults in each of five saves. The same
setting at launch, for any process: the environment variable GLIBC_TUNABLES set to `LAUNCH_TUNABLES`
(below; glibc reads it at start). The price,
process-wide: the process keeps the memory it freed, and one heap shared by every thread fragments
(peak RSS above the state during a 2 GiB save: +1.2 GiB against +0.23 GiB without, the heap grown
over the first saves; so `max_inflight_bytes` no longer bounds it); threads share one allocator
lock; the first two saves are no faster. It is off by default for that reason, and pointless where
the process runs tcmalloc or jemalloc (`LD_PRELOAD`, as torch_xla's TPU images do: they cache freed
blocks themselves); xlakit then leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import threading

from xlakit import _knobs

log = logging.getLogger("xlakit")

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_KEEP = 2**31 - 1  # mallopt takes an int
_LARGE = 1 << 30  # thresholds from here up keep a model's tensors in the heap
_OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

_lock = threading.Lock()
_kept: bool | None = None  # None: not asked yet in this process (once asked, tried once)


def allocator() -> str:
    """The process's malloc: an allocator loaded into it by name, else its C library's ("glibc")."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        maps = ""
    for name in _OTHER_ALLOCATORS:
        if f"lib{name}" in maps:
            return name
    libc, _ = platform.libc_ver()
    return libc or "unknown"


def kept() -> bool:
    """Whether xlakit has asked glibc to keep freed host memory in this process."""
    return bool(_kept)


LAUNCH_TUNABLES = (f"glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold={2**31 - 1}"
                   f":glibc.malloc.trim_threshold={2**31 - 1}")


def kept_at_launch() -> bool:
    """Whether glibc was started with the same setting (GLIBC_TUNABLES names both thresholds and one arena)."""
    tunables = dict(part.partition("=")[::2] for part in os.environ.get("GLIBC_TUNABLES", "").split(":"))
    return (tunables.get("glibc.malloc.arena_max") == "1"
            and _LARGE <= _glibc_number(tunables.get("glibc.malloc.mmap_threshold", "")) < 2**64
            and _LARGE <= _glibc_number(tunables.get("glibc.malloc.trim_threshold", "")) < 2**64)


def _glibc_number(text: str) -> int:
    """A tunable's value as glibc reads it (decimal or 0x hex digits only); -1 for anything else."""
    if re.fullmatch(r"[0-9]+", text):
        return int(text)
    if re.fullmatch(r"0[xX][0-9a-fA-F]+", text):
        return int(text, 16)
    return -1


def keep_at_import() -> None:
    """(At `import xlakit`.) Apply `XLAKIT_KEEP_HOST_HEAP` while few threads have allocated yet.

    A bad value does nothing here: every save refuses it, and `xlakit doctor` fails its line.
    """
    try:
        keep_if_asked()
    except Exception:  # noqa: BLE001 - an import never fails on a knob (ConfigurationError, ctypes)
        pass


def keep_if_asked() -> bool:
    """(Before a copying save.) Apply `XLAKIT_KEEP_HOST_HEAP` once per process; whether it is applied."""
    global _kept
    asked = _knobs.get_flag(_knobs.KEEP_HOST_HEAP)  # a bad value is refused at every save
    with _lock:
        if _kept is None and asked:
            _kept = _keep()
    return bool(_kept)


def _keep() -> bool:
    which = allocator()
    if which != "glibc":
        log.info("xlakit: %s=1 left malloc alone: this process runs %s, which keeps freed memory itself",
                 _knobs.KEEP_HOST_HEAP, which)
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = [mallopt(option, value) == 1 for option, value in
            ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _KEEP), (_M_TRIM_THRESHOLD, _KEEP))]
    if not all(done):
        log.warning("xlakit: %s=1: glibc refused part of the setting (M_ARENA_MAX, M_MMAP_THRESHOLD, "
                    "M_TRIM_THRESHOLD applied: %s); host copies may still map fresh memory",
                    _knobs.KEEP_HOST_HEAP, done)
        return False
    log.info("xlakit: %s=1: glibc keeps freed host memory for the next save's copies (one arena, no "
             "mmap or trim below 2 GiB)", _knobs.KEEP_HOST_HEAP)
    return True
