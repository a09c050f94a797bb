"""Checkpoint folders: the commit record that makes a folder a checkpoint, and what it may replace.

A folder checkpoint (`xlakit.dcp_save`, and `xlakit.save(layout="sharded")`)
is a checkpoint only once its commit record, `xlakit-commit.json`, is in
place: written last, fsynced, listing every file with its size and xxh3-64.
A folder without one is an interrupted save: it is never loaded. The two kinds
share the record's name and are told apart by its `format`.

A save replaces a folder only when it positively holds nothing but checkpoint
files, so a wrong path can never cost a user's other files.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import xxhash

from xlakit.checkpoint.core import paths
from xlakit.checkpoint.format.archive import HASH
from xlakit.errors import (CheckpointCorruptError, CheckpointFormatError, CheckpointIncompleteError,
                           CheckpointWriteError)

COMMIT_RECORD = "xlakit-commit.json"
DCP_FORMAT = "xlakit-dcp"
SHARDED_FORMAT = "xlakit-sharded"
REPLICATED_FORMAT = "xlakit-replicated"  # a replica-parallel folder of shares (replicas.py)
FORMAT_VERSION = 1  # what DCP and sharded records are written with
# The newest record this xlakit reads; 2: replicated checkpoints as a folder of shares (replicas.py).
NEWEST_VERSION = 2
DCP_METADATA = ".metadata"
_DCP_DATA_SUFFIX = ".distcp"
_CHUNK = 8 << 20
ITEMS = "items"  # a DCP file's entry: [[offset, length, xxh3-64], ...] of each item DCP wrote (torch_dcp/one_pass.py)


def _is_checkpoint_file(name: str) -> bool:
    return name in (COMMIT_RECORD, DCP_METADATA) or name.endswith(_DCP_DATA_SUFFIX)


def check_replaceable(final: Path) -> None:
    """Refuse to replace `final` unless it is absent or holds only DCP checkpoint files."""
    if not final.exists():
        return
    foreign = (["(it is a file)"] if not final.is_dir()
               else sorted(n for n in os.listdir(final) if not _is_checkpoint_file(n)))
    if foreign:
        err = CheckpointWriteError(errno.EEXIST, f"cannot save {final}: it exists and is not a "
                                   f"DCP checkpoint folder (found {', '.join(foreign[:5])})")
        err.filename = str(final)
        err.add_note(f"A save replaces a folder holding only {DCP_METADATA}, *{_DCP_DATA_SUFFIX} "
                     f"and {COMMIT_RECORD}; choose another path or move those files away.")
        raise err


def file_digest(path: Path, also: Callable[[int, bytes], None] | None = None) -> tuple[int, str]:
    """A file's size and xxh3-64; `also(offset, chunk)` sees each chunk of the same read."""
    h, n = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if also is not None:
                also(n, chunk)
            n += len(chunk)
    return n, h.hexdigest()


class RangeHashes:
    """The xxh3-64 of each of a file's sorted, non-overlapping (offset, length) ranges, from chunks of
    one front-to-back read (`update(offset, data)`, in order)."""

    def __init__(self, ranges: list[tuple[int, int]]):
        self.ranges = ranges
        self.digests: list[str] = []  # of the ranges the read has passed, in order
        self._hash = xxhash.xxh3_64()

    def update(self, offset: int, data) -> None:
        end = offset + len(data)
        while len(self.digests) < len(self.ranges):
            o, n = self.ranges[len(self.digests)]
            lo, hi = max(o, offset), min(o + n, end)
            if hi > lo:
                self._hash.update(data[lo - offset:hi - offset])
            if o + n > end:
                return
            self.digests.append(self._hash.hexdigest())
            self._hash.reset()

    def finish(self, size: int) -> list[str] | None:
        """After the read (`size` bytes): every range's digest, or None if some lie past the end."""
        self.update(size, b"")  # a range of no bytes at the very end
        return self.digests if len(self.digests) == len(self.ranges) else None


def unlisted_item(root: object, name: str, offset: int, length: int) -> str:
    """What is wrong when DCP's checked metadata names an item its file's item list lacks."""
    return (f"{root}/{name}: DCP's metadata, which matches its commit record, names an item at byte {offset} "
            f"({length} bytes) that the record's item list does not; the commit record was changed after the "
            f"save committed")


def item_digests(root: object, name: str, items: object) -> dict[tuple[int, int], str]:
    """A DCP file's item list from its commit record entry (`[[offset, length, xxh3-64], ...]`), by
    (offset, length); refused, naming the record, if malformed."""
    try:
        found = {(o, n): d for o, n, d in items}  # type: ignore[union-attr]
        if all(isinstance(o, int) and isinstance(n, int) and o >= 0 and n >= 0 and isinstance(d, str)
               for (o, n), d in found.items()):
            return found
    except (TypeError, ValueError):
        pass
    raise CheckpointCorruptError(f"{root}: the commit record's item list of {name} is not a list of [offset, length, "
                                 f"{HASH}] entries; the record was changed after the save committed")


class ItemHashes:
    """The item hashes of a file read front to back, in the read that hashes the whole file.

    `update(offset, data)` with each chunk in order; once the whole file matched its own hash,
    `check(size)` raises for the first item that differs, blaming the record's item list (the
    file itself is as committed): `xlakit ckpt verify` then agrees with `dcp_load`, which checks
    each item as it reads it.
    """

    def __init__(self, root: object, name: str, items: object):
        self.where = f"{root}/{name}"
        self.items = sorted(item_digests(root, name, items).items())
        for ((o1, n1), _), ((o2, _n), _) in zip(self.items, self.items[1:]):
            if o1 + n1 > o2:
                raise CheckpointCorruptError(f"{root}: the commit record's item list of {name} has items that overlap "
                                             f"(at bytes {o1} and {o2}); the record was changed after the save "
                                             f"committed")
        self._hashes = RangeHashes([r for r, _ in self.items])

    def update(self, offset: int, data) -> None:
        self._hashes.update(offset, data)

    def check(self, size: int) -> None:
        self._hashes.finish(size)
        found = self._hashes.digests
        mismatch = next((f"{self.where}: the item at byte {o} ({n} bytes) has {HASH} {d}, the commit record's item "
                         f"list says {digest}" for ((o, n), digest), d in zip(self.items, found) if d != digest), None)
        if mismatch is None and len(found) < len(self.items):
            (o, n), _ = self.items[len(found)]
            mismatch = f"{self.where}: the commit record lists an item at byte {o} ({n} bytes), past its end ({size} bytes)"
        if mismatch is not None:
            raise CheckpointCorruptError(f"{mismatch}; the file matches its own {HASH}, so the item list was "
                                         f"changed after the save committed (dcp_load refuses it too; "
                                         f"dcp_load(..., verify=False) reads the files unchecked)")


def lists_items(files: dict[str, dict]) -> bool:
    """Whether a DCP commit record lists the items of every data file (an empty one, of a rank given
    nothing to write, holds none): `dcp_load` then checks each item it reads against its file's list."""
    data = [e for name, e in files.items() if not name.endswith(DCP_METADATA)]
    return bool(data) and all(ITEMS in e or e["nbytes"] == 0 for e in data)


def item_checks(root: object, files: dict[str, dict]) -> dict[str, "ItemHashes | ListedItems"]:
    """What verify checks in its one read of each file of a DCP commit record, besides the file's own
    hash: each data file's item hashes, and (where the record lists every file's items) that the
    `.metadata` names no item its file's list lacks, as `dcp_load` requires."""
    out: dict[str, ItemHashes | ListedItems] = {name: ItemHashes(root, name, e[ITEMS])
                                                for name, e in files.items() if ITEMS in e}
    if lists_items(files):
        out.update((name, ListedItems(root, name, files)) for name in files if name.endswith(DCP_METADATA))
    return out


def metadata_last(names: object) -> list[str]:
    """A DCP commit's files in verify's order: `.metadata` last, so that a damaged data file is blamed
    before the record's item list is compared with the metadata."""
    return sorted(names, key=lambda n: (n.endswith(DCP_METADATA), n))  # type: ignore[attr-defined]


class ListedItems:
    """A DCP `.metadata` read in verify's one read of it: once the file matched its own hash, `check`
    requires each item it names to be in its file's item list of the commit record (`dcp_load` refuses
    an item the list lacks). Unpickled through `dcp_metadata`'s allowlist: a metadata that names
    anything else is left to `dcp_load` (the file itself is as committed)."""

    def __init__(self, root: object, name: str, files: dict[str, dict]):
        self.root, self.files = root, files
        self.prefix = name[:-len(DCP_METADATA)]  # a bucket's object names carry the folder
        self._data = bytearray()

    def update(self, offset: int, data) -> None:
        self._data += data

    def check(self, size: int) -> None:
        import io

        from xlakit.checkpoint.format import dcp_metadata

        data, self._data = self._data, bytearray()
        try:
            metadata = dcp_metadata.load(io.BytesIO(data), str(self.root))
        except CheckpointFormatError:
            return
        listed: dict[str, dict[tuple[int, int], str]] = {}
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            name = self.prefix + str(info.relative_path)
            if name not in listed:
                listed[name] = item_digests(self.root, name, self.files.get(name, {}).get(ITEMS, []))
            if (info.offset, info.length) not in listed[name]:
                raise CheckpointCorruptError(f"{unlisted_item(self.root, name, info.offset, info.length)} (dcp_load "
                                             f"refuses it too; dcp_load(..., verify=False) reads the files unchecked)")


def file_entry(path: Path) -> dict:
    """A file's line in the commit record: its size and xxh3-64."""
    nbytes, digest = file_digest(path)
    return {"nbytes": nbytes, HASH: digest}


def write_commit_record(tmp: Path, known: dict[str, dict] | None = None) -> None:
    """List every file of `tmp` with size and checksum in the commit record; fsync it all.

    `known` entries (hashed by the ranks that wrote them) are taken as they are
    once their size matches, so the committing rank does not read every file.
    """
    known = known or {}
    present = sorted(os.listdir(tmp))
    missing = sorted(set(known) - set(present))
    if missing:
        raise CheckpointIncompleteError(f"{tmp}: {', '.join(missing[:5])} reported written but not "
                                        f"found; the folder is not on storage every rank shares")
    files = {}
    for name in present:
        files[name] = known.get(name) or file_entry(tmp / name)
        size = os.stat(tmp / name).st_size
        if size != files[name]["nbytes"]:
            raise CheckpointIncompleteError(f"{tmp / name}: reported {files[name]['nbytes']} bytes "
                                            f"by the rank that wrote it, found {size}")
    record = {"format": DCP_FORMAT, "version": FORMAT_VERSION, "files": files}
    with open(tmp / COMMIT_RECORD, "x") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    paths.fsync_dir(tmp)


def read_json_record(folder: Path) -> dict | None:
    """The commit record of `folder` as JSON, None when there is none; raises when unreadable."""
    try:
        text = (folder / COMMIT_RECORD).read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise CheckpointCorruptError(f"{folder / COMMIT_RECORD} is not an xlakit commit record "
                                     f"({e}); found {text[:80]!r}") from e
    version = record.get("version")
    if isinstance(version, int) and version > NEWEST_VERSION:
        raise CheckpointFormatError(f"{folder} was committed in xlakit folder format version "
                                    f"{version}; this xlakit understands versions up to "
                                    f"{NEWEST_VERSION}: upgrade xlakit to load it")
    return record


def describe_folder(folder: Path) -> str:
    """What a folder without a usable commit record holds, for messages."""
    try:
        found = sorted(os.listdir(folder))
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not found:
        return "it is empty"
    if DCP_METADATA in found:
        return f"it holds a torch.distributed.checkpoint save without xlakit's commit record ({', '.join(found[:4])})"
    if any(n.startswith("shard-") for n in found):
        return f"it holds shards of an interrupted sharded save ({', '.join(found[:4])})"
    return f"it holds {', '.join(found[:6])}" + (" ..." if len(found) > 6 else "")


def read_commit_record(final: Path) -> dict:
    """The commit record of the DCP folder `final`; refuses folders that have none."""
    if not final.is_dir():
        raise FileNotFoundError(errno.ENOENT, f"no checkpoint folder at {final}", str(final))
    record = read_json_record(final)
    if record is None:
        err = CheckpointIncompleteError(
            f"{final} has no commit record ({COMMIT_RECORD}): its save did not finish, or it was "
            f"not written by xlakit.dcp_save ({describe_folder(final)})")
        err.add_note("It is never loaded; the next xlakit.dcp_save to this path replaces it. If it "
                     "is a plain torch.distributed.checkpoint folder you trust, load it with "
                     "torch.distributed.checkpoint.load.")
        raise err
    if record.get("format") == SHARDED_FORMAT:
        raise CheckpointFormatError(
            f"{final} is a sharded xlakit.save checkpoint (format {SHARDED_FORMAT!r}), not a "
            f"DCP folder (format {DCP_FORMAT!r}); load it with xlakit.load")
    if record.get("format") != DCP_FORMAT or not isinstance(record.get("files"), dict):
        raise CheckpointCorruptError(f"{final / COMMIT_RECORD} is not an xlakit commit record "
                                     f"(expected format {DCP_FORMAT!r} with a file list)")
    return record


def verify_file(final: Path, name: str, expected: dict) -> None:
    path = final / name
    if not path.is_file():
        raise CheckpointIncompleteError(
            f"{final}: {name} is listed in the commit record but missing")
    nbytes, digest = file_digest(path)
    if nbytes != expected["nbytes"] or digest != expected[HASH]:
        raise CheckpointCorruptError(
            f"{path}: expected {expected['nbytes']} bytes with {HASH} "
            f"{expected[HASH]}, found {nbytes} bytes with {digest}; the file was "
            f"changed or damaged after the save committed")
