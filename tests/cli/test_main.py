"""The `xlakit` command itself (`xlakit.cli.main`): what it does with what escapes a command."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import xlakit
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


@pytest.mark.parametrize("args", [["cache", "ls", "{folder}"], ["pjrt", "path"], ["ckpt", "inspect", "{file}"],
                                  ["doctor", "--profile", "cpu-dev"]], ids=lambda a: " ".join(a[:2]))
def test_a_reader_that_went_away_ends_the_command_quietly(tmp_path, args):
    # Regression: `xlakit doctor | head -3` ended in a BrokenPipeError traceback (after a first fix, in the line
    # "xlakit doctor: Broken pipe" and exit 2; `ckpt` blamed the checkpoint: "a.pt: Broken pipe").
    for n in range(200):
        (tmp_path / f"f{n}").write_text("")
    xlakit.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    args = [a.format(folder=tmp_path, file=tmp_path / "a.pt") for a in args]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes: its first write meets a closed pipe
    env = {**os.environ, "PYTHONPATH": str(Path(xlakit.__file__).parents[1])}
    try:
        run = subprocess.run([sys.executable, "-m", "xlakit", *args], stdout=write, stderr=subprocess.PIPE,
                             env=env, text=True, timeout=240)
    finally:
        os.close(write)
    assert (run.returncode, run.stderr) == (141, ""), run.stderr  # 128 + SIGPIPE, as a shell's tools


def test_gcsfs_logs_one_line_per_record_in_the_command_and_nothing_changes_for_library_users(tmp_path):
    # Regression: gcsfs logs each request it gives up on with `logger.exception` ("_request out of retries on
    # exception: ..."), and its tracebacks reached the command's stderr, six of them for one `ckpt ls gs://...`.
    script = textwrap.dedent("""
        import logging, sys
        from xlakit import cli
        from xlakit.cli import pjrt

        def cmd(args):
            try:
                raise ConnectionError("Cannot connect to host storage.googleapis.com:443")
            except ConnectionError as e:
                logging.getLogger("gcsfs").exception(f"_request out of retries on exception: {e}")
            return 0

        pjrt._cmd_path = cmd
        logging.basicConfig()  # as torch_xla's first logging.warning does: a handler on the root logger
        code = cli.main(["pjrt", "path"])
        print("-- after", file=sys.stderr)
        try:
            raise ValueError("a library user's")
        except ValueError:
            logging.getLogger("gcsfs").exception("the record")  # theirs: as gcsfs and their logging make it
        sys.exit(code)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(xlakit.__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    during, after = run.stderr.split("-- after\n")
    assert during == "gcsfs: _request out of retries on exception: Cannot connect to host " \
                     "storage.googleapis.com:443\n", run.stderr
    assert after.startswith("ERROR:gcsfs:the record\nTraceback") and "ValueError: a library user's" in after
