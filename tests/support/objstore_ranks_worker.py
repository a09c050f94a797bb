"""One rank of a multi-process job saving to object storage; prints a JSON line per phase.

Started by tests/objstore/test_objstore_ranks.py with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and the servers' standard variables set: `objstore_ranks_worker.py
PHASES URL[,URL...]` runs the comma-separated phases in order against each
bucket URL (one job for all: starting ranks, and torch_xla's import that DCP
brings, are the slow part on a small machine); `kill` runs last, once,
against the last URL. Each report names its phase and its URL's scheme.

* `sharded`: a sharded save (version 1), loaded back inside the job (agreed),
  and restored into a template (this rank's shard).
* `replicated`: rank 1 writes a replicated checkpoint; every rank loads it.
* `async`: an asynchronous sharded save (version 2), loaded back.
* `dcp`: `dcp_save` of DTensors sharded over the ranks, `dcp_load` into other
  placements (tests/support/dcp_worker.py's states).
* `kill`: a sharded save (version 3) during which rank 2 announces
  `uploading` from inside its upload and waits there, to be killed by the
  test (SIGKILL); the others report their error and load their shard of
  the previous checkpoint (`shard=RANK`, without the dead rank).
* `killat` (tests/objstore/test_objstore_killed_rank.py, 3 ranks): a sharded
  save (version 1), then another (version 2) during which rank KILLAT_VICTIM
  SIGKILLs itself at the phase named by XLAKIT_TEST_KILL_AT: `before-vote`
  (its shard uploaded whole, not voted), `after-vote` (voted; rank 0 holds
  before reading the votes, its commit, until the victim is gone; a bucket
  URL or a folder), `after-vote-before-tidy` (a bucket only: voted;
  rank 0 holds its first listing, the tidy before its upload, until the
  victim is gone) or `after-commit` (the record created, before its save
  returns). Each survivor reports what its save returned or raised, and its
  shard of the newest checkpoint it can load.
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
from tests.support import objstore_servers  # noqa: E402
from tests.support.ranks import leave_together  # noqa: E402

# Defaults only for the test module, which imports DEADLINE_S and VICTIM from here.
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
VICTIM = 2
DEADLINE_S = 8.0  # the kill phase's timeout_s
KILLAT_VICTIM = 1
KILLAT_DEADLINE_S = 6.0  # the killat phase's timeout_s
KILLAT_N = 1 << 20  # floats per shard: 4 MiB, a few upload parts


def killat_tensor(version: int, rank: int) -> torch.Tensor:
    """The killat phase's shard of `rank` (a later process rebuilds it to compare bit for bit)."""
    return torch.randn(KILLAT_N, generator=torch.Generator().manual_seed(version * 100 + rank))


def state(version: int, *, big: bool = False) -> dict:
    n = (2 << 20) if big else 1000  # big: 8 MiB, several upload parts
    return {"version": version, "rank": RANK, "w": torch.full((n,), float(version * 10 + RANK))}


def report(phase: str, url: str, start: float, **values) -> None:
    print(json.dumps({"phase": phase, "scheme": url.partition(":")[0], "elapsed_s": time.monotonic() - start,
                      **values}), flush=True)


def _error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e), "rank_named": getattr(e, "rank", None)}


def _seen(s: dict) -> dict:
    return {"version": s["version"], "rank": s["rank"], "w0": s["w"][0].item()}


def sharded(url: str) -> None:
    start = time.monotonic()
    xlakit.save(state(1), f"{url}/sharded", layout="sharded", timeout_s=60)
    loaded = xlakit.load(f"{url}/sharded", timeout_s=60)
    template = state(0)
    restored = xlakit.restore(f"{url}/sharded", template, timeout_s=60)
    report("sharded", url, start, loaded=_seen(loaded), restored=_seen(restored),
           in_place=restored["w"] is template["w"])


def replicated(url: str) -> None:
    start = time.monotonic()
    xlakit.save(state(1) | {"rank": 1}, f"{url}/replicated.pt", layout="replicated", writer_rank=1,
                timeout_s=60)
    loaded = xlakit.load(f"{url}/replicated.pt", layout="replicated", timeout_s=60)
    report("replicated", url, start, loaded=_seen(loaded))


def asynchronous(url: str) -> None:
    start = time.monotonic()
    handle = xlakit.save(state(2), f"{url}/sharded", layout="sharded", asynchronous=True, timeout_s=60)
    handle.result()
    report("async", url, start, loaded=_seen(xlakit.load(f"{url}/sharded", timeout_s=60)))


def dcp(url: str) -> None:
    from tests.support import dcp_worker

    start = time.monotonic()
    xlakit.dcp_save(dcp_worker.saved_state(1), f"{url}/dcp", timeout_s=60)
    target = dcp_worker.target_state()
    xlakit.dcp_load(target, f"{url}/dcp", timeout_s=60)
    report("dcp", url, start, mismatch=dcp_worker.mismatches(target, 1))


def kill(url: str) -> None:
    if RANK == VICTIM:
        from xlakit.checkpoint.objstore import upload

        real_send = upload.Upload._send

        def send_then_wait(self, *, final):
            real_send(self, final=final)
            print(json.dumps({"event": "uploading"}), flush=True)
            time.sleep(600)  # the test kills this process here, mid-upload

        upload.Upload._send = send_then_wait
    start = time.monotonic()
    try:
        xlakit.save(state(3, big=True), f"{url}/sharded", layout="sharded", timeout_s=DEADLINE_S)
        report("kill", url, start, saved=True)
    except xlakit.CheckpointError as e:
        elapsed = time.monotonic() - start
        previous = xlakit.load(f"{url}/sharded", shard=RANK, timeout_s=60)
        report("kill", url, start, **_error(e), error_after_s=elapsed, previous=_seen(previous))


def _gone(pid: int) -> bool:
    """Dead and reaped by its parent, as torchrun reaps it (a zombie still answers kill(pid, 0))."""
    return not os.path.exists(f"/proc/{pid}")


def killat(url: str) -> None:
    import signal

    from xlakit.checkpoint.coordination import agreement
    from xlakit.checkpoint.store import bucket

    at = os.environ["XLAKIT_TEST_KILL_AT"]
    target = f"{url}/killat"
    xlakit.save({"version": 1, "rank": RANK, "w": killat_tensor(1, RANK)}, target, layout="sharded",
                timeout_s=60)
    store = dist.distributed_c10d._get_default_store()
    armed = []

    def die(where: str) -> None:
        print(json.dumps({"event": "killing", "at": where}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if RANK == KILLAT_VICTIM:
        store.set("killat/pid", str(os.getpid()))
        real_vote, real_outcome = agreement.Coordination.vote, agreement.Coordination.outcome

        def vote(self, value, round_="vote"):
            if armed and round_ == "vote" and at == "before-vote":
                die(at)
            real_vote(self, value, round_)
            if armed and round_ == "vote" and at.startswith("after-vote"):
                die(at)

        def outcome(self, op):
            final = real_outcome(self, op)  # the committing rank's final word: the record is there
            if armed and at == "after-commit":
                die(at)
            return final

        agreement.Coordination.vote, agreement.Coordination.outcome = vote, outcome
    elif RANK == 0:
        victim = int(store.get("killat/pid"))

        def hold(real, name):
            def held(*args, **kwargs):
                if armed and kwargs.get("round_", "vote") == "vote":
                    end = time.monotonic() + 30
                    while not _gone(victim) and time.monotonic() < end:
                        time.sleep(0.01)
                    print(json.dumps({"event": "held", "at": name, "victim_gone": _gone(victim)}), flush=True)
                return real(*args, **kwargs)
            return held

        if at == "after-vote":  # every vote is awaited right before the commit (on disk too)
            agreement.Coordination.votes = hold(agreement.Coordination.votes, "votes")
        elif at == "after-vote-before-tidy":
            bucket.Bucket.tidy = hold(bucket.Bucket.tidy, "tidy")
    armed.append(True)
    start = time.monotonic()
    try:
        xlakit.save({"version": 2, "rank": RANK, "w": killat_tensor(2, RANK)}, target, layout="sharded",
                    timeout_s=KILLAT_DEADLINE_S)
        outcome = {"saved": True}
    except (xlakit.CheckpointError, TimeoutError) as e:
        outcome = _error(e)
    outcome["returned_after_s"] = time.monotonic() - start
    try:
        got = xlakit.load(target, shard=RANK, timeout_s=60)
        outcome["loaded"] = {"version": got["version"], "rank": got["rank"],
                             "exact": torch.equal(got["w"], killat_tensor(got["version"], RANK))}
    except Exception as e:  # noqa: BLE001 - reported, the test judges it
        outcome["load_error"] = f"{type(e).__name__}: {e}"
    report("killat", url, start, at=at, **outcome)


def manager(url: str) -> None:
    start = time.monotonic()
    with xlakit.CheckpointManager(f"{url}/mgr", layout="sharded", max_to_keep=1,
                                  options=xlakit.SaveOptions(timeout_s=60)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), metrics={"loss": 1.0 / step})
        steps_seen = mgr.all_steps()
        restored = mgr.restore()
    report("manager", url, start, steps=steps_seen, restored=_seen(restored))


PHASES = {"sharded": sharded, "replicated": replicated, "async": asynchronous, "dcp": dcp, "manager": manager,
          "kill": kill, "killat": killat}


if __name__ == "__main__":
    objstore_servers.loopback_only()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    phases, urls = sys.argv[1].split(","), sys.argv[2].split(",")
    for url in urls:
        for name in phases:
            if name != "kill":
                PHASES[name](url)
    if "kill" in phases:
        kill(urls[-1])
    leave_together(RANK, WORLD, dead={VICTIM} if "kill" in phases else {KILLAT_VICTIM} if "killat" in phases
                   else set())
