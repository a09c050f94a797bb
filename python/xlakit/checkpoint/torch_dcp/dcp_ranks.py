"""`dcp_save` / `dcp_load`, alone or on every rank of a torch.distributed job, on disk or in a
bucket: one flow, over where the files go (`dcp.LocalDcp`, a folder; `bucket_dcp.BucketDcp`, a
generation of a URL).

With several ranks each operation is one `Operation` per rank under `agreement.Coordination`;
alone, the same steps without the agreement and the votes:

Save: *agree* (every rank the same path; rank 0 has proposed where the files go: on disk it
has checked that the target may be replaced, cleared dead processes' leftovers and made the
temporary sibling folder; in a bucket it has listed the prefix for the next generation), *tidy*
(rank 0: what no commit can name any more), *write* (DCP writes each rank's files, its
collectives on a fresh gloo group with the save's remaining time as timeout, never the training
group; each rank knows the size and xxh3-64 of its own files), *vote*, then rank 0 commits from
the votes, claiming the commit against every rank's abort: on disk the commit record written
into the folder and the folder exchanged atomically into place, in a bucket the create-only
commit record of the generation (once every voted file is there with its size). The folder must
be on storage every rank sees (as for DCP itself).

Load: *agree* (rank 0 names the commit to read: in a bucket its generation), *read* (DCP on the
same kind of group; it reshards: the target state may come from any number of ranks and any
placement; each rank reads each item it needs once and checks it against the commit record
before any of it reaches the state, `one_pass.py`), *vote*. A commit whose record lists no items
(older saves) is first verified, each rank its share of the files whole, then read.

A rank that fails is named on every rank (`CheckpointPeerError`); one that dies or stalls makes
the others raise `CheckpointTimeoutError` naming it. A collective broken by a peer is not the
waiting rank's fault: the survivors report themselves and name the rank that never did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from xlakit.checkpoint.coordination.agreement import Coordination, world_size
from xlakit.checkpoint.core import workers
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.checkpoint.torch_dcp import dcp, one_pass
from xlakit.errors import CheckpointError, CheckpointPeerError, CheckpointTimeoutError, RuntimeFeatureError

# A rank failing in these stages was waiting on the others (DCP's collectives).
_WAITING_STAGES = ("group", "plan", "finish")


def waiting(op: Operation):
    """A judge: whether a failure of `op` came from waiting on the others (a collective a peer broke)."""
    def judge(e: BaseException) -> bool:
        return isinstance(e, CheckpointPeerError) or (
            isinstance(e, CheckpointTimeoutError) and op.stage in _WAITING_STAGES)
    return judge


def _agreed(op: Operation, coord: Coordination | None, propose: Callable[[], dict],
            error: BaseException | None) -> dict:
    """Rank 0's proposal, agreed by every rank (alone: made here)."""
    prepared = {}
    if error is None and (coord is None or coord.rank == 0):
        try:
            prepared = propose()
        except (CheckpointError, OSError, ValueError) as e:
            error = e
    if coord is None:
        if error is not None:
            raise error
        return prepared
    coord.agree(op, prepared, error)
    return coord.proposals[0]


def _giving_up(coord: Coordination | None, op: Operation):
    return contextlib.nullcontext() if coord is None else coord.giving_up(op, waiting=waiting(op))


def _operation(kind: str, where: dcp.DcpStore, opts: SaveOptions | LoadOptions,
               **kwargs: Any) -> tuple[Operation, Coordination | None]:
    coord = Coordination(kind.replace(" ", "_"), {"path": where.identity, "layout": "dcp"}) \
        if world_size() > 1 else None
    op = Operation(kind, where.name, Watch.of(opts), gate=coord.gate if coord else None,
                   rank=coord.rank if coord else None, **kwargs)
    if coord is not None:
        coord.op = op
    return op, coord


def save(state: dict, where: dcp.DcpStore, opts: SaveOptions) -> None:
    """`xlakit.dcp_save(state, where)`, alone or on every rank of the job."""
    device = dcp.device_tensors(state)
    op, coord = _operation("dcp save", where, opts, bytes_total=sum(t.numel() * t.element_size() for t in device))

    def propose() -> dict:
        with where.writing(op):
            return where.propose(op)

    def work(op: Operation) -> None:
        error = None
        try:
            workers.check_idle(exclude=op)
            where.check(device, opts)
        except (CheckpointError, RuntimeFeatureError, OSError) as e:
            error = e
        where.adopt(_agreed(op, coord, propose, error))
        rank = coord.rank if coord else 0
        with _giving_up(coord, op):
            if rank == 0:
                where.tidy(op)  # agreed: what no commit can name any more may go
            with where.writing(op):
                entries = where.write(op, state, device, opts, coord.group(op) if coord else None)
            if coord is not None:
                coord.vote({"files": entries})
                if rank != 0:
                    coord.expect_commit(op, where.name)
                    return
                entries = {n: e for v in coord.votes(op).values() for n, e in v["files"].items()}
            with where.writing(op):
                where.commit(op, entries)
            if coord is not None:
                coord.finish({"ok": True})
            where.after_commit(op)

    try:
        op.run(work)
    finally:
        if coord is not None:
            coord.close()


def load(state: dict, where: dcp.DcpStore, opts: LoadOptions) -> None:
    """`xlakit.dcp_load(state, where)`: verified, then read (and resharded) in place."""
    op, coord = _operation("dcp load", where, opts, untouched=dcp.PARTLY_LOADED)

    def work(op: Operation) -> None:
        pinned = _agreed(op, coord, lambda: where.pin(op), None)
        rank, world = (coord.rank, coord.world) if coord else (0, 1)
        with _giving_up(coord, op):
            files = where.files(op, pinned)
            op.bytes_total = sum(e["nbytes"] for e in files.values())
            single = one_pass.one_pass(files)  # each rank checks each item it reads, as it reads it
            if opts.verify and not single:  # each rank checks its share of the files first
                for name in sorted(files)[rank::world]:
                    where.verify(op, name, files[name])
            if coord is not None:
                coord.vote({}, "verified")
                coord.votes(op, "verified")
            reader = where.reader(op, files if single else None, opts.verify)
            dcp.read_folder(op, state, None, group=coord.group(op) if coord else None, reader=reader)
            if coord is not None:
                coord.vote({}, "read")
                coord.votes(op, "read")

    try:
        op.run(work)
    finally:
        if coord is not None:
            coord.close()
