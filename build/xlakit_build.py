#!/usr/bin/env python3
"""xlakit's build CLI: one entry point, a subcommand per step.

Makefile targets only call this. Every external command goes through one
runner that logs it, so `--dry-run` prints the whole pipeline in order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pins  # noqa: E402


def cmd_requirements(args: argparse.Namespace) -> int:
    print("\n".join(pins.requirements(args.profile)))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlakit_build", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("requirements", help="print pip requirement lines for a profile")
    r.add_argument("--profile", default="cpu-dev")
    r.set_defaults(func=cmd_requirements)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except pins.PinError as e:
        print(f"xlakit_build: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
