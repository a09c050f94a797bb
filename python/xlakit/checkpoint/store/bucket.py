"""A checkpoint on object storage: a generation's data objects, committed by a create-only record.

An object store has no rename, so `generations.py`'s protocol stands where the local file system
renames: the committing rank lists the prefix and proposes the next generation and a token; each
rank uploads its part (`Upload`: streamed, bounded, hashed as sent) as the data object
`U/<generation>.<host>.<pid>.<token><suffix>`, a name no other save uses (`.pt` for a file,
`.shard-RRRRR-of-WWWWW.pt`, `.share-...`), and votes its name, size and xxh3-64; the committing
rank then creates `U/xlakit-commit.<generation>.json` naming every part, create-only, at the
operation's commit point. Before the upload (the committing rank, agreed), what no commit can
name any more goes; after the commit, the generations older than the previous one.

A part another rank's commit may name is kept until the save is surely off (`Operation.own`,
pending); a commit record another save created first (`CheckpointConflictError`) makes the
committing rank remove every rank's part, as none of them can ever be committed.

The read side: `open_object` (a part of a commit record, its size checked first, as a file for
the local readers) and `verify_object` (a part read whole against its entry).
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING

import xxhash

from xlakit.checkpoint.format import folders
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, Store, store_for
from xlakit.checkpoint.objstore.reader import CHUNK_BYTES, PARALLEL, ObjectFile, gone_error
from xlakit.checkpoint.objstore.upload import Upload
from xlakit.checkpoint.store.base import FILE, Destination, Parts
from xlakit.errors import CheckpointConflictError, CheckpointCorruptError

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation

log = logging.getLogger("xlakit")
FILE_KIND = "file"  # the kind of a commit record naming one file
_VERIFY_BYTES = 4 * CHUNK_BYTES


class ObjectPart:
    """A part streamed into its data object; the operation owns the object until a commit names it."""

    def __init__(self, op: "Operation", store: Store, loc: Location, name: str, *, shared: bool):
        self.op, self.name, self.shared = op, name, shared
        self.leftover = op.own(generations.Leftover(store, loc))
        self.upload = Upload(store, op, loc)
        op.enter("write")

    def write(self, data) -> int:
        return self.upload.write(data)

    def finish(self) -> dict:
        self.op.enter("upload")
        meta = self.upload.finish()
        if self.shared:  # complete: another rank's commit may name it now; it goes only once the save is off
            self.op.disown(self.leftover)
            self.op.own(self.leftover, pending=True)
        return {"name": self.name, **meta}

    def abort(self) -> None:
        self.upload.abort()


class Bucket(Destination):
    """A checkpoint URL: every layout, alone or on every rank of a job."""

    def __init__(self, url: str, parts: Parts = FILE):
        self.loc = Location.parse(url)  # a bad URL is refused before any work
        self.identity = self.loc.url
        self.parts = parts
        self.generation, self.token = 0, ""
        self.record: dict | None = None
        self._part: ObjectPart | None = None

    @property
    def store(self) -> Store:
        """The client (made on first use: in the operation, under its deadline)."""
        return store_for(self.loc)

    @property
    def operation_id(self) -> str:
        """This rank's part of its objects' names: its host and pid, the save's token."""
        return generations.operation_id(self.token)

    def propose(self, op: "Operation") -> dict:
        op.enter("list")
        found = generations.scan(self.store, op, self.loc)
        return {"generation": generations.next_generation(found), "token": secrets.token_hex(4)}

    def adopt(self, proposal: dict) -> None:
        self.generation, self.token = proposal["generation"], proposal["token"]

    def tidy(self, op: "Operation", committer: bool) -> None:
        """(The committing rank, agreed.) What no commit can name any more goes (never this save's: a
        rank that uploaded, voted and died before this listing leaves a part the commit names)."""
        if committer:
            op.enter("tidy")
            generations.tidy(self.store, op, self.loc, keep_token=self.token)

    def open_part(self, op: "Operation", rank: int, world: int) -> ObjectPart:
        suffix = f".{self.parts.name}-{rank:05d}-of-{world:05d}.pt" if self.parts.name else ".pt"
        name = generations.data_name(self.generation, self.operation_id, suffix)
        self._part = ObjectPart(op, self.store, self.loc.child(name), name, shared=world > 1)
        return self._part

    def commit(self, op: "Operation", votes: dict[int, dict]) -> None:
        """Create the commit record; on a conflict remove every rank's part (none of them can ever be
        committed), and raise."""
        parts = self.parts
        head = {"generation": self.generation, "operation": self.operation_id}
        if not parts.name:
            (entry,) = votes.values()
            self.record = {"kind": FILE_KIND, **head, "objects": {entry["name"]: _meta(entry)}}
        else:
            world = len(votes)
            writer = {} if parts.writer_rank is None else {"writer_rank": parts.writer_rank}
            self.record = {**parts.object_record, **head, "world": world, **writer,
                           parts.listed_as: [votes[r]["name"] for r in range(world)],
                           "objects": {votes[r]["name"]: {**_meta(votes[r]), "rank": r} for r in range(world)}}
        owned = [generations.Leftover(self.store, self.loc.child(n)) for n in self.record["objects"]]
        commit_record(op, self.store, self.loc, self.record, owned)
        if self._part is not None:
            op.disown(self._part.leftover)

    def after_commit(self, op: "Operation") -> None:
        tidy_after(op, self.store, self.loc, self.record)


def _meta(entry: dict) -> dict:
    return {"nbytes": entry["nbytes"], "xxh3_64": entry["xxh3_64"]}


def commit_record(op: "Operation", store: Store, loc: Location, record: dict,
                  owned: list[generations.Leftover]) -> None:
    """Create the commit record `record` of `loc`; on a conflict remove the objects `owned` (every
    rank's, when several uploaded them), and raise."""
    try:
        generations.commit(store, op, loc, record)
    except CheckpointConflictError:
        # Past the commit point the operation keeps its objects: this save removes them, and waits.
        try:
            store.delete(op, [o.loc for o in owned])
        except (OSError, ValueError) as e:
            log.warning("xlakit: could not remove the objects of the save that lost to another (%s); the "
                        "next save removes them", e)
        raise


def tidy_after(op: "Operation", store: Store, loc: Location, record: dict) -> None:
    """After `record` committed: generations older than the previous one go (records first)."""
    op.enter("tidy")
    generations.tidy(store, op, loc, keep_from=record["generation"] - 1)


def destination(url: str, parts: Parts = FILE) -> Bucket:
    """Where a checkpoint of `parts` at `url` is written."""
    return Bucket(url, parts)


# -- reading ------------------------------------------------------------------------------------

def replaced_error(loc: Location, name: str) -> CheckpointCorruptError:
    return gone_error(loc.url, name)


def open_object(op: "Operation", store: Store, loc: Location, name: str, entry: dict) -> ObjectFile:
    """The data object `name` of a commit record at `loc`, its size checked against the record."""
    obj = loc.child(name)
    try:
        size = store.size(op, obj)
    except FileNotFoundError as e:
        raise replaced_error(loc, name) from e
    if size != entry["nbytes"]:
        raise CheckpointCorruptError(f"{obj} holds {size} bytes, its commit record says {entry['nbytes']}: "
                                     f"the object was replaced or damaged after the save committed")
    return ObjectFile(store, op, obj, size)


def verify_object(op: "Operation", store: Store, loc: Location, name: str, expected: dict,
                  items: "folders.ItemHashes | folders.ListedItems | None" = None) -> None:
    """Read the object `name` whole and check its size and xxh3-64 against its commit record entry (and
    `items`, else the item hashes the entry lists, in the same read)."""
    op.enter("verify", name)
    obj = loc.child(name)
    try:
        size = store.size(op, obj)
    except FileNotFoundError as e:
        raise replaced_error(loc, name) from e
    h, n = xxhash.xxh3_64(), 0
    if items is None and folders.ITEMS in expected:
        items = folders.ItemHashes(loc, name, expected[folders.ITEMS])
    buffer = memoryview(bytearray(max(min(size, _VERIFY_BYTES), 1)))
    while n < size:
        got = store.get_into(op, obj, n, buffer[:min(len(buffer), size - n)], chunk_bytes=CHUNK_BYTES,
                             parallel=PARALLEL)
        if got == 0:
            break  # shorter than it was a moment ago
        h.update(buffer[:got])
        if items is not None:
            items.update(n, buffer[:got])
        n += got
        op.advance(got)
    if n != expected["nbytes"] or h.hexdigest() != expected["xxh3_64"]:
        raise CheckpointCorruptError(f"{obj}: expected {expected['nbytes']} bytes with xxh3_64 "
                                     f"{expected['xxh3_64']}, found {n} bytes with {h.hexdigest()}; the object "
                                     f"or its commit record was changed or damaged after the save committed")
    if items is not None:
        items.check(n)
