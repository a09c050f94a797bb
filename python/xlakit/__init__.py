"""xlakit: safe checkpoints and runtime tools for PyTorch/XLA.

Works on the stock torch_xla wheels and on xlakit's patched build; where a
patched binding exists it is used, otherwise the stock path that behaves best.
"""

from xlakit._version import __version__
from xlakit.checkpoint import load, save
from xlakit.options import LoadOptions, Progress, SaveOptions
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
    RuntimeFeatureError,
    XlakitError,
)

__all__ = [
    "__version__",
    "save",
    "load",
    "SaveOptions",
    "LoadOptions",
    "Progress",
    "CheckpointBusyError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIncompleteError",
    "CheckpointPeerError",
    "CheckpointSerializationError",
    "CheckpointTimeoutError",
    "CheckpointWriteError",
    "RuntimeFeatureError",
    "XlakitError",
]
