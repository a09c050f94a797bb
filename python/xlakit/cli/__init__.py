"""The `xlakit` command: one subcommand per area, each defined beside its code.

Each area module exposes `add_parser(subparsers)` which registers its
subcommand and sets `func(args) -> int`. Errors xlakit raises on purpose are
printed as one line, then their hints (how to fix it), never a traceback, with
exit status 2. Stdout is the report's: the commands that read files (`ckpt`,
`cache`, `pjrt`) run with torch's device-backend autoload off, so torch
imports no device backend (torch-tpu's import prints, and aborts a process
without libtpu or TPU_LIBRARY_PATH), and the runtime's commands import torch
with stdout sent to stderr (`runtime/torchtpu.py`).

What the user gave that cannot be read is a wrong argument too, whichever
command met it: an OSError (a folder you cannot list, a symbolic link loop), a
file that is not text where text was expected (UnicodeDecodeError) and
pathlib's "Symlink loop" RuntimeError are one line naming the path, and how to
fix it, with exit status 2. Any other exception is a bug, and keeps its
traceback. A reader of stdout that went away ends the command quietly
(`pipe.py`). Hints that give the Python API's fix, and client libraries' log
records, are said the command's way (`hints.py`).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys

from xlakit._version import describe
from xlakit.cli import hints, pipe
from xlakit.errors import XlakitError, with_hints
from xlakit.runtime import torchtpu

# Modules that define subcommands, in help order.
_COMMAND_MODULES: tuple[str, ...] = (
    "xlakit.cli.runtime",
    "xlakit.cli.cache",
    "xlakit.cli.pjrt",
    "xlakit.cli.ckpt",
    "xlakit.cli.selftest",
)
# The commands that need no device: no device backend is imported with torch while they run.
_NO_DEVICE = frozenset({"cache", "pjrt", "ckpt"})


class _Version(argparse.Action):
    """`--version` as one line (argparse's own would wrap it to the terminal)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe())
        parser.exit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlakit", description="xlakit: patched PyTorch/XLA runtime tools")
    p.add_argument("--version", action=_Version, help="the version, and the commit and toolchain it was built with")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            pipe.flush()
    except BrokenPipeError:
        if not pipe.stdout_gone():
            raise
        return pipe.quiet()  # the reader went away (`xlakit doctor | head -3`): 141, as a shell's tools


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        with hints.one_line_client_logs():
            if args.command in _NO_DEVICE:
                with torchtpu.without_device_backends():
                    return int(args.func(args) or 0)
            return int(args.func(args) or 0)
    except XlakitError as e:
        print(with_hints(f"xlakit {args.command}: {e}", hints.for_the_command(e)), file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError, RuntimeError) as e:
        line = None if isinstance(e, BrokenPipeError) and pipe.stdout_gone() else _unreadable(e)
        if line is None:
            raise  # a bug: its traceback (or stdout's reader gone: `main` ends quietly)
        print(f"xlakit {args.command}: {line}", file=sys.stderr)
        return 2


_SYMLINK_LOOP = re.compile(r"Symlink loop from (?P<path>.+)")  # pathlib's resolve() before Python 3.13


def _unreadable(e: BaseException) -> str | None:
    """What a path the user gave that cannot be used is, and its fix, as one line; None for anything else."""
    if isinstance(e, UnicodeDecodeError):
        return (f"expected a text file, found binary data ({e.reason} at byte {e.start}); pass the text file "
                "the option asks for")
    if isinstance(e, RuntimeError):
        found = _SYMLINK_LOOP.fullmatch(str(e))
        return None if found is None else _loop(found["path"].strip("'\""))
    if not isinstance(e, OSError) or e.strerror is None:  # a client library's OSError with no errno: a bug
        return None
    if e.filename is None:
        return e.strerror
    name = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
    if e.errno == errno.ELOOP:
        return _loop(name)
    if e.errno in (errno.EACCES, errno.EPERM):
        if os.path.isdir(e.filename):
            fix = f"chmod u+rx {e.filename} (u+rwx to write in it)"
        elif os.path.lexists(e.filename):
            fix = f"chmod u+r {e.filename} (u+rw to write it)"
        else:
            fix = "make each folder on its path searchable by you (ls -ld each)"
        return f"{name}: permission denied; {fix}, or run this as its owner"
    if str(e.filename) in e.strerror:  # xlakit's own messages name the path
        return e.strerror
    return f"{name}: {e.strerror}"


def _loop(path: str) -> str:
    return (f"{path}: a symbolic link loop (links that lead to each other); point it at a real file or folder "
            f"(ls -l shows where each link leads), or pass another path")


if __name__ == "__main__":
    sys.exit(main())
