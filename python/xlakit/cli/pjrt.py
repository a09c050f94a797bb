"""`xlakit pjrt path|env`: the PJRT wrapping plugin on the command line (`xlakit.runtime.pjrt_wrap`)."""

from __future__ import annotations

import argparse
import sys

from xlakit import cache_tier
from xlakit.runtime import pjrt_wrap


def _cmd_path(args: argparse.Namespace) -> int:
    print(pjrt_wrap.library_path())
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    if cache_tier.is_url(args.cache_dir):
        from xlakit.cache_tier import commands

        say = lambda text: print(f"xlakit pjrt env: {text}", file=sys.stderr)  # noqa: E731
        print("\n".join(commands.env_lines(args.cache_dir, local=args.local, plugin=args.plugin, say=say)))
        return 0
    if args.local is not None:
        print(f"xlakit pjrt env: --local names the working folder of a shared tier (a gs:// or s3:// URL); "
              f"{args.cache_dir!r} is a local folder already: pass it alone", file=sys.stderr)
        return 2
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
                     "pjrt-tpu subfolder, judged now as the wrapper will), or a gs:// or s3:// URL: the shared "
                     "tier, pulled now into the local folder, published by a process started beside the job")
    env.add_argument("--local", help="with a URL: the local working folder (default "
                     "~/.cache/xlakit/compile-cache/<bucket>-<hash>)")
    env.add_argument("--plugin", help="the real PJRT plugin (default: the installed libtpu)")
    env.set_defaults(func=_cmd_env)
