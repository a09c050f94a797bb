"""The persistent compilation cache, keyed so runtimes never share executables.

torch_xla keys its on-disk entries by graph hash only, so one cache folder
shared by two runtimes (a libtpu bump, a rebuilt torch_xla, stock and
patched wheels) hands one the other's executables. `enable_persistent_cache`
therefore places entries in a subfolder named by the platform version (which
carries the libtpu build on TPU), the torch_xla/openxla/torch revisions and
the patch set, and writes the key beside them as JSON for people and tools.

`cache_stats()` reads torch_xla's own counters. A stock torch_xla writes
entries and then fails every load (`PersistentCacheDeserializeFailure`),
silently recompiling; `xlakit doctor` probes exactly that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from xlakit import _features, _knobs
from xlakit.errors import CompileCacheError

log = logging.getLogger(__name__)

KEY_FILE = "xlakit-cache-key.json"
# torch_xla's counters (its PersistentCache::Get): a lookup counts exactly one
# of these; a failed load also erases the entry, so the next process rewrites it.
COUNTERS = {
    "hits": "PersistentCacheHit",
    "misses": "PersistentCacheMiss",
    "deserialize_failures": "PersistentCacheDeserializeFailure",
}


def _xlac():
    return _features.require_xlac("the persistent cache")


def cache_key() -> dict[str, Any]:
    """What an executable depends on beyond its graph: the runtime that compiled it."""
    xlac = _xlac()
    import torch
    import torch_xla
    import torch_xla.runtime as xr
    import torch_xla.version as v

    build = _features.build_info() or {}
    return {
        "device_type": xr.device_type(),
        "platform_version": xlac._xla_get_platform_version(),
        "torch_xla": torch_xla.__version__,
        "torch_xla_commit": build.get("torch_xla_commit"),
        "xla_commit": build.get("xla_commit") or getattr(v, "__xla_gitrev__", None),
        "torch_commit": torch.version.git_version,
        "patch_set": build.get("patch_set") or "stock",
        "series_sha256": build.get("series_sha256"),
    }


def cache_dir_name(key: dict[str, Any]) -> str:
    """`<device>-<patch set>-<hash of the whole key>`: readable, and unique per runtime."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"{(key.get('device_type') or 'unknown').lower()}-{key['patch_set']}-{digest}"


def enable_persistent_cache(path: str | os.PathLike, *, readonly: bool = False) -> Path:
    """Turn on torch_xla's persistent compilation cache in a runtime-keyed subfolder.

    Call it before the first graph is compiled (torch_xla reads the setting
    once, when it creates its computation cache).

    Args:
        path: The shared cache folder; created if missing (unless `readonly`).
        readonly: Load entries but never write any (for all but one worker).

    Returns:
        The subfolder this runtime's entries live in.

    Raises:
        CompileCacheError: a graph was already compiled, or the folder cannot be made.
        RuntimeFeatureError: torch_xla cannot be imported.

    Example:
        >>> import tempfile, xlakit
        >>> where = xlakit.enable_persistent_cache(tempfile.mkdtemp())
    """
    xlac = _xlac()
    if xlac._xla_computation_cache_is_initialized():
        raise CompileCacheError(
            "expected to run before the first compilation, found torch_xla's computation cache already "
            "created, so the setting would be ignored; call enable_persistent_cache() at start-up, "
            "before any tensor is computed on an XLA device")
    key = cache_key()
    where = Path(path).expanduser().resolve() / cache_dir_name(key)
    if readonly:
        if not where.is_dir():
            log.warning("persistent cache %s holds nothing for this runtime yet (read-only: nothing will be "
                        "written); every graph will compile", where)
    else:
        try:
            where.mkdir(parents=True, exist_ok=True)
            (where / KEY_FILE).write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
        except OSError as e:
            raise CompileCacheError(
                f"expected a writable cache folder at {where}, found {type(e).__name__}: {e}; "
                "pass a writable path or readonly=True") from e
    import torch_xla.runtime as xr

    xr.initialize_cache(str(where), readonly=readonly)
    if key["patch_set"] == "stock":
        log.warning("stock torch_xla: persistent cache entries are written but fail to load "
                    "(PersistentCacheDeserializeFailure); install the xlakit wheels for a working cache")
    return where


def cache_stats() -> dict[str, Any]:
    """The persistent cache's counters in this process, and where it points.

    Returns:
        `{"path", "readonly", "hits", "misses", "deserialize_failures"}`;
        counters are 0 until the first lookup, `path` None when the cache is off.

    Example:
        >>> import xlakit
        >>> stats = xlakit.cache_stats()
        >>> sorted(stats)
        ['deserialize_failures', 'hits', 'misses', 'path', 'readonly']
    """
    _xlac()
    import torch_xla.debug.metrics as met

    stats: dict[str, Any] = {
        "path": os.environ.get(_knobs.XLA_PERSISTENT_CACHE_PATH) or None,
        "readonly": _knobs.get_flag(_knobs.XLA_PERSISTENT_CACHE_READ_ONLY),
    }
    for name, counter in COUNTERS.items():
        stats[name] = met.counter_value(counter) or 0
    return stats
