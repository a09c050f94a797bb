"""Every environment variable xlakit reads, in one place.

An explicit argument always beats the environment; the environment beats the
built-in default. Getters parse and validate, naming the variable on error.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator

from xlakit import _C
from xlakit.errors import ConfigurationError

MiB = 1 << 20

SAVE_TIMEOUT_S = "XLAKIT_SAVE_TIMEOUT_S"
MAX_INFLIGHT_BYTES = "XLAKIT_MAX_INFLIGHT_BYTES"
STALL_WARNING_S = "XLAKIT_STALL_WARNING_S"
PROGRESS_INTERVAL_S = "XLAKIT_PROGRESS_INTERVAL_S"
TRANSFER_BACKEND = "XLAKIT_TRANSFER_BACKEND"
PROFILE = "XLAKIT_PROFILE"  # VERSIONS.toml profile the manifest checks against
PREEMPTION_GRACE_S = "XLAKIT_PREEMPTION_GRACE_S"  # CheckpointManager: SIGTERM to the last moment to save
DOCTOR_TIMEOUT_S = "XLAKIT_DOCTOR_TIMEOUT_S"  # deadline of each `xlakit doctor` subprocess probe
# 1: when xlakit is imported (or at its first copying save, if set later), it asks glibc to keep freed
# host memory for the next batch's copies (runtime/host_heap.py says what it sets, why it has to be
# early and what it costs); off by default.
KEEP_HOST_HEAP = "XLAKIT_KEEP_HOST_HEAP"
# Object storage (checkpoint/objstore): S3, the size of one upload part and how many are sent at once
# (host memory for the upload: part bytes times parts in flight, plus the one being filled); GCS,
# the size of one resumable upload chunk (one is sent while the next fills).
OBJECT_PART_BYTES = "XLAKIT_OBJECT_PART_BYTES"
OBJECT_PARTS_IN_FLIGHT = "XLAKIT_OBJECT_PARTS_IN_FLIGHT"
OBJECT_CHUNK_BYTES = "XLAKIT_OBJECT_CHUNK_BYTES"
# The bound of one object-storage request made outside a save or load's deadline (listings of
# `xlakit ckpt`, a manager's scan).
OBJECT_REQUEST_TIMEOUT_S = "XLAKIT_OBJECT_REQUEST_TIMEOUT_S"
# How long a CheckpointManager's lease on an object-storage URL lasts unless renewed (checkpoint/objstore/lease.py).
MANAGER_LEASE_S = "XLAKIT_MANAGER_LEASE_S"
# Which host this process runs on, for a CheckpointManager's local tier (checkpoint/tier/local_tier.py): its
# parts are copied to ranks of other hosts. Default: the hostname. Tests set it to make several
# simulated hosts of the processes of one machine.
HOST_ID = "XLAKIT_HOST_ID"
# Accept a persistent cache folder a group you belong to can write (see cache_trust); the PJRT
# wrapping plugin reads it too, so its name comes from the C++ (csrc/pjrt_wrap/env.h).
CACHE_TRUST_SHARED = _C.CACHE_TRUST_SHARED_ENV
# The PJRT wrapping plugin (csrc/pjrt_wrap/env.h): the real plugin it loads, its cache folder,
# whether it only reads entries, and the largest entry it reads or writes.
PJRT_PLUGIN = _C.PJRT_PLUGIN_ENV
PJRT_CACHE_DIR = _C.PJRT_CACHE_DIR_ENV
PJRT_CACHE_READ_ONLY = _C.PJRT_CACHE_READ_ONLY_ENV
PJRT_CACHE_MAX_ENTRY_BYTES = _C.PJRT_CACHE_MAX_ENTRY_BYTES_ENV
# 0: the wrapper counts no live buffers per device (its memory accounting; the plugin's own statistics
# are still reported). Default on.
PJRT_MEMORY_ACCOUNTING = _C.PJRT_MEMORY_ACCOUNTING_ENV
PJRT_CACHE_MAX_BYTES = _C.PJRT_CACHE_MAX_BYTES_ENV
# The job's secret for authenticated cache entries. The C++ runtime and the PJRT wrapper read it
# too: its name and the shortest key accepted are facts of csrc/core/envelope.h (kCacheKeyEnv,
# kMinCacheKeyBytes), taken from there. Never logged.
CACHE_KEY = _C.CACHE_KEY_ENV
MIN_CACHE_KEY_BYTES = _C.MIN_CACHE_KEY_BYTES

# torch_xla's and libtpu's own variables, which xlakit reads (never sets behind
# the user's back) to record and check the run contract.
PJRT_DEVICE = "PJRT_DEVICE"
XLA_FLAGS = "XLA_FLAGS"
LIBTPU_INIT_ARGS = "LIBTPU_INIT_ARGS"
XLA_NO_SPECIAL_SCALARS = "XLA_NO_SPECIAL_SCALARS"
XLA_USE_SPMD = "XLA_USE_SPMD"
XLA_PERSISTENT_CACHE_PATH = "XLA_PERSISTENT_CACHE_PATH"
XLA_PERSISTENT_CACHE_READ_ONLY = "XLA_PERSISTENT_CACHE_READ_ONLY"
# Which PJRT_DEVICE values torch_xla accepts depends on these (torch_xla/__init__.py, pjrt_registry.cpp).
XLA_REGISTER_INSTALLED_PLUGINS = "XLA_REGISTER_INSTALLED_PLUGINS"
PJRT_DYNAMIC_PLUGINS = "PJRT_DYNAMIC_PLUGINS"
# Where torch_xla's TPU plugin looks for libtpu; the second is set by torch_xla's import when it finds one.
TPU_LIBRARY_PATH = "TPU_LIBRARY_PATH"
PTXLA_TPU_LIBRARY_PATH = "PTXLA_TPU_LIBRARY_PATH"
# torch's: its CPU tensors on transparent huge pages, read once when torch starts (runtime/host_heap.py).
THP_MEM_ALLOC_ENABLE = "THP_MEM_ALLOC_ENABLE"
# TorchTPU's (runtime/torchtpu.py): torch's device-backend autoload (which imports torch_tpu with
# torch), the GCE metadata query libtpu's loader skips when set, and its persistent compile cache
# (tier 3: a folder; tier 2: node-local, in /dev/shm), read once by its runtime.
TORCH_DEVICE_BACKEND_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
TPU_SKIP_MDS_QUERY = "TPU_SKIP_MDS_QUERY"
TORCH_TPU_TIER3_CACHE_ROOT = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
TORCH_TPU_TIER2_CACHE = "TORCH_TPU_TIER2_COMPILATION_CACHE"
# The compile cache's shared tier on object storage (cache_tier/): how long a start waits for it to fill
# the local folder, how often (and how long at a clean exit) new entries are published, and the most
# requests a second it sends (JAX users on GCS met 429s).
CACHE_TIER_PULL_TIMEOUT_S = "XLAKIT_CACHE_TIER_PULL_TIMEOUT_S"
CACHE_TIER_PUBLISH_INTERVAL_S = "XLAKIT_CACHE_TIER_PUBLISH_INTERVAL_S"
CACHE_TIER_EXIT_TIMEOUT_S = "XLAKIT_CACHE_TIER_EXIT_TIMEOUT_S"
CACHE_TIER_REQUESTS_PER_S = "XLAKIT_CACHE_TIER_REQUESTS_PER_S"
# Set by xlakit, not by users: the shared tier this job's cache mirrors (for the manifest and doctor).
CACHE_TIER_URL = "XLAKIT_CACHE_TIER_URL"
CONTRACT_ENV = (PJRT_DEVICE, XLA_NO_SPECIAL_SCALARS, XLA_USE_SPMD, XLA_FLAGS, LIBTPU_INIT_ARGS,
                XLA_PERSISTENT_CACHE_PATH, XLA_PERSISTENT_CACHE_READ_ONLY)

DEFAULTS: dict[str, float | int | str] = {
    SAVE_TIMEOUT_S: 3600.0,
    MAX_INFLIGHT_BYTES: 256 * MiB,
    STALL_WARNING_S: 60.0,
    PROGRESS_INTERVAL_S: 10.0,
    TRANSFER_BACKEND: "auto",
    PREEMPTION_GRACE_S: 30.0,
    DOCTOR_TIMEOUT_S: 120.0,
    OBJECT_PART_BYTES: 16 * MiB,
    OBJECT_PARTS_IN_FLIGHT: 4,
    OBJECT_CHUNK_BYTES: 100 * MiB,  # google-cloud-storage's own default chunk
    OBJECT_REQUEST_TIMEOUT_S: 120.0,
    MANAGER_LEASE_S: 300.0,
    CACHE_TIER_PULL_TIMEOUT_S: 60.0,
    CACHE_TIER_PUBLISH_INTERVAL_S: 30.0,
    CACHE_TIER_EXIT_TIMEOUT_S: 30.0,
    CACHE_TIER_REQUESTS_PER_S: 20.0,
}


TRANSFER_BACKENDS = ("auto", "patched", "dlpack", "stock")
_FLAG_VALUES = {"1": True, "TRUE": True, "YES": True, "ON": True, "Y": True,
                "0": False, "FALSE": False, "NO": False, "OFF": False, "N": False}


def _bad(name: str, raw: str, expected: str) -> ConfigurationError:
    """An environment default that cannot be used: the variable, its value, and the fix."""
    err = ConfigurationError(f"environment variable {name}={raw!r}: expected {expected}")
    err.add_note(f"Fix or unset {name} (unset, the default is {DEFAULTS[name]!r}); an explicit argument "
                 f"overrides it.")
    return err


_DECIMAL = re.compile(r"\s*\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*", re.ASCII)
_WHOLE = re.compile(r"\s*\+?[0-9]+\s*", re.ASCII)


def get_float(name: str, *, unit: str = "seconds") -> float:
    """A positive number (of `unit`) from `name` (its default when unset or empty)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return float(DEFAULTS[name])
    # Plain ASCII decimals only: float() also takes "inf", "1_0" and other scripts' digits.
    value = float(raw) if _DECIMAL.fullmatch(raw) else math.nan
    if not math.isfinite(value) or value <= 0:
        raise _bad(name, raw, f"a positive, finite number of {unit} (e.g. {DEFAULTS[name]:g})")
    return value


def get_int(name: str) -> int:
    """A positive whole number from `name` (its default when unset or empty)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return int(DEFAULTS[name])
    if not _WHOLE.fullmatch(raw):  # int() also takes "1_0" and other scripts' digits
        raise _bad(name, raw, "a positive whole number (e.g. 268435456)")
    value = int(raw)
    if value <= 0:
        raise _bad(name, raw, "a positive whole number")
    return value


def get_choice(name: str, choices: tuple[str, ...]) -> str:
    """One of `choices` from `name` (its default when unset or empty)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return str(DEFAULTS[name])
    if raw not in choices:
        raise _bad(name, raw, f"one of {', '.join(choices)}")
    return raw


def get_transfer_backend() -> str:
    return get_choice(TRANSFER_BACKEND, TRANSFER_BACKENDS)


def get_cache_key() -> bytes | None:
    """The job's cache key, or None when unset; refuses one too short to be a secret (never shows it),
    by the rule the C++ runtime applies (`_C.cache_key_problem`)."""
    raw = os.environ.get(CACHE_KEY)
    if not raw:
        return None
    key = os.fsencode(raw)  # the bytes the runtime reads
    problem = _C.cache_key_problem(key)
    if problem is not None:
        raise ConfigurationError(problem)
    return key


def get_str(name: str) -> str:
    return os.environ.get(name) or str(DEFAULTS[name])


@contextlib.contextmanager
def override(**env: str | None) -> Iterator[None]:
    """Set (or unset, with None) variables for a block; restores them in `finally`."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def is_true(raw: str | None) -> bool:
    """A boolean value read the way torch_xla reads its own flags (1/true/yes/on/y)."""
    return (raw or "").strip().upper() in ("1", "TRUE", "YES", "ON", "Y")


def xla_flag(name: str) -> bool:
    """One of torch_xla's own flags, read as torch_xla reads it (anything else than a true word is off)."""
    return is_true(os.environ.get(name))


def get_flag(name: str) -> bool:
    """An xlakit switch: 1/true/yes/on/y or 0/false/no/off/n (any case); unset or empty is off.

    Stricter than torch_xla's own flags (`is_true`): a typo such as `ture` must not
    silently turn a safety setting off.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return False
    value = _FLAG_VALUES.get(raw.strip().upper())
    if value is None:
        raise ConfigurationError(f"environment variable {name}={raw!r}: expected 1/true/yes/on or 0/false/no/off "
                         f"(fix or unset {name})")
    return value


# 1: at each compile-cache miss the PJRT wrapper logs what differed from the nearest recorded entry of the
# same module (csrc/pjrt_wrap/env.h kCacheExplainEnv; docs/runtime.md "Why did it miss?").
PJRT_CACHE_EXPLAIN = _C.PJRT_CACHE_EXPLAIN_ENV


_HOST_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", re.ASCII)


def get_host_id() -> str:
    """`XLAKIT_HOST_ID`, else the hostname: the host a local checkpoint tier's folder belongs to."""
    import socket

    raw = os.environ.get(HOST_ID)
    if not raw:
        return socket.gethostname().replace("/", "_") or "host"
    if not _HOST_ID.fullmatch(raw):
        raise ConfigurationError(f"environment variable {HOST_ID}={raw!r}: expected a host name of letters, "
                                 f"digits, '.', '_' or '-' (at most 128, not starting with '.'); fix or unset "
                                 f"it (unset, the hostname is used)")
    return raw
