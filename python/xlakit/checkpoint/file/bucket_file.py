"""One checkpoint file on object storage: `xlakit.save`, `load` and `restore` of a `gs://`/`s3://` URL.

The object-storage sibling of `pipeline.py` (save), `loading.py` and `restoring.py`; `save`, `load` and `restore` hand a URL here.

The save is the local pipeline with another write and commit (`pipeline.py`
plans, syncs and transfers in the same byte-capped batches): the archive
writer streams into an `Upload` of the data object
`U/<generation>.<host>.<pid>.<random>.pt` instead of a temporary file, then the
commit record of that generation is created, create-only, at the operation's
commit point (`generations.py`). Before the upload, objects no commit can
name any more are removed; after the commit, generations older than the
previous one.

Load and restore read one data object of the newest committed generation
(the file, or one shard: the caller's `choose`) through `ObjectFile` with the
local readers, so every record is verified exactly as on disk; the object's
size is checked against the commit record first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from xlakit.checkpoint.core import workers
from xlakit.checkpoint.file import background, loading, pipeline, restoring
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, Store, store_for
from xlakit.checkpoint.objstore import reader
from xlakit.checkpoint.objstore.reader import ObjectFile, gone_error
from xlakit.checkpoint.objstore.upload import Upload
from xlakit.errors import CheckpointConflictError, CheckpointCorruptError, CheckpointFormatError

log = logging.getLogger("xlakit")
KIND = "file"
SUFFIX = ".pt"


def upload_archive(op: Operation, store: Store, loc: Location, job: pipeline.FileSave,
                   items: pipeline.HostItems) -> tuple[dict, generations.Leftover]:
    """Stream the archive of `job` into the object `loc`; its size and xxh3-64, and the object as
    the operation owns it (removed if the operation fails, until a commit names it)."""
    leftover = op.own(generations.Leftover(store, loc))
    upload = Upload(store, op, loc)
    try:
        op.enter("write")
        pipeline.write_archive(op, job, upload, items)
        op.enter("upload")
        return upload.finish(), leftover
    except BaseException:
        upload.abort()
        raise


def begin(op: Operation, store: Store, loc: Location) -> int:
    """The generation this save aims at; what no commit can name any more is removed first."""
    op.enter("list")
    generations.tidy(store, op, loc)
    return generations.next_generation(generations.scan(store, op, loc))


def commit(op: Operation, store: Store, loc: Location, record: dict,
           owned: list[generations.Leftover]) -> None:
    """Create the commit record; on a conflict remove the objects `owned` (every rank's, when
    several uploaded them: none of them can ever be committed), and raise."""
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
    for o in owned:
        op.disown(o)


def tidy_after(op: Operation, store: Store, loc: Location, record: dict) -> None:
    """After `record` committed: generations older than the previous one go (records first)."""
    op.enter("tidy")
    generations.tidy(store, op, loc, keep_from=record["generation"] - 1)


def write(op: Operation, job: pipeline.FileSave, items: pipeline.HostItems) -> None:
    """The write and commit of one file at the URL `job.final`."""
    loc = Location.parse(job.final)
    store = store_for(loc)
    generation = begin(op, store, loc)
    op_id = generations.operation_id()
    name = generations.data_name(generation, op_id, SUFFIX)
    obj = loc.child(name)
    meta, leftover = upload_archive(op, store, obj, job, items)
    record = {"kind": KIND, "generation": generation, "operation": op_id, "objects": {name: meta}}
    commit(op, store, loc, record, [leftover])
    tidy_after(op, store, loc, record)


def save_file(obj: Any, url: str, opts: SaveOptions):
    """`xlakit.save(state, "gs://...")`, synchronous or asynchronous."""
    Location.parse(url)  # a bad URL is refused before any work
    job = pipeline.prepare(obj, url, opts, check_target=False)
    if opts.asynchronous:
        return background.start(job, lambda op: background.stage(op, job), lambda op, staged: write(op, job, staged))
    op = Operation("save", url, Watch.of(opts), bytes_total=job.plan.nbytes)
    op.run(lambda op: write(op, job, pipeline.device_batches(op, job.plan, opts)))
    return None


# -- reading ------------------------------------------------------------------------------------

Choose = Callable[[dict], tuple[str, dict]]  # a commit record -> the data object to read, its entry


def peek(loc: Location, opts: LoadOptions) -> dict:
    """The newest commit record at `loc` (what kind of checkpoint it is), under `opts`' deadline."""
    op = Operation("load", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED)
    return op.run(lambda op: committed(op, store_for(loc), loc))


def committed(op: Operation, store: Store, loc: Location, record: dict | None = None) -> dict:
    """`record` if given (a generation pinned earlier), else the newest commit record at `loc`."""
    if record is not None:
        return record
    op.enter("list")
    return generations.latest_record(store, op, loc)


def open_object(op: Operation, store: Store, loc: Location, name: str, entry: dict) -> ObjectFile:
    """The data object `name` of a commit record, its size checked against the record."""
    obj = loc.child(name)
    try:
        size = store.size(op, obj)
    except FileNotFoundError as e:
        raise replaced_error(loc, name) from e
    if size != entry["nbytes"]:
        raise CheckpointCorruptError(f"{obj} holds {size} bytes, its commit record says {entry['nbytes']}: "
                                     f"the object was replaced or damaged after the save committed")
    return ObjectFile(store, op, obj, size)


def replaced_error(loc: Location, name: str) -> CheckpointCorruptError:
    return gone_error(loc.url, name)


def _read_index(f: ObjectFile) -> dict:
    index = loading.open_index(f, f.loc.url, size=f.size)
    if index is None:
        raise CheckpointFormatError(f"{f.loc} is not an xlakit checkpoint file (no xlakit index)")
    return index


def read_object(op: Operation, store: Store, loc: Location, name: str, entry: dict, opts: LoadOptions) -> Any:
    """The state in the data object `name`, every record verified."""
    f = open_object(op, store, loc, name, entry)
    op.bytes_total = f.size
    return loading.read_records(op, f, f.loc.url, _read_index(f), opts.verify)


def load_plain(loc: Location, opts: LoadOptions) -> Any:
    """`xlakit.load(url, verify=False)` of an object another tool wrote (a torch.save file): read whole,
    then `torch.load(weights_only=True)` as a local file without xlakit checksums is read."""
    import io

    op = Operation("load", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED)

    def work(op: Operation) -> Any:
        store = store_for(loc)
        op.enter("read")
        size = store.size(op, loc)
        op.bytes_total = size
        data = bytearray(size)
        op.object = loc.url
        got = store.get_into(op, loc, 0, memoryview(data), chunk_bytes=reader.CHUNK_BYTES,
                             parallel=reader.PARALLEL) if size else 0
        op.object = None
        op.advance(got)
        return loading.torch_load(io.BytesIO(bytes(memoryview(data)[:got])), False, name=loc.url)

    return op.run(work)


def load_file(loc: Location, opts: LoadOptions, choose: Choose, record: dict | None = None) -> Any:
    """`xlakit.load("gs://...")` of one data object (the file, or one shard) of the newest committed
    generation (or of `record`'s), every record verified."""
    op = Operation("load", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED)

    def work(op: Operation) -> Any:
        store = store_for(loc)
        name, entry = choose(committed(op, store, loc, record))
        return read_object(op, store, loc, name, entry, opts)

    return op.run(work)


def restore(loc: Location, template: Any, opts: LoadOptions, choose: Choose, record: dict | None = None) -> Any:
    """`xlakit.restore("gs://...", template)`: one data object's records streamed into the template."""
    workers.check_idle(writing_ok=True)
    op = Operation("restore", loc.url, Watch.of(opts), untouched=restoring.PARTLY)

    def work(op: Operation) -> Any:
        store = store_for(loc)
        name, entry = choose(committed(op, store, loc, record))
        f = open_object(op, store, loc, name, entry)
        return restoring.restore_records(op, f, f.loc.url, _read_index(f), template, opts)

    return op.run(work)
