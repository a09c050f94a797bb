"""Moved import paths keep working for one release, each with a DeprecationWarning naming the new
place (python/xlakit/_moved.py), and every path the documentation names is a current one.

Each alias is tested from `_moved.MOVED` itself; each test first forgets what an earlier import
of the old path left (sys.modules, the parent's attribute), so each sees its own first import.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings

import pytest

from tests.support import REPO
from xlakit import _moved

# Old paths that are packages now: only the old module's names are aliased (`_moved.attribute`).
PACKAGES_NOW = {old for old in _moved.MOVED if (REPO / "python" / old.replace(".", "/") / "__init__.py").exists()}
MODULES = sorted(set(_moved.MOVED) - PACKAGES_NOW)


@pytest.fixture
def forget(monkeypatch):
    def forget(old: str) -> None:
        parent, _, leaf = old.rpartition(".")
        monkeypatch.delitem(sys.modules, old, raising=False)
        if leaf in vars(importlib.import_module(parent)):  # (hasattr would ask the alias itself)
            monkeypatch.delattr(importlib.import_module(parent), leaf)
    return forget


@pytest.mark.parametrize("old", MODULES)
def test_an_old_module_path_imports_the_new_module_and_warns_naming_it(old, forget):
    forget(old)
    new = importlib.import_module(_moved.MOVED[old])
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(new.__name__)}; ") as seen:
        got = importlib.import_module(old)
    assert got is new  # the module itself: one object, one state
    assert len(seen) == 1 and seen[0].filename == __file__  # at the user's line, once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is new  # once per process


@pytest.mark.parametrize("old", MODULES)
def test_from_parent_import_an_old_module_name_works_and_warns(old, forget):
    forget(old)
    parent, _, leaf = old.rpartition(".")
    with pytest.warns(DeprecationWarning, match=re.escape(_moved.MOVED[old])) as seen:
        got = getattr(__import__(parent, fromlist=[leaf]), leaf)  # what `from parent import leaf` runs
    assert got is importlib.import_module(_moved.MOVED[old])
    assert len(seen) == 1 and seen[0].filename == __file__


def test_from_xlakit_import_pjrt_wrap_and_compile_cache_work_again(forget):
    # Regression (issue 36): issue 23's move broke `from xlakit import pjrt_wrap` without a word.
    forget("xlakit.pjrt_wrap")
    forget("xlakit.compile_cache")
    with pytest.warns(DeprecationWarning, match="xlakit.runtime.pjrt_wrap"):
        from xlakit import pjrt_wrap
    with pytest.warns(DeprecationWarning, match="xlakit.runtime.compile_cache"):
        from xlakit import compile_cache
    assert pjrt_wrap.__name__ == "xlakit.runtime.pjrt_wrap"
    assert compile_cache.enable_persistent_cache is importlib.import_module(
        "xlakit.runtime.compile_cache").enable_persistent_cache


@pytest.mark.parametrize("old", sorted(PACKAGES_NOW))
def test_an_old_module_that_is_a_package_now_keeps_its_public_names(old, monkeypatch):
    package = importlib.import_module(old)
    target = importlib.import_module(_moved.MOVED[old])
    names = [n for n, v in vars(target).items()
             if not n.startswith("_") and getattr(v, "__module__", None) == target.__name__]
    assert names, f"{target.__name__} defines no public name"
    for name in names:
        if name in vars(package):
            monkeypatch.delattr(package, name)
        with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)}\.{name} moved to "
                                                    rf"{re.escape(target.__name__)}\.{name}") as seen:
            assert getattr(package, name) is getattr(target, name)
        assert len(seen) == 1 and seen[0].filename == __file__


def test_a_package_that_was_a_module_still_imports_its_submodules_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for old in PACKAGES_NOW:
            package = importlib.import_module(old)
            for sub in (REPO / "python" / old.replace(".", "/")).glob("*.py"):
                if sub.stem != "__init__":
                    assert importlib.import_module(f"{old}.{sub.stem}").__name__ == f"{old}.{sub.stem}"
            with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
                package.no_such_name  # noqa: B018 - an unknown name stays unknown


def test_a_name_that_never_existed_is_still_missing():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("xlakit.no_such_module")
    with pytest.raises(AttributeError):
        import xlakit

        xlakit.no_such_module  # noqa: B018


def test_the_warning_shows_under_the_default_filters_in_a_script():
    # The default filters show a DeprecationWarning only when it is attributed to __main__.
    out = subprocess.run([sys.executable, "-c", "import xlakit.pjrt_wrap"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO / "python")}, timeout=120, check=True)
    assert "<string>:1: DeprecationWarning: xlakit.pjrt_wrap moved to xlakit.runtime.pjrt_wrap" in out.stderr


# -- the documentation names current paths only ------------------------------------------------

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").rglob("*.py"))]
# Dotted names in the documentation that are not import paths, each with what it is.
NOT_PATHS = {
    "xlakit.values": "a key of `xlakit ckpt inspect --json` (docs/cli.md)",
    "xlakit.compile_cache": "the logger's name (docs/runtime.md), kept when the module moved",
}


# The one page that names the old paths: it states the policy.
POLICY = REPO / "docs" / "architecture.md"


def _documented_paths() -> set[str]:
    found = set()
    for path in DOCS:
        text = path.read_text()
        here = set(re.findall(r"\bxlakit(?:\.[A-Za-z_]\w*)+", text))
        for module, names in re.findall(r"^\s*from (xlakit[\w.]*) import ([\w, ]+)", text, re.M):
            here.update(f"{module}.{n.strip().split(' as ')[0]}" for n in names.split(","))
        found.update(here - set(_moved.MOVED) if path == POLICY else here)
    return {p for p in found if p not in NOT_PATHS}


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_import_path_the_documentation_names_is_current():
    paths = _documented_paths()
    assert "xlakit.lightning.XlakitCheckpointIO" in paths and "xlakit.runtime.torchtpu" in paths  # the scan works
    stale = {}
    for dotted in sorted(paths):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a deprecated path in the docs is a stale one
            try:
                _resolve(dotted)
            except (ImportError, AttributeError, DeprecationWarning) as e:
                stale[dotted] = f"{type(e).__name__}: {e}"
    assert stale == {}
