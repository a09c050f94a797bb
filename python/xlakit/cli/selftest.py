"""`xlakit selftest`: run `xlakit.selftest` and print its report (text, or `--json`), optionally to a file too.

Progress goes to stderr, the report alone to stdout: while the checks run,
this process's stdout is pointed at stderr, so that nothing else (a library
writing to file descriptor 1) can get into `--json`. Exit status: 0 when no
check failed, 1 when one did, 2 for a wrong argument, 130 on Ctrl-C or
SIGTERM (the children stopped, the temporary folder removed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from xlakit import selftest
from xlakit.selftest import devices, report


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt


def report_path(given: str, job: dict) -> Path:
    """`--report FILE` for this rank: `{rank}` in the name is replaced; with several ranks and no `{rank}`,
    `.rankN` goes before the suffix, so that the ranks of a host never write one file."""
    if "{rank}" in given:
        return Path(given.replace("{rank}", str(job["rank"]))).expanduser()
    path = Path(given).expanduser()
    if job["world"] > 1:
        path = path.with_name(f"{path.stem}.rank{job['rank']}{path.suffix}")
    return path


def _checks(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in report.NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(report.NAMES)}, "
                                         f"found {text!r}")
    return names


def _unusable_folder(given: str) -> str | None:
    """Why `--tmpdir` cannot hold the self-test's temporary folder, or None."""
    path = Path(given).expanduser()
    fix = "pass a folder you can write, on a local disk (without --tmpdir: TMPDIR, else /tmp)"
    if not path.exists():
        return f"no such folder; create it (mkdir -p {given}) or {fix}"
    if not path.is_dir():
        return f"not a folder; {fix}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"you cannot write in it; {fix}"
    return None


def _cmd(args: argparse.Namespace) -> int:
    try:
        options = selftest.Options(quick=args.quick, checks=args.checks, backend=args.backend, profile=args.profile,
                                   pins=args.pins, tmpdir=args.tmpdir, shared_dir=args.shared_dir,
                                   timeout_s=args.timeout_s)
    except ValueError as e:
        print(f"xlakit selftest: {e}", file=sys.stderr)
        return 2
    if args.tmpdir and (problem := _unusable_folder(args.tmpdir)):  # a wrong argument, not a failed check
        print(f"xlakit selftest: --tmpdir {args.tmpdir}: {problem}", file=sys.stderr)
        return 2
    say = lambda line: print(f"xlakit selftest: {line}", file=sys.stderr, flush=True)  # noqa: E731
    # A launcher stops its ranks with SIGTERM: unwind as for Ctrl-C, so that the child (in a session of its own,
    # perhaps holding the chips) is stopped and the temporary folder removed.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with _stdout_to_stderr():
            found = selftest.run(options, say=say)
    except KeyboardInterrupt:
        print("xlakit selftest: interrupted; its child processes were stopped and its folder removed", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.report:
        try:
            say(f"report written to {report.write(found, report_path(args.report, found['job']))}")
        except OSError as e:
            print(f"xlakit selftest: cannot write the report to {args.report}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            print(json.dumps(found, indent=2) if args.json else report.render(found))
            return 2
    if kept := found["job"].get("kept_folder"):
        say(f"a check failed: its files are kept in {kept} (remove it when done)")
    print(json.dumps(found, indent=2) if args.json else report.render(found), flush=True)
    return 1 if found["status"] == report.FAIL else 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("selftest", help="check this machine's accelerator end to end (compile cache, memory, "
                              "checkpoints, ranks, stack) and report it")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema xlakit-selftest/1)")
    p.add_argument("--quick", action="store_true", help="small states: seconds instead of minutes")
    p.add_argument("--report", metavar="FILE", help="also write the JSON report to FILE ({rank} is the rank; with "
                   "several ranks and no {rank}, .rankN goes before the suffix)")
    p.add_argument("--checks", type=_checks, default=report.NAMES, metavar="NAME[,NAME]",
                   help=f"run only these, of {', '.join(report.NAMES)} (default: all)")
    p.add_argument("--backend", choices=("auto", *devices.BACKENDS), default="auto",
                   help="what to check (default: what this environment runs)")
    p.add_argument("--profile", help="VERSIONS.toml profile to check the stack against")
    p.add_argument("--pins", help="a pins file instead of the one baked into xlakit")
    p.add_argument("--tmpdir", help="where the temporary folder goes (default: TMPDIR, else /tmp)")
    p.add_argument("--shared-dir", help="ranks on several hosts: a folder every host sees, for the sharded save")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="one deadline for the whole run (default 1800)")
    p.set_defaults(func=_cmd)
