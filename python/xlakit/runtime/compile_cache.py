"""The persistent compilation cache, keyed so runtimes never share executables.

torch_xla keys its on-disk entries by graph hash only, so one cache folder
shared by two runtimes (a libtpu bump, a rebuilt torch_xla, stock and
patched wheels) hands one the other's executables. `enable_persistent_cache`
therefore places entries in a subfolder named by the platform version (which
carries the libtpu build on TPU), the torch_xla/openxla/torch revisions and
the patched runtime's patch-series id (the one its entries carry and its C++
salts cache keys with), and writes the key beside them as JSON for people
and tools (`xlakit cache verify --patch-series-id`).

An entry is code the job runs, so the folder must be one only the user (and
root) can write: `enable_persistent_cache` refuses any other (`cache_trust`),
unless `trust_shared` accepts a group's, and creates its folders owner-only
(group-readable when shared). With `XLAKIT_CACHE_KEY` the patched runtime
writes authenticated entries and loads no other; the key's id (an HMAC of a
constant, not the key) joins the subfolder name, so jobs with different keys,
or none, never evict each other's entries.

On stock torch_xla with a PJRT C API plugin (a TPU's libtpu, or a plugin in
torch_xla's registry) the cache goes through xlakit's PJRT wrapping plugin
instead (`pjrt_wrap`): stock torch_xla writes its own entries and then fails
every load (`PersistentCacheDeserializeFailure`, pytorch/xla#9094), while the
wrapper serves compiles from its cache below torch_xla, in
`<path>/pjrt-<device>` (its keys cover the platform, devices and key id, so
one folder serves every runtime). The patched runtime, and torch_xla's
built-in CPU client (which is no plugin), use torch_xla's own cache.

`cache_stats()` reads the counters of whichever serves this process;
`xlakit doctor` probes that entries written by one process load in the next.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from xlakit import _C, _knobs
from xlakit.runtime import features, cache_trust, pjrt_wrap, torchtpu
from xlakit.errors import CacheFolderTrustError, CompileCacheError, ConfigurationError

log = logging.getLogger("xlakit.compile_cache")  # the name users filter by, whatever the module path

KEY_FILE = "xlakit-cache-key.json"
# torch_xla's counters (its PersistentCache::Get): a lookup counts exactly one
# of these; a failed load also erases the entry, so the next process rewrites it.
COUNTERS = {
    "hits": "PersistentCacheHit",
    "misses": "PersistentCacheMiss",
    "deserialize_failures": "PersistentCacheDeserializeFailure",
}


def _xlac():
    return features.require_xlac("the persistent cache")


def key_id(secret: bytes) -> str:
    """A name for a cache key that reveals nothing of it (an HMAC under the key of a constant), the
    one the patched runtime salts its cache keys with (`CacheKeyId`, csrc/core/envelope.h)."""
    return _C.cache_key_id(secret)


def cache_key(secret: bytes | None = None) -> dict[str, Any]:
    """What an executable depends on beyond its graph: the runtime that compiled it (and the key's id)."""
    xlac = _xlac()
    import torch
    import torch_xla
    import torch_xla.runtime as xr
    import torch_xla.version as v

    build = features.build_info() or {}
    key = {
        "device_type": xr.device_type(),
        "platform_version": xlac._xla_get_platform_version(),
        "torch_xla": torch_xla.__version__,
        "torch_xla_commit": build.get("torch_xla_commit"),
        "xla_commit": build.get("xla_commit") or getattr(v, "__xla_gitrev__", None),
        "torch_commit": torch.version.git_version,
        "patch_set": build.get("patch_set") or "stock",
        # The runtime's own id (patch set and the digest of the series, its placed C++ and the upstream
        # commits): what its entries carry and its C++ cache keys are salted with. Read, never recomputed.
        "patch_series_id": build.get("patch_series_id"),
    }
    if secret:  # only then, so the folder of a cache without a key keeps its name
        key["key_id"] = key_id(secret)
    return key


def cache_dir_name(key: dict[str, Any]) -> str:
    """`<device>-<patch set>-<hash of the whole key>`: readable, and unique per runtime."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"{(key.get('device_type') or 'unknown').lower()}-{key['patch_set']}-{digest}"


# Folders this process accepted as shared (logged once each; the manifest reports them as accepted).
_shared_accepted: set[Path] = set()


def _trusted(where: Path, *, trust_shared: bool, entries: bool = True) -> cache_trust.FolderTrust:
    verdict = cache_trust.require(where, trust_shared=trust_shared, entries=entries)
    if verdict.state == cache_trust.SHARED_TRUSTED and where not in _shared_accepted:
        _shared_accepted.add(where)
        log.warning("persistent cache %s is shared (trust_shared): %s; every one of them can put code into this "
                    "job", where, "; ".join(verdict.shared))
    return verdict


def _make_folders(where: Path, mode: int) -> None:
    """Create `where` and the folders above it that are missing, each with exactly `mode` (whatever the umask)."""
    missing = []
    for path in (where, *where.parents):
        if path.exists():
            break
        missing.append(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, mode)
        except FileExistsError:  # another process made it; it is judged again below
            continue
        os.chmod(path, mode)


def _write_key_file(where: Path, key: dict[str, Any], mode: int) -> None:
    fd = os.open(where / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, mode)
        f.write(json.dumps(key, indent=2, sort_keys=True) + "\n")


def prepare(where: Path, *, readonly: bool, shared: bool, key: dict[str, Any] | None = None,
            entries: bool = True) -> None:
    """Judge `where`, and unless read-only make it (owner-only) and write the key file, if any.
    `entries=False` for the PJRT wrapper's folders: it judges each entry as it reads it."""
    _trusted(where, trust_shared=shared, entries=entries)
    if readonly:
        if not where.is_dir():
            log.warning("persistent cache %s holds nothing for this runtime yet (read-only: nothing will be "
                        "written); every graph will compile", where)
        return
    try:
        _make_folders(where, 0o750 if shared else 0o700)
        _trusted(where, trust_shared=shared, entries=entries)  # a folder another process made meanwhile too
        if key is not None:
            _write_key_file(where, key, 0o640 if shared else 0o600)
    except CacheFolderTrustError:
        raise
    except OSError as e:
        raise CompileCacheError(
            f"expected a writable cache folder at {where}, found {type(e).__name__}: {e}; "
            "pass a writable path or readonly=True") from e


def through_wrapper() -> bool:
    """Whether this process's cache goes through the PJRT wrapper: stock torch_xla on a PJRT C API plugin.

    Raises:
        CompileCacheError: `PJRT_DEVICE=TPU` and no libtpu to wrap (the fix named).
    """
    if features.build_info() is not None:
        return False
    device = (os.environ.get(_knobs.PJRT_DEVICE) or "").upper()
    if not device:
        return False
    plugin, via = pjrt_wrap.plugin_of(device)
    if plugin is None and device == "TPU":
        raise CompileCacheError(f"{_knobs.PJRT_DEVICE}=TPU, but there is no libtpu to run on: {via}")
    return plugin is not None


def _default_readonly() -> bool:
    """`readonly` when not given: the wrapper's variable (or torch_xla's own, which its cache reads), so a
    worker told to only read by its environment is never turned into a writer."""
    return _knobs.get_flag(_knobs.PJRT_CACHE_READ_ONLY) or _knobs.xla_flag(_knobs.XLA_PERSISTENT_CACHE_READ_ONLY)


def enable_persistent_cache(path: str | os.PathLike, *, readonly: bool | None = None,
                            trust_shared: bool | None = None, max_bytes: int | None = None) -> Path:
    """Turn on a persistent compilation cache that loads after a restart.

    Call it before the first graph is compiled (and, on a TPU, before the
    runtime starts). On TorchTPU it turns on TorchTPU's own tier-3 cache in
    `<path>/torch_tpu-<version>` instead (`runtime/torchtpu.py`). On stock torch_xla with a PJRT plugin (`PJRT_DEVICE=TPU`
    with libtpu, or a plugin in torch_xla's registry) compiles go through
    xlakit's PJRT wrapping plugin, which caches them in `<path>/pjrt-<device>`;
    on the patched runtime (and torch_xla's built-in CPU client) torch_xla's
    own cache is turned on in a runtime-keyed subfolder. The folder, and every
    folder above it, must be one only you and root can write (a sticky folder
    such as `/tmp` may be above it); xlakit creates what is missing owner-only.

    Args:
        path: The shared cache folder; created if missing (unless `readonly`).
            `~` is your home folder; an empty path and a URL (`gs://...`: the
            shared tier is not available yet) are refused. `xlakit pjrt env
            PATH` names the same folder.
        readonly: Load entries but never write any (for all but one worker).
            Default `XLAKIT_PJRT_CACHE_READ_ONLY` (or torch_xla's
            `XLA_PERSISTENT_CACHE_READ_ONLY`).
        trust_shared: Accept a folder a group you belong to can write (a team
            cache); its folders are then created group-readable. Default
            `XLAKIT_CACHE_TRUST_SHARED`.
        max_bytes: Through the PJRT wrapper, the most bytes the folder's
            entries may hold: after each write the least recently used (a hit
            is a use) are removed. Default `XLAKIT_PJRT_CACHE_MAX_BYTES`, else
            no bound.

    Returns:
        The subfolder this runtime's entries live in.

    Raises:
        CacheFolderTrustError: another user can write the folder or one above
            it; names the folder, its owner and mode, and the `chmod` that fixes it.
        CompileCacheError: a graph was already compiled (or, through the
            wrapper, the runtime started), the path is empty, a URL, or is
            (or lies below) no folder (a device, a file), the folder cannot
            be made, or `XLAKIT_CACHE_KEY` is too short to be a secret.
        ConfigurationError: `XLAKIT_PJRT_CACHE_READ_ONLY` or
            `XLAKIT_CACHE_TRUST_SHARED` holds no 1/0 word.
        RuntimeFeatureError: torch_xla cannot be imported, or this xlakit has
            no PJRT wrapper where one is needed.

    Example:
        >>> import tempfile, xlakit
        >>> where = xlakit.enable_persistent_cache(tempfile.mkdtemp())
    """
    if torchtpu.in_use():  # TorchTPU's own tier-3 cache, under the same trust rules; no second cache
        if max_bytes is not None:
            log.warning("max_bytes bounds the PJRT wrapper's cache only; TorchTPU's own cache (here) is not "
                        "bounded by xlakit")
        return torchtpu.enable_persistent_cache(path, readonly=readonly, trust_shared=trust_shared if trust_shared
                                                is not None else _knobs.get_flag(_knobs.CACHE_TRUST_SHARED))
    xlac = _xlac()
    if xlac._xla_computation_cache_is_initialized():
        raise CompileCacheError(
            "expected to run before the first compilation, found torch_xla's computation cache already "
            "created, so the setting would be ignored; call enable_persistent_cache() at start-up, "
            "before any tensor is computed on an XLA device")
    root = cache_trust.local_folder(path)
    shared = trust_shared if trust_shared is not None else _knobs.get_flag(_knobs.CACHE_TRUST_SHARED)
    readonly = readonly if readonly is not None else _default_readonly()
    try:
        secret = _knobs.get_cache_key()
    except ValueError as e:
        raise CompileCacheError(str(e)) from None
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ConfigurationError(f"max_bytes: expected a positive number of bytes, found {max_bytes!r}")
    if through_wrapper():
        pjrt_wrap.library_path()  # a missing wrapper is said before anything is made
        where = pjrt_wrap.cache_folder(root, os.environ[_knobs.PJRT_DEVICE])
        prepare(where, readonly=readonly, shared=shared, key=None, entries=False)
        routed = pjrt_wrap.route(where, readonly=readonly, trust_shared=shared, max_bytes=max_bytes)
        log.info("persistent cache %s through xlakit's PJRT wrapper around %s (%s)", where, routed["plugin"],
                 routed["via"])
        return where
    if max_bytes is not None:
        log.warning("max_bytes bounds the PJRT wrapper's cache only; torch_xla's own cache (here) is not bounded")
    key = cache_key(secret)
    where = root / cache_dir_name(key)
    prepare(where, readonly=readonly, shared=shared, key=key)
    import torch_xla.runtime as xr

    xr.initialize_cache(str(where), readonly=readonly)
    if key["patch_set"] == "stock":
        log.warning("stock torch_xla: persistent cache entries are written but fail to load "
                    "(PersistentCacheDeserializeFailure); install the xlakit wheels for a working cache")
        if secret:
            log.warning("%s is set, but stock torch_xla writes and reads entries without a tag: they are not "
                        "authenticated; install the xlakit wheels", _knobs.CACHE_KEY)
    return where


def folder_report(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The persistent cache's trust state, for the manifest and doctor (never raises).

    Returns:
        `{"path", "folder", "authenticated", ...}`: `folder` is owner-only,
        shared-trusted or untrusted (with `problem` and `fix`), None with `why`
        when no cache is set up (`XLA_PERSISTENT_CACHE_PATH` unset);
        `authenticated` says whether entries carry a tag this job checks;
        `off` and `off_fix` when the wrapper's cache that
        `XLAKIT_PJRT_CACHE_DIR` asks for is (or will be) off.
    """
    wrapped = not path and not os.environ.get(_knobs.XLA_PERSISTENT_CACHE_PATH) and \
        bool(os.environ.get(_knobs.PJRT_CACHE_DIR))
    path = path or os.environ.get(_knobs.XLA_PERSISTENT_CACHE_PATH) or os.environ.get(_knobs.PJRT_CACHE_DIR)
    if wrapped:  # the wrapper reads a leading ~ as $HOME, as enable_persistent_cache does
        path = os.path.expanduser(path)
    if not path:
        return {"path": None, "folder": None, "authenticated": False,
                "why": f"no persistent cache ({_knobs.XLA_PERSISTENT_CACHE_PATH} and {_knobs.PJRT_CACHE_DIR} unset)"}
    try:
        shared = _knobs.get_flag(_knobs.CACHE_TRUST_SHARED) or Path(path).resolve() in _shared_accepted
    except ConfigurationError as e:  # whether a group may write the folder is then unknown
        return {"path": str(path), "folder": "untrusted", "authenticated": False, "problem": str(e),
                "fix": f"set {_knobs.CACHE_TRUST_SHARED} to 1 or 0, or unset it", "via": "pjrt-wrap" if wrapped else "torch_xla"}
    verdict = cache_trust.judge(path, trust_shared=shared, entries=not wrapped)  # the wrapper judges its entries
    out: dict[str, Any] = {"path": str(path), "folder": verdict.state, "via": "pjrt-wrap" if wrapped else "torch_xla"}
    if not verdict.trusted:
        out.update(problem=verdict.problem, fix=verdict.fix)
    elif verdict.shared:
        out["shared"] = list(verdict.shared)
    try:
        secret = _knobs.get_cache_key()
    except ValueError as e:
        secret = None
        out["key_problem"] = str(e)
    patched = features.build_info() is not None
    if wrapped and verdict.trusted and "key_problem" not in out:
        off = pjrt_wrap.requested_cache_off()
        if off is not None:  # the cache the environment asks for will not run: a finding, as an untrusted folder is
            out["off"], out["off_fix"] = off
    out["authenticated"] = bool(secret) and (patched or wrapped)
    if os.environ.get(_knobs.CACHE_TIER_URL):  # set by xlakit where a shared tier mirrors the folder
        out["shared_tier"] = os.environ[_knobs.CACHE_TIER_URL]
    if secret and not (patched or wrapped):
        out["why_not_authenticated"] = f"{_knobs.CACHE_KEY} is set, but stock torch_xla writes entries without a tag"
    return out


def cache_stats() -> dict[str, Any]:
    """The persistent cache's counters in this process, and where it points.

    Returns:
        `{"path", "readonly", "hits", "misses", "deserialize_failures", "via"}`;
        counters are 0 until the first lookup, `path` None when the cache is
        off; `via` is "pjrt-wrap" when xlakit's PJRT wrapper serves this
        process (`deserialize_failures` then counts the entries it refused),
        else "torch_xla".

    Example:
        >>> import xlakit
        >>> stats = xlakit.cache_stats()
        >>> sorted(stats)
        ['deserialize_failures', 'hits', 'misses', 'path', 'readonly', 'via']
    """
    _xlac()
    wrapper = pjrt_wrap.status()
    if wrapper.get("active"):
        counts = wrapper["counts"]
        return {"path": wrapper["cache"]["dir"], "readonly": wrapper["cache"]["read_only"], "hits": counts["hits"],
                "misses": counts["misses"], "deserialize_failures": sum(wrapper["refused_entries"].values()),
                "via": "pjrt-wrap"}
    import torch_xla.debug.metrics as met

    stats: dict[str, Any] = {
        "path": os.environ.get(_knobs.XLA_PERSISTENT_CACHE_PATH) or None,
        "readonly": _knobs.xla_flag(_knobs.XLA_PERSISTENT_CACHE_READ_ONLY),
        "via": "torch_xla",
    }
    for name, counter in COUNTERS.items():
        stats[name] = met.counter_value(counter) or 0
    return stats
