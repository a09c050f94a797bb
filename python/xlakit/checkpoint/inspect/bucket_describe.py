"""What a URL on object storage holds, and its state, for `xlakit ckpt`: the bucket side of
`describe.kind_of` and `tensors.read_state`.

The object-storage sibling of `describe.py` (and of `tensors.read_state`); `xlakit ckpt` hands a URL here.
It stays a sibling: a path is told apart by its files (a zip's magic, a folder's commit record,
a step record) and read through memory maps, a URL by its newest commit record's kind and read
through the loads of its layout.

A URL is one of:

* a checkpoint: its newest commit record says which kind (`file`, `sharded`, `replicated`
  (replica-parallel), `dcp`);
* a manager's step (`M/<step>`): its step record, and its checkpoint's URL inside
  (`M/<step>/ckpt.pt` or `M/<step>/ckpt`);
* a manager URL: it holds steps, interrupted steps, steps being deleted, or the lease.

Nothing here writes. Every state is verified before it is returned: a file's and
each shard's records as `xlakit.load` reads them, a DCP checkpoint's files against
its commit record; a DCP checkpoint's non-tensor values are read weights-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xlakit import _knobs
from xlakit.checkpoint.file import loading
from xlakit.checkpoint.stepstore import step_folders, steps
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.file import bucket_file
from xlakit.checkpoint.multirank import bucket_ranks, bucket_replicas
from xlakit.checkpoint.torch_dcp import bucket_dcp
from xlakit.checkpoint.objstore.client import Location, store_for
from xlakit.checkpoint.objstore.lease import is_lease
from xlakit.checkpoint.stepstore.bucket_steps import DELETING
from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, CheckpointIncompleteError

FILE, SHARDED, DCP, MANAGER = bucket_file.KIND, bucket_ranks.SHARDED, bucket_dcp.KIND, "manager"
REPLICATED = bucket_replicas.KIND


@dataclass(frozen=True)
class UrlKind:
    """`kind`: FILE, SHARDED, REPLICATED, DCP or MANAGER. `url`: the checkpoint's URL (a step's checkpoint when
    the URL named a step); `record` its newest commit record (empty for a manager); `step` the step
    record, for a step."""

    kind: str
    url: str
    record: dict = field(default_factory=dict)
    step: dict | None = None

    @property
    def loc(self) -> Location:
        return Location.parse(self.url)


def kind_of(url: str, opts: LoadOptions | None = None) -> UrlKind:
    """What `url` holds; a URL that holds none of the above is refused, saying what is there. Its
    few requests are bounded by XLAKIT_OBJECT_REQUEST_TIMEOUT_S unless `opts` says otherwise (an
    endpoint that cannot be reached is said within that, not the hour of a load's deadline)."""
    opts = opts or LoadOptions(timeout_s=_knobs.get_float(_knobs.OBJECT_REQUEST_TIMEOUT_S))
    loc = Location.parse(url)
    try:
        record = bucket_file.peek(loc, opts)
        return UrlKind(record.get("kind"), loc.url, record)
    except (FileNotFoundError, CheckpointIncompleteError) as no_checkpoint:
        not_a_checkpoint = no_checkpoint
    step = _step_record(loc, opts)
    if step is not None:
        inside = loc.child(step["checkpoint"])
        try:
            record = bucket_file.peek(inside, opts)
            return UrlKind(record.get("kind"), inside.url, record, step)
        except (FileNotFoundError, CheckpointIncompleteError) as e:
            raise CheckpointIncompleteError(f"{loc} is step {step['step']} of a manager, but its checkpoint "
                                            f"{inside} never committed (an interrupted save): {e}") from e
    if _is_manager(loc):
        return UrlKind(MANAGER, loc.url)
    raise not_a_checkpoint


def _step_record(loc: Location, opts: LoadOptions) -> dict | None:
    """The step record of `loc` if it is a manager's step; a damaged one, or a step retention is
    deleting, is refused, naming why."""
    store = store_for(loc)
    op = Operation("load", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED)
    text, deleting = op.run(lambda op: store.get_many(op, [loc.child(steps.STEP_RECORD), loc.child(DELETING)]))
    if deleting is not None:
        raise CheckpointIncompleteError(f"{loc} is a step that a retention is deleting ({DELETING}); it is "
                                        f"no longer a step, and the manager's next run removes it")
    if text is None:
        return None
    try:
        return steps.check_record(text, loc.key.rsplit("/", 1)[-1])
    except ValueError as e:
        raise CheckpointCorruptError(f"{loc} is not a step: its {steps.STEP_RECORD} is damaged ({e})") from e


def _is_manager(loc: Location) -> bool:
    found = step_folders.folder_at(loc.url).scan()
    if found.committed or found.pending or found.damaged or found.trash:
        return True
    store = store_for(loc)
    return any(is_lease(name) for name in store.list(None, loc, starting="xlakit-lease."))


def refuse_manager(url: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{url} is a manager URL, not one checkpoint; name one of its steps "
                                 f"({url}/<step>; `xlakit ckpt ls {url}` lists them)")


def read_state(url: str) -> tuple[Any, UrlKind]:
    """The state the checkpoint (or step) at `url` holds, verified; a sharded one as
    `{"shard0": ..., "shard1": ...}`, a replica-parallel one whole, a DCP one flat by name (as
    `tensors.read_state` on disk)."""
    found = kind_of(url)
    if found.kind == MANAGER:
        raise refuse_manager(found.url)
    loc, record, opts = found.loc, found.record, LoadOptions()
    if found.kind == FILE:
        return bucket_file.load_file(loc, opts, lambda r: bucket_ranks.part_of(loc, r, None), record), found
    if found.kind == SHARDED:
        return {f"shard{rank}": read_shard(loc, record, rank) for rank in range(record["world"])}, found
    if found.kind == REPLICATED:
        return bucket_replicas.load_all(loc, record, opts), found
    if found.kind == DCP:
        from xlakit.checkpoint.inspect import tensors

        bucket_file.verify(loc, record, opts)
        op = Operation("load", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED)
        read = lambda op: tensors.read_dcp(bucket_dcp.reader_for(op, loc, record), loc.url)  # noqa: E731
        return op.run(read), found
    raise generations.kind_error(loc, record, FILE)


def read_shard(loc: Location, record: dict, rank: int) -> Any:
    """Shard `rank` of the sharded checkpoint `record` at `loc`, every record verified."""
    return bucket_file.load_file(loc, LoadOptions(), lambda r: bucket_ranks.part_of(loc, r, rank), record)


def dcp_metadata(loc: Location, record: dict) -> Any:
    """The DCP metadata (`.metadata`) of the checkpoint `record` at `loc`."""
    op = Operation("load", loc.url, Watch.of(LoadOptions()), untouched=loading.NOTHING_CHANGED)
    return op.run(lambda op: bucket_dcp.reader_for(op, loc, record).read_metadata())


def check_target(url: str, force: bool) -> None:
    """Refuse to save a new file checkpoint at `url` (`xlakit ckpt convert`) unless the URL is
    empty, or, with `force`, holds a file checkpoint or saves of one that never committed: never
    over a manager, a step, a sharded or DCP checkpoint, or objects that are not xlakit's."""
    loc = Location.parse(url)
    if not store_for(loc).list(None, loc):
        return
    try:
        found = kind_of(url)
        what = ("a manager URL" if found.kind == MANAGER else "a manager's step" if found.step is not None
                else None if found.kind == FILE else f"a {found.kind} checkpoint")
    except CheckpointIncompleteError:
        what = None  # saves that never committed: a new save goes on from them
    except FileNotFoundError as e:
        what = f"objects that are not an xlakit checkpoint's ({e.strerror})"
    if what is not None:
        raise FileExistsError(17, f"{url} holds {what}; convert writes a file checkpoint to an empty URL, "
                                  f"or over a file checkpoint with --force", url)
    if not force:
        raise FileExistsError(17, f"{url} holds a file checkpoint; pass --force to save a new one over it "
                                  f"(the save commits a new generation)", url)

