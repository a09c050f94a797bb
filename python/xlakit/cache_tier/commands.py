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

import re
import shlex
import sys
from pathlib import Path

from xlakit import _knobs
from xlakit.cache_tier import default_local, is_url, open_tier, require_key
from xlakit.errors import CompileCacheError
from xlakit.runtime import cache_trust, compile_cache, pjrt_wrap

PUBLISH_LOG = "xlakit-publish.log"
_ENTRY_OBJECT = re.compile(r"pjrt-[a-z0-9_-]+/([0-9a-f]{64})")


def _folder(url: str, local: str | None, device: str) -> Path:
    root = cache_trust.local_folder(local) if local else default_local(url)
    return pjrt_wrap.cache_folder(root, device)


def env_lines(url: str, *, local: str | None = None, plugin: str | None = None, say=print) -> list[str]:
    """Pull `url` into the local folder, then the lines `eval` runs: the wrapper's exports and the publisher.

    Raises:
        CompileCacheError, CacheFolderTrustError: as `pjrt_wrap.env_lines`, and no `XLAKIT_CACHE_KEY`.
    """
    require_key(url)
    root = cache_trust.local_folder(local) if local else default_local(url)
    readonly = _knobs.get_flag(_knobs.PJRT_CACHE_READ_ONLY)
    shared = _knobs.get_flag(_knobs.CACHE_TRUST_SHARED)
    where = pjrt_wrap.cache_folder(root, "TPU")
    compile_cache.prepare(where, readonly=readonly, shared=shared)
    lines = pjrt_wrap.env_lines(root, plugin) + [f"export {_knobs.CACHE_TIER_URL}={shlex.quote(url)}"]
    tier = open_tier(url, where, readonly=readonly)
    report = tier.pull()
    if report.error and not report.moved:
        say(f"the shared tier {tier.url} could not be read ({report.error}); the job starts on its local cache "
            f"{where}")
    else:
        say(f"pulled {report.moved} entries ({report.bytes_moved} bytes) from {tier.url} into {where} in "
            f"{report.seconds:.1f} s; {report.already} were here already"
            + (f"; refused {len(report.refused)}: {', '.join(sorted(report.refused))[:300]}" if report.refused else ""))
    if not readonly:
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
    report = tier.publish(_knobs.get_float(_knobs.CACHE_TIER_EXIT_TIMEOUT_S)) if once else follow_loop(tier, follow)
    print(f"published {report.moved} entries ({report.bytes_moved} bytes) to {tier.url}; {report.already} were "
          f"there already" + (f"; refused {len(report.refused)}" if report.refused else "")
          + (f"; store: {report.error}" if report.error else ""))
    for name, why in sorted(report.refused.items()):
        print(f"  not published: {name}: {why}")
    return 1 if report.error or report.refused or report.skipped else 0


def prune(url: str, max_bytes: int, *, dry_run: bool) -> int:
    """Delete the oldest entries under `url` until the rest hold at most `max_bytes`; how many went."""
    from xlakit.checkpoint.objstore import client

    if not is_url(url):
        raise CompileCacheError(f"expected a gs:// or s3:// URL, found {url!r}")
    root = client.Location.parse(url)
    store = client.store_for(root)
    listed = store.list_dated(None, root)
    entries = sorted(((when, name, size) for name, (size, when) in listed.items() if _ENTRY_OBJECT.fullmatch(name)),
                     key=lambda e: (e[0], e[1]))
    total = sum(size for _, _, size in entries)
    print(f"{root.url}: {len(entries)} entries, {total} bytes (objects not named as entries are left alone: "
          f"{len(listed) - len(entries)})")
    gone = 0
    for when, name, size in entries:
        if total <= max_bytes:
            break
        if not dry_run:
            store.delete(None, [root.child(name)])
        total -= size
        gone += 1
        print(f"{'would remove' if dry_run else 'removed'}: {name} (oldest; {total} of {max_bytes} bytes left)")
    print(f"{gone} of {len(entries)} entries {'to remove' if dry_run else 'removed'}")
    return gone

