"""One object streamed to a store in parts, several in flight, hashed from the bytes sent.

`Upload` is a write-only file: the archive writer (or DCP's writer) calls
`write`, bytes go into a part buffer, and a full buffer is sent as one part
once more bytes arrive (so the last part is never empty). At most
`parts_in_flight` parts are being sent at once; `write` waits for the oldest
when that many are out, so host memory stays at the part size times
(parts in flight + 1) whatever the object's size (`buffer_bytes`). Each part is hashed
(xxh3-64, for the commit record) from the very buffer that is sent.

* s3: a multipart upload (`CreateMultipartUpload`, `UploadPart` concurrently,
  `CompleteMultipartUpload`); an object of one part is one `PutObject`.
* gs: a resumable upload; GCS takes its chunks in order, so one chunk
  (`XLAKIT_OBJECT_CHUNK_BYTES`, 100 MiB by default as in Google's own client:
  each chunk costs a round trip, and fake-gcs-server rewrites the object so far
  on every chunk) is sent while the next fills. An object of one chunk is one
  request.

A completed object's size is checked against the bytes sent before `finish`
returns (a part resent after its answer was lost must not leave an object
the commit record cannot match). Nothing is visible under the final name of
an upload until it completes. A
failed or abandoned upload is aborted (the multipart upload or the resumable
session removed) without waiting; a session the process's death left is
invisible and expires on the store's side (S3: a bucket lifecycle rule
`AbortIncompleteMultipartUpload`; GCS: after a week).
"""

from __future__ import annotations

import concurrent.futures
import errno
from collections import deque
from typing import TYPE_CHECKING, Any

import xxhash

from xlakit import _knobs
from xlakit.checkpoint.core.operation import transient_note
from xlakit.checkpoint.objstore.answers import is_transient
from xlakit.checkpoint.objstore.client import Location, Store
from xlakit.errors import CheckpointTimeoutError, CheckpointWriteError

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation

_GCS_QUANTUM = 256 << 10  # resumable chunks are multiples of this (all but the last)
_S3_MIN_PART = 5 << 20
_SLICE_BYTES = 8 << 20


def part_bytes() -> int:
    """S3: one part of a multipart upload (at least S3's 5 MiB)."""
    return max(_knobs.get_int(_knobs.OBJECT_PART_BYTES), _S3_MIN_PART)


def parts_in_flight() -> int:
    return _knobs.get_int(_knobs.OBJECT_PARTS_IN_FLIGHT)


def chunk_bytes() -> int:
    """GCS: one chunk of a resumable upload (a multiple of 256 KiB, as GCS requires)."""
    n = _knobs.get_int(_knobs.OBJECT_CHUNK_BYTES)
    return -(-n // _GCS_QUANTUM) * _GCS_QUANTUM


def shape(kind: str) -> tuple[int, int]:
    """(bytes of one part, parts in flight) of an upload to a store of `kind`."""
    if kind == "s3":
        return part_bytes(), parts_in_flight()
    return chunk_bytes(), 1


def buffer_bytes(kind: str) -> int:
    """The host memory an upload holds at most: the parts in flight and the one filling."""
    size, count = shape(kind)
    return size * (count + 1)


class Upload:
    """A write-only stream into one object; `finish()` completes it, `abort()` gives it up."""

    def __init__(self, store: Store, op: "Operation", loc: Location):
        self.store, self.op, self.loc = store, op, loc
        self.part_bytes, self.in_flight = shape(store.kind)
        self._buffer = bytearray(self.part_bytes)
        self._filled = 0
        self._sent = 0  # bytes handed to parts
        self._parts: deque[tuple[int, concurrent.futures.Future]] = deque()
        self._etags: dict[int, str] = {}
        self._hash = xxhash.xxh3_64()
        self._session: Any = None  # the multipart upload id / the resumable session's URL
        self._last: BaseException | None = None  # a part's last transient failure, retried
        self.finished = False

    # -- the file interface -------------------------------------------------------------------
    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n, at = len(view), 0
        while at < n:
            if self._filled == self.part_bytes:
                self._send(final=False)
            m = min(self.part_bytes - self._filled, n - at)
            self._buffer[self._filled:self._filled + m] = view[at:at + m]
            self._filled += m
            at += m
        return n

    def writable(self) -> bool:
        return True

    def finish(self) -> dict:
        """Send the last part and complete the object; its size and xxh3-64."""
        if self._session is None:  # one part: one request
            data = memoryview(self._buffer)[:self._filled]
            self._hash.update(data)
            self.op.object = self.loc.url
            self.store.put(self.op, self.loc, bytes(data))
        else:
            self._send(final=True)
            self._drain(0)
            self._complete()
            self._check_stored(self._sent)
        self.finished = True
        self.op.object = None
        size = self._sent + (self._filled if self._session is None else 0)
        self._buffer = bytearray()
        return {"nbytes": size, "xxh3_64": self._hash.hexdigest()}

    def abort(self) -> None:
        """Give the upload up without waiting: parts in flight are cancelled, the session removed."""
        for _, future in self._parts:
            future.cancel()
        self._parts.clear()
        self._buffer = bytearray()
        if self._session is None or self.finished:
            return
        session, self._session = self._session, None
        if self.store.kind == "s3":
            async def abort() -> None:
                await self.store.fs._call_s3("abort_multipart_upload", Bucket=self.loc.bucket, Key=self.loc.key,
                                             UploadId=session)
        else:
            async def abort() -> None:
                await self.store.fs._call("DELETE", session)
        self.store.tidy_soon(abort)

    def _check_stored(self, sent: int) -> None:
        """The completed object holds as many bytes as were sent, or the save stops here, before any
        commit: a part whose answer was lost is resent by the client, and a store that appends it
        again (a resumable session) would leave an object the commit record could never match."""
        stored = self.store.size(self.op, self.loc)
        if stored != sent:
            self.finished = True  # complete, so it is removed as a leftover, not aborted
            raise CheckpointWriteError(errno.EIO, f"cannot save {self.loc}: the store holds {stored} bytes "
                                                  f"of it after the upload, {sent} were sent (a part applied "
                                                  f"twice or lost, e.g. one resent after its answer was "
                                                  f"lost); nothing was committed, save again")

    # -- parts ----------------------------------------------------------------------------------
    def _send(self, *, final: bool) -> None:
        """Send the filled buffer as the next part (waiting while too many are out)."""
        self.op.object = self.loc.url
        if self._session is None:
            self._session = self._begin()
        self._drain(self.in_flight - 1)
        data, self._buffer = self._buffer[:self._filled] if final else self._buffer, bytearray(self.part_bytes)
        self._hash.update(data)
        offset, number = self._sent, len(self._etags) + len(self._parts) + 1
        self._sent += len(data)
        self._filled = 0
        total = self._sent if final else None
        self._parts.append((number, self.store.submit(lambda: self._part(number, offset, data, total),
                                                      max(self.op.remaining(), 0.001))))

    def _drain(self, keep: int) -> None:
        """Wait until at most `keep` parts are in flight; raise the first part's failure."""
        while len(self._parts) > keep:
            number, future = self._parts[0]
            what = f"uploading part {number} of {self.loc}"
            try:
                self.store.run(self.op, what, lambda f=future: _wrap(f), retry=False)
            except CheckpointTimeoutError as e:
                if self._last is not None:  # the part was being retried when time ran out
                    e.add_note(transient_note(self._last))
                raise
            except Exception as e:  # noqa: BLE001 - a transient failure the part could not retry in time
                if not is_transient(e):
                    raise
                raise self.store.timeout_error(self.op, what, f"it failed, and the {self.op.remaining():.1f} s "
                                                              f"left of the deadline leave no time to retry it",
                                               e) from e
            self._parts.popleft()
            self._etags[number] = future.result()
            self.op.advance(0)

    def _begin(self) -> Any:
        if self.store.kind == "s3":
            async def create() -> str:
                out = await self.store.fs._call_s3("create_multipart_upload", Bucket=self.loc.bucket,
                                                   Key=self.loc.key)
                return out["UploadId"]

            return self.store.run(self.op, f"starting the upload of {self.loc}", create)
        from gcsfs.core import initiate_upload

        async def initiate() -> str:
            return await initiate_upload(self.store.fs, self.loc.bucket, self.loc.key)

        return self.store.run(self.op, f"starting the upload of {self.loc}", initiate)

    async def _part(self, number: int, offset: int, data: bytearray, total: int | None) -> str:
        """One part, retried while transient (the bytes are still in hand)."""
        import asyncio

        attempt = 0
        while True:
            try:
                if self.store.kind == "s3":
                    out = await self.store.fs._call_s3("upload_part", Bucket=self.loc.bucket, Key=self.loc.key,
                                                       PartNumber=number, UploadId=self._session, Body=data)
                    etag = out["ETag"]
                else:
                    await self._chunk(offset, memoryview(data), total)
                    etag = ""
                if attempt:
                    self.op.last_transient = None  # retried, and it went through
                return etag
            except Exception as e:  # noqa: BLE001 - transient failures are retried, the rest raised
                # Retried while the deadline leaves time, as every other request (a server killed and
                # restarted mid-save is a transient failure); `_drain` names the last one.
                wait = min(0.5 * 2 ** attempt, 8.0)
                if not is_transient(e) or self.op.remaining() <= wait:
                    raise
                self._last = self.op.last_transient = e
                attempt += 1
                await asyncio.sleep(wait)

    async def _chunk(self, offset: int, data: memoryview, total: int | None) -> None:
        """One chunk of the resumable session, once (no blind resend: `_part` retries), streamed; a
        session that took only the first bytes (its 308 names them) gets the rest."""
        from gcsfs.retry import validate_response

        fs = self.store.fs
        await fs._set_session()
        while True:
            end = offset + len(data) - 1
            headers = fs._get_headers({"Content-Range": f"bytes {offset}-{end}/{'*' if total is None else total}",
                                       "Content-Type": "application/octet-stream",
                                       "Content-Length": str(len(data))})
            async with fs.session.request("POST", self._session, headers=headers, data=_Slices(data),
                                          allow_redirects=False, timeout=fs.requests_timeout) as r:
                validate_response(r.status, await r.read(), self._session)
                taken = r.headers.get("Range") if r.status == 308 else None
            if taken is None:
                return
            last = int(taken.rsplit("-", 1)[1])
            if last >= end:
                return
            data, offset = data[last + 1 - offset:], last + 1

    def _complete(self) -> None:
        if self.store.kind != "s3":
            return  # the resumable upload completed with its last chunk

        parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._etags.items())]

        async def complete() -> None:
            await self.store.fs._call_s3("complete_multipart_upload", Bucket=self.loc.bucket, Key=self.loc.key,
                                         UploadId=self._session, MultipartUpload={"Parts": parts})

        self.store.run(self.op, f"completing the upload of {self.loc}", complete)


class _Slices:
    """A chunk's body handed to the socket a slice at a time (its length is in the headers): given
    whole, the client's transport copied it (an upload held about five chunks, measured). Each
    request iterates it afresh."""

    def __init__(self, data: memoryview):
        self.view = data

    def __aiter__(self):
        return self._slices()

    async def _slices(self):
        for at in range(0, len(self.view), _SLICE_BYTES):
            yield self.view[at:at + _SLICE_BYTES]


async def _wrap(future: concurrent.futures.Future) -> Any:
    """Await a part's future from the loop (so `Store.run` bounds the wait by the deadline)."""
    import asyncio

    return await asyncio.wrap_future(future)
