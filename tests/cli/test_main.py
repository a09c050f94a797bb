"""The `xlakit` command itself (`xlakit.cli.main`): what it does with what escapes a command."""

from __future__ import annotations

import errno

import pytest

from xlakit import cli
from xlakit.cli import pjrt


def _failing(monkeypatch, error: BaseException) -> None:
    """`xlakit pjrt path` raises `error`."""
    def cmd(args):
        raise error

    monkeypatch.setattr(pjrt, "_cmd_path", cmd)


@pytest.mark.parametrize("error, says", [
    (PermissionError(errno.EACCES, "Permission denied", "/srv/nope/x"),
     "/srv/nope/x: permission denied; make each folder on its path searchable by you (ls -ld each), or run this "
     "as its owner"),
    (OSError(errno.ELOOP, "Too many levels of symbolic links", "/a/loop1"),
     "/a/loop1: a symbolic link loop (links that lead to each other); point it at a real file or folder "
     "(ls -l shows where each link leads), or pass another path"),
    (RuntimeError("Symlink loop from '/a/loop1'"), "/a/loop1: a symbolic link loop (links that lead to each other)"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/a/dir"), "/a/dir: Is a directory"),
    (UnicodeDecodeError("utf-8", b"\x80", 0, 1, "invalid start byte"),
     "expected a text file, found binary data (invalid start byte at byte 0)"),
], ids=["permission", "eloop", "pathlib-loop", "folder", "binary"])
def test_what_the_user_gave_that_cannot_be_read_is_one_line_exit_2(monkeypatch, capsys, error, says):
    # Regression: an OSError, a UnicodeDecodeError or pathlib's symlink-loop RuntimeError from any command other
    # than `ckpt` reached the user as a traceback, exit 1 (`cache ls` of a folder they cannot list, `pjrt env`
    # of a link loop, `manifest --pins` of a binary file).
    _failing(monkeypatch, error)
    assert cli.main(["pjrt", "path"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xlakit pjrt: {says}") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("error", [ZeroDivisionError("a bug"), RuntimeError("a bug"), KeyError("x")])
def test_a_bug_keeps_its_traceback(monkeypatch, error):
    _failing(monkeypatch, error)
    with pytest.raises(type(error)):
        cli.main(["pjrt", "path"])
