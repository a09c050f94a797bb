"""`dcp_save` / `dcp_load` on object storage: DCP's fsspec storage into a generation's prefix.

The object-storage sibling of `dcp.py` / `dcp_ranks.py`; `dcp_save` and `dcp_load` hand a URL here.

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
with its size and xxh3-64.

With several ranks the agreement is `dcp_ranks.py`'s: rank 0 proposes the
generation, every rank writes its files (DCP's collectives on a fresh gloo
group) and votes with their sizes and hashes, and rank 0 checks that every
voted file is in the bucket with its size, then creates the record at the
agreed commit point: once every rank voted, never after one gave up. A load
reads the generation rank 0 names; each rank first verifies its share of the
files against the record (`verify`), then DCP reads and reshards.
"""

from __future__ import annotations

import contextlib
import io
import secrets
from collections.abc import Iterator
from typing import Any

import xxhash
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from xlakit.checkpoint.file import loading
from xlakit.checkpoint.format import dcp_metadata
from xlakit.checkpoint.torch_dcp import dcp, dcp_ranks
from xlakit.checkpoint.multirank.agreement import Coordination, world_size
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.core import workers
from xlakit.checkpoint.file import bucket_file
from xlakit.checkpoint.objstore.client import Location, Store, store_for
from xlakit.checkpoint.objstore.reader import CHUNK_BYTES, PARALLEL, ObjectFile
from xlakit.checkpoint.objstore.upload import Upload
from xlakit.errors import CheckpointCorruptError, CheckpointError, CheckpointIncompleteError

KIND = "dcp"
SUFFIX = ".dcp"
_READ_BUFFER = 1 << 20  # torch.load reads a record's header in small pieces
_VERIFY_BYTES = 4 * CHUNK_BYTES


class _Stream(io.RawIOBase):
    """What DCP writes a file into: an `Upload`; DCP's own `close()` does not end it."""

    def __init__(self, upload: Upload):
        super().__init__()
        self.upload, self.written = upload, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = self.upload.write(data)
        self.written += n
        return n

    def tell(self) -> int:
        return self.written

    def close(self) -> None:
        pass  # finished (or aborted) by the file system that opened it


class StoreFileSystem(FileSystem):
    """DCP's fsspec file system on xlakit's client, its streams bounded by `op`'s deadline.

    `entries` holds, for each file written, its name under `root` with its size and xxh3-64;
    `sizes` (reading) the sizes a commit record names, so a read needs no lookup first.
    """

    def __init__(self, store: Store, op: Operation, root: Location, sizes: dict[str, int] | None = None):
        super().__init__()
        self.fs, self.store, self.op, self.root = store.fs, store, op, root
        self.entries: dict[str, dict] = {}
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
            yield _Stream(upload)
            self.entries[self.name(path)] = upload.finish()
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
    """DCP's fsspec reader on a `StoreFileSystem`."""

    def __init__(self, op: Operation, store: Store, root: Location, sizes: dict[str, int]):
        FileSystemReader.__init__(self, root.url)
        self.fs = StoreFileSystem(store, op, root, sizes)
        self.path, self.op = root.url, op


class _SafeReader(dcp_metadata.SafeMetadata, _Reader):
    """`_Reader` whose metadata is read through `dcp_metadata`'s allowlist (`xlakit ckpt`)."""


def reader_for(op: Operation, loc: Location, record: dict, *, safe_metadata: bool = False) -> _Reader:
    """A DCP storage reader of the files the commit record `record` at `loc` names."""
    folder = record["folder"]
    sizes = {n[len(folder) + 1:]: e["nbytes"] for n, e in record["objects"].items()}
    return (_SafeReader if safe_metadata else _Reader)(op, store_for(loc), loc.child(folder), sizes)


def _agreed(op: Operation, coord: Coordination | None, prepare, error: BaseException | None) -> dict:
    """Rank 0's proposal, agreed by every rank (alone: prepared here)."""
    prepared = {}
    if error is None and (coord is None or coord.rank == 0):
        try:
            prepared = prepare()
        except (CheckpointError, OSError, ValueError) as e:
            error = e
    if coord is None:
        if error is not None:
            raise error
        return prepared
    coord.agree(op, prepared, error)
    return coord.proposals[0]


def _giving_up(coord: Coordination | None, op: Operation):
    return contextlib.nullcontext() if coord is None else coord.giving_up(op, waiting=dcp_ranks.waiting(op))


def save(state: dict, url: str, opts: SaveOptions) -> None:
    """`xlakit.dcp_save(state, "gs://...")`, alone or on every rank of the job."""
    loc = Location.parse(url)
    store = store_for(loc)
    device = dcp.device_tensors(state)
    coord = Coordination("dcp_save", {"path": loc.url, "layout": KIND}) if world_size() > 1 else None
    op = Operation("dcp save", loc.url, Watch.of(opts), gate=coord.gate if coord else None,
                   rank=coord.rank if coord else None,
                   bytes_total=sum(t.numel() * t.element_size() for t in device))
    if coord is not None:
        coord.op = op

    def propose() -> dict:
        op.enter("list")
        token = secrets.token_hex(4)
        generation = generations.next_generation(generations.scan(store, op, loc))
        return {"generation": generation, "operation": generations.operation_id(token),
                "folder": generations.data_name(generation, generations.operation_id(token), SUFFIX)}

    def work(op: Operation) -> None:
        error = None
        try:
            workers.check_idle(exclude=op)
        except CheckpointError as e:
            error = e
        chosen = _agreed(op, coord, propose, error)
        rank = coord.rank if coord else 0
        root = loc.child(chosen["folder"])
        with _giving_up(coord, op):
            if rank == 0:
                op.enter("tidy")  # agreed: what no commit can name any more may go
                generations.tidy(store, op, loc)
            writer = _Writer(op, store, root)
            dcp.write_folder(op, state, device, None, opts, group=coord.group(op) if coord else None,
                             writer=writer)
            entries = {f"{chosen['folder']}/{n}": e for n, e in writer.fs.entries.items()}
            if coord is not None:
                coord.vote({"files": entries})
                if rank != 0:
                    coord.expect_commit(op, loc.url)
                    return
                entries = {n: e for v in coord.votes(op).values() for n, e in v["files"].items()}
            op.enter("commit")
            _check_present(op, store, loc, root, entries)
            record = {"kind": KIND, "generation": chosen["generation"], "operation": chosen["operation"],
                      "folder": chosen["folder"], "objects": entries}
            bucket_file.commit(op, store, loc, record, [generations.Leftover(store, loc.child(n)) for n in entries])
            if coord is not None:
                coord.finish({"ok": True})
            bucket_file.tidy_after(op, store, loc, record)

    try:
        op.run(work)
    finally:
        if coord is not None:
            coord.close()


def _check_present(op: Operation, store: Store, loc: Location, root: Location, entries: dict[str, dict]) -> None:
    """Every file the ranks voted for is in the bucket with its size (a rank pointed at another
    endpoint or bucket would otherwise commit a checkpoint that cannot be read)."""
    found = {f"{root.key[len(loc.key) + 1:]}/{n}": size for n, size in store.list(op, root).items()}
    wrong = sorted(n for n, e in entries.items() if found.get(n) != e["nbytes"])
    if wrong:
        raise CheckpointIncompleteError(f"{loc}: {', '.join(wrong[:5])} reported written by the rank that "
                                        f"wrote it but not found in {root} with its size; every rank must "
                                        f"write to the same bucket and endpoint")


def load(state: dict, url: str, opts: LoadOptions) -> None:
    """`xlakit.dcp_load(state, "gs://...")`: verified, then read (and resharded) in place."""
    loc = Location.parse(url)
    store = store_for(loc)
    coord = Coordination("dcp_load", {"path": loc.url, "layout": KIND}) if world_size() > 1 else None
    op = Operation("dcp load", loc.url, Watch.of(opts), gate=coord.gate if coord else None,
                   rank=coord.rank if coord else None, untouched=dcp.PARTLY_LOADED)
    if coord is not None:
        coord.op = op

    def propose() -> dict:
        op.enter("list")
        return {"generation": generations.latest_record(store, op, loc, KIND)["generation"]}

    def work(op: Operation) -> None:
        chosen = _agreed(op, coord, propose, None)
        rank, world = (coord.rank, coord.world) if coord else (0, 1)
        with _giving_up(coord, op):
            record = generations.read_record(store, op, loc, chosen["generation"])
            if record.get("kind") != KIND:
                raise generations.kind_error(loc, record, KIND)
            objects = record["objects"]
            op.bytes_total = sum(e["nbytes"] for e in objects.values())
            if opts.verify:  # each rank checks its share of the files
                for name in sorted(objects)[rank::world]:
                    verify_object(op, store, loc, name, objects[name])
            if coord is not None:
                coord.vote({}, "verified")
                coord.votes(op, "verified")
            dcp.read_folder(op, state, None, group=coord.group(op) if coord else None,
                            reader=reader_for(op, loc, record))
            if coord is not None:
                coord.vote({}, "read")
                coord.votes(op, "read")

    try:
        op.run(work)
    finally:
        if coord is not None:
            coord.close()


def verify(loc: Location, record: dict, opts: LoadOptions) -> None:
    """Every file of the DCP checkpoint `record` (a commit record at `loc`) read and checked."""
    store = store_for(loc)
    op = Operation("verify", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED,
                   bytes_total=sum(e["nbytes"] for e in record["objects"].values()))
    op.run(lambda op: [verify_object(op, store, loc, n, e) for n, e in sorted(record["objects"].items())])


def verify_object(op: Operation, store: Store, loc: Location, name: str, expected: dict) -> None:
    """Read the object `name` whole and check its size and xxh3-64 against its commit record entry."""
    op.enter("verify", name)
    obj = loc.child(name)
    try:
        size = store.size(op, obj)
    except FileNotFoundError as e:
        raise bucket_file.replaced_error(loc, name) from e
    h, n = xxhash.xxh3_64(), 0
    buffer = memoryview(bytearray(max(min(size, _VERIFY_BYTES), 1)))
    while n < size:
        got = store.get_into(op, obj, n, buffer[:min(len(buffer), size - n)], chunk_bytes=CHUNK_BYTES,
                             parallel=PARALLEL)
        if got == 0:
            break  # shorter than it was a moment ago
        h.update(buffer[:got])
        n += got
        op.advance(got)
    if n != expected["nbytes"] or h.hexdigest() != expected["xxh3_64"]:
        raise CheckpointCorruptError(f"{obj}: expected {expected['nbytes']} bytes with xxh3_64 "
                                     f"{expected['xxh3_64']}, found {n} bytes with {h.hexdigest()}; the object "
                                     f"or its commit record was changed or damaged after the save committed")
