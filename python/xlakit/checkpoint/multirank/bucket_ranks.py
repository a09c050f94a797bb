"""Replicated and sharded saves to object storage, and their loads: the agreement of `ranks.py`
with the commit of `generations.py`.

The object-storage sibling of `ranks.py`; a coordinated `save` / `load` hands a URL here.

A sharded checkpoint at URL `U` is one generation of the prefix, like a file:
each rank uploads its shard as the data object
`U/<generation>.<host>.<pid>.<token>.shard-RRRRR-of-WWWWW.pt` (its own host
and pid, the token of the save: a name no other save uses), and rank 0
creates `U/xlakit-commit.<generation>.json` naming every shard. A replicated
checkpoint is a file checkpoint whose one data object the writer rank uploads.

The ranks run the agreement of a coordinated save (`agreement.Coordination`):

1. *agree*: the committing rank (0, or the writer) lists the prefix and
   proposes the generation and the save's token; every rank must propose the
   same URL, layout and options, or nothing is touched;
2. *write*: each rank uploads its part (streamed, bounded, hashed as sent)
   and votes ready with its object's name, size and xxh3-64;
3. *commit*: the committing rank creates the commit record, create-only,
   inside the agreed commit point: only once every rank voted, never after
   any rank gave up. One abort (an error, a deadline, a rank that died) means
   no record anywhere; each rank's complete object is then removed once the
   abort is confirmed, or by the next save (its name says it can never be
   committed). A record that another save created first
   (`CheckpointConflictError`) makes the committing rank remove every rank's
   object.

Only after the commit, and only the committing rank, removes older
generations and what no commit can name any more. Loading inside the job is
agreed the same way: the committing rank names the generation, every rank
reads its part of that one, every rank succeeds or all raise.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from typing import Any

from xlakit.checkpoint.file import background, loading, pipeline
from xlakit.checkpoint.multirank import ranks
from xlakit.checkpoint.multirank.agreement import Coordination, dist, world_size
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.file import bucket_file
from xlakit.checkpoint.objstore.client import Location, store_for
from xlakit.errors import CheckpointError, CheckpointFormatError

SHARDED = "sharded"


def shard_suffix(rank: int, world: int) -> str:
    return f".shard-{rank:05d}-of-{world:05d}.pt"


class ObjectSave(ranks.CoordinatedSave):
    """One rank's part of a replicated or sharded save to a bucket: the phases of a coordinated
    save on disk (agree, stage, write, vote, commit), with a generation's objects and record."""

    def __init__(self, obj: Any, url: str, opts: SaveOptions):
        self.loc = Location.parse(url)
        self.store = store_for(self.loc)
        self.url = self.loc.url
        self.committer = opts.writer_rank if opts.layout == "replicated" else 0
        self.generation, self.token = 0, ""
        super().__init__(obj, self.url, opts)

    @staticmethod
    def identity(path: str) -> str:
        return path

    def _prepare(self, obj: Any) -> pipeline.FileSave | None:
        if self.opts.layout == "replicated" and self.rank != self.opts.writer_rank:
            return None
        return pipeline.prepare(obj, self.url, self.opts, check_target=False)

    @property
    def operation_id(self) -> str:
        """This rank's part of its object's name: its host and pid, the save's token."""
        return generations.operation_id(self.token)

    # -- phases ---------------------------------------------------------------------------------
    def agree(self, op: Operation) -> None:
        """Every rank the same save, and the generation the committing rank proposes."""
        prepared, error = {}, self.error
        if error is None and self.rank == self.committer:
            try:
                op.enter("list")
                found = generations.scan(self.store, op, self.loc)
                prepared = {"generation": generations.next_generation(found), "token": secrets.token_hex(4)}
            except (CheckpointError, OSError, ValueError) as e:
                error = e
        self.coord.agree(op, prepared, error)
        chosen = self.coord.proposals[self.committer]
        self.generation, self.token = chosen["generation"], chosen["token"]

    def _tidy(self, op: Operation) -> None:
        """(The committing rank, agreed.) What no commit can name any more goes (never this save's: a
        rank that uploaded, voted and died before this listing leaves a shard the commit names)."""
        if self.rank == self.committer:
            op.enter("tidy")
            generations.tidy(self.store, op, self.loc, keep_token=self.token)

    def _upload(self, op: Operation, items: Any, suffix: str) -> tuple[str, dict, generations.Leftover]:
        name = generations.data_name(self.generation, self.operation_id, suffix)
        meta, leftover = bucket_file.upload_archive(op, self.store, self.loc.child(name), self.job, items)
        # Complete: another rank's commit may name it now. It goes only once the save is surely off.
        op.disown(leftover)
        op.own(leftover, pending=True)
        return name, meta, leftover

    def _commit(self, op: Operation, record: dict, names: list[str]) -> None:
        owned = [generations.Leftover(self.store, self.loc.child(n)) for n in names]
        bucket_file.commit(op, self.store, self.loc, record, owned)
        self.coord.finish({"ok": True})
        bucket_file.tidy_after(op, self.store, self.loc, record)

    def _write_replicated(self, op: Operation, items: Any) -> None:
        self._tidy(op)
        self.coord.vote({})
        if self.rank != self.committer:
            self.coord.expect_commit(op, self.url)
            return
        name, meta, _ = self._upload(op, items, bucket_file.SUFFIX)
        self.coord.votes(op)  # every rank still wants it
        record = {"kind": bucket_file.KIND, "generation": self.generation, "operation": self.operation_id,
                  "objects": {name: meta}}
        self._commit(op, record, [name])

    def _write_sharded(self, op: Operation, items: Any) -> None:
        self._write_parts(op, items, shard_suffix(self.rank, self.world), {"kind": SHARDED}, "shards")

    def _write_parts(self, op: Operation, items: Any, suffix: str, fields: dict, listed_as: str) -> None:
        """Every rank uploads its part and votes its object; the committer commits one record naming them
        all (under `listed_as`, in rank order) with `fields` added: a sharded save, a replica-parallel one."""
        self._tidy(op)
        name, meta, _ = self._upload(op, items, suffix)
        self.coord.vote({"name": name, **meta})
        if self.rank != self.committer:
            self.coord.expect_commit(op, self.url)
            return
        votes = self.coord.votes(op)
        names = [votes[r]["name"] for r in range(self.world)]
        record = {**fields, "generation": self.generation, "operation": self.operation_id, "world": self.world,
                  listed_as: names,
                  "objects": {votes[r]["name"]: {"nbytes": votes[r]["nbytes"], "xxh3_64": votes[r]["xxh3_64"],
                                                 "rank": r} for r in range(self.world)}}
        self._commit(op, record, names)


def save(obj: Any, url: str, opts: SaveOptions) -> background.SaveHandle | None:
    """`xlakit.save("gs://...", layout="replicated"|"sharded")` on every rank of the job."""
    return ranks.save(obj, url, opts, saver=ObjectSave)


# -- loading ----------------------------------------------------------------------------------

def shard_entry(loc: Location, record: dict, shard: int) -> tuple[str, dict]:
    """The object name and record entry of shard `shard` of a sharded commit record."""
    world = record["world"]
    if not 0 <= shard < world:
        raise ValueError(f"{loc} has shards 0..{world - 1}, not {shard}")
    name = record["shards"][shard]
    return name, record["objects"][name]


def part_of(loc: Location, record: dict, shard: int | None) -> tuple[str, dict]:
    """The data object one reader reads: the file, or shard `shard` of a sharded checkpoint."""
    if record.get("kind") == SHARDED:
        if shard is None:
            raise CheckpointFormatError(f"{loc} is a sharded checkpoint: inside the job that wrote it each "
                                        f"rank loads its own shard; elsewhere pass shard=N to read one")
        return shard_entry(loc, record, shard)
    if record.get("kind") != bucket_file.KIND:
        raise generations.kind_error(loc, record, bucket_file.KIND)
    if shard is not None:
        raise ValueError(f"shard={shard} reads one shard of a sharded checkpoint; {loc} is a file checkpoint")
    (name, entry), = record["objects"].items()
    return name, entry


def load(url: str, opts: LoadOptions) -> Any:
    """`xlakit.load("gs://...")`: one shard, the file, or (inside a job) every rank its part, agreed."""
    if opts.mmap:
        raise ValueError(f"mmap=True maps a local file; {url} is on object storage (load it without mmap)")
    try:
        return _load(url, opts)
    except CheckpointFormatError as e:
        if opts.verify or getattr(e, "plain_object", None) is None or opts.shard is not None:
            raise
    return bucket_file.load_plain(Location.parse(url), opts)  # another tool's file, read as torch.load would


def _load(url: str, opts: LoadOptions) -> Any:
    loc = Location.parse(url)
    record = None
    if opts.shard is None and opts.layout != "replicated" and world_size() > 1:
        record = bucket_file.peek(loc, opts)  # a sharded checkpoint is loaded by every rank, agreed
    if opts.shard is None and (opts.layout == "replicated" or (record or {}).get("kind") == SHARDED):
        return _load_agreed(loc, opts)
    return bucket_file.load_file(loc, opts, lambda r: part_of(loc, r, opts.shard), record)


def restore(url: str, template: Any, opts: LoadOptions) -> Any:
    """`xlakit.restore("gs://...", template)`: the file, or one shard (this rank's inside the job),
    streamed into the template; a DCP checkpoint through `dcp_load`."""
    loc = Location.parse(url)
    record = bucket_file.peek(loc, opts)
    if record.get("kind") == "dcp":
        from xlakit.checkpoint.torch_dcp import bucket_dcp

        bucket_dcp.load(template, loc.url, dataclasses.replace(opts, shard=None, layout="auto"))
        return template
    shard = opts.shard
    if shard is None and record.get("kind") == SHARDED and world_size() > 1:
        shard = dist().get_rank()
    return bucket_file.restore(loc, template, opts, lambda r: part_of(loc, r, shard), record)


def _load_agreed(loc: Location, opts: LoadOptions) -> Any:
    """Every rank loads its part of the generation the first rank names, or every rank raises."""
    def mine(record: dict, coord: Coordination) -> tuple[str, dict]:
        sharded = record.get("kind") == SHARDED
        if sharded:
            ranks.check_world(loc, record["world"], coord.world)
        return part_of(loc, record, coord.rank if sharded else None)

    return agreed_load(loc, opts, opts.layout, mine)


def agreed_load(loc: Location, opts: LoadOptions, layout: str | None,
                mine: Callable[[dict, Coordination], tuple[str, dict]], *, kind: str | None = None,
                then: Callable[[Coordination, Operation, Any], Any] | None = None) -> Any:
    """An agreed load from a bucket: rank 0 names the newest committed generation (of `kind`), every
    rank reads and verifies its own object of it (`mine(record, coord)`: its name and entry, or a
    dict of several by key), all or none; `then(coord, op, value)` runs on every rank after (a
    broadcast), under the same deadline."""
    store = store_for(loc)
    coord = Coordination("load", {"path": loc.url, "layout": layout})
    op = Operation("load", loc.url, Watch.of(opts), gate=coord.gate, rank=coord.rank,
                   untouched=loading.NOTHING_CHANGED)
    coord.op = op

    def work(op: Operation) -> Any:
        prepared, error = {}, None
        if coord.rank == 0:
            try:
                op.enter("list")
                prepared["generation"] = generations.latest_record(store, op, loc, kind)["generation"]
            except (CheckpointError, OSError, ValueError) as e:
                error = e
        coord.agree(op, prepared, error)

        def part() -> Any:
            record = generations.read_record(store, op, loc, coord.proposals[0]["generation"])
            named = mine(record, coord)
            if isinstance(named, dict):  # several objects, by key (the shares a rank reads)
                return {k: bucket_file.read_object(op, store, loc, n, e, opts) for k, (n, e) in named.items()}
            name, entry = named
            return bucket_file.read_object(op, store, loc, name, entry, opts)

        value = coord.all_or_none(op, part)
        return value if then is None else then(coord, op, value)

    try:
        return op.run(work)
    finally:
        coord.close()  # a group `then` made for the one operation


def verify(url: str, opts: LoadOptions) -> tuple[str, int]:
    """Every object of the newest committed checkpoint at `url` read whole and verified; its kind and
    the bytes checked (`xlakit ckpt verify`)."""
    from xlakit.checkpoint.torch_dcp import bucket_dcp

    loc = Location.parse(url)
    record = bucket_file.peek(loc, opts)
    kind = record.get("kind")
    if kind != "dcp":  # a file's or shard's records as `xlakit.load` reads them (a damage names its tensor)
        for shard in range(record["world"]) if kind == SHARDED else [None]:
            bucket_file.load_file(loc, opts, lambda r, s=shard: part_of(loc, r, s), record)
    # Then every object whole against the size and xxh3-64 its commit record names: an edited record,
    # or an object replaced by another whose records still verify, is found only here (a load checks
    # each record's checksum, never the whole object's hash: that would be a second pass over it).
    bucket_dcp.verify(loc, record, opts)
    return kind, sum(e["nbytes"] for e in record["objects"].values())
