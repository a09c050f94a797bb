"""One shared tier: a prefix on object storage mirrored by a local cache folder, both ways.

`SharedTier(url, folder, key=...)` pairs the wrapper's local folder
(`<local>/pjrt-<device>`) with `<url>/pjrt-<device>/` in a bucket:

* `pull()` copies into the folder every entry the bucket has and the folder
  lacks, before the runtime compiles anything, each verified on the way in
  (`objects.entry_from_object`: a tampered, swapped or foreign object is
  refused, counted and named, and never written). A VM recreated with an
  empty disk thus starts with every program earlier processes published.
* `publish()` sends the folder's entries the bucket lacks, each checked
  first (an entry that would be refused everywhere is not published),
  compressed where it pays, with a create-only request: two hosts publishing
  one program leave one object, and the loser counts it as already there.

Every request is bounded (by the call's deadline, through the checkpoint
code's `Operation`, so a store that stops answering is cancelled, not waited
on), retried with backoff when transient (`objstore.client`), and spaced by a
process-wide rate limit (`XLAKIT_CACHE_TIER_REQUESTS_PER_S`). A store that
cannot be reached leaves the job on its local folder: said once in the log,
tried again at the next publish, never an exception into the job.
"""

from __future__ import annotations

import logging
import queue
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from xlakit import _C, _knobs
from xlakit.cache_tier import objects
from xlakit.checkpoint.objstore import client
from xlakit.checkpoint.operation import Operation, Watch

log = logging.getLogger("xlakit.compile_cache")
_PARALLEL = 8


class RateLimit:
    """At most `per_s` requests a second from this process (a token bucket of one second's burst)."""

    def __init__(self, per_s: float):
        self.per_s, self.tokens, self.at = per_s, per_s, time.monotonic()
        self.lock = threading.Lock()

    def wait(self, op: Operation) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.per_s, self.tokens + (now - self.at) * self.per_s)
                self.at = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return
                pause = (1 - self.tokens) / self.per_s
            if pause >= op.remaining():
                raise TimeoutError("the rate limit leaves no time for another request before the deadline")
            time.sleep(pause)


_limits: dict[float, RateLimit] = {}


def _rate_limit() -> RateLimit:
    per_s = _knobs.get_float(_knobs.CACHE_TIER_REQUESTS_PER_S)
    return _limits.setdefault(per_s, RateLimit(per_s))


@dataclass
class Report:
    """What one pull or publish did: entries and bytes moved, and what it refused or could not do."""

    moved: int = 0
    bytes_moved: int = 0  # bytes over the network (compressed where they were)
    entry_bytes: int = 0  # bytes of the entries themselves
    already: int = 0  # present on the other side (or published by another host meanwhile)
    refused: dict[str, str] = field(default_factory=dict)  # name: why
    skipped: int = 0  # left for later: the deadline or a bound came first
    error: str | None = None  # the store could not be reached, or answered with a failure
    seconds: float = 0.0


def _each(fn, items: list, parallel: int = _PARALLEL):
    """(item, result or exception) of `fn(item)` for every item, `parallel` at a time, in the order they
    finish. Plain threads: a ThreadPoolExecutor refuses work once interpreter exit has begun, which is
    when the last publish runs."""
    todo: "queue.SimpleQueue" = queue.SimpleQueue()
    done: "queue.SimpleQueue" = queue.SimpleQueue()
    for item in items:
        todo.put(item)

    def work() -> None:
        while True:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((item, fn(item)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.put((item, e))

    threads = [threading.Thread(target=work, name="xlakit-cache-tier", daemon=True)
               for _ in range(min(parallel, len(items)))]
    for t in threads:
        t.start()
    for _ in items:
        yield done.get()
    for t in threads:
        t.join()


def max_entry_bytes() -> int:
    """The largest entry the wrapper loads (`XLAKIT_PJRT_CACHE_MAX_ENTRY_BYTES`), which bounds a download."""
    raw = os.environ.get(_knobs.PJRT_CACHE_MAX_ENTRY_BYTES, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else int(_C.PJRT_DEFAULT_MAX_ENTRY_BYTES)


class SharedTier:
    """The bucket prefix `url` and the local `folder` it mirrors (the wrapper's `pjrt-<device>` folder).

    `key` is the job's `XLAKIT_CACHE_KEY`: every entry is verified under it
    (a bucket is untrusted storage). `readonly` tiers pull and never publish.
    """

    def __init__(self, url: str, folder: Path, *, key: bytes, readonly: bool = False,
                 max_bytes: int | None = None):
        self.root = client.Location.parse(url)
        self.prefix = self.root.child(folder.name)
        self.folder, self.key, self.readonly, self.max_bytes = folder, key, readonly, max_bytes
        self.store = client.store_for(self.prefix)
        self.remote: set[str] = set()  # names known to be in the bucket
        self.unpublishable: dict[str, str] = {}  # local entries never to be sent, and why
        self._said: set[str] = set()
        self.last_pull: Report | None = None  # what this start's pull did (the manifest and the bench read it)
        self._lock = threading.Lock()  # one publish at a time (the thread and the exit hook)

    @property
    def url(self) -> str:
        return self.prefix.url

    def _say_once(self, what: str, e: BaseException) -> str:
        text = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        if what not in self._said:
            self._said.add(what)
            log.warning("compile cache shared tier %s: %s failed (%s); the job goes on with its local cache %s",
                        self.url, what, text, self.folder)
        return text

    def _operation(self, kind: str, timeout_s: float) -> Operation:
        return Operation(kind, self.url, Watch(timeout_s, math.inf, math.inf, None))

    def _local_names(self) -> set[str]:
        try:
            with os.scandir(self.folder) as found:
                return {e.name for e in found if objects.is_entry_name(e.name) and e.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            return set()

    def _listing(self, op: Operation) -> dict[str, int]:
        _rate_limit().wait(op)
        listed = self.store.list(op, self.prefix)
        return {name: size for name, size in listed.items() if objects.is_entry_name(name)}

    # -- pull --------------------------------------------------------------------------------
    def pull(self, timeout_s: float | None = None) -> Report:
        """Copy into the folder what the bucket has and the folder lacks, within `timeout_s` (default
        `XLAKIT_CACHE_TIER_PULL_TIMEOUT_S`); never raises for the store's sake."""
        timeout_s = timeout_s if timeout_s is not None else _knobs.get_float(_knobs.CACHE_TIER_PULL_TIMEOUT_S)
        report, start = Report(), time.monotonic()
        op = self._operation("compile cache pull", timeout_s)
        try:
            listed = self._listing(op)
        except Exception as e:  # noqa: BLE001 - any failure of the store leaves the job on its local folder
            report.error = self._say_once("listing", e)
            self.last_pull = report
            return report
        self.remote.update(listed)
        local = self._local_names()
        report.already = len(set(listed) & local)
        wanted = [n for n in listed if n not in local]
        limit = max_entry_bytes()
        budget = self.max_bytes if self.max_bytes else math.inf
        for name, got in _each(lambda n: self._pull_one(op, n, listed[n], limit), wanted):
            if isinstance(got, objects.RefusedObject):
                report.refused[name] = str(got)
                log.warning("compile cache shared tier: refused %s/%s: %s (not written; the program "
                            "compiles here)", self.url, name, got)
                continue
            if isinstance(got, BaseException):  # a deadline, a failed request: the rest compiles
                report.skipped += 1
                report.error = report.error or self._say_once("pull", got)
                continue
            if got is None:
                report.skipped += 1
                continue
            body_bytes, entry = got
            if report.entry_bytes + len(entry) > budget:
                report.skipped += 1
                continue
            self._write(name, entry)
            report.moved += 1
            report.bytes_moved += body_bytes
            report.entry_bytes += len(entry)
        report.seconds = time.monotonic() - start
        self.last_pull = report
        return report

    def _pull_one(self, op: Operation, name: str, size: int, limit: int) -> tuple[int, bytes] | None:
        if op.remaining() <= 0:
            return None
        if size > limit + limit // 100 + 64:  # zlib's worst case grows an entry by far less
            raise objects.RefusedObject(f"it is {size} bytes, more than the largest entry the wrapper loads "
                                        f"({limit}); not read")
        _rate_limit().wait(op)
        body = self.store.get(op, self.prefix.child(name))
        return len(body), objects.entry_from_object(name, body, key=self.key, limit=limit)

    def _write(self, name: str, entry: bytes) -> None:
        target = self.folder / name
        if target.exists():  # compiled here meanwhile, or pulled by another process of this host
            return
        _C.write_file_atomic(str(target), entry)

    # -- publish -----------------------------------------------------------------------------
    def publish(self, timeout_s: float) -> Report:
        """Send the folder's entries the bucket lacks, within `timeout_s`; never raises for the store's sake."""
        report, start = Report(), time.monotonic()
        if self.readonly:
            return report
        with self._lock:
            op = self._operation("compile cache publish", timeout_s)
            todo = sorted(self._local_names() - self.remote - set(self.unpublishable))
            if not todo:
                return report
            try:  # what other hosts published since: not sent again
                self.remote.update(self._listing(op))
            except Exception as e:  # noqa: BLE001
                report.error = self._say_once("listing", e)
                return report
            todo = [n for n in todo if n not in self.remote]
            for name, outcome in _each(lambda n: self._publish_one(op, n), todo):
                if isinstance(outcome, BaseException):  # tried again at the next publish
                    report.skipped += 1
                    report.error = report.error or self._say_once("publish", outcome)
                elif outcome is None:
                    report.skipped += 1
                elif isinstance(outcome, str):
                    report.refused[name] = self.unpublishable[name] = outcome
                elif outcome == (0, 0):
                    report.already += 1
                    self.remote.add(name)
                else:
                    report.moved += 1
                    report.bytes_moved += outcome[0]
                    report.entry_bytes += outcome[1]
                    self.remote.add(name)
        report.seconds = time.monotonic() - start
        return report

    def _publish_one(self, op: Operation, name: str) -> tuple[int, int] | str | None:
        """(object bytes, entry bytes) sent; (0, 0) when another host had; a reason not to; None: no time."""
        if op.remaining() <= 0:
            return None
        path = self.folder / name
        try:
            if path.stat().st_size > max_entry_bytes():
                return "larger than the largest entry the wrapper loads"
            entry = path.read_bytes()
        except FileNotFoundError:  # evicted meanwhile
            return None
        why = objects.check_entry(name, entry, key=self.key)
        if why is not None:
            return why
        body = objects.object_from_entry(entry)
        _rate_limit().wait(op)
        try:
            self.store.put(op, self.prefix.child(name), body, create_only=True)
        except FileExistsError:
            return 0, 0
        return len(body), len(entry)
