"""Check every checksum of a checkpoint on disk, streamed in bounded memory, with progress.

The check is planned first from the metadata alone (every byte range and the
digest it must have), so structural damage (a missing shard, a truncated
file, an index that disagrees with the zip) is found before any data is
read, and the total is known for the progress report. Then each range is
read in `CHUNK_BYTES` pieces into one reused buffer and hashed: memory stays
at one buffer whatever the checkpoint's size. The first range whose digest
differs is named (the tensor, or the file of a DCP folder).

What it covers: an xlakit file (its zip structure, as torch's reader uses it,
then its pickle, its structure record and every storage), a sharded or
replica-parallel folder (every shard or share named by the commit record,
against its record's size and checksum record, then its own checksums), a DCP folder (every file the commit
record lists, and each item the record hashes, in the same read), a manager's
step folder or every committed step of a manager folder. A plain
`torch.save` file has no checksums: `NothingToVerify`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from xlakit.checkpoint.core.load_stats import CountedFile, LoadStats
from xlakit.checkpoint.format import archive, folders, zip_structure
from xlakit.checkpoint.inspect import describe
from xlakit.checkpoint.format.archive import HASH
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointIncompleteError

CHUNK_BYTES = 4 << 20
Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, what is being read)


class NothingToVerify(CheckpointFormatError):
    """The checkpoint carries no checksums (a plain torch.save file)."""


@dataclass(frozen=True)
class Range:
    """`nbytes` bytes of `file` at `offset` must hash to `expected`."""

    file: Path
    offset: int
    nbytes: int
    expected: str
    label: str
    tensor: str | None
    items: folders.ItemHashes | folders.ListedItems | None = None  # a DCP file's items, checked in the same read


def plan(path: Path) -> tuple[describe.Kind, list[Range]]:
    """Every byte range to hash, found from metadata; raises on structural damage."""
    kind = describe.kind_of(path)
    return kind, _ranges(kind, "")


def _ranges(kind: describe.Kind, prefix: str) -> list[Range]:
    if kind.kind == describe.XLAKIT_FILE:
        return file_ranges(kind.path, prefix)
    if kind.kind == describe.TORCH_FILE:
        if archive.is_zip(kind.path):  # damage to its zip structure still counts
            zip_structure.check(kind.path)
        raise NothingToVerify(f"{kind.path} has no xlakit checksums ({kind.note}); there is nothing to "
                              f"verify. `xlakit ckpt inspect` lists what it holds.")
    if kind.kind == describe.SHARDED:
        return _sharded_ranges(kind, prefix)
    if kind.kind == describe.REPLICATED:
        return _sharded_ranges(kind, prefix, "shares", "share")
    if kind.kind == describe.DCP:
        return _dcp_ranges(kind, prefix)
    if kind.kind == describe.STEP:
        return _ranges(describe.step_checkpoint(kind), f"{prefix}step {kind.record['step']}: ")
    if kind.kind == describe.MANAGER:
        from xlakit.checkpoint.stepstore import steps

        found = steps.scan(kind.path)
        if found.damaged:  # structural damage, found before any data is read
            step = min(found.damaged)
            err = CheckpointCorruptError(f"{prefix}step {step}: {kind.path / str(step) / steps.STEP_RECORD} is "
                                         f"damaged: {found.damaged[step]}")
            err.add_note(steps.damage_note(kind.path / str(step)))
            raise err
        out: list[Range] = []
        for step in sorted(found.committed.values(), key=lambda s: s.step):
            out += _ranges(describe.kind_of(step.path), prefix)
        return out
    raise CheckpointIncompleteError(f"{kind.path} is not a committed checkpoint: {kind.note}")


def file_ranges(path: Path, prefix: str = "") -> list[Range]:
    """The pickle and every storage of an xlakit file, where the zip itself puts them; the zip's own
    structure (which no checksum covers) is checked first, as torch's reader will use it."""
    meta, reader = archive.read_index(str(path))
    try:
        zip_structure.check(path)
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{prefix}{e}") from None
    size = path.stat().st_size
    pk = meta["pickle"]
    entries = [("data.pkl", "the pickled structure (data.pkl)", None, pk["nbytes"], pk[HASH], pk.get("offset"))]
    if "structure" in meta:  # files since xlakit.restore (the layout of every tensor)
        st = meta["structure"]
        entries.append((archive.STRUCTURE_RECORD, "the structure record", None, st["nbytes"], st[HASH],
                        st.get("offset")))
    entries += [(f"data/{c.key}", f"tensor {c.path!r}", c.path, c.nbytes, c.expected, c.offset)
                for c in archive.iter_checks(meta)]
    out = []
    for record, what, tensor, nbytes, expected, indexed in entries:
        label = f"{prefix}{what}"
        offset = archive.record_offset(reader, record, str(path), label, tensor)
        if indexed is not None and indexed != offset:
            raise CheckpointCorruptError(f"{path}: {label} starts at byte {offset} in the zip but at "
                                         f"{indexed} in xlakit's index; the file was altered", tensor=tensor)
        if offset + nbytes > size:
            raise CheckpointCorruptError(f"{path}: {label} should hold {nbytes} bytes at offset {offset}, "
                                         f"but the file ends at {size}: it is truncated", tensor=tensor)
        out.append(Range(path, offset, nbytes, expected, label, tensor))
    return out


def _sharded_ranges(kind: describe.Kind, prefix: str, key: str = "shards", what: str = "shard") -> list[Range]:
    """Every shard (or replica-parallel share) the commit record names: there, of the size and with the
    checksum record it names, then each one's own checksums."""
    from xlakit.checkpoint.store.local import shard_digest

    out = []
    for entry in kind.record[key]:
        shard = kind.path / entry["file"]
        where = f"{kind.path}: {what} {entry['rank']} ({entry['file']})"
        if not shard.is_file():
            raise CheckpointIncompleteError(f"{where} is named by the commit record but missing")
        if shard.stat().st_size != entry["bytes"]:
            raise CheckpointCorruptError(f"{where} holds {shard.stat().st_size} bytes, the commit record "
                                         f"says {entry['bytes']}")
        if shard_digest(shard) != entry["checksums"]:
            raise CheckpointCorruptError(f"{where}: its checksum record is not the one the commit "
                                         f"record names; the {what} was replaced or altered")
        out += file_ranges(shard, f"{prefix}{what} {entry['rank']}: ")
    return out


def _dcp_ranges(kind: describe.Kind, prefix: str) -> list[Range]:
    out = []
    checks = folders.item_checks(kind.path, kind.record["files"])
    for name in folders.metadata_last(kind.record["files"]):
        entry = kind.record["files"][name]
        file = kind.path / name
        if not file.is_file():
            raise CheckpointIncompleteError(f"{kind.path}: {name} is listed in the commit record but missing")
        if file.stat().st_size != entry["nbytes"]:
            raise CheckpointCorruptError(f"{file} holds {file.stat().st_size} bytes, the commit record says "
                                         f"{entry['nbytes']}: it is truncated or was replaced")
        out.append(Range(file, 0, entry["nbytes"], entry[HASH], f"{prefix}file {name}", None, checks.get(name)))
    return out


def check(ranges: list[Range], progress: Progress | None = None) -> int:
    """Hash every range, streaming; the bytes checked. Raises naming the first that differs."""
    total = sum(r.nbytes for r in ranges)
    done = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    stats = LoadStats()  # what was read, for `xlakit ckpt verify --json` (load_stats.collecting)
    for r in ranges:
        hasher = xxhash.xxh3_64()
        with CountedFile(r.file, stats) as f:
            f.seek(r.offset)
            left = r.nbytes
            while left:
                n = f.readinto(view[:min(left, CHUNK_BYTES)])
                if not n:
                    raise CheckpointCorruptError(f"{r.file}: {r.label} ends early: the file is truncated",
                                                 tensor=r.tensor)
                hasher.update(view[:n])
                if r.items is not None:
                    r.items.update(r.offset + r.nbytes - left, view[:n])
                left -= n
                done += n
                if progress is not None:
                    progress(done, total, r.label)
        actual = hasher.hexdigest()
        if actual != r.expected:
            raise CheckpointCorruptError(f"{r.file}: {r.label} is corrupt: its {HASH} is {actual}, the "
                                         f"checkpoint recorded {r.expected}", tensor=r.tensor)
        if r.items is not None:
            r.items.check(r.offset + r.nbytes)
    return done

