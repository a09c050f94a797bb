"""What a compile-cache entry is on object storage: its object's name, its bytes, and their checks.

An object holds one wrapper entry (the envelope of csrc/core/envelope.h
around a serialized executable), compressed where that pays: a 4-byte header
says which (`XKZ1` zlib, `XKR1` as written), so the name is the entry's name
whichever was chosen and two hosts publishing one program race for one
object. Executables compress well (a CPU executable of a small jax program:
1.8 MB to about a tenth), and an entry that does not shrink by a tenth is
stored as it is, since decompressing it would cost a start time for nothing.

A bucket is untrusted storage, so an object becomes a local entry only after
`entry_from_object` has checked, in memory and bounded by the wrapper's
largest entry: a known header, a decompressed size within the bound, and the
envelope the wrapper itself verifies on load (checksum; the tag under the
job's key; the entry's stored name equal to its object's name, so a renamed
or swapped object is refused, never another program's executable).
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


def _decompressed(body: bytes, limit: int) -> bytes:
    unpack = zlib.decompressobj()
    try:
        out = unpack.decompress(body, limit + 1)
    except zlib.error as e:
        raise RefusedObject(f"its compressed bytes are corrupt ({e})") from None
    if len(out) > limit:
        raise RefusedObject(f"it decompresses to more than the largest entry the wrapper loads ({limit} bytes)")
    if not unpack.eof or unpack.unused_data:
        raise RefusedObject("its compressed bytes are truncated or followed by others")
    return out


def entry_from_object(name: str, body: bytes, *, key: bytes, limit: int) -> bytes:
    """The entry an object holds, verified as the wrapper verifies it on load, for the object `name`.

    Raises:
        RefusedObject: an unknown header; corrupt, truncated or oversized bytes; an envelope that fails
            its checksum or its tag under `key`, or that stores another entry's name.
    """
    if len(body) > limit + HEADER_BYTES and not body.startswith(ZLIB):
        raise RefusedObject(f"it is {len(body)} bytes, more than the largest entry the wrapper loads ({limit})")
    head, rest = body[:HEADER_BYTES], body[HEADER_BYTES:]
    if head == ZLIB:
        entry = _decompressed(rest, limit)
    elif head == RAW:
        entry = rest
    else:
        raise RefusedObject(f"it does not start with an xlakit object header ({ZLIB!r} or {RAW!r}; found "
                            f"{head!r}): not an entry xlakit published")
    found = _C.verify_entry(entry, key=key, expected_key=name)
    if not found["ok"]:
        raise RefusedObject(f"its entry does not verify: {found['message']}")
    if not found.get("authenticated") or not found.get("tag_checked"):
        raise RefusedObject("its entry carries no tag under the job's key (XLAKIT_CACHE_KEY)")
    return entry


def check_entry(name: str, entry: bytes, *, key: bytes) -> str | None:
    """Why a local entry must not be published (it would be refused everywhere), or None."""
    found = _C.verify_entry(entry, key=key, expected_key=name)
    if not found["ok"]:
        return found["message"]
    if not found.get("authenticated") or not found.get("tag_checked"):
        return "it carries no tag under the job's key (written before XLAKIT_CACHE_KEY was set?)"
    return None
