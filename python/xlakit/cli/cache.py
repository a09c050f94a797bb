"""`xlakit cache ls|verify|prune|explain DIR`: a persistent compilation cache folder on the command line.

What each entry is, and what may be deleted, is decided in
`xlakit.runtime.cache_files` (through the same C++ the runtime loads entries
with); here the arguments are read, the findings printed and prune carried out,
re-checking each file just before it is removed. `explain` reads the PJRT
wrapper's key records (`xlakit.runtime.cache_explain`).
"""

from __future__ import annotations

import argparse
import os
import json
import time
from dataclasses import asdict

from xlakit import _knobs, cache_tier
from xlakit.errors import XlakitError
from xlakit.runtime import cache_explain, cache_files


def _identity(args: argparse.Namespace) -> dict[str, str] | None:
    """The runtime to judge entries against: three fields, plus the torch_xla revision when given."""
    given = {k: getattr(args, k) for k in ("platform_name", "platform_version", "patch_series_id")}
    if not any(given.values()):
        if args.torch_xla_revision:
            raise XlakitError("--torch-xla-revision checks entries only together with --platform-name, "
                              "--platform-version and --patch-series-id")
        return None
    if not all(given.values()):
        raise XlakitError("pass all of --platform-name, --platform-version and --patch-series-id, or none")
    if args.torch_xla_revision:
        given["torch_xla_revision"] = args.torch_xla_revision
    return given


def _print(directory: str | os.PathLike, reports: list[cache_files.EntryReport], as_json: bool) -> None:
    trust = cache_files.folder_trust(directory)
    if as_json:
        folder = {k: v for k, v in asdict(trust).items() if k != "folder"}
        print(json.dumps({"folder": {"path": str(trust.folder), **folder},
                          "entries": [asdict(r) for r in reports]}, indent=2))
        return
    print(f"folder {trust.folder}: {trust.describe()}")
    for r in reports:
        platform = f"{r.platform_name} {r.platform_version!r}" if r.platform_name else "-"
        line = f"{r.status:<26} {r.kind or '-':<11} {r.size_bytes:>12}  {platform:<28} {r.name}"
        print(line + (f"\n    {r.message}" if r.message else ""))
    print(cache_files.summary(reports))


def cmd_ls(args: argparse.Namespace) -> int:
    _print(args.dir, cache_files.scan(args.dir, full=False, identity=_identity(args)), args.json)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    reports = cache_files.scan(args.dir, full=True, identity=_identity(args), key=cache_files.key_from_env())
    _print(args.dir, reports, args.json)
    return 0 if all(r.valid for r in reports if r.is_entry) else 1


def cmd_prune(args: argparse.Namespace) -> int:
    if cache_tier.is_url(args.dir):
        if args.max_bytes is None or args.foreign:
            raise XlakitError(f"{args.dir} is a shared tier: prune it with --max-bytes N (its oldest entries go "
                              "first); --foreign is for local folders")
        from xlakit.cache_tier import commands

        commands.prune(args.dir, args.max_bytes, dry_run=args.dry_run)
        return 0
    folder = cache_files.require_folder(args.dir)
    if args.foreign and not cache_files.made_by_xlakit(folder):
        raise XlakitError(
            f"--foreign removes entries without an envelope only in a folder xlakit.enable_persistent_cache "
            f"made (it holds {cache_files.KEY_FILE}); {folder} has none, so its files may be another program's. Nothing "
            "was removed; delete them by hand if you are sure, or prune without --foreign")
    identity, key = _identity(args), cache_files.key_from_env()
    tag_faults = key is not None and cache_files.keyed_for(folder, key)
    now = time.time()
    files = cache_files.regular_files(folder)
    removed = 0
    gone: set[str] = set()  # entries removed (or, in a dry run, to remove)
    for path, st in files:
        r = cache_files.classify(path, st, full=True, identity=identity, key=key, now=now)
        if not cache_files.removable(r, foreign=args.foreign, tag_faults=tag_faults):
            if r.status in cache_files.TAG_FAULTS:
                print(f"kept: {r.name} ({r.status}: another key's entry, or none's, or a forgery; the runtime never "
                      f"loads it with this key, and only a folder made for this key is pruned of them)")
            continue
        if args.dry_run:
            verb = "would remove"
        elif not cache_files.unchanged_since(path, st):
            verb = "changed since it was checked, kept"
        else:
            try:
                path.unlink()
                verb = "removed"
            except FileNotFoundError:  # a concurrent prune or the runtime removed it first
                verb = "already gone"
        removed += verb in ("removed", "would remove")
        print(f"{verb}: {r.name} ({r.status})")
        if verb == "removed" and cache_files.remove_parts(path):
            removed += 1
            print(f"removed: {cache_files.parts_of(path).name} (its key record)")
        if verb in ("removed", "would remove"):
            gone.add(path.name)
    if args.max_bytes is not None:
        removed += _evict(folder, args.max_bytes, dry_run=args.dry_run, gone=gone)
    for path, st in cache_files.stale_parts(folder, gone=gone if args.dry_run else set()):
        if not args.dry_run:
            if not cache_files.unchanged_since(path, st):
                continue  # rewritten since it was listed: its entry may be back
            path.unlink(missing_ok=True)
        removed += 1
        print(f"{'would remove' if args.dry_run else 'removed'}: {path.name} (the key record of an entry no "
              "longer there)")
    print(f"{removed} of {len(files)} files {'to remove' if args.dry_run else 'removed'}")
    return 0


def _evict(folder, max_bytes: int, *, dry_run: bool, gone: set[str]) -> int:
    """Removes the least recently used entries until the folder's entries hold at most `max_bytes`.

    A wrapper hit touches its entry, so the oldest modification time is the entry used least recently.
    An entry is a file named like one with xlakit's envelope; without one (a stock torch_xla's) only in a
    folder `enable_persistent_cache` made: elsewhere a file called `1234` may be anyone's.
    """
    made = cache_files.made_by_xlakit(folder)
    named = [(p, st) for p, st in cache_files.regular_files(folder) if cache_files.is_entry_name(p.name)]
    entries = [(p, st) for p, st in named if made or cache_files.has_envelope(p)]
    if len(entries) < len(named):
        print(f"kept: {len(named) - len(entries)} file(s) named like entries without xlakit's envelope (a stock "
              f"torch_xla's, or another program's: {folder} was not made by xlakit.enable_persistent_cache); "
              f"not counted, never evicted")
    total = sum(st.st_size for _, st in entries)
    removed = 0
    for path, st in sorted(entries, key=lambda e: (e[1].st_mtime_ns, e[0].name)):
        if total <= max_bytes:
            break
        if dry_run:
            verb = "would remove"
        elif not cache_files.unchanged_since(path, st):
            continue  # used or rewritten since it was listed: no longer the least recently used
        else:
            try:
                path.unlink()
                verb = "removed"
            except FileNotFoundError:
                verb = "already gone"
            if cache_files.remove_parts(path):
                removed += 1
                print(f"removed: {cache_files.parts_of(path).name} (its key record)")
        gone.add(path.name)
        total -= st.st_size
        removed += verb != "already gone"
        print(f"{verb}: {path.name} (least recently used; {total} of {max_bytes} bytes left)")
    return removed


def cmd_explain(args: argparse.Namespace) -> int:
    if cache_tier.is_url(args.dir):
        from xlakit.cache_tier import check_url, records as tier_records

        check_url(args.dir)
        records, notes = tier_records.read_bucket(args.dir)
    else:
        records, notes = cache_explain.read_folder(cache_files.require_folder(args.dir))
    try:
        findings = cache_explain.explain(records, entry=args.entry)
    except ValueError as e:
        raise XlakitError(str(e)) from None
    if args.json:
        print(json.dumps(cache_explain.to_json(findings, notes), indent=2))
    else:
        print(cache_explain.render(findings, notes))
    return 0


def _byte_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of bytes (0 or more), e.g. 10000000000; found {text!r}")
    return int(text)


def cmd_publish(args: argparse.Namespace) -> int:
    from xlakit.cache_tier import commands

    return commands.publish(args.url, local=args.local, device=args.device, follow=args.follow, once=args.follow is None)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cache", help="inspect a persistent compilation cache folder")
    sub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    for name, func, help_text in (
        ("ls", cmd_ls, "list entries from their headers"),
        ("verify", cmd_verify, f"checksum every entry (and its tag, with {_knobs.CACHE_KEY}); exit 1 if any is not "
                               "loadable"),
        ("prune", cmd_prune, "delete rejected entries and abandoned temporary files, nothing else"),
    ):
        q = sub.add_parser(name, help=help_text)
        q.add_argument("dir", help="the cache folder (XLA_PERSISTENT_CACHE_PATH, or the wrapper's pjrt-<device> "
                       "folder)" + ("; or a shared tier's gs:// or s3:// URL, with --max-bytes" if name == "prune" else ""))
        q.add_argument("--json", action="store_true", help="print the folder's trust state and the entries as JSON")
        q.add_argument("--platform-name", help="check entries against this runtime (with the next two)")
        q.add_argument("--platform-version")
        q.add_argument("--patch-series-id", help=f"the runtime's id, as its {cache_files.KEY_FILE} records it")
        q.add_argument("--torch-xla-revision", help="also check the torch_xla commit entries were written by "
                                                    "(with the three above)")
        if name == "prune":
            q.add_argument("--dry-run", action="store_true", help="list what would be removed")
            q.add_argument("--max-bytes", type=_byte_count, metavar="N",
                           help="then remove the least recently used entries until the rest hold at most N bytes "
                                "(of a URL: the oldest written, since a bucket records no reads)")
            q.add_argument("--foreign", action="store_true",
                           help=f"also remove entries without an envelope (only in a folder holding {cache_files.KEY_FILE})")
        q.set_defaults(func=func)
    q = sub.add_parser("publish", help="send a local folder's new entries to its shared tier (gs://, s3://): once, "
                                       "or while a process lives (`xlakit pjrt env URL` starts it)",
                       description="Send the entries of the wrapper's local folder that the shared tier lacks, each "
                                   "checked under XLAKIT_CACHE_KEY first, create-only. Exit 0: everything it had "
                                   "was published (or was there); 1: the store failed, the time ran out, or entries "
                                   "were not publishable (listed); 2: a wrong argument or setting.")
    q.add_argument("url", help="the shared tier, gs://BUCKET/PREFIX or s3://BUCKET/PREFIX")
    q.add_argument("--local", help="the local folder given to the job (default: the one `pjrt env URL` picks)")
    q.add_argument("--device", default="TPU", help="the PJRT_DEVICE whose pjrt-<device> folder is published "
                                                   "(default TPU)")
    q.add_argument("--follow", type=int, metavar="PID",
                   help=f"publish every {_knobs.CACHE_TIER_PUBLISH_INTERVAL_S} seconds while PID lives, then once more")
    q.set_defaults(func=cmd_publish)
    q = sub.add_parser("explain", help="why programs missed: each module's newest entry against its nearest "
                                       "other entry (from the PJRT wrapper's key records)")
    q.add_argument("dir", help="the PJRT wrapper's cache folder (XLAKIT_PJRT_CACHE_DIR), or a shared tier's "
                               "gs:// or s3:// URL")
    q.add_argument("--entry", metavar="KEY", help="explain this entry (its name, or the start of it)")
    q.add_argument("--json", action="store_true", help="print the findings as JSON")
    q.set_defaults(func=cmd_explain)
