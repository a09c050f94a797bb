"""The PJRT wrapping plugin from Python: where it is, what it did in this process, and turning it on.

`xlakit/_lib/libxlakit_pjrt_wrap.so` (csrc/pjrt_wrap) is a PJRT C API plugin
that loads the real one (libtpu, a CPU or GPU plugin), passes every call
through, and serves `PJRT_Client_Compile` from a persistent cache. Stock
torch_xla 2.9 reaches a TPU only through the PJRT C API, and fails to load its
own persistent cache entries there (pytorch/xla#9094), so putting the wrapper
where torch_xla loads its plugin gives every restart the compiled programs of
the last one, with no rebuild.

`route()` does that inside a job (`xlakit.enable_persistent_cache` calls it):
for `PJRT_DEVICE=TPU` it points `TPU_LIBRARY_PATH` at the wrapper and
`XLAKIT_PJRT_PLUGIN` at the libtpu torch_xla would have loaded; for a plugin
in torch_xla's registry (`PJRT_DYNAMIC_PLUGINS`) it registers a copy whose
library is the wrapper. A job that cannot change code sets the same
variables itself (`xlakit pjrt env DIR` prints them).

`status()` reads the wrapper's own report in this process (through ctypes,
without loading it if the runtime did not): whether it is active, which
plugin it wraps, its C API versions and its hit/miss counts.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from xlakit import _knobs
from xlakit.errors import CompileCacheError, ConfigurationError, RuntimeFeatureError
from xlakit.runtime import cache_trust

LIBRARY = Path(__file__).resolve().parent.parent / "_lib" / "libxlakit_pjrt_wrap.so"
_STATUS = "xlakit_pjrt_wrap_status"
_REGISTRY = "torch_xla's plugin registry"


def library_path() -> Path:
    """The wrapping plugin's path, for `TPU_LIBRARY_PATH` or a framework's plugin list.

    Raises:
        RuntimeFeatureError: this xlakit was installed without it.
    """
    if not LIBRARY.is_file():
        raise RuntimeFeatureError(
            f"expected the PJRT wrapping plugin at {LIBRARY}, found nothing: this xlakit was built without it; "
            "install the prebuilt xlakit wheel, or `pip install .` from a clone on a host with a C++ compiler")
    return LIBRARY


def _report(handle: ctypes.CDLL) -> dict[str, Any]:
    fn = getattr(handle, _STATUS)
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    capacity = 1 << 14
    while True:  # counters grow while other threads compile: one call must fit its whole report
        buf = ctypes.create_string_buffer(capacity)
        size = fn(buf, capacity)
        if size < capacity:
            return json.loads(buf.value.decode("utf-8", "replace"))
        capacity = size + (1 << 12)


def status() -> dict[str, Any]:
    """What the wrapper did in this process; never raises.

    Returns:
        `{"library", "built", "loaded", ...}`: `built` False (with `why_not`)
        when the library is missing; `loaded` whether a runtime of this
        process started it (called its `GetPjrtApi`); then the wrapper's own report: `built_api` (the
        PJRT C API it was compiled for), `active`, `plugin`, `plugin_api`,
        `refused` (why it would not start), `cache` (`dir`, `on`, `why_off`,
        `folder`, `authenticated`, `read_only`) and `counts` (`compiles`,
        `hits`, `misses`, `bypassed`, `writes`, ... and refused entries by
        reason in `refused_entries`).
    """
    out: dict[str, Any] = {"library": str(LIBRARY), "built": LIBRARY.is_file(), "loaded": False}
    if not out["built"]:
        out["why_not"] = "this xlakit was installed without the PJRT wrapping plugin"
        return out
    try:  # loading runs nothing until GetPjrtApi is called; a file already loaded is the same handle
        handle = ctypes.CDLL(str(LIBRARY))
    except OSError as e:
        out.update(built=False, why_not=f"the library does not load here: {e}")
        return out
    out.update(_report(handle))
    # Only a runtime calls GetPjrtApi, and only then does the report name a plugin (or why it refused):
    # whether the file is mapped says nothing, as this function itself maps it.
    out["loaded"] = "plugin" in out
    return out


def _is_wrapper(path: str) -> bool:
    return Path(path).resolve() == LIBRARY


def _real_tpu_plugin() -> str | None:
    """The libtpu torch_xla would load: TPU_LIBRARY_PATH, the one its import found; where one of them is
    the wrapper already (`xlakit pjrt env` was followed), the plugin it wraps."""
    for name in (_knobs.TPU_LIBRARY_PATH, _knobs.PTXLA_TPU_LIBRARY_PATH):
        given = os.environ.get(name)
        if given and _is_wrapper(given):
            wrapped = os.environ.get(_knobs.PJRT_PLUGIN)
            if wrapped and not _is_wrapper(wrapped):
                return wrapped
        elif given:
            return given
    try:
        import libtpu  # noqa: F401  (the pip package; torch_xla's import looks for it too)

        return libtpu.get_library_path()
    except ImportError:
        return None


@functools.cache
def _wrapped_plugin_class():
    import torch_xla.experimental.plugins as plugins

    class WrappedPlugin(plugins.DevicePlugin):
        """A registered torch_xla device plugin whose library is the wrapper; everything else is the plugin's."""

        def __init__(self, inner: plugins.DevicePlugin):
            super().__init__()
            self.inner = inner

        def library_path(self) -> str:
            return str(LIBRARY)

        def host_index(self) -> int:
            return self.inner.host_index()

        def configure_single_process(self):
            return self.inner.configure_single_process()

        def configure_multiprocess(self, local_rank, local_world_size):
            return self.inner.configure_multiprocess(local_rank, local_world_size)

        def physical_chip_count(self):
            return self.inner.physical_chip_count()

        def client_create_options(self) -> dict:
            return self.inner.client_create_options()

        def requires_xla_coordinator(self) -> bool:
            return self.inner.requires_xla_coordinator()

    return WrappedPlugin


def plugin_of(device_type: str) -> tuple[str | None, str]:
    """The real plugin torch_xla would load for `device_type`, and how it finds it (or why it has none)."""
    device_type = device_type.upper()
    if device_type == "TPU":  # torch_xla's built-in TPU client and its TpuPlugin both read TPU_LIBRARY_PATH
        found = _real_tpu_plugin()
        return found, (_knobs.TPU_LIBRARY_PATH if found else
                       "no libtpu: pip install libtpu, or set TPU_LIBRARY_PATH to libtpu.so")
    import torch_xla.experimental.plugins as plugins

    registered = plugins._plugin_registry.get(device_type)
    if registered is not None and _knobs.get_flag(_knobs.PJRT_DYNAMIC_PLUGINS) and device_type != "CPU":
        library = getattr(registered, "inner", registered).library_path()
        if _is_wrapper(library):  # registered as the wrapper by hand: the plugin is the one it wraps
            library = os.environ.get(_knobs.PJRT_PLUGIN) or None
        return library, f"{_REGISTRY} ({device_type})"
    return None, (f"{_knobs.PJRT_DEVICE}={device_type} is torch_xla's built-in client, not a PJRT C API plugin, so "
                  "there is nothing to wrap")


def route(cache_dir: Path, *, readonly: bool, trust_shared: bool, max_bytes: int | None = None) -> dict[str, str]:
    """Make the runtime, when it starts, load the wrapper around its plugin, caching in `cache_dir`.

    `cache_dir` has been judged and made already. Returns what was done
    (`device_type`, `plugin`, `via`).

    Raises:
        CompileCacheError: the runtime started already, or `PJRT_DEVICE` names
            no PJRT C API plugin.
        RuntimeFeatureError: this xlakit has no wrapper.
    """
    from xlakit.runtime import features

    xlac = features.require_xlac("the PJRT wrapping plugin")
    wrapper = library_path()
    if xlac._xla_runtime_is_initialized():
        raise CompileCacheError("expected to run before the XLA runtime starts (the wrapper is loaded with the "
                                "plugin), found it started; call enable_persistent_cache() at start-up, before "
                                "any tensor is put on an XLA device")
    device_type = (os.environ.get(_knobs.PJRT_DEVICE) or "").upper()
    plugin, via = plugin_of(device_type)
    if plugin is None:
        raise CompileCacheError(f"cannot cache through the PJRT wrapper: {via}")
    os.environ[_knobs.PJRT_PLUGIN] = plugin
    os.environ[_knobs.PJRT_CACHE_DIR] = str(cache_dir)
    os.environ[_knobs.PJRT_CACHE_READ_ONLY] = "1" if readonly else "0"
    if trust_shared:
        os.environ[_knobs.CACHE_TRUST_SHARED] = "1"
    if max_bytes is not None:
        os.environ[_knobs.PJRT_CACHE_MAX_BYTES] = str(max_bytes)
    if via.startswith(_REGISTRY):
        import torch_xla.experimental.plugins as plugins

        registered = plugins._plugin_registry[device_type]
        if not isinstance(registered, _wrapped_plugin_class()):
            plugins.register_plugin(device_type, _wrapped_plugin_class()(registered))
    else:
        os.environ[_knobs.TPU_LIBRARY_PATH] = str(wrapper)
    return {"device_type": device_type, "plugin": plugin, "via": via}


def cache_folder(root: Path, device_type: str) -> Path:
    """The folder the wrapper caches in for a cache path `root` (absolute) and a `PJRT_DEVICE`:
    `<root>/pjrt-<device>`, whichever route turns it on (`enable_persistent_cache`, `xlakit pjrt env`),
    so one path is one cache. The subfolder keeps the wrapper's entries apart from the patched runtime's
    own subfolders in the same path."""
    return root / f"pjrt-{device_type.lower()}"


# The wrapper names its entries by a SHA-256 in hex (csrc/pjrt_wrap/compile_cache.h).
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}")


def entries_left_in(root: Path) -> int:
    """How many files named like the wrapper's entries lie in `root` itself, where `xlakit pjrt env ROOT` of
    an earlier xlakit had them written (now `cache_folder(root, "TPU")`); never raises."""
    try:
        with os.scandir(root) as found:
            return sum(1 for e in found if _ENTRY_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def _loads_wrapper() -> str | None:
    """Why a runtime started now would not load the wrapper (from `PJRT_DEVICE`, `TPU_LIBRARY_PATH` and
    torch_xla's plugin registry), or None when it would (or may: torch_xla chooses the device itself)."""
    device = (os.environ.get(_knobs.PJRT_DEVICE) or "").strip().upper()
    tpu_library = os.environ.get(_knobs.TPU_LIBRARY_PATH) or ""
    if not device:
        return None if tpu_library and _is_wrapper(tpu_library) else (
            f"{_knobs.PJRT_DEVICE} is unset and {_knobs.TPU_LIBRARY_PATH} is not the wrapper, so no runtime loads it")
    if device == "TPU":
        return None if tpu_library and _is_wrapper(tpu_library) else (
            f"{_knobs.PJRT_DEVICE}=TPU loads {_knobs.TPU_LIBRARY_PATH}={tpu_library or '(unset: the installed libtpu)'}"
            ", not the wrapper")
    plugins = sys.modules.get("torch_xla.experimental.plugins")
    registered = getattr(plugins, "_plugin_registry", {}).get(device) if plugins else None
    if registered is not None:
        try:
            if isinstance(registered, _wrapped_plugin_class()) or _is_wrapper(registered.library_path()):
                return None
        except Exception:  # a user's plugin class: what it says of its library is beyond this check
            return None
    return (f"{_knobs.PJRT_DEVICE}={os.environ.get(_knobs.PJRT_DEVICE)} starts "
            + ("torch_xla's built-in CPU client, which loads no plugin" if device == "CPU" else
               "a runtime whose library is not the wrapper"))


def requested_cache_off(s: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """Why the compile cache `XLAKIT_PJRT_CACHE_DIR` asks for is (or, once the runtime starts, will be) off in
    this process, and the fix; None when it is on, not asked for, or refused for its folder's trust (said by
    `cache_trust`). `s` is `status()`. Never raises.

    A wrapper that ran says why itself; before the runtime starts, what the wrapper would refuse is
    judged here: a URL, a read-only flag that is no 1/0 word, a folder that cannot be made, a runtime
    that will not load the wrapper at all.
    """
    raw = os.environ.get(_knobs.PJRT_CACHE_DIR)
    if not raw:
        return None
    asked = f"{_knobs.PJRT_CACHE_DIR}={raw} asks for a compile cache, but"
    unset = f"or unset {_knobs.PJRT_CACHE_DIR}"
    s = s if s is not None else status()
    if s.get("loaded"):
        cache = s.get("cache") or {}
        if cache.get("on") or s.get("refused"):  # a refused wrapper is a finding of its own
            return None
        return (f"{asked} the wrapper turned it off: {cache.get('why_off')}",
                f"correct what it names (`xlakit pjrt env DIR` judges a folder as the wrapper will), {unset}")
    from xlakit.runtime import features

    xlac = features.xlac()
    if xlac is not None and xlac._xla_runtime_is_initialized():
        why = _loads_wrapper()
        return (f"{asked} the runtime started without xlakit's PJRT wrapper{f' ({why})' if why else ''}, so "
                "nothing reads it",
                f"start the job with the wrapper: eval \"$(xlakit pjrt env DIR)\" (PJRT_DEVICE=TPU), or "
                f"xlakit.enable_persistent_cache(DIR) in its code, {unset}")
    try:
        cache_trust.refuse_shared_tier_url(raw)
    except CompileCacheError as e:
        return f"{asked} {e}", f"set {_knobs.PJRT_CACHE_DIR} to a local folder, {unset}"
    try:
        readonly = _knobs.get_flag(_knobs.PJRT_CACHE_READ_ONLY)
    except ConfigurationError as e:
        return (f"{asked} the wrapper turns it off: {e}",
                f"export {_knobs.PJRT_CACHE_READ_ONLY}=1 (load only) or 0, or unset it")
    if not readonly:
        where = Path(raw).expanduser().resolve()
        above = next((p for p in (where, *where.parents) if os.path.lexists(p)), None)
        if above is not None and above != where and above.is_dir() and not os.access(above, os.W_OK | os.X_OK):
            return (f"{asked} the wrapper cannot create {where}: you cannot write {above}",
                    f"point {_knobs.PJRT_CACHE_DIR} at a folder you can create, or export "
                    f"{_knobs.PJRT_CACHE_READ_ONLY}=1 to load from an existing one, {unset}")
    why = _loads_wrapper()
    if why:
        return (f"{asked} {why}, so nothing reads it",
                f"start the job with the wrapper: eval \"$(xlakit pjrt env DIR)\" (PJRT_DEVICE=TPU), or "
                f"xlakit.enable_persistent_cache(DIR) in its code, {unset}")
    return None


def earlier_entries_note(cache_dir: str | os.PathLike) -> str | None:
    """What to do with entries an earlier xlakit's `pjrt env` had written in the path itself, where
    `env_lines(cache_dir)` no longer looks; None when there are none. Moves nothing; never raises."""
    try:
        root = cache_trust.local_folder(cache_dir)
    except CompileCacheError:
        return None
    left = entries_left_in(root)
    if not left:
        return None
    where = cache_folder(root, "TPU")
    if root.name == where.name:  # the subfolder given as the path: its parent names it now
        return (f"{root} holds {left} entries, and `xlakit pjrt env {root}` now names {where}; pass "
                f"{root.parent} instead (the path enable_persistent_cache takes) to keep using them")
    return (f"{root} holds {left} entries an earlier xlakit wrote there directly; the wrapper now caches in {where} "
            f"(as enable_persistent_cache does); to keep them, move them there: mkdir -m 700 -p "
            f"{shlex.quote(str(where))} && find {shlex.quote(str(root))} -maxdepth 1 -type f -regextype egrep "
            f"-regex '.*/[0-9a-f]{{64}}' -exec mv -t {shlex.quote(str(where))} {{}} +")


def env_lines(cache_dir: str | os.PathLike, plugin: str | None = None) -> list[str]:
    """`export` lines that turn the wrapper on for a TPU job that runs no xlakit code.

    `cache_dir` names the cache as `enable_persistent_cache` takes it (`~`
    expanded, no URL, not empty); the wrapper caches in its `pjrt-tpu`
    subfolder, the one `enable_persistent_cache(cache_dir)` uses under
    `PJRT_DEVICE=TPU`. That folder is judged first, as the wrapper will
    judge it; `plugin` defaults to the libtpu torch_xla would load.

    Raises:
        CacheFolderTrustError: another user can write the folder.
        CompileCacheError: the path is empty, a URL, or not a folder; no real
            plugin is given or installed.
    """
    where = cache_folder(cache_trust.local_folder(cache_dir), "TPU")
    verdict = cache_trust.require(where, trust_shared=_knobs.get_flag(_knobs.CACHE_TRUST_SHARED), entries=False)
    plugin = plugin or _real_tpu_plugin()
    if plugin is None:
        raise CompileCacheError("no real plugin to wrap: pass --plugin PATH (libtpu.so, a CPU or GPU plugin), "
                                "or pip install libtpu")
    real = Path(plugin).resolve()
    if not real.is_file():
        raise CompileCacheError(f"expected the real PJRT plugin (a .so file), found {'a folder' if real.is_dir() else 'nothing'} "
                                f"at {plugin}")
    if real == LIBRARY:
        raise CompileCacheError(f"{plugin} is the wrapper itself: pass the plugin it should load (e.g. libtpu.so)")
    return [f"export {_knobs.TPU_LIBRARY_PATH}={shlex.quote(str(library_path()))}",
            f"export {_knobs.PJRT_PLUGIN}={shlex.quote(str(real))}",
            f"export {_knobs.PJRT_CACHE_DIR}={shlex.quote(str(verdict.folder))}"]


