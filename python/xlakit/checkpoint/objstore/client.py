"""Requests to an object store, each bounded by the operation's deadline and cancellable.

The client libraries are fsspec's: gcsfs for `gs://` (its JSON-API filesystem,
`gcsfs.core.GCSFileSystem`, which the commit protocol needs for
`ifGenerationMatch`) and s3fs for `s3://`. They find their server the standard
way: `STORAGE_EMULATOR_HOST` (then without credentials: an emulator takes
none) and the AWS variables (`AWS_ENDPOINT_URL`, credentials, region).

fsspec runs every request as a coroutine on its own IO thread. `Store.run`
submits one there wrapped in `asyncio.wait_for(..., what is left of the
deadline)`, so a request to a server that stopped answering is cancelled on
the loop (its connection closed) when the time is up, and the worker raises
`CheckpointTimeoutError` naming the object; while it waits the worker checks
every 0.1 s whether the owner gave the operation up. Transient failures
(connection errors, 408/429/5xx) are retried with exponential backoff while
time is left, on top of the libraries' own retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from xlakit import _knobs
from xlakit.checkpoint.core import workers
from xlakit.checkpoint.core.load_stats import counted
from xlakit.checkpoint.core.operation import transient_note
from xlakit.checkpoint.objstore.answers import is_transient
from xlakit.errors import CheckpointTimeoutError

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation

log = logging.getLogger("xlakit")
T = TypeVar("T")
_POLL_S = 0.1
_BACKOFF_S, _BACKOFF_MAX_S = 0.5, 8.0
_EXTRA = {"gs": "gcs", "gcs": "gcs", "s3": "s3"}


@dataclass(frozen=True)
class Location:
    """An object or prefix: `gs://bucket/key`."""

    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> "Location":
        scheme, _, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        key = key.strip("/")
        if not bucket or not key:
            raise ValueError(f"{url}: a checkpoint on object storage needs a bucket and a name in it "
                             f"({scheme}://BUCKET/NAME), found {'no bucket' if not bucket else 'no name'}")
        if any(part in ("", ".", "..") for part in key.split("/")):
            raise ValueError(f"{url}: the name has an empty, '.' or '..' part; object names are taken "
                             f"literally, so give the checkpoint a plain name")
        return cls(scheme.lower(), bucket, key)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def path(self) -> str:
        """The name as fsspec takes it: `bucket/key`."""
        return f"{self.bucket}/{self.key}"

    def child(self, name: str) -> "Location":
        return Location(self.scheme, self.bucket, f"{self.key}/{name}")

    def relative(self, path: str) -> str:
        """A listed `bucket/key/...` path relative to this prefix."""
        return path[len(self.path) + 1:]

    def __str__(self) -> str:
        return self.url


_stores: dict[tuple[str, str], "Store"] = {}
_stores_lock = threading.Lock()


def store_for(loc: Location) -> "Store":
    """The process's client for `loc`'s scheme and the endpoint the environment names (made on first use)."""
    import os

    kind = _EXTRA[loc.scheme]
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST" if kind == "gcs" else "AWS_ENDPOINT_URL", "")
    with _stores_lock:
        if (kind, endpoint) not in _stores:
            _stores[kind, endpoint] = Store(kind)
        return _stores[kind, endpoint]


def _filesystem(kind: str):
    try:
        if kind == "gcs":
            import os

            from gcsfs.core import GCSFileSystem

            # An emulator takes no credentials; looking for them would ask the GCE metadata server.
            return GCSFileSystem(token="anon" if os.environ.get("STORAGE_EMULATOR_HOST") else None,
                                 use_listings_cache=False, skip_instance_cache=True)
        import s3fs

        # No listing cache: which commit records exist must be read from the store every time.
        return s3fs.S3FileSystem(use_listings_cache=False, skip_instance_cache=True)
    except ImportError as e:
        raise ModuleNotFoundError(f"checkpoints on {kind} need {'gcsfs' if kind == 'gcs' else 's3fs'}, which "
                                  f"is not installed ({e}); install it with pip install 'xlakit[{kind}]'",
                                  name=e.name) from e


class IoExecutor(concurrent.futures.ThreadPoolExecutor):
    """The IO loop's default executor, with threads of its own that keep working at interpreter exit.

    The clients hand blocking calls to `loop.run_in_executor(None, ...)` (aiohttp's name lookups,
    botocore's credential and config files). The loop's usual default is a `ThreadPoolExecutor`, and
    every `ThreadPoolExecutor` refuses work ("cannot schedule new futures after interpreter
    shutdown") once exit has begun, before the exit hook runs: an asynchronous save still writing
    then (`workers._at_exit`) could never finish. A subclass only because the loop takes nothing
    else; none of the base class's machinery is used.
    """

    def __init__(self, max_threads: int = 8):
        super().__init__(max_workers=max_threads, thread_name_prefix="xlakit-io")
        self._jobs: "queue.SimpleQueue[tuple[concurrent.futures.Future, Callable, tuple, dict]]" = \
            queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._started = 0
        self._start_lock = threading.Lock()
        self._max_threads = max_threads

    def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001 - Executor.submit's signature
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        if not self._idle.acquire(blocking=False):
            with self._start_lock:
                if self._started < self._max_threads:
                    self._started += 1
                    threading.Thread(target=self._serve, name=f"xlakit-io-{self._started}",
                                     daemon=True).start()
        return future

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(e)
            del future, fn, args, kwargs
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # the threads are daemons, idle between calls, and serve whoever still needs them


_tidying: set[concurrent.futures.Future] = set()  # removals in flight (`Store.tidy_soon`)
_tidying_lock = threading.Lock()


def _tidied(future: concurrent.futures.Future) -> None:
    with _tidying_lock:
        _tidying.discard(future)


def _settle_tidying(seconds: float) -> None:
    """(At exit.) Wait up to `seconds` for the removals still in flight."""
    with _tidying_lock:
        pending = list(_tidying)
    if pending:
        concurrent.futures.wait(pending, timeout=seconds)


workers.settle_at_exit(_settle_tidying)

_io_executor: IoExecutor | None = None
_io_executor_lock = threading.Lock()


def _own_executor(loop: asyncio.AbstractEventLoop) -> None:
    """Give fsspec's IO loop `IoExecutor` as its default executor (once per process)."""
    global _io_executor
    with _io_executor_lock:
        if _io_executor is None:
            _io_executor = IoExecutor()
        if getattr(loop, "_default_executor", None) is not _io_executor:
            loop.set_default_executor(_io_executor)


def _written(info: dict) -> float:
    """When a listed object was written, from gcsfs's `timeCreated` / `updated` or s3fs's `LastModified`."""
    import datetime

    for field in ("timeCreated", "updated", "LastModified", "mtime"):
        value = info.get(field)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


class Store:
    """One object store's client: fsspec's async filesystem, driven from worker threads."""

    def __init__(self, kind: str):
        self.kind = kind
        self.fs = _filesystem(kind)
        self.loop = self.fs.loop
        _own_executor(self.loop)

    # -- running requests ------------------------------------------------------------------
    def run(self, op: "Operation | None", what: str, request: Callable[[], Awaitable[T]], *,
            retry: bool = True) -> T:
        """`request()` on the IO loop within the deadline (the operation's; without one,
        `XLAKIT_OBJECT_REQUEST_TIMEOUT_S` for the request and its retries together); retried while
        transient and time is left."""
        end = None if op is not None else time.monotonic() + _knobs.get_float(_knobs.OBJECT_REQUEST_TIMEOUT_S)
        attempt, last = 0, None
        while True:
            try:
                answer = self._once(op, what, request, end, last)
                if op is not None and last is not None:
                    op.last_transient = None  # retried, and it went through
                return answer
            except CheckpointTimeoutError:
                raise
            except Exception as e:  # noqa: BLE001 - only transient failures are retried, the rest re-raised
                if not (retry and is_transient(e)):
                    raise
                left = self._left(op, end)
                wait = min(_BACKOFF_S * 2 ** attempt, _BACKOFF_MAX_S)
                if left <= wait:
                    raise self.timeout_error(op, what, f"it failed, and the {left:.1f} s left of the deadline "
                                                  f"leave no time to retry it", e) from e
                attempt, last = attempt + 1, e
                if op is not None:
                    op.last_transient = e
                log.warning("xlakit: %s failed (%s: %s); retrying in %.1f s", what, type(e).__name__, e, wait)
                self._sleep(op, wait)

    @staticmethod
    def _left(op: "Operation | None", end: float | None) -> float:
        return op.remaining() if op is not None else end - time.monotonic()

    def _sleep(self, op: "Operation | None", seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if op is not None:
                op.check()
            time.sleep(min(_POLL_S, max(end - time.monotonic(), 0)))

    def _once(self, op: "Operation | None", what: str, request: Callable[[], Awaitable[T]], end: float | None,
              last: BaseException | None) -> T:
        left = self._left(op, end)
        if left <= 0:
            raise self.timeout_error(op, what, "no time was left of the deadline for it", last)
        future = self.submit(request, left)
        while True:
            done, _ = concurrent.futures.wait([future], timeout=_POLL_S)
            if done:
                break
            if op is not None and op.cancelled:
                future.cancel()
                op.check()  # raises Cancelled
        try:
            return future.result()
        except (asyncio.TimeoutError, TimeoutError) as e:
            raise self.timeout_error(op, what, f"the object store did not answer within {left:.1f} s (what was "
                                          f"left of the deadline)", last) from e

    def submit(self, request: Callable[[], Awaitable[T]], timeout_s: float) -> concurrent.futures.Future:
        """Start `request()` on the IO loop, cancelled there after `timeout_s`; its future."""
        async def bounded() -> T:
            return await asyncio.wait_for(request(), timeout_s)

        return asyncio.run_coroutine_threadsafe(bounded(), self.loop)

    @staticmethod
    def timeout_error(op: "Operation | None", what: str, how: str, last: BaseException | None) -> CheckpointTimeoutError:
        """The deadline's error for request `what`, naming the store's `last` transient answer."""
        err = CheckpointTimeoutError(f"{what}: {how}", stage=op.stage if op else "request",
                                     tensor=op.tensor if op else None)
        err.last_answer = last
        if last is not None:
            err.add_note(transient_note(last))
        err.add_note("The server stopped answering, is very slow or kept failing; nothing was committed by "
                     "this request. Check the bucket's endpoint and network, or raise timeout_s.")
        return err

    # -- requests ----------------------------------------------------------------------------
    def list(self, op: "Operation | None", prefix: Location, *, starting: str = "") -> dict[str, int]:
        """Every object under `prefix/` (recursively) whose name there begins with `starting`: its
        name relative to the prefix, and its size."""
        async def find() -> dict:
            return await self.fs._find(prefix.path + "/", detail=True, prefix=starting)

        try:
            found = self.run(op, f"listing {prefix}/{starting}", find)
        except FileNotFoundError as e:  # a missing prefix lists empty: the bucket is missing
            raise FileNotFoundError(errno.ENOENT, f"{prefix}: the bucket {prefix.bucket!r} does not exist "
                                    f"at this endpoint ({e}); create it first, or check the URL and the "
                                    f"endpoint variables", prefix.url) from e
        return {prefix.relative(p): int(info.get("size") or 0) for p, info in found.items()
                if info.get("type", "file") == "file" and p.startswith(prefix.path + "/" + starting)}

    def list_dated(self, op: "Operation | None", prefix: Location) -> dict[str, tuple[int, float]]:
        """Every object under `prefix/` (recursively): its name relative to the prefix, its size and when
        it was written (seconds since the epoch; 0 where the store does not say)."""
        async def find() -> dict:
            return await self.fs._find(prefix.path + "/", detail=True)

        found = self.run(op, f"listing {prefix}/", find)
        return {prefix.relative(p): (int(info.get("size") or 0), _written(info)) for p, info in found.items()
                if info.get("type", "file") == "file" and p.startswith(prefix.path + "/")}

    def get_many(self, op: "Operation | None", locs: list[Location]) -> list[bytes | None]:
        """Small objects read at once; None for one that is gone."""
        async def cat(loc: Location) -> bytes | None:
            try:
                return await self.fs._cat_file(loc.path)
            except FileNotFoundError:
                return None

        async def cat_all() -> list[bytes | None]:
            return list(await asyncio.gather(*(cat(loc) for loc in locs)))

        found = self.run(op, f"reading {len(locs)} object(s) under {locs[0]}", cat_all) if locs else []
        return counted(op, found, sum(len(d) for d in found if d is not None), len(locs))

    def exists(self, op: "Operation | None", loc: Location) -> bool:
        async def info() -> bool:
            try:
                await self.fs._info(loc.path)
                return True
            except FileNotFoundError:
                return False

        return self.run(op, f"looking up {loc}", info)

    def put(self, op: "Operation | None", loc: Location, data: bytes, *, create_only: bool = False) -> None:
        """One object in one request; `create_only` fails with FileExistsError if the name is taken."""
        async def pipe() -> Any:
            return await self.fs._pipe_file(loc.path, data, mode="create" if create_only else "overwrite")

        # A create-only request is not repeated blindly: a lost answer to a write that happened would
        # read as someone else's; the caller resolves that case by reading the object back.
        self.run(op, f"writing {loc}", pipe, retry=not create_only)

    def get(self, op: "Operation | None", loc: Location, start: int | None = None, end: int | None = None) -> bytes:
        async def cat() -> bytes:
            return await self.fs._cat_file(loc.path, start=start, end=end)

        data = self.run(op, f"reading {loc}", cat)
        return counted(op, data, len(data), 1)

    def get_into(self, op: "Operation | None", loc: Location, offset: int, dst: memoryview, *,
                 chunk_bytes: int, parallel: int) -> int:
        """Fill `dst` from `offset` with ranged reads, `parallel` at a time; the bytes read."""
        n = len(dst)

        async def fetch() -> int:
            gate = asyncio.Semaphore(parallel)

            async def piece(start: int) -> int:
                async with gate:
                    data = await self.fs._cat_file(loc.path, start=offset + start,
                                                   end=offset + min(start + chunk_bytes, n))
                dst[start:start + len(data)] = data
                return len(data)

            got = await asyncio.gather(*(piece(s) for s in range(0, n, chunk_bytes)))
            return sum(got)

        got = self.run(op, f"reading {loc}", fetch)
        return counted(op, got, got, -(-n // chunk_bytes))

    def copy(self, op: "Operation | None", src: Location, dst: Location) -> None:
        """Copy an object within the store (the server copies: no bytes pass through here)."""
        async def cp() -> None:
            await self.fs._cp_file(src.path, dst.path)

        self.run(op, f"copying {src} to {dst}", cp)

    def size(self, op: "Operation | None", loc: Location) -> int:
        async def info() -> int:
            return int((await self.fs._info(loc.path))["size"])

        return self.run(op, f"looking up {loc}", info)

    def delete(self, op: "Operation | None", locs: list[Location]) -> None:
        """Remove objects; already gone is fine."""
        if not locs:
            return

        async def rm() -> None:
            results = await asyncio.gather(*(self.fs._rm_file(l.path) for l in locs), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, FileNotFoundError):
                    raise r

        self.run(op, f"removing {len(locs)} object(s) under {locs[0]}", rm)

    def delete_soon(self, locs: list[Location]) -> None:
        """Remove objects without waiting (an owner giving up must not block on a stalled server);
        what a failure or the process's end leaves is removed by the next save (generations.py)."""
        if not locs:
            return

        async def rm() -> None:
            await asyncio.gather(*(self.fs._rm_file(l.path) for l in locs), return_exceptions=True)

        self.tidy_soon(rm)

    def tidy_soon(self, request: Callable[[], Awaitable[Any]]) -> None:
        """Start a removal (objects, an upload session) without waiting for it. The exit hook waits a
        little for the ones still in flight (`_settle_tidying`): a save that gave up at exit leaves
        nothing behind when the server answers."""
        future = self.submit(request, _knobs.get_float(_knobs.OBJECT_REQUEST_TIMEOUT_S))
        with _tidying_lock:
            _tidying.add(future)
        future.add_done_callback(_tidied)
