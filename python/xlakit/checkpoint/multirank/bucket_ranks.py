"""Replicated and sharded saves to object storage, and their loads: the agreement of `ranks.py`
with the commit of `generations.py`.

The object-storage sibling of `ranks.py`; a coordinated `save` / `load` hands a URL here.

A sharded checkpoint at URL `U` is one generation of the prefix, like a file:
each rank uploads its shard as the data object
`U/<generation>.<host>.<pid>.<token>.shard-RRRRR-of-WWWWW.pt` (its own host
and pid, the token of the save: a name no other save uses), and rank 0
creates `U/xlakit-commit.<generation>.json` naming every shard. A replicated
checkpoint is a file checkpoint whose one data object the writer rank uploads.

The save is `ranks.py`'s, the same flow as on disk, into `store/bucket.py`
(agree on the generation and token the committing rank proposes, upload each
part, vote, commit the create-only record at the agreed commit point, tidy
after): this module only hands it the bucket.

The loads stay here, beside their local twins rather than one flow with them:
a bucket is read by generation (the committing rank names it, every rank reads
its part of that one, all succeed or all raise), a folder by its one commit
record; and an object another tool wrote at the URL is named as such, or read
with verify=False.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from xlakit.checkpoint.coordination.agreement import Coordination, dist, world_size
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.file import background, bucket_file, loading
from xlakit.checkpoint.multirank import ranks
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, store_for
from xlakit.checkpoint.store import bucket
from xlakit.errors import CheckpointError, CheckpointFormatError

SHARDED = ranks.SHARDS.object_record["kind"]


def save(obj: Any, url: str, opts: SaveOptions) -> background.SaveHandle | None:
    """`xlakit.save("gs://...", layout="replicated"|"sharded")` on every rank of the job: the
    coordinated save of `ranks.py` into a bucket (`store/bucket.py`)."""
    return ranks.save(obj, url, opts, store=bucket.destination)


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
        from xlakit.checkpoint.torch_dcp import bucket_dcp, dcp_ranks

        dcp_ranks.load(template, bucket_dcp.BucketDcp(loc.url), dataclasses.replace(opts, shard=None, layout="auto"))
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
    loc = Location.parse(url)
    record = bucket_file.peek(loc, opts)
    kind = record.get("kind")
    if kind != "dcp":  # a file's or shard's records as `xlakit.load` reads them (a damage names its tensor)
        for shard in range(record["world"]) if kind == SHARDED else [None]:
            bucket_file.load_file(loc, opts, lambda r, s=shard: part_of(loc, r, s), record)
    # Then every object whole against the size and xxh3-64 its commit record names: an edited record,
    # or an object replaced by another whose records still verify, is found only here (a load checks
    # each record's checksum, never the whole object's hash: that would be a second pass over it).
    bucket_file.verify(loc, record, opts)
    return kind, sum(e["nbytes"] for e in record["objects"].values())
