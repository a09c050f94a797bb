"""`xlakit cache ls|verify|prune DIR`: inspect a persistent compilation cache.

The patched torch_xla wraps every cache entry in an envelope (csrc/core/
envelope.h); this tool reads it through the same C++ (`xlakit._C`) so what it
calls valid is exactly what the runtime will load. `ls` reads headers only
(cheap on multi-GB caches), `verify` checksums every payload, `prune` deletes
what the runtime would reject anyway: corrupt entries, entries for another
platform version or patch series (given `--platform-version` and friends),
and temporary files left by killed writers. Entries written by a stock
torch_xla have no envelope; they are listed as `foreign` and pruned only on
request (`--foreign`), since a stock runtime may still be using the folder.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from xlakit import _C
from xlakit.errors import XlakitError

_HEADER_PREFIX_BYTES = 64 * 1024


@dataclass(frozen=True)
class EntryReport:
    name: str
    size_bytes: int
    status: str  # "ok", "temporary", "foreign", or an envelope status name
    kind: str | None
    platform_name: str | None
    platform_version: str | None
    patch_series_id: str | None
    message: str

    @property
    def valid(self) -> bool:
        return self.status == "ok"


def _report(path: Path, info: dict | None, size: int) -> EntryReport:
    if info is None:
        status, message = "temporary", "left by a writer that did not finish (killed or running)"
        info = {}
    elif info["status"] == "bad_magic":
        status, message = "foreign", info["message"]
    else:
        status, message = info["status"], info["message"]
    return EntryReport(
        name=path.name, size_bytes=size, status=status, kind=info.get("kind"),
        platform_name=info.get("platform_name"), platform_version=info.get("platform_version"),
        patch_series_id=info.get("patch_series_id"), message=message,
    )


def scan(directory: Path, *, full: bool, identity: dict[str, str] | None = None) -> list[EntryReport]:
    """Report every file in a cache folder; `full` checksums payloads."""
    if not directory.is_dir():
        raise XlakitError(f"{directory}: not a directory (expected an XLA_PERSISTENT_CACHE_PATH folder)")
    reports = []
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        size = path.stat().st_size
        if path.name.startswith(_C.TEMP_PREFIX):
            reports.append(_report(path, None, size))
            continue
        if full or identity:
            info = _C.verify_entry(path.read_bytes(), **(identity or {}))
        else:
            with open(path, "rb") as f:
                info = _C.inspect_header(f.read(_HEADER_PREFIX_BYTES), size)
        reports.append(_report(path, info, size))
    return reports


def _identity(args: argparse.Namespace) -> dict[str, str] | None:
    given = {k: getattr(args, k) for k in ("platform_name", "platform_version", "patch_series_id")}
    if not any(given.values()):
        return None
    if not all(given.values()):
        raise XlakitError("pass all of --platform-name, --platform-version and --patch-series-id, or none")
    return given


def _print(reports: list[EntryReport], as_json: bool) -> None:
    if as_json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
        return
    for r in reports:
        platform = f"{r.platform_name} {r.platform_version!r}" if r.platform_name else "-"
        line = f"{r.status:<26} {r.kind or '-':<11} {r.size_bytes:>12}  {platform:<28} {r.name}"
        print(line + (f"\n    {r.message}" if r.message else ""))
    bad = sum(not r.valid for r in reports)
    print(f"{len(reports)} files, {sum(r.size_bytes for r in reports)} bytes, {bad} not loadable")


def cmd_ls(args: argparse.Namespace) -> int:
    _print(scan(Path(args.dir), full=False, identity=_identity(args)), args.json)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    reports = scan(Path(args.dir), full=True, identity=_identity(args))
    _print(reports, args.json)
    return 0 if all(r.valid for r in reports) else 1


def cmd_prune(args: argparse.Namespace) -> int:
    reports = scan(Path(args.dir), full=True, identity=_identity(args))
    doomed = [r for r in reports if not r.valid and (r.status != "foreign" or args.foreign)]
    for r in doomed:
        verb = "would remove" if args.dry_run else "removed"
        if not args.dry_run:
            # A concurrent prune or writer may have removed or renamed it first.
            try:
                os.unlink(Path(args.dir) / r.name)
            except FileNotFoundError:
                verb = "already gone"
        print(f"{verb}: {r.name} ({r.status})")
    print(f"{len(doomed)} of {len(reports)} files {'to remove' if args.dry_run else 'removed'}")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cache", help="inspect a persistent compilation cache folder")
    sub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    for name, func, help_text in (
        ("ls", cmd_ls, "list entries from their headers"),
        ("verify", cmd_verify, "checksum every entry; exit 1 if any is not loadable"),
        ("prune", cmd_prune, "delete corrupt, mismatched and temporary files"),
    ):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("dir", help="the cache folder (XLA_PERSISTENT_CACHE_PATH)")
        q.add_argument("--json", action="store_true", help="print a JSON list")
        q.add_argument("--platform-name", help="check entries against this runtime (with the next two)")
        q.add_argument("--platform-version")
        q.add_argument("--patch-series-id")
        if name == "prune":
            q.add_argument("--dry-run", action="store_true", help="list what would be removed")
            q.add_argument("--foreign", action="store_true", help="also remove entries without an envelope")
        q.set_defaults(func=func)
