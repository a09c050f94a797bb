"""`xlakit ckpt ls|inspect|verify|diff|convert`: look into and check checkpoints from the shell.

The work is done by the checkpoint package (`steps`, `describe`, `integrity`,
`tensors`); this module parses arguments, prints (a table, or `--json` on
stdout) and maps outcomes to exit codes:

  0  success (verify: every checksum matched; diff: no difference)
  1  verify: the checkpoint is damaged or incomplete (the first bad tensor or file is named);
     diff: the checkpoints differ
  2  an error: a bad argument, a missing path, something that is not a checkpoint,
     a source that cannot be read
  3  verify: nothing to verify (a plain torch.save file has no checksums, a manager folder
     has no committed step)
  130  interrupted (Ctrl-C); nothing was changed

Errors are one line on stderr, never a traceback, and name the file they are
about. The progress bar of `verify` appears on a terminal only. `--json`
output is strict JSON: a float that is not finite (a NaN metric, a NaN or
infinite difference) is written as the string "NaN", "Infinity" or "-Infinity".

`diff` compares names, the containers leading to them (a list is not a dict
keyed "0"), dtypes and shapes, then elements bit by bit, chunk by chunk; a
NaN equals a NaN, a NaN against a number is a difference whose size is NaN.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from xlakit.cli import hints, pipe
from xlakit.cli.ckpt.common import EPILOG, ERROR, allowing, code_refusal, runs_code
from xlakit.cli.ckpt.convert import cmd_convert
from xlakit.cli.ckpt.diff import cmd_diff
from xlakit.cli.ckpt.inspect import cmd_inspect
from xlakit.cli.ckpt.ls import cmd_ls
from xlakit.cli.ckpt.verify import cmd_verify
from xlakit.errors import XlakitError, with_hints


_ALLOWING = ("inspect", "diff", "convert")  # the commands that read pickled values


def _guarded(func):
    """Run a subcommand; any failure is one line on stderr, then its hints, and exit status 2 (never a
    traceback)."""
    def run(args: argparse.Namespace) -> int:
        from xlakit.checkpoint import objstore

        try:
            for name in ("path", "dir", "a", "b", "out"):
                objstore.check_url(getattr(args, name, None))  # az://, http://: refused by scheme
            with allowing(getattr(args, "allow_global", None)):
                return func(args)
        except KeyboardInterrupt:
            print(f"xlakit ckpt {args.ckpt_command}: interrupted; nothing was changed", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - a client library's own error too: one line, never a traceback
            if isinstance(e, BrokenPipeError) and pipe.stdout_gone():
                raise  # the reader went away: `xlakit.cli.main` ends quietly
            print(f"xlakit ckpt {args.ckpt_command}: {_error_message(e, args.ckpt_command)}", file=sys.stderr)
            return ERROR
    return run


def _error_message(e: Exception, command: str) -> str:
    """The error's line, then its hints (`with_hints`)."""
    line = _line(e)
    if command in _ALLOWING and isinstance(e, XlakitError):
        from xlakit.checkpoint.format import pickled

        refused = pickled.named_refused(line)
        if refused and runs_code(refused):
            return f"{line}; {code_refusal(refused)}"
        if refused:  # the command's own way to allow it, in place of the Python one its hint gives
            return f"{line}; if you trust it, pass --allow-global {refused}"
    return with_hints(line, hints.for_the_command(e))


def _line(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        if e.filename is None or str(e.filename) in e.strerror:  # xlakit's own messages name the path
            return e.strerror
        return f"{e.filename}: {e.strerror}"
    return str(e) if isinstance(e, XlakitError) else f"{type(e).__name__}: {e}"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ckpt", help="inspect, verify, compare and convert checkpoints",
                              epilog=EPILOG)
    sub = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    commands: list[tuple[str, Any, str, list[tuple[str, str]]]] = [
        ("ls", cmd_ls, "list a CheckpointManager folder: steps, commit state, sizes, metrics, best",
         [("dir", "the manager folder (or its gs:// or s3:// URL)")]),
        ("inspect", cmd_inspect, "tensors (dtype, shape, bytes, shared storages), format, checksums, commit record",
         [("path", "a checkpoint file, a sharded or DCP folder, or a manager step folder (or their gs:// or "
                   "s3:// URLs)")]),
        ("verify", cmd_verify, "check every checksum, streamed; exit 1 naming the first bad tensor",
         [("path", "a checkpoint file, a sharded or DCP folder, a step folder or a manager folder")]),
        ("diff", cmd_diff, "which tensors differ between two checkpoints, and by how much",
         [("a", "the first checkpoint"), ("b", "the second checkpoint")]),
        ("convert", cmd_convert, "write a checkpoint (file, sharded or DCP folder) as one safetensors or "
                                 "xlakit file", [("path", "the checkpoint to convert")]),
    ]
    for name, func, help_text, positional in commands:
        q = sub.add_parser(name, help=help_text, epilog=EPILOG)
        for arg, arg_help in positional:
            q.add_argument(arg, help=arg_help)
        if name == "convert":
            q.add_argument("--to", required=True, choices=("safetensors", "xlakit"), help="the output format")
            q.add_argument("out", help="the file to write (or, with --to xlakit, a gs:// or s3:// URL)")
            q.add_argument("--force", action="store_true", help="replace OUT if it exists")
        if name in _ALLOWING:
            q.add_argument("--allow-global", action="append", metavar="MODULE.NAME",
                           help="let a weights-only load of pickled values accept this class (repeat for "
                                "each); only for checkpoints you trust")
        q.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        q.set_defaults(func=_guarded(func))
