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
import shlex
from pathlib import Path
from typing import Any

from xlakit import _knobs
from xlakit.runtime import cache_trust
from xlakit.errors import CacheFolderTrustError, CompileCacheError, RuntimeFeatureError

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


def route(cache_dir: Path, *, readonly: bool, trust_shared: bool) -> dict[str, str]:
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
    if via.startswith(_REGISTRY):
        import torch_xla.experimental.plugins as plugins

        registered = plugins._plugin_registry[device_type]
        if not isinstance(registered, _wrapped_plugin_class()):
            plugins.register_plugin(device_type, _wrapped_plugin_class()(registered))
    else:
        os.environ[_knobs.TPU_LIBRARY_PATH] = str(wrapper)
    return {"device_type": device_type, "plugin": plugin, "via": via}


def env_lines(cache_dir: str | os.PathLike, plugin: str | None = None) -> list[str]:
    """`export` lines that turn the wrapper on for a TPU job that runs no xlakit code.

    The folder is judged first, as the wrapper will judge it; `plugin`
    defaults to the libtpu torch_xla would load.

    Raises:
        CacheFolderTrustError: another user can write the folder.
        CompileCacheError: no real plugin is given or installed.
    """
    if not str(cache_dir):
        raise CompileCacheError("expected a cache folder, found an empty path")
    verdict = cache_trust.judge(cache_dir, trust_shared=_knobs.get_flag(_knobs.CACHE_TRUST_SHARED))
    if not verdict.trusted:
        raise CacheFolderTrustError(f"expected a cache folder only you (and root) can write, since its entries are "
                                    f"code your jobs run; found {verdict.problem}; fix: {verdict.fix}")
    if verdict.folder.exists() and not verdict.folder.is_dir():
        raise CompileCacheError(f"expected a cache folder, found a file at {verdict.folder}")
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


