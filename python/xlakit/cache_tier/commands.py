"""The shared tier for jobs that run no xlakit code, and its upkeep: `xlakit pjrt env URL`,
`xlakit cache publish URL`, `xlakit cache prune --max-bytes N URL`.

`env_lines(url)` does before the job what `enable_persistent_cache(url)`
does inside one: judges and makes the local folder, pulls the bucket into it
(the job's runtime reads it as soon as it starts), and returns the exports,
plus, unless the job only reads, the line that starts `xlakit cache publish
--follow $$` beside it (the shell that evaluates the lines is the one it
follows). The key is never printed: the job and the publisher read
`XLAKIT_CACHE_KEY` from the environment they share.

`prune(url, max_bytes)` bounds a bucket prefix: a bucket records when an
object was written, not when it was last read, so the oldest entries go first
(docs/runtime.md gives the lifecycle rule that does the same without a job).
It deletes only objects named as the wrapper names entries, in a `pjrt-*`
folder under the prefix.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import sys
from pathlib import Path

from xlakit import _knobs
from xlakit.cache_tier import check_url, default_local, open_tier, require_key
from xlakit.errors import CompileCacheError
from xlakit.runtime import cache_trust, compile_cache, pjrt_wrap

PUBLISH_LOG = "xlakit-publish.log"
_RECORD_SUFFIX = ".parts.json"  # runtime/cache_explain.PARTS_SUFFIX
_ENTRY_OBJECT = re.compile(r"pjrt-[a-z0-9_-]+/[0-9a-f]{16}/[0-9a-f]{64}")


def _folder(url: str, local: str | None, device: str) -> Path:
    root = cache_trust.local_folder(local) if local else default_local(url)
    return pjrt_wrap.cache_folder(root, device)


def env_lines(url: str, *, local: str | None = None, plugin: str | None = None, say=print) -> list[str]:
    """Pull `url` into the local folder, then the lines `eval` runs: the wrapper's exports and the publisher.

    Raises:
        CompileCacheError, CacheFolderTrustError: as `pjrt_wrap.env_lines`; no `XLAKIT_CACHE_KEY`; a URL
            without a bucket and prefix.
        ConfigurationError: a variable the shared tier reads holds a value it cannot use.
    """
    from xlakit.cache_tier.tier import settings

    check_url(url)
    require_key(url)
    settings()
    root = cache_trust.local_folder(local) if local else default_local(url)
    readonly = compile_cache._default_readonly()
    where = pjrt_wrap.cache_folder(root, "TPU")
    lines = pjrt_wrap.env_lines(root, plugin) + [f"export {_knobs.CACHE_TIER_URL}={shlex.quote(url)}"]
    compile_cache.prepare(where, readonly=readonly, shared=_knobs.get_flag(_knobs.CACHE_TRUST_SHARED),
                          entries=False)  # the wrapper judges each entry as it reads it
    tier = open_tier(url, where, readonly=readonly)
    report = tier.pull()
    if report.error and not report.moved:
        say(f"the shared tier {tier.url} could not be read: the job starts on its local cache {where}")
    else:
        say(f"pulled {report.moved} entries ({report.bytes_moved} bytes) from {tier.url} into {where} in "
            f"{report.seconds:.1f} s; {report.already} were here already"
            + (f"; refused {len(report.refused)} (see the log line above)" if report.refused else ""))
    if readonly:
        say("read-only (XLAKIT_PJRT_CACHE_READ_ONLY or XLA_PERSISTENT_CACHE_READ_ONLY): nothing is published")
        lines.append(f"export {_knobs.PJRT_CACHE_READ_ONLY}=1")
    else:
        command = [sys.executable, "-m", "xlakit", "cache", "publish", url, "--local", str(root)]
        log = shlex.quote(str(root / PUBLISH_LOG))
        lines.append(f"( exec {shlex.join(command)} --follow $$ </dev/null >>{log} 2>&1 & )")
    return lines


def publish(url: str, *, local: str | None, device: str, follow: int | None, once: bool) -> int:
    """`xlakit cache publish`: send the folder's new entries, once or while `follow` lives; exit 0 when the
    last publish sent everything it had, 1 when the store failed or entries were refused."""
    from xlakit.cache_tier.publisher import follow as follow_loop

    where = _folder(url, local, device)
    if not where.is_dir():
        raise CompileCacheError(f"expected the wrapper's cache folder {where}, found nothing: pass the --local "
                                "folder the job was given (its pjrt-<device> folder holds the entries)")
    cache_trust.require(where, trust_shared=_knobs.get_flag(_knobs.CACHE_TRUST_SHARED))
    tier = open_tier(url, where, readonly=False)
    if follow is not None and not _only_publisher(where.parent, follow):
        print(f"another `xlakit cache publish` already follows process {follow} for {where}; nothing to do")
        return 0
    report = tier.publish(tier.settings.exit_timeout_s) if once else follow_loop(tier, follow)
    print(f"published {report.moved} entries ({report.bytes_moved} bytes) to {tier.url}; {report.already} were "
          f"there already" + (f"; refused {len(report.refused)}" if report.refused else "")
          + (f"; store: {report.error}" if report.error else ""))
    for name, why in sorted(report.refused.items()):
        print(f"  not published: {name}: {why}")
    return 1 if report.error or report.refused or report.skipped else 0


_held: list[int] = []  # the lock files this process holds until it exits


def _only_publisher(root: Path, pid: int) -> bool:
    """Whether this is the one publisher following `pid` for the folder `root` (a shell that evaluated
    `pjrt env` twice starts two): an exclusive lock on `<root>/xlakit-publish.<pid>.lock`, held until exit."""
    fd = os.open(root / f"xlakit-publish.{pid}.lock", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held.append(fd)
    return True


def prune(url: str, max_bytes: int, *, dry_run: bool) -> int:
    """Delete the oldest entries under `url` until the rest hold at most `max_bytes`; how many went.

    Only objects positively identified as entries are counted or deleted: named
    `pjrt-<device>/<key id>/<entry name>` under the prefix, and (read before
    deleting) starting as an object xlakit published.

    Raises:
        CompileCacheError: `url` names no bucket and prefix.
    """
    from xlakit.cache_tier import objects
    from xlakit.checkpoint.objstore import client

    check_url(url)
    root = client.Location.parse(url)
    store = client.store_for(root)
    listed = store.list_dated(None, root)
    entries = sorted(((when, name, size) for name, (size, when) in listed.items() if _ENTRY_OBJECT.fullmatch(name)),
                     key=lambda e: (e[0], e[1]))
    total = sum(size for _, _, size in entries)
    print(f"{root.url}: {len(entries)} entries, {total} bytes; {len(listed) - len(entries)} other objects, left alone")
    if not entries and any(_ENTRY_OBJECT.fullmatch(f"pjrt-x/{n}") for n in listed):
        print(f"(these look like one device's folder: pass the prefix the job was given, {root.url.rsplit('/', 1)[0]})")
    gone = 0
    for when, name, size in entries:
        if total <= max_bytes:
            break
        if not objects.is_object_start(store.get(None, root.child(name), 0, 64)):
            print(f"kept: {name} (named like an entry, but not an object xlakit published; not counted)")
            total -= size
            continue
        if not dry_run:  # and the entry's key record, if it was published beside it
            store.delete(None, [root.child(name), root.child(name + _RECORD_SUFFIX)])
        total -= size
        gone += 1
        print(f"{'would remove' if dry_run else 'removed'}: {name} (oldest written; {total} of {max_bytes} bytes left)")
    print(f"{gone} of {len(entries)} entries {'to remove' if dry_run else 'removed'}")
    return gone
