"""The `xlakit` command: one subcommand per area, each defined beside its code.

Each area module exposes `add_parser(subparsers)` which registers its
subcommand and sets `func(args) -> int`. Errors xlakit raises on purpose are
printed as one line (no traceback) with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from xlakit.errors import XlakitError

# Modules that define subcommands, in help order.
_COMMAND_MODULES: tuple[str, ...] = (
    "xlakit.cli.runtime",
    "xlakit.cli.cache",
    "xlakit.cli.pjrt",
    "xlakit.cli.ckpt",
    "xlakit.cli.selftest",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlakit", description="xlakit: patched PyTorch/XLA runtime tools")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except XlakitError as e:
        print(f"xlakit {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
