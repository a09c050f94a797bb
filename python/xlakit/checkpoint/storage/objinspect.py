"""What a URL on object storage holds, and its state, for `xlakit ckpt`: the bucket side of
`describe.kind_of` and `tensors.read_state`.

A URL is one of:

* a checkpoint: its newest commit record says which kind (`file`, `sharded`, `dcp`);
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

from xlakit.checkpoint import loading, steps
from xlakit.checkpoint.operation import Operation, Watch
from xlakit.checkpoint.options import LoadOptions
from xlakit.checkpoint.storage import generations, objdcp, objfile, objranks
from xlakit.checkpoint.storage.client import Location, store_for
from xlakit.checkpoint.storage.lease import is_lease
from xlakit.errors import CheckpointError, CheckpointFormatError, CheckpointIncompleteError

FILE, SHARDED, DCP, MANAGER = objfile.KIND, objranks.SHARDED, objdcp.KIND, "manager"


@dataclass(frozen=True)
class UrlKind:
    """`kind`: FILE, SHARDED, DCP or MANAGER. `url`: the checkpoint's URL (a step's checkpoint when
    the URL named a step); `record` its newest commit record; `step` the step record, for a step."""

    kind: str
    url: str
    record: dict | None = None
    step: dict | None = None

    @property
    def loc(self) -> Location:
        return Location.parse(self.url)


def kind_of(url: str, opts: LoadOptions | None = None) -> UrlKind:
    """What `url` holds; a URL that holds none of the above is refused, saying what is there."""
    opts = opts or LoadOptions()
    loc = Location.parse(url)
    try:
        record = objfile.peek(loc, opts)
        return UrlKind(record.get("kind"), loc.url, record)
    except (FileNotFoundError, CheckpointIncompleteError) as no_checkpoint:
        not_a_checkpoint = no_checkpoint
    step = _step_record(loc, opts)
    if step is not None:
        inside = loc.child(step["checkpoint"])
        try:
            record = objfile.peek(inside, opts)
            return UrlKind(record.get("kind"), inside.url, record, step)
        except (FileNotFoundError, CheckpointIncompleteError) as e:
            raise CheckpointIncompleteError(f"{loc} is step {step['step']} of a manager, but its checkpoint "
                                            f"{inside} never committed (an interrupted save): {e}") from e
    if _is_manager(loc):
        return UrlKind(MANAGER, loc.url)
    raise not_a_checkpoint


def _step_record(loc: Location, opts: LoadOptions) -> dict | None:
    """The step record of `loc` if it is a manager's step; a damaged one is refused, naming why."""
    store, where = store_for(loc), loc.child(steps.STEP_RECORD)
    op = Operation("load", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED)
    (text,) = op.run(lambda op: store.get_many(op, [where]))
    if text is None:
        return None
    try:
        return steps.check_record(text, loc.key.rsplit("/", 1)[-1])
    except ValueError as e:
        raise CheckpointFormatError(f"{loc} is not a step: its {steps.STEP_RECORD} is damaged ({e})") from e


def _is_manager(loc: Location) -> bool:
    found = steps.folder_at(loc.url).scan()
    if found.committed or found.pending or found.damaged or found.trash:
        return True
    store = store_for(loc)
    return any(is_lease(name) for name in store.list(None, loc, starting="xlakit-lease."))


def refuse_manager(url: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{url} is a manager URL holding several steps; name one ({url}/<step>; "
                                 f"`xlakit ckpt ls {url}` lists them)")


def read_state(url: str) -> tuple[Any, UrlKind]:
    """The state the checkpoint (or step) at `url` holds, verified; a sharded one as
    `{"shard0": ..., "shard1": ...}`, a DCP one flat by name (as `tensors.read_state` on disk)."""
    found = kind_of(url)
    if found.kind == MANAGER:
        raise refuse_manager(found.url)
    loc, record, opts = found.loc, found.record, LoadOptions()
    if found.kind == FILE:
        return objfile.load_file(loc, opts, lambda r: objranks.part_of(loc, r, None), record), found
    if found.kind == SHARDED:
        return {f"shard{rank}": read_shard(loc, record, rank) for rank in range(record["world"])}, found
    if found.kind == DCP:
        from xlakit.checkpoint import tensors

        objdcp.verify(loc, record, opts)
        op = Operation("load", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED)
        return op.run(lambda op: tensors.read_dcp(objdcp.reader_for(op, loc, record), loc.url)), found
    raise generations.kind_error(loc, record, FILE)


def read_shard(loc: Location, record: dict, rank: int) -> Any:
    """Shard `rank` of the sharded checkpoint `record` at `loc`, every record verified."""
    return objfile.load_file(loc, LoadOptions(), lambda r: objranks.part_of(loc, r, rank), record)


def dcp_metadata(loc: Location, record: dict) -> Any:
    """The DCP metadata (`.metadata`) of the checkpoint `record` at `loc`."""
    op = Operation("load", loc.url, Watch.of(LoadOptions()), untouched=loading.NOTHING_CHANGED)
    return op.run(lambda op: objdcp.reader_for(op, loc, record).read_metadata())


def exists(url: str) -> bool:
    """Whether a committed checkpoint is at `url` (a target `xlakit ckpt convert` would replace)."""
    try:
        objfile.peek(Location.parse(url), LoadOptions())
        return True
    except (FileNotFoundError, CheckpointIncompleteError):
        return False
    except CheckpointError:
        return True

