"""DCP checkpoints on object storage: DCP's fsspec storage into a generation's prefix.

The bucket destination of `dcp_ranks.py`'s flow (`BucketDcp`; `dcp.LocalDcp` is the folder's);
`dcp_save` and `dcp_load` hand a URL here.

DCP writes and reads through its fsspec storage (`FsspecWriter` /
`FsspecReader`), pointed at xlakit's client for the store (the same
filesystem, configured once: no credential lookup against an emulator) by a
file system whose streams are xlakit's: writes go through `Upload` (parts
streamed, bounded, every request under the operation's deadline, hashed as
sent) and reads through `ObjectFile` (ranged, bounded). A save at URL `U`
writes generation `g` into the prefix `U/<g>.<host>.<pid>.<token>.dcp/`
(DCP's `__R_0.distcp` files and `.metadata`), a name no other save uses; the
commit is then `generations.py`'s: the commit record
`U/xlakit-commit.<g>.json`, created last and create-only, names every file
with its size and xxh3-64, and each item of a data file with its own (hashed as
sent), so a load reads each item once and checks it (`one_pass.py`).

With several ranks rank 0 proposes the generation, every rank writes its files
and votes with their sizes and hashes, and rank 0 checks that every voted file
is in the bucket with its size before it creates the record at the agreed
commit point. A load reads the generation rank 0 names; DCP reads and
reshards, each item read once and checked against the record as it comes in
(a record that lists no items: each rank first verifies its share of the files
whole, `store.bucket.verify_object`).
"""

from __future__ import annotations

import contextlib
import io
import secrets
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from xlakit.checkpoint.core.operation import Operation
from xlakit.checkpoint.core.options import SaveOptions
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, Store, store_for
from xlakit.checkpoint.objstore.reader import ObjectFile
from xlakit.checkpoint.objstore.upload import Upload
from xlakit.checkpoint.store import bucket
from xlakit.checkpoint.torch_dcp import dcp, one_pass
from xlakit.errors import CheckpointIncompleteError

KIND = "dcp"
SUFFIX = ".dcp"
_READ_BUFFER = 1 << 20  # torch.load reads a record's header in small pieces


class _Stream(io.RawIOBase):
    """What DCP writes a file into: an `Upload`; DCP's own `close()` does not end it. Its items are
    hashed as sent (`one_pass.SegmentHashes`: DCP asks the position around each)."""

    def __init__(self, upload: Upload):
        super().__init__()
        self.upload, self.written = upload, 0
        self.segments = one_pass.SegmentHashes()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = self.upload.write(data)
        self.segments.update(memoryview(data).cast("B")[:n])
        self.written += n
        return n

    def tell(self) -> int:
        self.segments.mark()
        return self.written

    def close(self) -> None:
        pass  # finished (or aborted) by the file system that opened it


class StoreFileSystem(FileSystem):
    """DCP's fsspec file system on xlakit's client, its streams bounded by `op`'s deadline.

    `entries` holds, for each file written, its name under `root` with its size and xxh3-64,
    and `segments` its items' hashes; `sizes` (reading) the sizes a commit record names, so a
    read needs no lookup first.
    """

    def __init__(self, store: Store, op: Operation, root: Location, sizes: dict[str, int] | None = None):
        super().__init__()
        self.fs, self.store, self.op, self.root = store.fs, store, op, root
        self.entries: dict[str, dict] = {}
        self.segments: dict[str, one_pass.SegmentHashes] = {}
        self.sizes = sizes or {}

    def name(self, path: Any) -> str:
        return Location.parse(str(path)).key[len(self.root.key) + 1:]

    def init_path(self, path: Any, **kwargs: Any) -> Any:
        return path

    def mkdir(self, path: Any) -> None:
        pass  # an object store has no folders

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        loc = Location.parse(str(path))
        if "r" in mode:
            size = self.sizes.get(self.name(path))
            if size is None:
                size = self.store.size(self.op, loc)
            with io.BufferedReader(ObjectFile(self.store, self.op, loc, size), _READ_BUFFER) as f:
                yield f
            return
        leftover = self.op.own(generations.Leftover(self.store, loc))
        upload = Upload(self.store, self.op, loc)
        try:
            stream = _Stream(upload)
            yield stream
            self.entries[self.name(path)] = upload.finish()
            self.segments[self.name(path)] = stream.segments
        except BaseException:
            upload.abort()
            raise
        # Complete: the commit record may name it now; it goes only once the save is surely off.
        self.op.disown(leftover)
        self.op.own(leftover, pending=True)

    def rename(self, path: Any, new_path: Any) -> None:
        """(DCP's `.metadata.tmp` -> `.metadata`.) A copy in the store, then the old name goes."""
        src, dst = Location.parse(str(path)), Location.parse(str(new_path))
        self.op.own(generations.Leftover(self.store, dst), pending=True)
        self.store.copy(self.op, src, dst)
        self.entries[self.name(new_path)] = self.entries.pop(self.name(path))
        self.store.delete(self.op, [src])

    def exists(self, path: Any) -> bool:
        return self.store.exists(self.op, Location.parse(str(path)))

    def rm_file(self, path: Any) -> None:
        self.store.delete(self.op, [Location.parse(str(path))])

    def ls(self, path: Any) -> list[str]:
        loc = Location.parse(str(path))
        return [f"{loc.url}/{n}" for n in self.store.list(self.op, loc)]


class _Writer(dcp.StagedWriter, FsspecWriter):
    """DCP's fsspec writer on a `StoreFileSystem` (no fsync: an object exists once complete)."""

    def __init__(self, op: Operation, store: Store, root: Location):
        # FsspecWriter's own __init__ would make a second client through fsspec's registry.
        FileSystemWriter.__init__(self, root.url, single_file_per_rank=True, sync_files=False, thread_count=1)
        self.fs = StoreFileSystem(store, op, root)
        self.path, self.op, self.files = root.url, op, []


class _Reader(dcp.StagedReader, FsspecReader):
    """DCP's fsspec reader on a `StoreFileSystem`; in one pass given the commit record's `entries`."""

    def __init__(self, op: Operation, store: Store, root: Location, sizes: dict[str, int],
                 entries: dict[str, dict] | None = None, verify: bool = True):
        FileSystemReader.__init__(self, root.url)
        self.fs = StoreFileSystem(store, op, root, sizes)
        self.path, self.op, self.entries, self.verify = root.url, op, entries, verify
        self.root = root

    def open_raw(self, name: str) -> ObjectFile:
        return bucket.open_object(self.op, self.fs.store, self.root, name, self.entries[name])  # its size checked


def reader_for(op: Operation, loc: Location, record: dict, *, one_pass_verify: bool | None = None) -> _Reader:
    """A DCP storage reader of the files the commit record `record` at `loc` names; in one pass
    (`one_pass.py`, checking each item unless `one_pass_verify` is False) unless it is None."""
    folder = record["folder"]
    entries = {n[len(folder) + 1:]: e for n, e in record["objects"].items()}
    sizes = {n: e["nbytes"] for n, e in entries.items()}
    return _Reader(op, store_for(loc), loc.child(folder), sizes, None if one_pass_verify is None else entries,
                   bool(one_pass_verify))


class BucketDcp(dcp.DcpStore):
    """A DCP checkpoint at a URL: generation `g`'s files under `U/<g>.<host>.<pid>.<token>.dcp/`,
    committed by the create-only record `U/xlakit-commit.<g>.json` naming every file."""

    def __init__(self, url: str):
        self.loc = Location.parse(url)  # a bad URL is refused before any work
        self.identity = self.name = self.loc.url
        self.chosen: dict = {}
        self.record: dict | None = None

    @property
    def store(self) -> Store:
        return store_for(self.loc)

    def propose(self, op: Operation) -> dict:
        op.enter("list")
        token = secrets.token_hex(4)
        generation = generations.next_generation(generations.scan(self.store, op, self.loc))
        return {"generation": generation, "operation": generations.operation_id(token),
                "folder": generations.data_name(generation, generations.operation_id(token), SUFFIX)}

    def adopt(self, proposal: dict) -> None:
        self.chosen = proposal

    def tidy(self, op: Operation) -> None:
        op.enter("tidy")
        generations.tidy(self.store, op, self.loc)

    def write(self, op: Operation, state: dict, device: list, opts: SaveOptions, group: Any) -> dict[str, dict]:
        writer = _Writer(op, self.store, self.loc.child(self.chosen["folder"]))
        dcp.write_folder(op, state, device, None, opts, group, writer=writer)
        entries = {}
        for name, entry in writer.fs.entries.items():
            hashed = writer.fs.segments.get(name)  # not `.metadata`: renamed, and holds no items
            items = hashed.items(writer.ranges[name]) if hashed and name in writer.ranges else None
            entries[f"{self.chosen['folder']}/{name}"] = {**entry, one_pass.ITEMS: items} if items else entry
        return entries

    def commit(self, op: Operation, entries: dict[str, dict]) -> None:
        op.enter("commit")
        store, loc = self.store, self.loc
        _check_present(op, store, loc, loc.child(self.chosen["folder"]), entries)
        self.record = {"kind": KIND, "generation": self.chosen["generation"], "operation": self.chosen["operation"],
                       "folder": self.chosen["folder"], "objects": entries}
        bucket.commit_record(op, store, loc, self.record, [generations.Leftover(store, loc.child(n)) for n in entries])

    def after_commit(self, op: Operation) -> None:
        bucket.tidy_after(op, self.store, self.loc, self.record)

    def pin(self, op: Operation) -> dict:
        op.enter("list")
        return {"generation": generations.latest_record(self.store, op, self.loc, KIND)["generation"]}

    def files(self, op: Operation, pinned: dict) -> dict[str, dict]:
        self.record = generations.read_record(self.store, op, self.loc, pinned["generation"])
        if self.record.get("kind") != KIND:
            raise generations.kind_error(self.loc, self.record, KIND)
        return self.record["objects"]

    def verify(self, op: Operation, name: str, entry: dict) -> None:
        bucket.verify_object(op, self.store, self.loc, name, entry)

    def reader(self, op: Operation, entries: dict[str, dict] | None, verify: bool) -> _Reader:
        return reader_for(op, self.loc, self.record, one_pass_verify=None if entries is None else verify)


def _check_present(op: Operation, store: Store, loc: Location, root: Location, entries: dict[str, dict]) -> None:
    """Every file the ranks voted for is in the bucket with its size (a rank pointed at another
    endpoint or bucket would otherwise commit a checkpoint that cannot be read)."""
    found = {f"{root.key[len(loc.key) + 1:]}/{n}": size for n, size in store.list(op, root).items()}
    wrong = sorted(n for n, e in entries.items() if found.get(n) != e["nbytes"])
    if wrong:
        raise CheckpointIncompleteError(f"{loc}: {', '.join(wrong[:5])} reported written by the rank that "
                                        f"wrote it but not found in {root} with its size; every rank must "
                                        f"write to the same bucket and endpoint")
