"""What a compile-cache entry is on object storage: its object's name, its bytes, and their checks.

An object holds one wrapper entry (the envelope of csrc/core/envelope.h
around a serialized executable), compressed where that pays: a 4-byte header
says which (`XKZ1` zlib, `XKR1` as written), so the name is the entry's name
whichever was chosen and two hosts publishing one program race for one
object. Executables compress well (a CPU executable of a small jax program:
1.8 MB to about a tenth), and an entry that does not shrink by a tenth is
stored as it is, since decompressing it would cost a start time for nothing.

A bucket is untrusted storage, so an object becomes a local entry only after
its bytes passed `Unpacker` as they streamed in (a known header; a size
within the wrapper's largest entry; no more than MAX_RATIO times inflated, so
a decompression bomb stops early) and the whole entry passed the envelope
checks the wrapper itself makes on load (checksum; the tag under the job's
key; the entry's stored name equal to its object's name, so a renamed or
swapped object is refused, never another program's executable).
"""

from __future__ import annotations

import re
import zlib

from xlakit import _C

ZLIB, RAW = b"XKZ1", b"XKR1"
HEADER_BYTES = 4
# The wrapper names an entry by the SHA-256 (hex) of its key (csrc/pjrt_wrap/compile_cache.h).
ENTRY_NAME = re.compile(r"[0-9a-f]{64}")
# An entry that compresses to more than this fraction of its size is stored as it is.
_PAYS = 0.9
_LEVEL = 6


class RefusedObject(ValueError):
    """An object that is not a loadable entry for this job: the message says what was found."""


def is_entry_name(name: str) -> bool:
    return ENTRY_NAME.fullmatch(name) is not None


def object_from_entry(entry: bytes) -> bytes:
    """The object's bytes for an entry's: compressed where it pays, with the header saying which."""
    packed = zlib.compress(entry, _LEVEL)
    if len(packed) <= _PAYS * len(entry):
        return ZLIB + packed
    return RAW + entry


# An executable compresses about 15 times (one jax program here: 524,551 bytes to 31,638); an object
# that inflates far more is a decompression bomb, refused before it grows further.
MAX_RATIO = 200
_SLACK = 1 << 20


class Unpacker:
    """An object's bytes, fed in order, turned into its entry's bytes, bounded as they grow.

    `feed(chunk)` returns the entry bytes the chunk yields; `finish()` checks
    nothing is missing. Memory: one chunk in, at most one chunk's worth out.

    Raises (from both):
        RefusedObject: an unknown header; more than `limit` bytes, or more than
            MAX_RATIO times the compressed bytes; corrupt or truncated data.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.head = b""
        self.mode: bytes | None = None
        self.unpack = zlib.decompressobj()
        self.bytes_in = self.bytes_out = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        self.bytes_in += len(chunk)
        if self.mode is None:
            self.head += chunk
            if len(self.head) < HEADER_BYTES:
                return []
            chunk, self.mode = self.head[HEADER_BYTES:], self.head[:HEADER_BYTES]
            if self.mode not in (ZLIB, RAW):
                raise RefusedObject(f"it does not start with an xlakit object header ({ZLIB!r} or {RAW!r}; "
                                    f"found {self.mode!r}): not an entry xlakit published")
        out = [chunk] if self.mode == RAW else self._inflate(chunk)
        self.bytes_out += sum(len(o) for o in out)
        if self.bytes_out > self.limit:
            raise RefusedObject(f"it holds more than the largest entry the wrapper loads ({self.limit} bytes)")
        return out

    def _inflate(self, chunk: bytes) -> list[bytes]:
        out, made = [], 0
        try:
            while chunk:
                allowed = min(self.limit + 1, MAX_RATIO * self.bytes_in + _SLACK) - self.bytes_out - made
                if allowed <= 0:
                    break
                piece = self.unpack.decompress(chunk, allowed)
                out.append(piece)
                made += len(piece)
                chunk = self.unpack.unconsumed_tail
        except zlib.error as e:
            raise RefusedObject(f"its compressed bytes are corrupt ({e})") from None
        if chunk:  # more to inflate than allowed
            if self.bytes_out + made > self.limit:
                raise RefusedObject(f"it decompresses to more than the largest entry the wrapper loads "
                                    f"({self.limit} bytes)")
            raise RefusedObject(f"it inflates more than {MAX_RATIO} times its size: a decompression bomb, not "
                                "an executable")
        return out

    def finish(self) -> None:
        if self.mode is None:
            raise RefusedObject(f"it is {self.bytes_in} bytes, shorter than an xlakit object header")
        if self.mode == ZLIB and (not self.unpack.eof or self.unpack.unused_data):
            raise RefusedObject("its compressed bytes are truncated or followed by others")


def entry_from_object(name: str, body: bytes, *, key: bytes, limit: int) -> bytes:
    """The entry an object (whole in memory) holds, verified as the wrapper verifies it on load:
    `Unpacker`, then the envelope under `key` with `name` as its stored name.

    Raises:
        RefusedObject: as `Unpacker`; an envelope that fails its checksum or its tag under `key`, or
            that stores another entry's name.
    """
    unpacker = Unpacker(limit)
    entry = b"".join(unpacker.feed(body))
    unpacker.finish()
    why = check_entry(name, entry, key=key)
    if why is not None:
        raise RefusedObject(f"its entry does not verify: {why}")
    return entry


def printable(text: str) -> str:
    """A message safe for a log line: what an object held may contain any bytes."""
    return text.encode("unicode_escape", "backslashreplace").decode("ascii")[:300]


def _why_not(found: dict) -> str | None:
    if not found["ok"]:
        return printable(found["message"])
    if not found.get("authenticated") or not found.get("tag_checked"):
        return "it carries no tag under the job's key (XLAKIT_CACHE_KEY)"
    return None


def check_entry(name: str, entry: bytes, *, key: bytes) -> str | None:
    """Why an entry in memory is not one this job may load under `name` (the wrapper's own checks), or None."""
    return _why_not(_C.verify_entry(entry, key=key, expected_key=name))


def check_entry_file(name: str, path: str, *, key: bytes) -> str | None:
    """`check_entry` of a file, read streaming in bounded pieces."""
    return _why_not(_C.verify_entry_file(path, key=key, expected_key=name))


def is_object_start(head: bytes) -> bool:
    """Whether the first bytes of an object are those of one xlakit published: a header, then an
    envelope's magic (inflated first when compressed). What `cache prune` requires before it deletes."""
    if head.startswith(RAW):
        return head[HEADER_BYTES:HEADER_BYTES + 4] in (_C.ENVELOPE_MAGIC, _C.AUTH_MAGIC)
    if head.startswith(ZLIB):
        try:
            inner = zlib.decompressobj().decompress(head[HEADER_BYTES:], 8)
        except zlib.error:
            return False
        return inner[:4] in (_C.ENVELOPE_MAGIC, _C.AUTH_MAGIC)
    return False
