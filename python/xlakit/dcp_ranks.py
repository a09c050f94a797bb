"""`dcp_save` / `dcp_load` on every rank of a torch.distributed job: one folder, one commit.

Each operation is a sequence of *steps*. In a step every rank does its local
part under the operation's one deadline (`_job.run`: a hung call cannot hang
the rank), then publishes a small outcome record through `distributed._Round`;
rank 0 gathers them all, decides, publishes the verdict, and every rank
returns or raises from that same verdict. So no rank runs on believing a
failed save succeeded, and the culprit is named the same way everywhere:

1. a rank that never reported (it died or stalled): `CheckpointTimeoutError`;
2. else the ranks that failed on their own (a write error, a local timeout),
   not those that merely failed *waiting* on them (a DCP collective broken by
   a peer, or DCP reporting a peer's error): `CheckpointPeerError`.
   A culprit raises its own error.

Save: step *start* (rank 0 picks the temporary sibling folder, every rank
checks it has no abandoned work), step *write* (DCP writes each rank's files
into that folder, its collectives on xlakit's gloo group with the save's
remaining time as timeout, never the training group; each rank fsyncs and
hashes its own files), then rank 0 writes the commit record from those
reports and exchanges the folder atomically, only if every rank's files are
durable. The folder must be on storage every rank sees (as for DCP itself).

Load: step *verify* (every rank reads the commit record and checks its share
of the files), step *read* (DCP on the same group). DCP reshards: the target
state may come from any number of ranks and any placement.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from xlakit import _dirs, _job, dcp, dcp_plan
from xlakit.distributed import _Round
from xlakit.errors import CheckpointError, CheckpointPeerError, CheckpointTimeoutError
from xlakit.options import LoadOptions, SaveOptions

# A rank failing in these stages was waiting on the others (DCP's collectives).
_WAITING_STAGES = ("plan", "finish")


def save(state: dict, final: Path, opts: SaveOptions) -> None:
    rnd = _Round("dcp_save", final, opts.timeout_s)
    made: list[Path] = []  # rank 0's temporary folder, removed unless it became the checkpoint

    def start(job: _job.Job) -> dict:
        # Checked on every rank, reported, so that none waits on one that refused to start.
        _job.check_no_abandoned_work()
        dcp.check_parent(final)
        if rnd.rank != 0:
            return {}
        _dirs.check_replaceable(final)
        _dirs.remove_stale_temps(final)
        made.append(_dirs.temp_dir(final))
        made[0].mkdir()
        return {"folder": made[0].name}

    try:
        _save(rnd, state, final, opts, start)
    finally:
        for folder in made:
            _dirs.discard(folder)  # gone already when committed


def _save(rnd: _Round, state: dict, final: Path, opts: SaveOptions,
          start: Callable[[_job.Job], dict]) -> None:
    verdict = _step(rnd, "start", start, opts)
    tmp = final.parent / verdict["records"]["0"]["folder"]
    device = [t for t in dcp_plan.tensors(state) if t.device.type != "cpu"]

    def write(job: _job.Job) -> dict:
        try:
            files = dcp.write_folder(job, state, device, tmp, opts, group=rnd.group())
            job.enter("checksum")
            return {"files": {name: _dirs.file_entry(tmp / name) for name in files}}
        except OSError as e:
            if isinstance(e, CheckpointError):  # CheckpointTimeoutError is an OSError too
                raise
            raise _dirs.write_error(e, final, stage=job.stage, bytes_done=job.bytes_done) from e

    def commit(records: dict[str, dict]) -> None:
        try:
            reported = {n: e for r in records.values() for n, e in r["files"].items()}
            _dirs.write_commit_record(tmp, reported)
            _dirs.replace(tmp, final)
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise _dirs.write_error(e, final, stage="commit") from e

    _step(rnd, "write", write, opts, on_success=commit,
          bytes_total=sum(t.numel() * t.element_size() for t in device))


def load(state: dict, final: Path, opts: LoadOptions) -> None:
    rnd = _Round("dcp_load", final, opts.timeout_s)
    records: list[dict] = []

    def verify(job: _job.Job) -> dict:
        records.append(_dirs.read_commit_record(final))
        if opts.verify:  # each rank checks its share of the files
            dcp.verify_files(job, final, records[0], sorted(records[0]["files"])[rnd.rank::rnd.world])
        return {}

    _step(rnd, "verify", verify, opts)
    _step(rnd, "read", lambda job: dcp.read_folder(job, state, final, group=rnd.group()) or {}, opts,
          bytes_total=sum(f["nbytes"] for f in records[0]["files"].values()))


def _step(rnd: _Round, name: str, work: Callable[[_job.Job], dict], opts: Any, *,
          on_success: Callable[[dict], None] | None = None, bytes_total: int = 0) -> dict:
    """Run `work` here under the deadline; every rank returns rank 0's verdict or raises it."""
    saving = rnd.what == "dcp_save"
    kind, hint = ("dcp save", _SAVE_HINT) if saving else ("dcp load", _LOAD_HINT)
    job = _job.Job(kind, f"{rnd.path} (rank {rnd.rank} of {rnd.world})", bytes_total)
    job.started = rnd.started  # one deadline for the whole operation
    watch = _job.Watch(opts.timeout_s, opts.stall_warning_s, opts.progress_interval_s,
                       opts.progress_callback)
    error: BaseException | None = None
    try:
        outcome = {"ok": True, **_job.run(job, work, watch, lambda j: hint)}
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised below
        error = e
        waiting = isinstance(e, CheckpointPeerError) or (
            isinstance(e, CheckpointTimeoutError) and e.stage in _WAITING_STAGES)
        outcome = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                   "timeout": isinstance(e, TimeoutError), "waiting": waiting}
    try:
        rnd.publish(f"{name}/{rnd.rank}", outcome)
    except RuntimeError as e:  # the store lives in rank 0's process
        raise CheckpointPeerError(f"coordinated {rnd.what} of {rnd.path}: rank {rnd.rank} cannot "
                                  f"reach the job's store on rank 0 ({e}); rank 0 probably died",
                                  rank=0) from error or e
    if rnd.rank == 0:
        verdict = _decide(rnd, name)
        if verdict["ok"] and on_success is not None:
            try:
                on_success(verdict["records"])
            except Exception as e:  # noqa: BLE001 - the others must hear of it, then it is raised
                error = e
                verdict = {"ok": False, "timeout": False, "ranks": [0],
                           "error": f"rank 0: {type(e).__name__}: {e}"}
        rnd.publish(f"{name}-verdict", verdict)
    else:
        verdict = rnd.read(f"{name}-verdict")
        if verdict is None:
            raise rnd.timeout(f"rank 0 did not say how step {name!r} ended (it stalled or died)",
                              stage=name, rank=0) from error
    if verdict["ok"]:
        return verdict
    culprits = verdict["ranks"]
    if error is not None and rnd.rank in culprits and not outcome.get("waiting"):
        raise error
    consequence = "nothing was committed" if saving else "the state may be partly loaded"
    message = f"step {name!r} failed, {consequence}: {verdict['error']}"
    if verdict["timeout"]:
        raise rnd.timeout(message, stage=name, rank=culprits[0]) from error
    raise CheckpointPeerError(f"coordinated {rnd.what} of {rnd.path} (rank {rnd.rank} of "
                              f"{rnd.world}): {message}", rank=culprits[0]) from error


_SAVE_HINT = "The other ranks are told; the previous checkpoint, if any, is untouched."
_LOAD_HINT = "The other ranks are told; nothing was changed on disk, the state may be partly loaded."


def _decide(rnd: _Round, name: str) -> dict:
    """Rank 0's verdict on a step from every rank's record (see the module docstring)."""
    records, missing = rnd.gather(name)
    if missing:
        return {"ok": False, "timeout": True, "ranks": missing,
                "error": f"rank(s) {missing} did not report within the deadline (stalled or died)"}
    failed = {r: v for r, v in records.items() if not v["ok"]}
    if not failed:
        # JSON keys are strings; the verdict travels as JSON too.
        return {"ok": True, "records": {str(r): v for r, v in records.items()}}
    own = {r: v for r, v in failed.items() if not v["waiting"]}
    culprits = sorted(own or failed)
    lines = "; ".join(f"rank {r}: {failed[r]['error']}" for r in culprits)
    return {"ok": False, "timeout": all(failed[r]["timeout"] for r in culprits), "ranks": culprits,
            "error": lines}

