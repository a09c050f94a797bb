"""One rank of a replica-parallel test: runs a named scenario, prints one JSON line.

Started by tests/multirank/test_replica_parallel*.py with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set; torch.distributed runs on gloo over loopback. The target is a
folder path, or a bucket URL given in XLAKIT_TEST_TARGET.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import xlakit  # noqa: E402
from tests.support import fakes, replica_state  # noqa: E402
from tests.support.ranks import leave_together  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


class _Dies(fakes.HostTransfer):
    """A fake device whose process dies in the middle of the transfer."""

    def to_host(self, tensors, *, timeout_s):
        os._exit(17)


def _count_reads() -> list[str]:
    """The files or objects (shares) this rank reads, by name."""
    from xlakit.checkpoint.file import bucket_file, loading

    read, real_file, real_object = [], loading.read_file, bucket_file.read_object

    def counting_file(op, path, opts):
        read.append(Path(path).name)
        return real_file(op, path, opts)

    def counting_object(op, store, loc, name, entry, opts):
        read.append(name)
        return real_object(op, store, loc, name, entry, opts)

    loading.read_file, bucket_file.read_object = counting_file, counting_object
    return read


def manager(target: str) -> dict:
    """Steps 1-3 saved replica-parallel by a manager keeping 2; the latest restored (each share read
    once, broadcast), and step 2 into a template."""
    out: dict = {"rank": RANK}
    with xlakit.CheckpointManager(target, layout="replicated", replica_parallel=True, max_to_keep=2,
                                  options=xlakit.SaveOptions(timeout_s=60)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, replica_state.state(step))
        out["steps"] = mgr.all_steps()
        read = _count_reads()
        loaded = mgr.restore()
        out["read"] = list(read)
        out["digest"], out["expected"] = replica_state.digest(loaded), replica_state.digest(replica_state.state(3))
        restored = mgr.restore(2, template=replica_state.zeroed(replica_state.state(2)))
        out["restored_digest"] = replica_state.digest(restored)
        out["restored_expected"] = replica_state.digest(replica_state.state(2))
    return out


def manager_rank_dies(target: str) -> dict:
    """Steps 1 and 2 saved replica-parallel by a manager; rank 2 dies in the transfer of step 3."""
    out: dict = {"rank": RANK}
    mgr = xlakit.CheckpointManager(target, layout="replicated", replica_parallel=True, max_to_keep=2,
                                   options=xlakit.SaveOptions(timeout_s=15))
    for step in (1, 2):
        mgr.save(step, replica_state.state(step))
    dist.barrier()
    if RANK == 2:
        from xlakit.checkpoint.file import transfer

        transfer.backend_for = lambda device_type, sample, **_: _Dies()
    try:
        mgr.save(3, replica_state.state(3))
        out["saved"] = True
    except xlakit.CheckpointError as e:
        out.update({"error": type(e).__name__, "message": str(e), "rank_named": getattr(e, "rank", None)})
    out["steps"] = mgr.all_steps()
    return out


def load_only(target: str) -> dict:
    """A checkpoint another job saved (of state 2, with another world size), loaded by this job."""
    read = _count_reads()
    loaded = xlakit.load(target)
    first_read = list(read)
    restored = xlakit.restore(target, replica_state.zeroed(replica_state.state(2)))
    return {"rank": RANK, "read": first_read, "digest": replica_state.digest(loaded),
            "restored_digest": replica_state.digest(restored),
            "expected": replica_state.digest(replica_state.state(2))}


def run(scenario: str, folder: Path) -> dict:
    out: dict = {"rank": RANK}
    target = os.environ.get("XLAKIT_TEST_TARGET") or str(folder / "ckpt")
    if scenario == "manager":
        return manager(target)
    if scenario == "manager-2-dies":
        return manager_rank_dies(target)
    if scenario == "load-only":
        return load_only(target)
    first = replica_state.state(1)
    dist.barrier()
    written = _wchar()
    # The writer of the commit record (and the skeleton) is the last rank, not rank 0.
    xlakit.save(first, target, layout="replicated", replica_parallel=True, writer_rank=WORLD - 1, timeout_s=60)
    out["wchar"] = _wchar() - written  # every byte this process passed to write(), as the kernel counts
    if scenario == "roundtrip":
        read = _count_reads()
        loaded = xlakit.load(target)
        out["digest"] = replica_state.digest(loaded)
        out["expected"] = replica_state.digest(replica_state.state(1))
        out["view_shares_storage"] = (loaded["view"].untyped_storage().data_ptr()
                                      == loaded["model"]["layer3"].untyped_storage().data_ptr())
        out["tied_shares_storage"] = (loaded["tied"].untyped_storage().data_ptr()
                                      == loaded["model"]["layer0"].untyped_storage().data_ptr())
        out["read"] = list(read)
        handle = xlakit.save(replica_state.state(2), target, layout="replicated", replica_parallel=True,
                             writer_rank=WORLD - 1, asynchronous=True, timeout_s=60)
        handle.result()
        out["async_digest"] = replica_state.digest(xlakit.load(target))
        out["async_expected"] = replica_state.digest(replica_state.state(2))
        restored = xlakit.restore(target, replica_state.zeroed(replica_state.state(2)))
        out["restored_digest"] = replica_state.digest(restored)
        return out
    if scenario == "old-format":  # a single-file replicated checkpoint, as written before
        old = str(folder / "old.pt") if "://" not in target else target + "-old.pt"
        xlakit.save(replica_state.state(3), old, layout="replicated", timeout_s=60)
        out["digest"] = replica_state.digest(xlakit.load(old, layout="replicated"))
        out["expected"] = replica_state.digest(replica_state.state(3))
        return out
    if scenario == "1-differs":  # rank 1 holds one more tensor than the others: no share is written
        second = replica_state.state(2)
        if RANK == 1:
            second["model"]["local"] = torch.zeros(3)
        try:
            xlakit.save(second, target, layout="replicated", replica_parallel=True, timeout_s=30)
            out["saved"] = True
        except xlakit.CheckpointError as e:
            out.update({"error": type(e).__name__, "message": str(e), "rank_named": getattr(e, "rank", None)})
        return out
    # "<victim rank>-dies[-writing]": the victim dies in the second save's transfer, or after
    # writing the first batch of its share (a partial temporary file is left behind)
    victim = int(scenario.split("-")[0])
    if RANK == victim and scenario.endswith("-writing"):
        from xlakit.checkpoint.file import pipeline

        real = pipeline.write_batch

        def write_then_die(*args, **kwargs):
            real(*args, **kwargs)
            os._exit(17)

        pipeline.write_batch = write_then_die
    elif RANK == victim:
        from xlakit.checkpoint.file import transfer

        transfer.backend_for = lambda device_type, sample, **_: _Dies()
    start = time.monotonic()
    try:
        xlakit.save(replica_state.state(2), target, layout="replicated", replica_parallel=True, timeout_s=4,
                    max_inflight_bytes=1 << 20)  # batches of 1 MiB: a share is written in several
        out["saved"] = True
    except xlakit.CheckpointError as e:
        out.update({"error": type(e).__name__, "message": str(e), "rank_named": getattr(e, "rank", None)})
    out["elapsed_s"] = time.monotonic() - start
    return out


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = run(sys.argv[1], Path(sys.argv[2]))
    print(json.dumps(result), flush=True)
    leave_together(RANK, int(os.environ["WORLD_SIZE"]))  # a peer may die on purpose here
