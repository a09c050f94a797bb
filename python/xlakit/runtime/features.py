"""Feature detection: which xlakit patches the running torch_xla carries.

A patch is detected by the binding it adds to `torch_xla._XLAC`, never by a
version string, so a stock wheel, a patched wheel and a future upstream fix
are each treated by what they can actually do. Import failures are recorded
with their reason (for the manifest and `xlakit doctor`), never swallowed.
"""

from __future__ import annotations

import functools
from types import ModuleType

# Bindings the patch series adds (names are the contract with patches/).
TRANSFER_TO_HOST = "_xla_transfer_to_host"
RUNTIME_MEMORY_INFO = "_xla_runtime_memory_info"
BUILD_INFO = "_xlakit_build_info"


@functools.cache
def _import_xlac() -> tuple[ModuleType | None, str | None]:
    from xlakit.runtime import torchtpu

    if torchtpu.in_use():  # torch_xla beside torch-tpu is not the runtime here: never imported
        return None, "TorchTPU stack: torch_xla is not used (torch-tpu is installed; docs/torchtpu.md)"
    try:
        import torch_xla  # noqa: F401
        from torch_xla import _XLAC
    # A broken install raises more than ImportError at import (OSError for a missing library, RuntimeError
    # from a version check); each is recorded with its reason for the manifest and doctor.
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return _XLAC, None


def xlac() -> ModuleType | None:
    """torch_xla's extension module, or None when torch_xla cannot be imported."""
    return _import_xlac()[0]


def xla_import_error() -> str | None:
    """Why torch_xla could not be imported, or None when it could."""
    return _import_xlac()[1]


def require_xlac(purpose: str) -> ModuleType:
    """torch_xla's extension module, or RuntimeFeatureError saying why `purpose` cannot run."""
    from xlakit.errors import RuntimeFeatureError

    module = xlac()
    if module is None:
        raise RuntimeFeatureError(f"{purpose} needs torch_xla, which cannot be imported: "
                                  f"{xla_import_error()}")
    return module


def has_binding(name: str) -> bool:
    module = xlac()
    return module is not None and hasattr(module, name)


def build_info() -> dict | None:
    """The patched binary's provenance (`_xlakit_build_info()`), None on stock builds."""
    if not has_binding(BUILD_INFO):
        return None
    return dict(getattr(xlac(), BUILD_INFO)())
