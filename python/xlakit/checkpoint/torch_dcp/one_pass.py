"""DCP checkpoints read in one pass: each stored item read once and checked by its own xxh3-64
before any of it reaches the state.

DCP's files are a concatenation of items (one per tensor chunk or pickled
object); its reader reads each requested item again for every chunk of the
target that overlaps it, and xlakit used to read every file whole before that
to check it against the commit record: a verified load read the checkpoint
twice or more. Here the commit record's entry of a DCP file also lists its
items (`"items": [[offset, length, xxh3-64], ...]`), hashed at save time from
the same pass as the whole file's hash (`file_entry`, a folder; `SegmentHashes`,
an upload hashed as sent). A load then reads each item it needs once,
checks it, and serves every request for it from those bytes (`OnePassReader`);
`.metadata` is read once, checked whole, and only then unpickled.

A checkpoint whose record lists no items (written before this) is verified
whole first and read by DCP's own reader, as before.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from xlakit.checkpoint.core.operation import Operation
from xlakit.checkpoint.format import dcp_metadata, folders
from xlakit.checkpoint.format.archive import HASH
from xlakit.checkpoint.format.folders import ITEMS
from xlakit.errors import CheckpointCorruptError, CheckpointIncompleteError

METADATA = folders.DCP_METADATA


def item_ranges(results: list) -> dict[str, list[tuple[int, int]]]:
    """Each file DCP wrote, with the (offset, length) of its items, from `write_data`'s results."""
    out: dict[str, list[tuple[int, int]]] = {}
    for r in results:
        info = r.storage_data
        out.setdefault(info.relative_path, []).append((info.offset, info.length))
    return {name: sorted(set(ranges)) for name, ranges in out.items()}


def file_entry(path: Any, ranges: list[tuple[int, int]]) -> dict:
    """A file's line in the commit record: size, xxh3-64, and each item's, from one read of it."""
    hashes = folders.RangeHashes(ranges)
    nbytes, digest = folders.file_digest(path, hashes.update)
    entry = {"nbytes": nbytes, HASH: digest}
    items = hashes.finish(nbytes)
    if ranges and items is not None:
        entry[ITEMS] = [[offset, length, d] for (offset, length), d in zip(ranges, items)]
    return entry


class SegmentHashes:
    """The xxh3-64 of each stretch of a stream between two `tell()` calls, hashed as written.

    DCP asks a file's position before and after each item it writes, so an item's
    stretch is one segment; `items(ranges)` gives them, or None where an item is not
    exactly one segment (a writer that asks elsewhere): that file then lists no items.
    """

    def __init__(self) -> None:
        self.segments: dict[tuple[int, int], str] = {}
        self._start, self._pos, self._h = 0, 0, xxhash.xxh3_64()

    def update(self, data: Any) -> None:
        self._h.update(data)
        self._pos += memoryview(data).nbytes

    def mark(self) -> None:
        if self._pos > self._start:
            self.segments[(self._start, self._pos)] = self._h.hexdigest()
        self._start, self._h = self._pos, xxhash.xxh3_64()

    def items(self, ranges: list[tuple[int, int]]) -> list[list] | None:
        self.mark()
        found = [[o, n, self.segments.get((o, o + n))] for o, n in ranges]
        return found if found and all(d is not None for *_, d in found) else None


def one_pass(entries: dict[str, dict]) -> bool:
    """Whether a commit's DCP files can be read in one pass (every data file lists its items; an empty
    one, of a rank given nothing to write, holds none)."""
    return folders.lists_items(entries)


class _Buffer(io.RawIOBase):
    """Bytes already read, as the seekable file `torch.load` wants (no copy)."""

    def __init__(self, data: memoryview):
        super().__init__()
        self.data, self.pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: len(self.data)}[whence]
        self.pos = max(base + offset, 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        part = self.data[self.pos:self.pos + len(buffer)]
        memoryview(buffer).cast("B")[:len(part)] = part
        self.pos += len(part)
        return len(part)


class OnePassReader(dcp_metadata.SafeMetadata):
    """Mixed into a DCP storage reader (before it): reads in one pass, each item checked; its
    `.metadata` through `dcp_metadata`'s allowlist, never running pickled code (DCP's `pickle.load`
    would run what a bucket or folder holds, whatever its commit record says).

    The reader sets `op`; `entries`, each file's commit record entry by its name under the
    reader's root (None: DCP reads as it does, a checkpoint whose record lists no items);
    `verify` (False: nothing checked); and gives `open_raw(name)`, the file unbuffered, its
    reads counted in `op.stats`.
    """

    op: Operation
    entries: dict[str, dict] | None = None
    verify: bool = True

    def open_raw(self, name: str) -> io.RawIOBase:
        raise NotImplementedError

    @property
    def checked(self) -> dict[str, dict] | None:
        return self.entries if self.verify else None

    def prepare(self) -> None:
        """Read `.metadata` once and check it, before DCP asks for it (DCP takes any failure of
        `read_metadata` for a missing file and tries another, so it must not fail there)."""
        if self.entries is None:  # a folder saved before items were listed: read here all the same, where
            self._metadata = super().read_metadata()  # a refusal is raised, not taken by DCP for no file
            return
        entry = self.entries.get(METADATA)
        if entry is None:
            raise CheckpointCorruptError(f"{self.path}: the commit record lists the items of DCP's data files but no "
                                         f"{METADATA}; the record was changed after the save committed")
        with self.open_raw(METADATA) as f:
            data = _read_exactly(f, 0, entry["nbytes"], self.path, METADATA)
        if self.verify:
            _check(self.path, METADATA, data, entry["nbytes"], entry[HASH], "")
        try:
            self._metadata = dcp_metadata.load(io.BytesIO(data), str(self.path))
        except Exception as e:  # noqa: BLE001 - any failure of unpickling: the file is not DCP metadata
            if self.verify and getattr(e, "refused", None):
                raise  # the bytes the save wrote name a class the allowlist lacks: not a damaged file
            hint = ("it matches its commit record: the save that wrote it was faulty (or the record was "
                    "written with it)" if self.verify else
                    "it was damaged or replaced: load with verify=True to check it against its commit record")
            raise CheckpointCorruptError(f"{self.path}/{METADATA} is not DCP metadata ({type(e).__name__}: {e}); "
                                         f"{hint}") from e

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = getattr(self, "_metadata", None)
        if metadata is None or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> Future:
        if self.entries is None:
            return super().read_data(plan, planner)
        by_file: dict[str, dict[tuple[int, int], list]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if info.transform_descriptors:
                raise CheckpointIncompleteError(f"{self.path}: {info.relative_path} was written with DCP "
                                                f"transforms {info.transform_descriptors}; xlakit writes none")
            by_file.setdefault(info.relative_path, {}).setdefault((info.offset, info.length), []).append(req)
        for name in sorted(by_file):
            digests = folders.item_digests(self.path, name, self.entries.get(name, {}).get(ITEMS, []))
            with self.open_raw(name) as f:
                for (offset, length), reqs in sorted(by_file[name].items()):
                    data = _read_exactly(f, offset, length, self.path, name)
                    if self.checked is not None:
                        if (offset, length) not in digests:
                            raise CheckpointCorruptError(
                                f"{folders.unlisted_item(self.path, name, offset, length)} (nothing of the item was "
                                f"loaded). `xlakit ckpt verify` says the same if every file is whole; then "
                                f"dcp_load(..., verify=False) reads it unchecked")
                        _check(self.path, name, data, length, digests[(offset, length)], f" at byte {offset}")
                    self.op.advance(length)
                    _serve(planner, reqs, data)
        future: Future = Future()
        future.set_result(None)
        return future


def _read_exactly(f: io.RawIOBase, offset: int, length: int, root: Any, name: str) -> memoryview:
    buf = memoryview(bytearray(length))
    f.seek(offset)
    n = 0
    while n < length:
        got = f.readinto(buf[n:])
        if not got:
            raise CheckpointIncompleteError(f"{root}/{name}: ends at byte {offset + n}, inside an item of "
                                            f"{length} bytes at byte {offset}; the file was cut short")
        n += got
    return buf


def _check(root: Any, name: str, data: Any, nbytes: int, digest: str, where: str) -> None:
    found = xxhash.xxh3_64(data).hexdigest()
    if len(data) != nbytes or found != digest:
        raise CheckpointCorruptError(f"{root}/{name}: expected {nbytes} bytes with {HASH} {digest}{where}, found "
                                     f"{len(data)} bytes with {found}; the file was changed or damaged after the "
                                     f"save committed (nothing of it was loaded)")


def _serve(planner, reqs: list, data: memoryview) -> None:
    """Every request for one stored item, from its bytes: pickled objects, tensor chunks."""
    tensor = None
    for req in reqs:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            continue
        if tensor is None:
            tensor = torch.load(_Buffer(data), map_location="cpu", weights_only=True)
        part = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != part.size():
            raise CheckpointIncompleteError(f"DCP item {req.storage_index}: stored {tuple(part.size())}, the "
                                            f"target wants {tuple(target.size())}")
        target.copy_(part)
        planner.commit_tensor(req, target)
