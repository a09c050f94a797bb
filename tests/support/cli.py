"""The `xlakit` command run in the test's own process, its output captured; and how to run it as a user."""

import os
import shutil

import pytest

from xlakit import cli


def ckpt(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["ckpt", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def as_a_user() -> list[str]:
    """The command prefix that takes root's permission bypass away (a user's view of a folder), or skip."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root reads and writes any folder; taking that away needs setpriv")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
