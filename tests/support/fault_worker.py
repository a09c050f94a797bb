"""One rank of a multi-process fault test: runs a named scenario, announces its steps on stdout.

Started by tests/multirank/test_agreement.py through `tests.ranks.Job` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; torch.distributed runs on gloo
over loopback. Every line is JSON: `{"event": ...}` marks a moment the test
may act on (a signal to this PID), `{"result": {...}}` is the outcome.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import xlakit  # noqa: E402
from xlakit.checkpoint.store import local as local_store  # noqa: E402
from tests.support.ranks import leave_together  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
DEADLINE_S = 4.0


def say(**line) -> None:
    print(json.dumps(line), flush=True)


def state(version: int) -> dict:
    return {"version": version, "rank": RANK, "w": torch.full((4096,), float(version * 10 + RANK))}


def outcome(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
        return {"ok": True, "elapsed_s": time.monotonic() - start}
    except xlakit.CheckpointError as e:
        return {"ok": False, "error": type(e).__name__, "message": str(e), "rank_named": getattr(e, "rank", None),
                "elapsed_s": time.monotonic() - start}


def versions(target: Path, layout: str) -> int:
    """The version every rank loads now (a coordinated load)."""
    loaded = xlakit.load(target, layout="replicated" if layout == "replicated" else "auto", timeout_s=30)
    return loaded["version"]


def stop_after_shard() -> None:
    """Rank 0 sends itself SIGSTOP right after its shard is written, before it votes."""
    real = local_store._rename_shard

    def then_stop(op, tmp, final):
        real(op, tmp, final)
        say(event="shard-written")
        os.kill(os.getpid(), signal.SIGSTOP)

    local_store._rename_shard = then_stop


def run(scenario: str, folder: Path) -> dict:
    target = folder / "ckpt"
    out: dict = {"rank": RANK}
    xlakit.save(state(1), target, layout="sharded", timeout_s=30)  # the previous checkpoint
    say(event="saved-1")
    if scenario == "rank0-stops-after-its-shard":
        if RANK == 0:
            stop_after_shard()
        out["save2"] = outcome(lambda: xlakit.save(state(2), target, layout="sharded", timeout_s=DEADLINE_S))
        say(event="save-2-returned")
    elif scenario == "path-mismatch":
        where = folder / "elsewhere" if RANK == 2 else target
        out["save2"] = outcome(lambda: xlakit.save(state(2), where, layout="sharded", timeout_s=DEADLINE_S))
    elif scenario == "layout-mismatch":
        layout = "replicated" if RANK == 1 else "sharded"
        out["save2"] = outcome(lambda: xlakit.save(state(2), target, layout=layout, timeout_s=DEADLINE_S))
    elif scenario == "dies-mid-shard":
        if RANK == 1:  # dies inside the transfer, its temporary shard file already open
            from tests.support import fakes
            from xlakit.checkpoint.file import transfer

            class Dies(fakes.HostTransfer):
                def to_host(self, tensors, *, timeout_s):
                    os._exit(17)

            transfer.backend_for = lambda device_type, sample, **_: Dies()
        out["save2"] = outcome(lambda: xlakit.save(state(2), target, layout="sharded", timeout_s=DEADLINE_S))
        return out
    elif scenario == "absent-rank":
        if RANK == 3:
            time.sleep(DEADLINE_S + 6)  # misses this save entirely
            out["save2"] = {"ok": None}
        else:
            out["save2"] = outcome(lambda: xlakit.save(state(2), target, layout="sharded", timeout_s=DEADLINE_S))
        return out  # the sequence of coordinated operations is off from here on
    elif scenario == "stopped-rank-then-recovery":
        say(event="saving-2")
        if RANK == 3:  # stops itself before save 2: a SIGSTOP the test sent at "saving-2" could land after its vote
            os.kill(os.getpid(), signal.SIGSTOP)
        out["save2"] = outcome(lambda: xlakit.save(state(2), target, layout="sharded", timeout_s=DEADLINE_S))
        out["save3"] = outcome(lambda: xlakit.save(state(3), target, layout="sharded", timeout_s=30))
        out["dcp2"] = outcome(lambda: xlakit.dcp_save({"w": torch.ones(8) * RANK}, folder / "dcp", timeout_s=30))
    elif scenario == "interrupted-rank":
        # A slow device (fake) on SLOW_RANK: the test's SIGINT to rank 1 lands mid-save, in its own transfer
        # (SLOW_RANK 1) or while it waits for the slow rank 0 (SLOW_RANK 0).
        if RANK == int(os.environ.get("SLOW_RANK", "1")):
            from tests.support import fakes
            from xlakit.checkpoint.file import transfer

            slow = fakes.FakeSlowDevice(delay_s=0.5)
            transfer.backend_for = lambda device_type, sample, **_: slow
        parts = {**state(2), **{f"p{i}": torch.full((1024,), float(i)) for i in range(12)}}
        say(event="saving-2")
        try:
            # SHORT_RANK gives up at its 3 s deadline while it waits for the slow rank.
            timeout_s = 3 if RANK == int(os.environ.get("SHORT_RANK", "-1")) else 30
            out["save2"] = outcome(lambda: xlakit.save(parts, target, layout="sharded", timeout_s=timeout_s,
                                                       max_inflight_bytes=4096))
        except KeyboardInterrupt as e:
            out["save2"] = {"ok": False, "error": "KeyboardInterrupt", "notes": getattr(e, "__notes__", [])}
        # This rank's own temporaries, at once (the error's note says whether its worker has stopped and
        # removed them) and once its worker is idle (`wait_until_idle`, as the note says to). Other ranks'
        # files are theirs to remove, on their own time: the test looks at the folder after the job.
        def own() -> list[str]:
            return sorted(n for n in os.listdir(target) if n.endswith(".xlakit-tmp") and f"shard-{RANK:05d}" in n)

        out["temporaries_at_once"] = own()
        out["idle"] = xlakit.wait_until_idle(10)
        out["temporaries"] = own()
    elif scenario == "late-committer":
        # Rank 0 (the committer) reaches its commit inside the last second before the ranks' earliest deadline
        # (a fake delay, exactly there): too late to commit safely, it gives the save up itself.
        asynchronous = os.environ.get("ASYNC") == "1"
        layout = os.environ.get("LAYOUT", "sharded")
        where = target if layout == "sharded" else folder / "replicated.pt"
        if layout != "sharded":
            xlakit.save(state(1), where, layout=layout, timeout_s=30)
        if RANK == 0:
            from xlakit.checkpoint.coordination import agreement

            real = agreement.Coordination.votes

            def late(self, op, round_="vote"):
                time.sleep(max(self.earliest_deadline() - 0.5 - time.time(), 0.0))
                return real(self, op, round_)

            agreement.Coordination.votes = late

        def save2():
            handle = xlakit.save(state(2), where, layout=layout, timeout_s=DEADLINE_S, asynchronous=asynchronous)
            if handle is not None:
                handle.result(timeout=60)

        out["save2"] = outcome(save2)
        out["version_now"] = versions(where, layout)
        return out
    elif scenario == "no-time-left":
        # Rank 1's asynchronous save hands its write over after its deadline (a fake delay between the two
        # phases, exactly there): its write never starts. Rank 0, 1 s later to the save, is still writing its
        # shard then (a fake 3.5 s rename): it meets rank 1's abort, the first, when it goes on.
        from xlakit.checkpoint.file import background

        if RANK == 1:
            real_handle = background.SaveHandle.__init__

            def late(self, path, blocked_s, op, staged=None):
                time.sleep(max(op.deadline - time.monotonic() + 0.2, 0.0))
                real_handle(self, path, blocked_s, op, staged)

            background.SaveHandle.__init__ = late
        else:
            real_rename = local_store._rename_shard

            def slow(op, tmp, final):
                time.sleep(3.5)
                real_rename(op, tmp, final)

            local_store._rename_shard = slow
            time.sleep(1.0)

        def save2():
            xlakit.save(state(2), target, layout="sharded", timeout_s=DEADLINE_S, asynchronous=True).result(60)

        out["save2"] = outcome(save2)
        out["version_now"] = versions(target, "sharded")
        return out
    elif scenario == "cancelled-handle":
        # Rank 1 cancels its asynchronous save through its handle while it waits for rank 0 (slow: a fake
        # 3 s before it collects the votes). Its store answers its abort claim late (a fake 0.3 s delay):
        # the abort is in the store before this rank has settled it.
        from xlakit.checkpoint.coordination import agreement

        if RANK == 0:
            real_votes = agreement.Coordination.votes

            def slow(self, op, round_="vote"):
                time.sleep(3.0)
                return real_votes(self, op, round_)

            agreement.Coordination.votes = slow
        handle = xlakit.save(state(2), target, layout="sharded", asynchronous=True, timeout_s=30)
        if RANK == 1:
            real_claim = agreement.Coordination.claim

            def late_answer(self, record):
                held = real_claim(self, record)
                time.sleep(0.3)
                return held

            agreement.Coordination.claim = late_answer
            time.sleep(1.0)
            out["cancelled"] = handle.cancel()
        try:
            out["save2"] = outcome(lambda: handle.result(timeout=60))
        except concurrent.futures.CancelledError as e:
            out["save2"] = {"ok": False, "error": "CancelledError", "message": str(e)}
    elif scenario == "async-layouts":
        for layout in ("sharded", "replicated"):
            where = target if layout == "sharded" else folder / "replicated.pt"
            handle = xlakit.save(state(5), where, layout=layout, asynchronous=True, timeout_s=30)
            out[f"async-{layout}"] = outcome(lambda: handle.result(timeout=60))
            out[f"path-{layout}"] = [str(handle.path), str(where)]  # the checkpoint named, not this rank's shard
            out[f"version-{layout}"] = versions(where, layout)
        return out
    elif scenario == "async-failure":
        from tests.support import fakes

        disk = fakes.FakeFullDisk()
        if RANK == 2:  # this rank's background write hits a full disk (a fake one)
            disk.__enter__()
        handle = xlakit.save(state(6), target, layout="sharded", asynchronous=True, timeout_s=DEADLINE_S)
        out["async"] = outcome(lambda: handle.result(timeout=60))
        disk.__exit__(None, None, None)
    out["version_now"] = versions(target, "sharded")
    return out


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = run(sys.argv[1], Path(sys.argv[2]))
    say(result=result)
    # Rank 0 hosts the store: it stays until the others are done reading it (or 15 s).
    leave_together(RANK, WORLD)  # a peer may die, stall or leave early on purpose here
