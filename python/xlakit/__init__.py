"""xlakit: safe checkpoints and runtime tools for PyTorch/XLA.

Works on the stock torch_xla wheels and on xlakit's patched build; where a
patched binding exists it is used, otherwise the stock path that behaves best.
"""

from xlakit._version import __version__
from xlakit.compile_cache import cache_stats, enable_persistent_cache
from xlakit.contract import check_run_contract
from xlakit.errors import (
    CheckpointBusyError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointPeerError,
    CheckpointSerializationError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    CompileCacheError,
    PinsError,
    RunContractError,
    RuntimeFeatureError,
    XlakitError,
)
from xlakit._manifest import log_manifest, manifest, manifest_line
from xlakit.memory import MemoryInfo, memory_info

__all__ = [
    "__version__",
    "CheckpointBusyError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIncompleteError",
    "CheckpointPeerError",
    "CheckpointSerializationError",
    "CheckpointTimeoutError",
    "CheckpointWriteError",
    "CompileCacheError",
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
