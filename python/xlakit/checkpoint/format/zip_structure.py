"""The zip structure of a checkpoint file, checked the way torch's reader will use it.

xlakit's checksums cover every byte a reader takes as data (the pickle, the
structure record, every storage), but not the zip's own bookkeeping: the end
records, the central directory, the local headers. xlakit's reader never
needs them (the zip comment points at its index), torch's does: one flipped
byte in a local header's signature, a compression method or a name's prefix,
and `torch.load` refuses a file whose every checksum matches. `check` walks
that bookkeeping in full, from metadata alone (the central directory and one
local header per record, no data), so `xlakit ckpt verify` says "OK" only of
a file `torch.load` can open.

What is checked is what torch's reader (miniz) relies on: the end of central
directory and its zip64 records agree with each other and with the file; each
central directory entry has its signature, no encryption, the stored method,
equal sizes, a name under the archive's one top folder, and points at a local
header with its signature, the stored method and the same name, whose data
lies before the central directory. Fields no reader interprets (timestamps,
versions, CRC32s, which xlakit leaves zero by default) are not judged. The
small records torch reads besides the checksummed ones (the format version,
storage alignment, byte order, file version and serialization id) must hold
what torch can parse.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import BinaryIO

from xlakit.errors import CheckpointCorruptError

_EOCD = struct.Struct("<IHHHHIIH")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
# Records torch reads and parses that no xlakit checksum covers: what each must hold.
_PARSED = {".format_version": rb"[0-9]+", ".storage_alignment": rb"[0-9]+", "byteorder": rb"little|big",
           "version": rb"[0-9]+\n?", ".data/version": rb"[0-9]+\n?", ".data/serialization_id": rb"[!-~]{1,64}"}
_ENCRYPTED = 0x0001
_STORED = 0


class _Damage(Exception):
    pass


def check(path: Path) -> int:
    """Check the zip structure of checkpoint file `path`; the number of records.

    Raises:
        CheckpointCorruptError: naming the record and the field that torch's reader would refuse.
    """
    try:
        with open(path, "rb") as f:
            return _check(f, path.stat().st_size)
    except _Damage as e:
        raise CheckpointCorruptError(f"{path}: the zip structure is damaged: {e}; torch.load and other zip "
                                     f"readers may refuse the file, although its checksummed records are "
                                     f"intact") from None


def _read(f: BinaryIO, offset: int, n: int, what: str) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise _Damage(f"{what} at byte {offset} runs past the end of the file")
    return data


def _end_records(f: BinaryIO, size: int) -> tuple[int, int, int]:
    """(entries, central directory offset, its size) from the end records, checked against each other."""
    tail_len = min(size, _EOCD.size + _U16)
    tail = _read(f, size - tail_len, tail_len, "the end of the file")
    at = tail.rfind(b"PK\x05\x06")
    while at >= 0 and at + _EOCD.size + struct.unpack_from("<H", tail, at + 20)[0] != len(tail):
        at = tail.rfind(b"PK\x05\x06", 0, at)  # the signature's bytes inside the comment
    if at < 0:
        raise _Damage("no end of central directory record (signature PK\\x05\\x06) ends the file")
    eocd_at = size - tail_len + at
    _, disk, cd_disk, here, total, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
    if disk or cd_disk or here != total:
        raise _Damage(f"the end record names disk {disk}/{cd_disk} and {here} of {total} entries: "
                      f"expected one disk")
    saturated = _U32 in (cd_size, cd_offset) or total == _U16
    locator = (_read(f, eocd_at - _ZIP64_LOCATOR.size, _ZIP64_LOCATOR.size, "the zip64 locator")
               if eocd_at >= _ZIP64_LOCATOR.size else b"")
    if not locator.startswith(b"PK\x06\x07"):
        if saturated:
            raise _Damage("the end record's fields are full but no zip64 end record locator precedes it")
        if cd_offset + cd_size != eocd_at:
            raise _Damage(f"the central directory ({cd_size} bytes at {cd_offset}) does not end where the "
                          f"end record starts ({eocd_at})")
        return total, cd_offset, cd_size
    # xlakit and torch always write the zip64 records: they must agree with the end record.
    _, disk, record_at, disks = _ZIP64_LOCATOR.unpack(locator)
    if disk != 0 or disks != 1 or record_at + _ZIP64_EOCD.size > eocd_at - _ZIP64_LOCATOR.size:
        raise _Damage("the zip64 end record locator before the end record is damaged")
    record = _read(f, record_at, _ZIP64_EOCD.size, "the zip64 end record")
    sig, _, _, _, disk, cd_disk, here, total64, cd_size64, cd_offset64 = _ZIP64_EOCD.unpack(record)
    if sig != 0x06064B50 or disk or cd_disk or here != total64:
        raise _Damage(f"the zip64 end record at byte {record_at} is missing or damaged")
    for what, short, full, cap in (("entries", total, total64, _U16), ("central directory size", cd_size,
                                   cd_size64, _U32), ("central directory offset", cd_offset, cd_offset64, _U32)):
        if short != cap and short != full:
            raise _Damage(f"the end records disagree on the {what} ({short} and {full})")
    if cd_offset64 + cd_size64 != record_at:
        raise _Damage(f"the central directory ({cd_size64} bytes at {cd_offset64}) does not end where the "
                      f"zip64 end record starts ({record_at})")
    return total64, cd_offset64, cd_size64


def _check(f: BinaryIO, size: int) -> int:
    entries, cd_offset, cd_size = _end_records(f, size)
    if cd_offset + cd_size > size:
        raise _Damage(f"the central directory ({cd_size} bytes at {cd_offset}) runs past the end of the file")
    directory = _read(f, cd_offset, cd_size, "the central directory")
    pos, prefix = 0, None
    for i in range(entries):
        if pos + _CENTRAL.size > len(directory):
            raise _Damage(f"the central directory holds fewer entries than the {entries} the end record counts")
        (sig, _, _, flags, method, _, _, _, csize, usize, name_len, extra_len, comment_len, disk, _, _,
         local_at) = _CENTRAL.unpack_from(directory, pos)
        raw_name = directory[pos + 46:pos + 46 + name_len]
        extra = directory[pos + 46 + name_len:pos + 46 + name_len + extra_len]
        name = raw_name.decode("utf-8", "replace")
        where = f"entry {i} ({name!r})"
        if sig != 0x02014B50:
            raise _Damage(f"central directory {where} lacks its signature at byte {cd_offset + pos}")
        if flags & _ENCRYPTED or method != _STORED:
            raise _Damage(f"central directory {where} says flags {flags:#06x}, method {method}: expected a "
                          f"stored, unencrypted record")
        csize, usize, local_at = _zip64_sizes(extra, csize, usize, local_at, disk, where)
        if csize != usize:
            raise _Damage(f"central directory {where} has {csize} stored bytes but {usize} uncompressed")
        top = name.split("/", 1)[0] + "/"
        if "/" not in name or (prefix is not None and top != prefix):
            raise _Damage(f"central directory {where}: expected a name under {prefix or 'a top folder'!r}")
        prefix = prefix or top
        data_at = _check_local(f, local_at, raw_name, csize, cd_offset, where)
        pattern = _PARSED.get(name[len(prefix):])
        if pattern is not None and not re.fullmatch(pattern, _read(f, data_at, min(csize, 64), where)):
            raise _Damage(f"record {name!r} does not hold what torch reads there (expected "
                          f"{pattern.decode()!r})")
        pos += 46 + name_len + extra_len + comment_len
    if pos != cd_size:
        raise _Damage(f"the central directory holds {cd_size - pos} bytes more than its {entries} entries")
    return entries


def _zip64_sizes(extra: bytes, csize: int, usize: int, local_at: int, disk: int,
                 where: str) -> tuple[int, int, int]:
    """The sizes and local header offset, from the zip64 extra field where the 32-bit ones are full."""
    wanted = [v == _U32 for v in (usize, csize, local_at)] + [disk == _U16]
    if not any(wanted):
        return csize, usize, local_at
    at = 0
    while at + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            values = list(struct.unpack_from(f"<{n // 8}Q", extra, at + 4)) if n % 8 == 0 else []
            if len(values) < sum(wanted[:3]):
                break
            it = iter(values)
            usize = next(it) if wanted[0] else usize
            csize = next(it) if wanted[1] else csize
            local_at = next(it) if wanted[2] else local_at
            return csize, usize, local_at
        at += 4 + n
    raise _Damage(f"central directory {where} lacks the zip64 sizes its 32-bit fields point to")


def _check_local(f: BinaryIO, at: int, raw_name: bytes, nbytes: int, cd_offset: int, where: str) -> int:
    """Check the local header of a record; where its data starts."""
    header = _read(f, at, _LOCAL.size + len(raw_name), f"the local header of {where}")
    sig, _, flags, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(header)
    if sig != 0x04034B50:
        raise _Damage(f"the local header of {where} lacks its signature at byte {at}")
    if flags & _ENCRYPTED or method != _STORED:
        raise _Damage(f"the local header of {where} says flags {flags:#06x}, method {method}: expected a "
                      f"stored, unencrypted record")
    if header[_LOCAL.size:] != raw_name or name_len != len(raw_name):
        raise _Damage(f"the local header of {where} at byte {at} names another record")
    data_at = at + _LOCAL.size + name_len + extra_len
    if data_at + nbytes > cd_offset:
        raise _Damage(f"the data of {where} runs into the central directory")
    return data_at
