"""One checkpoint file on object storage: `xlakit.save`, `load` and `restore` of a `gs://`/`s3://` URL.

The save is the local one (`pipeline.write`: plan, sync, transfer in the same byte-capped
batches, the same archive writer) into another destination, `store/bucket.py`: the archive
streams into an upload of the data object `U/<generation>.<host>.<pid>.<token>.pt` instead of a
temporary file, and the commit is the create-only commit record of that generation instead of a
rename. This module is only its entry: the URL checked before any work, then synchronous or
asynchronous as on disk.

Load and restore read one data object of the newest committed generation (the file, or one
shard: the caller's `choose`) through `ObjectFile` with the local readers (`loading.py`,
`restoring.py`), so every record is verified exactly as on disk; the object's size is checked
against the commit record first (`store.bucket.open_object`). They stay beside the local readers
rather than behind the store: a URL names a generation's record first, then its object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xlakit.checkpoint.core import workers
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.file import background, loading, pipeline, restoring
from xlakit.checkpoint.format import folders
from xlakit.checkpoint.objstore import generations, reader
from xlakit.checkpoint.objstore.client import Location, Store, store_for
from xlakit.checkpoint.objstore.reader import ObjectFile
from xlakit.checkpoint.store import bucket
from xlakit.errors import CheckpointFormatError

KIND = bucket.FILE_KIND
SUFFIX = ".pt"


def save_file(obj: Any, url: str, opts: SaveOptions):
    """`xlakit.save(state, "gs://...")`, synchronous or asynchronous: `pipeline.write` into a bucket."""
    dest = bucket.destination(url)  # a bad URL is refused before any work
    job = pipeline.prepare(obj, url, opts, check_target=False)
    if opts.asynchronous:
        return background.start(job, lambda op: background.stage(op, job),
                                lambda op, staged: pipeline.write(op, job, staged, dest))
    op = Operation("save", url, Watch.of(opts), bytes_total=job.plan.nbytes)
    op.run(lambda op: pipeline.write(op, job, pipeline.device_batches(op, job.plan, opts), dest))
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


def _read_index(f: ObjectFile) -> dict:
    index = loading.open_index(f, f.loc.url, size=f.size)
    if index is None:
        raise CheckpointFormatError(f"{f.loc} is not an xlakit checkpoint file (no xlakit index)")
    return index


def read_object(op: Operation, store: Store, loc: Location, name: str, entry: dict, opts: LoadOptions) -> Any:
    """The state in the data object `name`, every record verified."""
    f = bucket.open_object(op, store, loc, name, entry)
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
        f = bucket.open_object(op, store, loc, name, entry)
        return restoring.restore_records(op, f, f.loc.url, _read_index(f), template, opts)

    return op.run(work)


def verify(loc: Location, record: dict, opts: LoadOptions) -> None:
    """Every object the commit record `record` at `loc` names read whole and checked against it."""
    store = store_for(loc)
    op = Operation("verify", loc.url, Watch.of(opts), untouched=loading.NOTHING_CHANGED,
                   bytes_total=sum(e["nbytes"] for e in record["objects"].values()))
    objects = record["objects"]
    checks = folders.item_checks(loc, objects)  # a DCP commit's items
    op.run(lambda op: [bucket.verify_object(op, store, loc, n, objects[n], checks.get(n))
                       for n in folders.metadata_last(objects)])
