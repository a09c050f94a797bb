"""xlakit's version and build, as the build stamped them into the package.

setup.py writes `xlakit/_build.json` at every build (wheel, sdist, editable):
the version (VERSIONS.toml `[xlakit] version`, the one place it is set), the
commit built and the toolchain with the glibc floor it targets. It is read
here, never from a checkout, which may have moved on since.
"""

from __future__ import annotations

import json
from importlib import resources

STAMP_NAME = "_build.json"


def _read_stamp() -> dict:
    try:
        return json.loads(resources.files("xlakit").joinpath(STAMP_NAME).read_text())
    except FileNotFoundError:
        return {"version": "0+unknown", "commit": None,
                "why_not": f"no xlakit/{STAMP_NAME}: this tree was never built (pip install ., or "
                           "setup.py build_ext --inplace)"}


BUILD: dict = _read_stamp()
__version__: str = BUILD["version"]


def describe() -> str:
    """One line for `xlakit --version`: the version and what it was built from and with."""
    if BUILD.get("commit"):
        source = f"commit {BUILD['commit'][:12]}{' (modified)' if BUILD.get('dirty') else ''}"
    else:
        source = f"commit unknown: {BUILD.get('why_not')}"
    tool = (f"{BUILD['compiler_version']}, target {BUILD['target']}, glibc {BUILD['glibc_floor']}+, "
            f"{BUILD['python_abi']}" if "compiler" in BUILD else "toolchain unknown")
    return f"xlakit {__version__} ({source}; {tool})"
