"""`dcp_save` / `dcp_load` on every rank of a torch.distributed job: one folder, one agreed commit.

Each operation is one `Operation` per rank under `agreement.Coordination`:

Save: *agree* (every rank the same path; rank 0 has checked that the target
may be replaced, cleared dead processes' leftovers and made the temporary
sibling folder, whose name travels in its proposal), *write* (DCP writes each
rank's files into that folder, its collectives on a fresh gloo group with the
save's remaining time as timeout, never the training group; each rank fsyncs
and hashes its own files), *vote*, then rank 0 writes the commit record from
the votes and exchanges the folder atomically, claiming the commit against
every rank's abort. The folder must be on storage every rank sees (as for DCP
itself).

Load: *agree*, *verify* (each rank checks its share of the files against the
commit record), *vote*, *read* (DCP on the same kind of group; it reshards:
the target state may come from any number of ranks and any placement), *vote*.

A rank that fails is named on every rank (`CheckpointPeerError`); one that
dies or stalls makes the others raise `CheckpointTimeoutError` naming it. A
collective broken by a peer is not the waiting rank's fault: the survivors
report themselves and name the rank that never did.
"""

from __future__ import annotations

import os
from pathlib import Path

from xlakit.checkpoint.core import paths, workers
from xlakit.checkpoint.format import folders
from xlakit.checkpoint.torch_dcp import dcp
from xlakit.checkpoint.multirank.agreement import Coordination
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.options import LoadOptions, SaveOptions
from xlakit.errors import CheckpointError, CheckpointPeerError, CheckpointTimeoutError, RuntimeFeatureError

# A rank failing in these stages was waiting on the others (DCP's collectives).
_WAITING_STAGES = ("group", "plan", "finish")


def waiting(op: Operation):
    """A judge: whether a failure of `op` came from waiting on the others (a collective a peer broke)."""
    def judge(e: BaseException) -> bool:
        return isinstance(e, CheckpointPeerError) or (
            isinstance(e, CheckpointTimeoutError) and op.stage in _WAITING_STAGES)
    return judge


def save(state: dict, final: Path, opts: SaveOptions) -> None:
    device = dcp.device_tensors(state)
    coord = Coordination("dcp_save", {"path": os.path.abspath(final), "layout": "dcp"})
    op = Operation("dcp save", final, Watch.of(opts), gate=coord.gate, rank=coord.rank,
                   bytes_total=sum(t.numel() * t.element_size() for t in device))
    coord.op = op

    def work(op: Operation) -> None:
        prepared, error = {}, None
        try:
            workers.check_idle(exclude=op)
            dcp.check_transfer(device, opts)
            dcp.check_parent(final)
            if coord.rank == 0:
                prepared["folder"] = dcp.new_folder(op, final).name
        except (CheckpointError, RuntimeFeatureError, OSError) as e:
            error = e
        coord.agree(op, prepared, error)
        tmp = final.parent / coord.proposals[0]["folder"]
        with coord.giving_up(op, waiting=waiting(op)):
            try:
                files = dcp.write_folder(op, state, device, tmp, opts, group=coord.group(op))
                op.enter("checksum")
                entries = {name: folders.file_entry(tmp / name) for name in files}
            except OSError as e:
                if isinstance(e, CheckpointError):  # CheckpointTimeoutError is an OSError too
                    raise
                raise paths.write_error(e, final, stage=op.stage, bytes_done=op.bytes_done) from e
            coord.vote({"files": entries})
            if coord.rank != 0:
                final_word = coord.outcome(op)
                if not final_word.get("ok"):
                    raise CheckpointPeerError(f"rank 0 could not commit {final}: {final_word.get('error')}",
                                              rank=0)
                return
            votes = coord.votes(op)
            op.enter("commit")
            folders.write_commit_record(tmp, {n: e for v in votes.values() for n, e in v["files"].items()})
            dcp.commit_folder(op, tmp, final)
            coord.finish({"ok": True})

    try:
        op.run(work)
    finally:
        coord.close()


def load(state: dict, final: Path, opts: LoadOptions) -> None:
    coord = Coordination("dcp_load", {"path": os.path.abspath(final), "layout": "dcp"})
    op = Operation("dcp load", final, Watch.of(opts), gate=coord.gate, rank=coord.rank,
                   untouched=dcp.PARTLY_LOADED)
    coord.op = op

    def work(op: Operation) -> None:
        coord.agree(op)
        with coord.giving_up(op, waiting=waiting(op)):
            record = folders.read_commit_record(final)
            op.bytes_total = sum(f["nbytes"] for f in record["files"].values())
            if opts.verify:  # each rank checks its share of the files
                dcp.verify_files(op, final, record, sorted(record["files"])[coord.rank::coord.world])
            coord.vote({}, "verified")
            coord.votes(op, "verified")
            dcp.read_folder(op, state, final, group=coord.group(op))
            coord.vote({}, "read")
            coord.votes(op, "read")

    try:
        op.run(work)
    finally:
        coord.close()
