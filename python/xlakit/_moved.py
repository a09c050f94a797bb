"""Import paths that moved, kept working for one release with a `DeprecationWarning` naming the new place.

The policy (docs/architecture.md): a public import path that moves keeps an alias for one release.
Public means named in `xlakit.__all__`, in README.md, docs/ or examples/, or the module a public
class is defined in (its `repr` shows that path, so users copy it). `MOVED` is the one list:

* `import xlakit.compile_cache` and `from xlakit.compile_cache import X` are served by a finder
  at the end of `sys.meta_path`, consulted only once no real module has the name; the module it
  gives is the new one itself (one module object, one state), never a copy;
* `from xlakit import compile_cache` and `xlakit.compile_cache` by `xlakit.__getattr__`;
* an old module whose name is now a sub-package (`xlakit.checkpoint.manager`) by that package's
  `__getattr__`, for the old module's public names.

Each warns once per process and path, at the user's line. Remove an entry one release after
the move it names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

# old path -> new path, and the change that moved it.
MOVED: dict[str, str] = {
    # Issue 23 moved the runtime side into xlakit.runtime, without aliases (issue 36 restores them).
    "xlakit.compile_cache": "xlakit.runtime.compile_cache",
    "xlakit.pjrt_wrap": "xlakit.runtime.pjrt_wrap",
    "xlakit.cache_files": "xlakit.runtime.cache_files",
    "xlakit.cache_trust": "xlakit.runtime.cache_trust",
    "xlakit.contract": "xlakit.runtime.contract",
    "xlakit.doctor": "xlakit.runtime.doctor",
    "xlakit.memory": "xlakit.runtime.memory",
    # Issue 36 gave checkpoint/ sub-packages: the modules that define xlakit's public checkpoint names.
    "xlakit.checkpoint.options": "xlakit.checkpoint.core.options",
    "xlakit.checkpoint.background": "xlakit.checkpoint.file.background",
    "xlakit.checkpoint.manager": "xlakit.checkpoint.manager.checkpoint_manager",
    "xlakit.checkpoint.readonly": "xlakit.checkpoint.stepstore.readonly",
    "xlakit.checkpoint.local_tier": "xlakit.checkpoint.tier.local_tier",
}


def _user_level() -> int:
    """The `stacklevel` of the first frame outside the import machinery and this module, so the
    warning names the user's line (and the default filters, which show `__main__`'s, show it).
    `warnings` itself skips (does not count) the frames of importlib's bootstrap."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        file, name = frame.f_code.co_filename, frame.f_globals.get("__name__", "")
        if not ("importlib" in file and "_bootstrap" in file):
            if not (name.startswith("importlib") or name == __name__ or frame.f_code.co_name == "__getattr__"):
                return level
            level += 1
        frame = frame.f_back
    return level


def warn(old: str, new: str, fix: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path works until the next release: {fix}",
                  DeprecationWarning, stacklevel=_user_level())


def module(old: str) -> Any:
    """The module now at `MOVED[old]`, with the warning that names it; from here on it is also
    `sys.modules[old]` and its parent's attribute, as an import of `old` would leave it."""
    warn(old, MOVED[old], f"import {MOVED[old]}")
    found = importlib.import_module(MOVED[old])
    sys.modules[old] = found
    parent, _, leaf = old.rpartition(".")
    setattr(sys.modules[parent], leaf, found)
    return found


def attribute(package: str, name: str) -> Any:
    """`package.name` where `package` used to be a module (`MOVED[package]`) and is a sub-package now:
    the old module's public name, with the warning. Submodules and unknown names are not its."""
    target = MOVED.get(package)
    if target is None or name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(target), name, _MISSING)
    if value is _MISSING:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    public = name in getattr(sys.modules.get("xlakit"), "__all__", ())
    warn(f"{package}.{name}", f"{target}.{name}", f"use xlakit.{name}" if public else f"from {target} import {name}")
    setattr(sys.modules[package], name, value)  # once: `from P import N` asks twice
    return value


_MISSING = object()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an old module path as the module now at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, placeholder) -> None:
        module(placeholder.__name__)  # the import returns what sys.modules holds under the name now


def install() -> None:
    """(Once, from `xlakit/__init__.py`.) Last on `sys.meta_path`: only names no real module has."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
