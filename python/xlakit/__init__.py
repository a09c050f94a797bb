"""xlakit: safe checkpoints and runtime tools for PyTorch/XLA.

Works on the stock torch_xla wheels and on xlakit's patched build; where a
patched binding exists it is used, otherwise the stock path that behaves best.
"""

from xlakit import _moved
from xlakit._version import __version__
from xlakit.cache_tier import enable_persistent_cache
from xlakit.runtime.compile_cache import cache_stats
from xlakit.runtime.contract import check_run_contract
from xlakit.checkpoint.core.options import LoadOptions, Progress, SaveOptions
from xlakit.errors import (
    CacheFolderTrustError,
    CheckpointAsyncError,
    CheckpointBusyError,
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointPeerError,
    CheckpointSerializationError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    CompileCacheError,
    ConfigurationError,
    PinsError,
    RunContractError,
    RuntimeFeatureError,
    XlakitError,
)
from xlakit.runtime.manifest import log_manifest, manifest, manifest_line
from xlakit.runtime.memory import MemoryInfo, memory_info
from xlakit.runtime import host_heap as _host_heap

# Loaded on first use so that `import xlakit` (and the CLI) works where torch is
# missing or broken; `xlakit doctor` has to run exactly there. The checkpoint
# package itself imports torch and torch.distributed.checkpoint (~0.3 s) only
# inside its functions.
_LAZY = {"save": "xlakit.checkpoint", "load": "xlakit.checkpoint", "restore": "xlakit.checkpoint",
         "dcp_save": "xlakit.checkpoint",
         "dcp_load": "xlakit.checkpoint", "wait_until_idle": "xlakit.checkpoint",
         "SaveHandle": "xlakit.checkpoint.file.background", "CheckpointManager": "xlakit.checkpoint.manager.checkpoint_manager",
         "ReadOnlyCheckpointManager": "xlakit.checkpoint.stepstore.readonly", "LocalTier": "xlakit.checkpoint.tier.local_tier"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if f"xlakit.{name}" in _moved.MOVED:  # an old path, for one release (_moved.py)
        return _moved.module(f"xlakit.{name}")
    raise AttributeError(f"module 'xlakit' has no attribute {name!r}")


_moved.install()
_host_heap.keep_at_import()  # XLAKIT_KEEP_HOST_HEAP: before the runtime's threads allocate


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})  # the lazily loaded names too: help(), completion, dir()


__all__ = [
    "__version__",
    "save",
    "load",
    "restore",
    "dcp_save",
    "dcp_load",
    "wait_until_idle",
    "SaveOptions",
    "LoadOptions",
    "Progress",
    "SaveHandle",
    "CheckpointManager",
    "ReadOnlyCheckpointManager",
    "LocalTier",
    "CacheFolderTrustError",
    "CheckpointAsyncError",
    "CheckpointBusyError",
    "CheckpointConflictError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointPeerError",
    "CheckpointSerializationError",
    "CheckpointTimeoutError",
    "CheckpointWriteError",
    "CompileCacheError",
    "ConfigurationError",
    "MemoryInfo",
    "PinsError",
    "RunContractError",
    "RuntimeFeatureError",
    "XlakitError",
    "cache_stats",
    "check_run_contract",
    "enable_persistent_cache",
    "log_manifest",
    "manifest",
    "manifest_line",
    "memory_info",
]
