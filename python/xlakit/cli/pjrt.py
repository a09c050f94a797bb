"""`xlakit pjrt path|env`: the PJRT wrapping plugin on the command line (`xlakit.runtime.pjrt_wrap`)."""

from __future__ import annotations

import argparse
import sys

from xlakit.runtime import pjrt_wrap


def _cmd_path(args: argparse.Namespace) -> int:
    print(pjrt_wrap.library_path())
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    print("\n".join(pjrt_wrap.env_lines(args.cache_dir, args.plugin)))
    if note := pjrt_wrap.earlier_entries_note(args.cache_dir):
        print(f"xlakit pjrt env: {note}", file=sys.stderr)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pjrt", help="the PJRT wrapping plugin: a persistent compile cache for stock torch_xla")
    sub = p.add_subparsers(dest="pjrt_command", required=True, metavar="SUBCOMMAND")
    path = sub.add_parser("path", help="print the wrapping plugin's path (for TPU_LIBRARY_PATH)")
    path.set_defaults(func=_cmd_path)
    env = sub.add_parser("env", help="print the exports that turn the wrapper on for a job that runs no xlakit code")
    env.add_argument("cache_dir", help="the cache path, as enable_persistent_cache takes it (entries go to its "
                     "pjrt-tpu subfolder, judged now as the wrapper will)")
    env.add_argument("--plugin", help="the real PJRT plugin (default: the installed libtpu)")
    env.set_defaults(func=_cmd_env)
