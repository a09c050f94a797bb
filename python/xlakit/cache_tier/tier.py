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

import contextlib
import itertools
import json
import logging
import queue
import secrets
import socket
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from xlakit import _C, _knobs
from xlakit.cache_tier import objects, records
from xlakit.checkpoint.objstore import answers, client
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.errors import ConfigurationError

log = logging.getLogger("xlakit.compile_cache")
_PARALLEL = 8
_CHUNK = 8 << 20  # one ranged read; a download holds one in memory, and as much inflated
_HOST = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:64] or "host"
_counter = itertools.count()


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


def _rate_limit(given: "Settings") -> RateLimit:
    return _limits.setdefault(given.requests_per_s, RateLimit(given.requests_per_s))


class _Budget:
    """Bytes a pull may still leave in the folder, shared by its download threads."""

    def __init__(self, left: float):
        self.left, self.lock = left, threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def fits(self, more: int) -> bool:
        """Take `more` (an entry's growth over its object's size), or give up its reservation."""
        return self.take(more)


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


@dataclass(frozen=True)
class Settings:
    """The shared tier's knobs, read and checked together before anything starts."""

    pull_timeout_s: float
    publish_interval_s: float
    exit_timeout_s: float
    requests_per_s: float
    max_entry_bytes: int
    max_bytes: int | None  # XLAKIT_PJRT_CACHE_MAX_BYTES, the folder's bound


def settings() -> Settings:
    """Every knob the shared tier reads, checked now (a publisher that dies later on a mistyped value would
    publish nothing, silently).

    Raises:
        ConfigurationError: a variable holds a value it cannot use; names it and its value.
    """
    def byte_count(name: str) -> int | None:  # read by the wrapper too, which turns its cache off for a bad one
        raw = os.environ.get(name, "").strip()
        if raw and not (raw.isdigit() and int(raw) > 0):
            raise ConfigurationError(f"environment variable {name}={raw!r}: expected a positive whole number of "
                                     "bytes, or unset it")
        return int(raw) if raw else None

    return Settings(_knobs.get_float(_knobs.CACHE_TIER_PULL_TIMEOUT_S),
                    _knobs.get_float(_knobs.CACHE_TIER_PUBLISH_INTERVAL_S),
                    _knobs.get_float(_knobs.CACHE_TIER_EXIT_TIMEOUT_S),
                    _knobs.get_float(_knobs.CACHE_TIER_REQUESTS_PER_S, unit="requests a second"),
                    byte_count(_knobs.PJRT_CACHE_MAX_ENTRY_BYTES) or int(_C.PJRT_DEFAULT_MAX_ENTRY_BYTES),
                    byte_count(_knobs.PJRT_CACHE_MAX_BYTES))


REFUSED_MEMO = "xlakit-tier-refused.json"


class SharedTier:
    """The bucket prefix `url` and the local `folder` it mirrors (the wrapper's `pjrt-<device>` folder).

    Objects live at `<url>/pjrt-<device>/<key id>/<entry name>`: the key's id
    (an HMAC of a constant under the key, which reveals nothing of it) keeps
    jobs with other keys, and a rotated key's old entries, out of each
    other's listings. `key` is the job's `XLAKIT_CACHE_KEY`: every entry is
    verified under it (a bucket is untrusted storage). `readonly` tiers pull
    and never publish. `max_bytes` bounds what a pull leaves in the folder.
    """

    def __init__(self, url: str, folder: Path, *, key: bytes, readonly: bool = False,
                 max_bytes: int | None = None):
        self.root = client.Location.parse(url)
        self.prefix = self.root.child(folder.name).child(_C.cache_key_id(key))
        self.settings = settings()
        self.folder, self.key, self.readonly = folder, key, readonly
        self.max_bytes = max_bytes if max_bytes is not None else self.settings.max_bytes
        self.store = client.store_for(self.prefix)
        self.remote: set[str] = set()  # names known to be in the bucket (entries and key records)
        self.listed_records: dict[str, tuple[int, float]] = {}
        self.unpublishable: dict[str, str] = {}  # local entries never to be sent, and why
        self._said: set[str] = set()
        self.last_pull: Report | None = None  # what this start's pull did (the manifest and the bench read it)
        self._lock = threading.Lock()  # one publish at a time (the thread and the exit hook)

    @property
    def url(self) -> str:
        return self.prefix.url

    def _say_once(self, what: str, e: BaseException) -> str:
        text = objects.printable(f"{type(e).__name__}: {e}".splitlines()[0])
        last = getattr(e, "last_answer", None)
        if answers.throttled(e) or answers.throttled(last):
            text = (f"the store answered 429 Too Many Requests, retried with backoff to the deadline ({text}); "
                    f"lower {_knobs.CACHE_TIER_REQUESTS_PER_S} (now {self.settings.requests_per_s:g} per "
                    f"second) or give each job its own prefix")
        if what not in self._said:
            self._said.add(what)
            log.warning("compile cache shared tier %s: %s failed (%s); the job goes on with its local cache %s",
                        self.url, what, text, self.folder)
        return text

    def _operation(self, kind: str, timeout_s: float) -> Operation:
        return Operation(kind, self.url, Watch(timeout_s, math.inf, math.inf, None))

    def _local_entries(self) -> dict[str, int]:
        try:
            with os.scandir(self.folder) as found:
                return {e.name: e.stat(follow_symlinks=False).st_size for e in found
                        if objects.is_entry_name(e.name) and e.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            return {}

    def _listing(self, op: Operation) -> dict[str, tuple[int, float]]:
        """The entries under the prefix: size and when written."""
        _rate_limit(self.settings).wait(op)
        listed = self.store.list_dated(op, self.prefix)
        self.listed_records = {name: found for name, found in listed.items() if records.is_record_name(name)}
        self.remote.update(self.listed_records)
        return {name: found for name, found in listed.items() if objects.is_entry_name(name)}

    # -- pull --------------------------------------------------------------------------------
    def _memo(self) -> dict[str, list]:
        try:
            found = json.loads((self.folder.parent / REFUSED_MEMO).read_text())
            return found if isinstance(found, dict) else {}
        except (OSError, ValueError):
            return {}

    def pull(self, timeout_s: float | None = None) -> Report:
        """Copy into the folder what the bucket has and the folder lacks, newest first, within `timeout_s`
        (default `XLAKIT_CACHE_TIER_PULL_TIMEOUT_S`) and `max_bytes`; never raises for the store's sake.

        An object refused once is remembered (by name, size and time written, in the local folder's
        `xlakit-tier-refused.json`) and not downloaded again until it changes."""
        timeout_s = timeout_s if timeout_s is not None else self.settings.pull_timeout_s
        report, start = Report(), time.monotonic()
        op = self._operation("compile cache pull", timeout_s)
        try:
            listed = self._listing(op)
        except Exception as e:  # noqa: BLE001 - any failure of the store leaves the job on its local folder
            report.error = self._say_once("listing", e)
            self.last_pull = report
            return report
        self.remote.update(listed)
        local = self._local_entries()
        memo, known_bad = self._memo(), 0
        report.already = len(set(listed) & set(local))
        wanted = []
        for name, (size, written) in sorted(listed.items(), key=lambda kv: -kv[1][1]):
            if name in local:
                continue
            if memo.get(name, [None, None])[:2] == [size, written]:
                known_bad += 1
                continue
            wanted.append(name)
        budget = _Budget(self.max_bytes - sum(local.values()) if self.max_bytes else math.inf)
        for name, got in _each(lambda n: self._pull_one(op, n, listed[n][0], budget), wanted):
            if isinstance(got, objects.RefusedObject):
                report.refused[name] = str(got)
                memo[name] = [*listed[name], str(got)]
            elif isinstance(got, BaseException):  # a deadline, a failed request: the rest compiles
                report.skipped += 1
                report.error = report.error or self._say_once("pull", got)
            elif got is None:
                report.skipped += 1
            elif got[1]:
                report.moved += 1
                report.bytes_moved += got[0]
                report.entry_bytes += got[1]
        if report.refused:
            first = sorted(report.refused.items())[0]
            log.warning("compile cache shared tier %s: refused %d objects, e.g. %s: %s; none was written (those "
                        "programs compile here), and they are not downloaded again until they change",
                        self.url, len(report.refused), first[0], first[1])
            self._save_memo({k: v for k, v in memo.items() if k in listed})
        if known_bad:
            log.info("compile cache shared tier %s: %d objects refused earlier were skipped", self.url, known_bad)
        records.pull(self, op, self.listed_records)
        report.seconds = time.monotonic() - start
        self.last_pull = report
        return report

    def _save_memo(self, memo: dict) -> None:
        try:
            _C.write_file_atomic(str(self.folder.parent / REFUSED_MEMO), json.dumps(memo).encode())
        except OSError:
            pass  # a memo is an optimisation: the objects are refused again next time

    def _pull_one(self, op: Operation, name: str, size: int, budget: "_Budget") -> tuple[int, int] | None:
        """Download one object streaming into a temporary in the folder, check it, link it into place:
        (object bytes, entry bytes written, 0 when the name was taken meanwhile); None: no time or room."""
        limit = self.settings.max_entry_bytes
        if op.remaining() <= 0 or not budget.take(size):
            return None
        if size > limit + limit // 100 + 64:  # zlib's worst case grows an entry by far less
            raise objects.RefusedObject(f"it is {size} bytes, more than the largest entry the wrapper loads "
                                        f"({limit}); not read")
        temp = self.folder / f"{_C.TEMP_PREFIX}{name}.{_HOST}.{os.getpid()}.{next(_counter)}.{secrets.token_hex(8)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            unpacker = objects.Unpacker(limit)
            with os.fdopen(fd, "wb") as out:
                for begin in range(0, max(size, 1), _CHUNK):
                    _rate_limit(self.settings).wait(op)
                    for piece in unpacker.feed(self.store.get(op, self.prefix.child(name), begin,
                                                              min(begin + _CHUNK, size))):
                        out.write(piece)
                unpacker.finish()
                out.flush()
                os.fsync(out.fileno())
            why = objects.check_entry_file(name, str(temp), key=self.key)
            if why is not None:
                raise objects.RefusedObject(f"its entry does not verify: {why}")
            if not budget.fits(unpacker.bytes_out - size):
                return None
            try:
                os.link(temp, self.folder / name)  # never over an entry the wrapper wrote meanwhile
            except FileExistsError:
                return size, 0
            return size, unpacker.bytes_out
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

    # -- publish -----------------------------------------------------------------------------
    def publish(self, timeout_s: float) -> Report:
        """Send the folder's entries the bucket lacks, within `timeout_s`; never raises for the store's sake."""
        report, start = Report(), time.monotonic()
        if self.readonly:
            return report
        with self._lock:
            op = self._operation("compile cache publish", timeout_s)
            todo = sorted(set(self._local_entries()) - self.remote - set(self.unpublishable))
            if not todo:
                records.publish(self, op)  # those of entries another host published first
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
            records.publish(self, op)
        report.seconds = time.monotonic() - start
        return report

    def _publish_one(self, op: Operation, name: str) -> tuple[int, int] | str | None:
        """(object bytes, entry bytes) sent; (0, 0) when another host had; a reason not to; None: no time."""
        if op.remaining() <= 0:
            return None
        path = self.folder / name
        try:
            if path.stat().st_size > self.settings.max_entry_bytes:
                return "larger than the largest entry the wrapper loads"
            entry = path.read_bytes()
        except FileNotFoundError:  # evicted meanwhile
            return None
        why = objects.check_entry(name, entry, key=self.key)
        if why is not None:
            return why
        body = objects.object_from_entry(entry)
        _rate_limit(self.settings).wait(op)
        try:
            self.store.put(op, self.prefix.child(name), body, create_only=True)
        except FileExistsError:
            return 0, 0
        return len(body), len(entry)
