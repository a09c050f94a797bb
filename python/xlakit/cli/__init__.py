"""The `xlakit` command: one subcommand per area, each defined beside its code.

Each area module exposes `add_parser(subparsers)` which registers its
subcommand and sets `func(args) -> int`. Errors xlakit raises on purpose are
printed as one line, then their hints (how to fix it), never a traceback, with
exit status 2. Stdout is the report's: the commands that read files (`ckpt`,
`cache`, `pjrt`) run with torch's device-backend autoload off, so torch
imports no device backend (torch-tpu's import prints, and aborts a process
without libtpu or TPU_LIBRARY_PATH), and the runtime's commands import torch
with stdout sent to stderr (`runtime/torchtpu.py`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from xlakit._version import describe
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
    args = parser().parse_args(argv)
    try:
        if args.command in _NO_DEVICE:
            with torchtpu.without_device_backends():
                return int(args.func(args) or 0)
        return int(args.func(args) or 0)
    except XlakitError as e:
        print(with_hints(f"xlakit {args.command}: {e}", e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
