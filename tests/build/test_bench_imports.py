"""The benchmarks import what exists: `make bench` is not in CI's run, so a moved test helper
(issue 23 moved tests/pjrt_job.py to tests/support/) would otherwise break it unseen."""

from __future__ import annotations

import ast
import importlib
import importlib.util

from tests.support import REPO


def test_every_bench_import_of_the_repository_resolves():
    missing = []
    for script in sorted((REPO / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("tests", "xlakit"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if importlib.util.find_spec(node.module) is None:
                    missing.append(f"{script.name}: {node.module}")
                    continue
                for full in names[1:]:  # a module, or a name the module defines
                    module = importlib.import_module(node.module)
                    if not hasattr(module, full.rsplit(".", 1)[1]) and importlib.util.find_spec(full) is None:
                        missing.append(f"{script.name}: {full}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in ("tests", "xlakit") and importlib.util.find_spec(a.name) is None:
                        missing.append(f"{script.name}: {a.name}")
    assert not missing, missing
