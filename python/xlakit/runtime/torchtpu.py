"""TorchTPU (`torch_tpu`, torch_xla's successor): what xlakit reads of it, never importing torch_xla.

TorchTPU is a PrivateUse1 backend: tensors on device `tpu` with ordinary
storages, run by a PJRT client that it loads from `TPU_LIBRARY_PATH` (libtpu
on a TPU host; any PJRT C API plugin, e.g. xla-cpu-pjrt, elsewhere). Its
persistent compile cache is its own (tier 2 in `/dev/shm`, tier 3 under
`TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`, read once by its runtime), and its
memory statistics come through `torch.accelerator`. Everything here is read
without starting TorchTPU unless said otherwise: torch-tpu registers itself as
a torch device backend, so once installed, `import torch` imports it, and
without a TPU, libtpu or `TPU_LIBRARY_PATH` that import aborts the process
(`start_hazard` says so before it happens).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from xlakit import _knobs
from xlakit.errors import CompileCacheError, RuntimeFeatureError
from xlakit.runtime import cache_trust, pins

DEVICE_TYPE = "tpu"
DIST = "torch-tpu"
# Tier 2: `<TIER2_ROOT>/<name>`, the name from TORCH_TPU_TIER2_COMPILATION_CACHE, else "default" (as
# torch-tpu 0.2.0 logs it). Node-local and shared by every process of the host that uses that name.
TIER2_ROOT = "/dev/shm/torch_tpu_cache"
TIER2_DEFAULT_NAME = "default"


def installed() -> bool:
    """torch-tpu is installed (found without importing it)."""
    return importlib.util.find_spec("torch_tpu") is not None


def loaded() -> bool:
    """torch_tpu was imported in this process (by the user or by torch's backend autoload)."""
    return "torch_tpu" in sys.modules


def started() -> bool:
    """TorchTPU's `tpu` device is registered in this process (importing torch_tpu does that only on a TPU host)."""
    return loaded() and bool(getattr(sys.modules["torch_tpu"]._loader, "_DEVICE_INITIALIZED", False))


def in_use() -> bool:
    """This process runs TorchTPU rather than torch_xla: torch_tpu is loaded, or installed while torch_xla
    is not loaded (`import torch` imports torch_tpu there: a torch_xla package beside it is not used)."""
    return loaded() or (installed() and "torch_xla" not in sys.modules)


def cpu_plugin_path() -> Path | None:
    """xla-cpu-pjrt's plugin (`xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so`), or None when not installed."""
    spec = importlib.util.find_spec("xla_plugins")
    for root in (spec.submodule_search_locations or []) if spec else []:
        so = Path(root) / "xla_cpu_pjrt" / "xla_cpu_pjrt.so"
        if so.is_file():
            return so
    return None


def start_hazard() -> str | None:
    """Why importing torch (which imports torch_tpu) would abort this process, with the fix; None if it won't.

    torch_tpu registers the PJRT plugin named by `TPU_LIBRARY_PATH`, which libtpu's
    package sets at import; with neither, or with a path that is no shared library
    (missing, a text file), its registration check aborts the process.
    """
    if not installed() or loaded():
        return None
    if os.environ.get(_knobs.TORCH_DEVICE_BACKEND_AUTOLOAD, "1") == "0":
        return None
    given = os.environ.get(_knobs.TPU_LIBRARY_PATH)
    if given:
        found = _not_a_library(given)
        return None if found is None else (
            f"{_knobs.TPU_LIBRARY_PATH}={given} {found}, and `import torch` imports torch-tpu, whose "
            f"registration of that plugin then aborts the process; point it at libtpu.so or a PJRT plugin "
            f"(pip install xla-cpu-pjrt gives a CPU one), or set {_knobs.TORCH_DEVICE_BACKEND_AUTOLOAD}=0 to "
            f"keep torch from importing torch-tpu")
    if importlib.util.find_spec("libtpu") is not None:
        return None
    plugin = cpu_plugin_path()
    hint = (f"`export {_knobs.TPU_LIBRARY_PATH}={plugin}` to run TorchTPU on the CPU plugin" if plugin else
            f"point {_knobs.TPU_LIBRARY_PATH} at a PJRT plugin (pip install xla-cpu-pjrt gives a CPU one)")
    return (f"torch-tpu is installed, so `import torch` imports it, and with neither libtpu nor "
            f"{_knobs.TPU_LIBRARY_PATH} it aborts the process; install libtpu (a TPU host), or {hint}, "
            f"or set {_knobs.TORCH_DEVICE_BACKEND_AUTOLOAD}=0 to keep torch from importing it")


def _not_a_library(path: str) -> str | None:
    """What is wrong with `path` as a plugin to load (no file, not ELF), or None: it opens no library."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return None if magic == b"\x7fELF" else "is not a shared library (no ELF header)"


def setup_hint(venv: str = ".venv-torchtpu") -> str:
    """How to start TorchTPU in a fresh `torchtpu*` environment (`make setup` prints it last)."""
    if importlib.util.find_spec("libtpu") is not None:
        return (f"TorchTPU is installed in {venv} with libtpu: `import torch` starts it on this host's TPU "
                f"chips (docs/torchtpu.md)")
    plugin = cpu_plugin_path()
    on_cpu = (f"export {_knobs.TPU_LIBRARY_PATH}={plugin} {_knobs.TPU_SKIP_MDS_QUERY}=1" if plugin else
              f"point {_knobs.TPU_LIBRARY_PATH} at a PJRT plugin (pip install xla-cpu-pjrt gives a CPU one)")
    return "\n".join([
        f"TorchTPU is installed in {venv}: `import torch` imports it, and without libtpu (a TPU host) it aborts "
        f"with \"{_knobs.TPU_LIBRARY_PATH} is not set\". To run it on the CPU plugin:",
        f"  in a shell:   {on_cpu}   (import torch works; no `tpu` device is registered)",
        "  in Python:    from xlakit.runtime import torchtpu; tpu = torchtpu.start_on_cpu_plugin()   "
        "(before torch is imported; sets both and registers `tpu`)",
        f"  xlakit ckpt needs neither. Tests: make test PROFILE=torchtpu-cpu VENV={venv} (docs/torchtpu.md)"])


def without_device_backends():
    """A block in which `import torch` imports no device backend (torch_tpu): for work that needs no device.

    Only where torch is not imported yet; torch reads the switch once, at its import.
    """
    if "torch" in sys.modules:
        return contextlib.nullcontext()
    return _knobs.override(**{_knobs.TORCH_DEVICE_BACKEND_AUTOLOAD: "0"})


def import_torch() -> ModuleType:
    """`import torch` (which imports torch_tpu where it is installed) with anything printed meanwhile on stderr.

    torch_tpu's import prints to stdout ("libtpu not found." without libtpu), and
    stdout is the caller's report (`xlakit manifest --json`). The file descriptor
    itself is redirected, since native code writes to it without Python.
    """
    if "torch" in sys.modules:
        return sys.modules["torch"]
    with _stdout_to_stderr():
        import torch
    return torch


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to keep clean (a daemon's closed fd 1)
        yield
        return
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if sys.stderr is not None:
            sys.stderr.flush()
        ctypes.CDLL(None).fflush(None)  # C's buffered stdout goes out now, to stderr, not later to stdout
        os.dup2(saved, 1)
        os.close(saved)


def start_on_cpu_plugin(plugin: str | os.PathLike | None = None):
    """Start TorchTPU over xla-cpu-pjrt on a host without a TPU (tests, the bench, CI); its `tpu` device.

    Must run before torch_tpu is imported (torch imports it when it is installed):
    it points `TPU_LIBRARY_PATH` at the plugin, sets `TPU_SKIP_MDS_QUERY=1` (no
    4-minute wait for GCE metadata) and registers the device by hand, since
    TorchTPU's own registration counts TPU chips on the PCI bus and finds none.

    Raises:
        RuntimeFeatureError: torch-tpu or xla-cpu-pjrt is missing, or torch_tpu
            was already imported over another plugin.
    """
    if not installed():
        raise RuntimeFeatureError("TorchTPU is not installed; run `make setup PROFILE=torchtpu-cpu "
                                  "VENV=.venv-torchtpu` (or pip install torch-tpu)")
    so = Path(plugin) if plugin else cpu_plugin_path()
    if so is None or not so.is_file():
        raise RuntimeFeatureError(f"expected xla-cpu-pjrt's plugin, found {so or 'no xla_plugins package'}; "
                                  f"pip install xla-cpu-pjrt (VERSIONS.toml, profile torchtpu-cpu)")
    given = os.environ.get(_knobs.TPU_LIBRARY_PATH)
    if loaded() and given != str(so):
        raise RuntimeFeatureError(f"torch_tpu was imported with {_knobs.TPU_LIBRARY_PATH}={given!r}, not the CPU "
                                  f"plugin {so}; call start_on_cpu_plugin() before anything imports torch")
    os.environ[_knobs.TPU_LIBRARY_PATH] = str(so)
    os.environ.setdefault(_knobs.TPU_SKIP_MDS_QUERY, "1")
    with warnings.catch_warnings(), _stdout_to_stderr():
        # torch_tpu warns at import when tcmalloc is not preloaded: a host performance hint.
        warnings.filterwarnings("ignore", message="<TorchTpu/Performance/TcMalloc/")
        import torch_tpu

    return torch_tpu._loader._init_device(DEVICE_TYPE)


def versions() -> dict[str, Any]:
    """torch-tpu, libtpu and the PJRT plugin TorchTPU loads (for the manifest; never imports anything)."""
    plugin = os.environ.get(_knobs.TPU_LIBRARY_PATH)
    return {"torch_tpu": pins.installed_version(DIST), "libtpu": pins.installed_version("libtpu"),
            "plugin": plugin or ("libtpu (installed)" if pins.installed_version("libtpu") else None)}


# -- the compile cache --------------------------------------------------------------------------

def cache_report() -> dict[str, Any]:
    """TorchTPU's persistent compile cache as this process's environment sets it up (never raises).

    Returns:
        `{"tier3": {"enabled", "path", "folder", "problem", "fix"}, "tier2": {...}}`;
        `folder` is xlakit's trust verdict on the folder (owner-only,
        shared-trusted or untrusted).
    """
    root = os.environ.get(_knobs.TORCH_TPU_TIER3_CACHE_ROOT)
    tier2 = os.environ.get(_knobs.TORCH_TPU_TIER2_CACHE)
    return {"tier3": _judged(root, f"{_knobs.TORCH_TPU_TIER3_CACHE_ROOT} is unset: TorchTPU keeps nothing "
                                   f"across restarts; xlakit.enable_persistent_cache(DIR) sets it"),
            "tier2": _judged(f"{TIER2_ROOT}/{tier2 or TIER2_DEFAULT_NAME}", None) | {
                "name": tier2 or TIER2_DEFAULT_NAME,
                "note": f"node-local, in memory, shared by the host's processes ({_knobs.TORCH_TPU_TIER2_CACHE} "
                        f"names it)"}}


def _judged(path: str | None, why_off: str | None) -> dict[str, Any]:
    if not path:
        return {"enabled": False, "path": None, "why": why_off}
    try:
        verdict = cache_trust.judge(path, trust_shared=_knobs.get_flag(_knobs.CACHE_TRUST_SHARED))
    except Exception as e:  # a report never raises: the reason is the finding
        return {"enabled": True, "path": path, "folder": None, "problem": f"{type(e).__name__}: {e}", "fix": None}
    return {"enabled": True, "path": path, "folder": verdict.state, "problem": verdict.problem, "fix": verdict.fix}


def enable_persistent_cache(path: str | os.PathLike, *, readonly: bool = False, trust_shared: bool = False) -> Path:
    """`xlakit.enable_persistent_cache` on TorchTPU: its own tier-3 cache in `<path>/torch_tpu-<version>`.

    The folder is judged by xlakit's trust rules and created owner-only (group
    readable with `trust_shared`), then `TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`
    names it; TorchTPU reads that once, at its first compile, and keys and
    writes its entries itself (xlakit's envelope, key and HMAC are not used on
    TorchTPU). No second cache is stacked: xlakit's PJRT wrapper is not used.
    """
    if readonly:
        raise RuntimeFeatureError(
            "TorchTPU's tier-3 cache has no read-only mode (torch-tpu "
            f"{pins.installed_version(DIST)}); call enable_persistent_cache(path) without readonly=True, "
            "or give read-only workers no cache")
    where = cache_trust.local_folder(path) / f"torch_tpu-{pins.installed_version(DIST)}"  # "" refused
    set_to = os.environ.get(_knobs.TORCH_TPU_TIER3_CACHE_ROOT)
    if set_to and Path(set_to).resolve() != where:
        raise CompileCacheError(
            f"{_knobs.TORCH_TPU_TIER3_CACHE_ROOT} already names {set_to}, and TorchTPU reads it once; expected it "
            f"unset or {where}. Unset it before the job starts, or pass that folder's parent")
    mode = 0o750 if trust_shared else 0o700
    _check_trust(where, trust_shared)
    if set_to is None and _device_used():
        raise CompileCacheError(
            "expected to run before TorchTPU's first use of a tpu device, found it initialized: TorchTPU reads "
            f"{_knobs.TORCH_TPU_TIER3_CACHE_ROOT} once, at its first compile, so the setting would be ignored; "
            "call enable_persistent_cache() at start-up, before any tensor is put on tpu")
    try:
        missing = [p for p in (where, *where.parents) if not p.exists()]
        for p in reversed(missing):
            os.mkdir(p, mode)
            os.chmod(p, mode)
    except OSError as e:
        raise CompileCacheError(f"expected a writable cache folder at {where}, found {type(e).__name__}: {e}; "
                                f"pass a writable path") from e
    _check_trust(where, trust_shared)  # a folder another process made meanwhile is judged too
    os.environ[_knobs.TORCH_TPU_TIER3_CACHE_ROOT] = str(where)
    return where


def _device_used() -> bool:
    """Whether TorchTPU's device was initialized in this process (its first tensor or op)."""
    if not loaded():
        return False
    import torch

    try:
        return bool(torch.tpu.is_initialized())
    except AttributeError:  # another torch-tpu without it: unknown, the docs' order stands
        return False


def _check_trust(where: Path, trust_shared: bool) -> None:
    from xlakit.errors import CacheFolderTrustError

    verdict = cache_trust.judge(where, trust_shared=trust_shared)
    if not verdict.trusted:
        raise CacheFolderTrustError(
            f"expected a cache folder only you (and root) can write, since TorchTPU runs its entries; "
            f"found {verdict.problem}; fix: {verdict.fix}")


# -- memory ------------------------------------------------------------------------------------

def memory_stats(index: int | None = None) -> dict[str, Any]:
    """TorchTPU's allocator statistics of `tpu:<index>` (the current device by default) through
    `torch.accelerator`; `why_not` where TorchTPU is not started.

    Never calls `reset_peak_memory_stats`, which crashes TorchTPU 0.2.0 on a
    plugin without allocator statistics.
    """
    if not started():
        return {"why_not": "TorchTPU's `tpu` device is not started in this process"}
    import torch

    stats = torch.accelerator.memory_stats(index)
    out = {"source": "torch.accelerator.memory_stats",
           "bytes_in_use": int(stats.get("allocated_bytes.all.current", 0)),
           "peak_bytes_in_use": int(stats.get("allocated_bytes.all.peak", 0)),
           "bytes_reserved": int(stats.get("reserved_bytes.all.current", 0))}
    if not any(stats.values()):
        out["note"] = ("every figure is 0: this PJRT client reports no allocator statistics "
                       "(GetAllocatorStats is UNIMPLEMENTED on the CPU plugin); HBM figures need a TPU")
    return out


def runtime_report() -> dict[str, Any]:
    """The `tpu` devices, for the manifest, when TorchTPU runs in this process; never starts it."""
    if not loaded():
        return {"why_not": "TorchTPU is not started in this process (the manifest never starts it: without a "
                           "TPU its start can abort the process)"}
    import torch

    if not started():
        # Not a failure: the manifest runs in processes that never start TorchTPU (the CLI, a launcher).
        return {"why_not": "torch_tpu is imported but registered no `tpu` device: it does so only where the "
                           "PCI bus has TPU chips (on a PJRT plugin: docs/torchtpu.md)"}
    count = torch.accelerator.device_count()
    return {"device_type": DEVICE_TYPE, "local_devices": count, "global_devices": count,
            "plugin": versions()["plugin"]}
