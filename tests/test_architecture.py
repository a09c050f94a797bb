"""The package's shape (issue 23): no import circle, layers that import only downward, modules of
one job, and a public API that moves of modules never change. Inside checkpoint/ (issue 36): every
module in a declared sub-package that says its one job, holds about a dozen modules, and imports
only the sub-packages below it.

Imports are read from the source (`ast`), every one of them: at module level, inside functions
(xlakit imports heavy modules lazily) and under `TYPE_CHECKING`, so a circle that only a lazy
import closes is found too. `from P import M` counts as an import of the module `P.M` when there
is one, else of the package `P`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO

PACKAGE = REPO / "python" / "xlakit"

# Layers, lowest first: a module may import its own layer and the ones before it, never a later one.
LAYERS = [
    ("base", ["xlakit._C", "xlakit._version", "xlakit._knobs", "xlakit.errors", "xlakit._moved"]),
    ("runtime", ["xlakit.runtime"]),
    # An operation (deadline, cancellation, its files) is what both the store and the entry points run under.
    ("operation", ["xlakit.checkpoint.core"]),
    ("objstore", ["xlakit.checkpoint.objstore"]),
    # The compile cache's shared tier: the runtime's cache mirrored to a bucket through the store.
    ("cache tier", ["xlakit.cache_tier"]),
    ("checkpoint", ["xlakit.checkpoint"]),
    ("integrations", ["xlakit.integrations", "xlakit.lightning"]),
    ("selftest", ["xlakit.selftest"]),
    ("cli", ["xlakit.cli", "xlakit.__main__"]),
]
# The package itself re-exports the public API from every layer below the CLI.
TOP = "xlakit"
# Layers that drive the public API as a user's job does, so they may import the package top (which never
# imports them: the circle test holds that). The self-test checks what users get, by the names they use.
PUBLIC_API_USERS = ("selftest",)

# The few modules that stay over the size rule, each with its reason.
LONG_MODULES = {
    # (none)
}
MAX_LINES = 450


def _modules() -> dict[str, Path]:
    found = {}
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]:
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                out.add(target if target in modules else source)
    return {m for m in out if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _layer(module: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_anywhere_in_the_package():
    # Regression (issue 23): checkpoint/steps.py and the object-storage steps imported each other.
    assert _circles(_graph()) == []


def test_layers_import_only_downward():
    upward = []
    for module, targets in _graph().items():
        if module == TOP:
            continue
        mine = _layer(module)
        assert mine is not None, f"{module} belongs to no layer of tests/test_architecture.py"
        for target in targets:
            theirs = _layer(target) if target != TOP else mine if LAYERS[mine][0] in PUBLIC_API_USERS else len(LAYERS)
            if theirs > mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) imports {target}")
    assert upward == []


def test_the_package_top_never_imports_the_cli():
    assert not {t for t in _graph()[TOP] if _layer(t) == len(LAYERS) - 1}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_have_one_job_a_docstring_and_a_bounded_size(path):
    text = path.read_text()
    module = ast.parse(text)
    if text.strip():
        assert ast.get_docstring(module), f"{path.relative_to(PACKAGE)} does not open with what its job is"
    lines = len(text.splitlines())
    name = str(path.relative_to(PACKAGE))
    assert lines <= MAX_LINES or name in LONG_MODULES, (
        f"{name} has {lines} lines: split it by job, or name it in LONG_MODULES with the reason")


def test_the_public_api_resolves():
    import importlib

    import xlakit

    for name in xlakit.__all__:
        assert getattr(xlakit, name) is not None, name
    assert importlib.import_module("xlakit.lightning").XlakitCheckpointIO.__module__ == "xlakit.integrations.lightning"
    assert callable(importlib.import_module("xlakit.cli").main)


# -- inside checkpoint/ (issue 36) ---------------------------------------------------------------

CHECKPOINT = "xlakit.checkpoint"
# Its sub-packages, lowest first: each imports only itself and the ones before it (and the layers
# below checkpoint). ENTRY is the package's own __init__.py, the entry points: the layouts below
# it are what it dispatches to; the manager and what `xlakit ckpt` reads call it.
ENTRY = "(entry points)"
CHECKPOINT_ORDER = ["core", "objstore", "format", "store", "file", "coordination", "torch_dcp", "multirank",
                    ENTRY, "stepstore", "tier", "manager", "inspect"]
MAX_SUBPACKAGE_MODULES = 12


def _subpackage(module: str) -> str | None:
    """The checkpoint sub-package `module` belongs to; ENTRY for the package itself."""
    if module == CHECKPOINT:
        return ENTRY
    if not module.startswith(CHECKPOINT + "."):
        return None
    return module[len(CHECKPOINT) + 1:].split(".")[0]


def test_checkpoint_holds_only_its_declared_subpackages():
    folder = PACKAGE / "checkpoint"
    loose = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    assert loose == [], "every checkpoint module belongs to a sub-package of CHECKPOINT_ORDER"
    found = sorted(p.parent.name for p in folder.glob("*/__init__.py"))
    assert found == sorted(set(CHECKPOINT_ORDER) - {ENTRY}), "place a new sub-package in CHECKPOINT_ORDER"


@pytest.mark.parametrize("name", sorted(set(CHECKPOINT_ORDER) - {ENTRY}))
def test_each_checkpoint_subpackage_says_its_one_job_and_holds_about_a_dozen_modules(name):
    folder = PACKAGE / "checkpoint" / name
    assert ast.get_docstring(ast.parse((folder / "__init__.py").read_text())), (
        f"checkpoint/{name}/__init__.py does not open with what the sub-package is for")
    modules = sorted(p.name for p in folder.rglob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_SUBPACKAGE_MODULES, (
        f"checkpoint/{name}/ holds {len(modules)} modules ({', '.join(modules)}): split it by concern")


def _upward_subpackage_imports(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, targets in graph.items():
        mine = _subpackage(module)
        if mine is None:
            continue
        for target in targets:
            theirs = _subpackage(target)
            if theirs is not None and CHECKPOINT_ORDER.index(theirs) > CHECKPOINT_ORDER.index(mine):
                upward.append(f"{module} ({mine}) imports {target} ({theirs})")
    return sorted(upward)


def test_checkpoint_subpackages_import_only_the_ones_below_them():
    assert _upward_subpackage_imports(_graph()) == []


def test_the_subpackage_order_check_sees_an_upward_import():
    graph = {"xlakit.checkpoint.core.options": {"xlakit.checkpoint.file.pipeline", "xlakit.errors"},
             "xlakit.checkpoint.file.pipeline": {"xlakit.checkpoint.core.options"},
             "xlakit.checkpoint.multirank.ranks": {"xlakit.checkpoint"},
             "xlakit.checkpoint.manager.checkpoint_manager": {"xlakit.checkpoint"}}
    assert _upward_subpackage_imports(graph) == [
        "xlakit.checkpoint.core.options (core) imports xlakit.checkpoint.file.pipeline (file)",
        f"xlakit.checkpoint.multirank.ranks (multirank) imports xlakit.checkpoint ({ENTRY})"]


def test_the_architecture_map_draws_checkpoint_subpackages_in_their_order():
    text = (REPO / "docs" / "architecture.md").read_text()
    tree = text[text.index("\n  checkpoint/\n") + 1:]
    drawn = []
    for line in tree.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("    "):
            break  # the next top-level folder
        name = line[4:].split(" ", 1)[0] if line.startswith("    ") and not line.startswith("     ") else ""
        if name:
            drawn.append(ENTRY if name == "__init__.py" else name.rstrip("/"))
    assert drawn == CHECKPOINT_ORDER


# -- C++ (issue 36 item 3) ------------------------------------------------------------------------------------

CSRC = REPO / "csrc"
# A C++ source or header over this many lines does more than one job: split it along its seams.
MAX_CXX_LINES = 500
# The few files that stay over it, each with its reason.
LONG_CXX_FILES: dict[str, str] = {
    # (none)
}


@pytest.mark.parametrize("path", sorted([*CSRC.rglob("*.cc"), *CSRC.rglob("*.h")]),
                         ids=lambda p: str(p.relative_to(CSRC)))
def test_cxx_files_open_with_what_they_provide_and_have_a_bounded_size(path):
    lines = path.read_text().splitlines()
    name = str(path.relative_to(CSRC))
    assert lines and lines[0].startswith("//"), f"csrc/{name} does not open with a comment saying what it provides"
    assert len(lines) <= MAX_CXX_LINES or name in LONG_CXX_FILES, (
        f"csrc/{name} has {len(lines)} lines: split it along its seams, or name it in LONG_CXX_FILES with the reason")
