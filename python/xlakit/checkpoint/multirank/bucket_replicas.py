"""Replica-parallel replicated saves to object storage, and their loads: the sibling of `replicas.py`.

A replica-parallel checkpoint at URL `U` is one generation, like a sharded one
(`bucket_ranks.py`): each rank uploads its share (`replica_plan.py`) as the data
object `U/<generation>.<host>.<pid>.<token>.share-RRRRR-of-WWWWW.pt` and votes
with its name, size and xxh3-64; the writing rank creates the commit record
(kind `replicated`, `layout_version` 2) naming every share, create-only, at the
agreed commit point. One abort means no record: the previous generation stays
the checkpoint. The save is `replicas.py`'s own, into `store/bucket.py`.

Loads: inside the job the ranks agree on the generation, each share is read
and verified once (`replicas.readers`: any world size) and its reader broadcasts
it (`replicas.broadcast_share`); outside it every share is read here. Every other kind of
checkpoint at a URL goes on to `bucket_ranks.load` as before.
"""

from __future__ import annotations

from typing import Any

from xlakit.checkpoint.coordination.agreement import Coordination, world_size
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.file import bucket_file
from xlakit.checkpoint.multirank import bucket_ranks, replicas
from xlakit.checkpoint.objstore.client import Location
from xlakit.checkpoint.store import bucket
from xlakit.errors import CheckpointFormatError

KIND = "replicated"


def save(obj: Any, url: str, opts: SaveOptions):
    """The replica-parallel save of `replicas.py` into a bucket (`store/bucket.py`)."""
    return replicas.save(obj, url, opts, store=bucket.destination)


def _share(record: dict, rank: int) -> tuple[str, dict]:
    name = record["shares"][rank]
    return name, record["objects"][name]


def _peek(loc: Location, opts: LoadOptions) -> dict | None:
    """The newest commit record at `loc`, or None where a plain object (another tool's file) stands
    there: `bucket_ranks` says so, or reads it with verify=False."""
    try:
        return bucket_file.peek(loc, opts)
    except CheckpointFormatError as e:
        if getattr(e, "plain_object", None) is None:
            raise
        return None


def load(url: str, opts: LoadOptions) -> Any:
    """`xlakit.load("gs://...")`: a replica-parallel checkpoint whole; any other kind as before."""
    loc = Location.parse(url)
    if opts.shard is not None or opts.mmap:
        return bucket_ranks.load(url, opts)
    record = _peek(loc, opts)
    if record is None:
        return bucket_ranks.load(url, opts)  # a plain object: named as one, or read with verify=False
    if record.get("kind") != KIND:
        if world_size() > 1 or opts.layout == "replicated":
            return bucket_ranks.load(url, opts)
        return bucket_file.load_file(loc, opts, lambda r: bucket_ranks.part_of(loc, r, None), record)
    if world_size() > 1:
        return _load_agreed(loc, opts)
    return load_all(loc, record, opts)


def load_all(loc: Location, record: dict, opts: LoadOptions) -> Any:
    """Outside the job: every share of the commit `record` at `loc`, read and verified here, as the
    whole state."""
    shares = {r: bucket_file.load_file(loc, opts, lambda rec, r=r: _share(rec, r), record)
              for r in range(record["world"])}
    return replicas.assemble(shares)


def verify(url: str, opts: LoadOptions) -> tuple[str, int]:
    """`xlakit ckpt verify` of the newest checkpoint at `url`: a replica-parallel one's every share read
    and its records verified, then every share whole against the size and xxh3-64 its commit record
    names; any other kind as `bucket_ranks.verify`. Its kind and the bytes checked."""
    loc = Location.parse(url)
    record = bucket_file.peek(loc, opts)
    if record.get("kind") != KIND:
        return bucket_ranks.verify(url, opts)
    load_all(loc, record, opts)
    bucket_file.verify(loc, record, opts)
    return KIND, sum(e["nbytes"] for e in record["objects"].values())


def restore(url: str, template: Any, opts: LoadOptions) -> Any:
    """`xlakit.restore("gs://...", template)`: a replica-parallel checkpoint loaded whole, then copied
    into the template; any other kind as before."""
    record = _peek(Location.parse(url), opts) if opts.shard is None else None
    if record is None or record.get("kind") != KIND:
        return bucket_ranks.restore(url, template, opts)
    return replicas.restore(url, template, opts, load_whole=load)


def _load_agreed(loc: Location, opts: LoadOptions) -> Any:
    """Rank 0 names the generation; each share of it is read once (`replicas.readers`: by rank
    s % world, whatever the saving job's world size); the readers broadcast them."""
    of: list = []

    def mine(record: dict, coord: Coordination) -> dict[int, tuple[str, dict]]:
        of[:] = [record["generation"], record["world"]]
        return {s: _share(record, s) for s, reader in replicas.readers(record["world"], coord.world).items()
                if reader == coord.rank}

    return bucket_ranks.agreed_load(loc, opts, replicas.PROPOSED_LAYOUT, mine, kind=KIND,
                                    then=lambda coord, op, parts: replicas.broadcast_all(coord, op, of, parts))
