"""A training job with a CheckpointManager and a local tier, as real ranks; 2 hosts simulated by processes.

    tier_worker.py SCENARIO FOLDER

Started by tests/multirank/test_local_tier.py as 4 gloo ranks (`tests.support.ranks.Job`).
Multi-host is simulated: ranks 0 and 1 set XLAKIT_HOST_ID=host0, ranks 2 and 3 host1,
so each "host" has its own folder under FOLDER/shm (one machine's /dev/shm would be
shared by both; a real host's RAM is its own). The persistent tier is FOLDER/ckpt, or
the URL in TIER_PERSISTENT when set (a bucket on a test server); the layout is sharded,
or TIER_LAYOUT.

Scenarios:
  train    local saves every step (keep 2), persistent every 4 steps, steps 1..6; prints
           {"event": "trained"} and waits to be killed
  restore  a restarted job: restore() and report the step, each part's source, and
           whether the state is bit-exact the one saved at that step
  preempt  SIGTERM (from the test) on one rank: the agreed step is saved to the local tier,
           copies included, then to the persistent tier
  full     rank 2's local writes meet a (fake) full /dev/shm from step 3 on: every rank
           names the error, the persistent saves go on
  die      keep=1, local saves at steps 2 and 4; rank 3 SIGKILLs itself (a real death) in the
           middle of the peer copy of step 4; the others report and exit without a clean teardown
  late     keep=1, timeout_s=6, local saves at steps 1 and 2; at step 2 each received chunk
           lands 0.5 s late (a fake slow disk) and rank 3 reaches the digest exchange at 7.5 s
  stall    keep=2, timeout_s=6, a local save every step to step STALL_STEP + 4; rank 3 (or
           TIER_STALL_RANK) sends itself SIGSTOP just before the save of STALL_STEP (with
           TIER_STALL_AT=copy: as its peer copy begins), the test sends SIGCONT; each save
           is reported as an event {"event": "saved", "step", "whole", "seconds", "error"};
           with TIER_SYNC=1 each step all-reduces first (a training step's collective); with
           TIER_END=stall every rank stops after the stalled save and waits to be killed
  retire   local saves to step 7, then three times: restore(5), retire_steps_after(5), save 6 and 7
  odd      odd settings: peers=3 with 2 hosts; keep differs on rank 3; host1's tier folder blocked
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
os.environ["XLAKIT_HOST_ID"] = f"host{RANK // 2}"  # 2 simulated hosts of 2 processes each

import torch  # noqa: E402

import xlakit  # noqa: E402

PERSISTENT_EVERY, STEPS = 4, 6
LAYOUT = os.environ.get("TIER_LAYOUT", "sharded")


def say(**line) -> None:
    print(json.dumps(line), flush=True)


def state(step: int) -> dict:
    """Rank `RANK`'s part at `step`: a different state on every rank and step (sharded), or on every
    step (replicated: every rank holds the same state)."""
    rank = RANK if LAYOUT == "sharded" else 0
    g = torch.Generator().manual_seed(step * 100 + rank)
    return {"w": torch.randn(256 * 1024, generator=g), "b": torch.arange(1000) + step, "step": step,
            "rank": rank}


def digest(s: dict) -> str:
    h = hashlib.sha256()
    for key in ("w", "b"):
        h.update(s[key].contiguous().numpy().tobytes())
    h.update(json.dumps([s["step"], s["rank"]]).encode())
    return h.hexdigest()


def manager(folder: Path, local_every: int = 1, persistent_every: int = PERSISTENT_EVERY, keep: int = 2,
            timeout_s: float = 60) -> xlakit.CheckpointManager:
    persistent = os.environ.get("TIER_PERSISTENT") or folder / "ckpt"
    tier = xlakit.LocalTier(folder / "shm", interval_steps=local_every, peers=1, keep=keep, timeout_s=timeout_s)
    return xlakit.CheckpointManager(persistent, layout=LAYOUT, save_interval_steps=persistent_every,
                                    local=tier)


def train(folder: Path) -> dict:
    mgr = manager(folder)
    for step in range(1, STEPS + 1):
        if mgr.should_save(step):
            mgr.save(step, state(step))
    say(event="trained", persistent=mgr.all_steps(), local_error=mgr.local.last_error,
        bytes=mgr.local.bytes_used(), peers=mgr.local.peers)
    while True:  # the test kills this process, as a preemption would
        time.sleep(1)


def restore(folder: Path) -> dict:
    mgr = manager(folder)
    template = os.environ.get("TIER_TEMPLATE") == "1"
    got = mgr.restore(template={"w": torch.zeros(256 * 1024), "b": torch.zeros(1000, dtype=torch.int64),
                                "step": 0, "rank": 0}) if template else mgr.restore()
    report = mgr.local.restored_from
    out = {"step": report["step"], "parts": {str(k): v for k, v in report["parts"].items()},
           "hosts": {str(k): v for k, v in report["hosts"].items()}, "damaged": report["damaged"],
           "persistent": report.get("persistent"),
           "exact": digest(got) == digest(state(report["step"])), "got_step": got["step"]}
    mgr.close()
    return out


def full(folder: Path) -> dict:
    from xlakit.checkpoint.format import archive

    shm = str(folder / "shm")
    real = {name: getattr(archive.ArchiveWriter, name) for name in ("write_storage", "write_small_storages")}

    def fake_full(name):  # a named fake: only this rank's writes into the local tier fail with ENOSPC
        def write(writer, *args, **kwargs):
            if RANK == 2 and writer._file.name.startswith(shm) and FULL["on"]:
                raise OSError(28, "No space left on device")
            return real[name](writer, *args, **kwargs)
        return write

    FULL = {"on": False}
    for name in real:
        setattr(archive.ArchiveWriter, name, fake_full(name))
    mgr = manager(folder)
    errors = {}
    for step in range(1, 9):
        FULL["on"] = step >= 3
        if mgr.should_save(step):
            mgr.save(step, state(step))
        errors[step] = mgr.local.last_error
    out = {"persistent": mgr.all_steps(), "errors": errors}
    mgr.close()
    return out


def preempt(folder: Path) -> dict:
    """A loop of all-reduces; SIGTERM from the test on one rank; neither tier is due on its own."""
    import torch.distributed as dist

    mgr = manager(folder, local_every=1000, persistent_every=1000)
    mgr.install_preemption_handler(grace_s=30)
    saved = []
    for step in range(1, 100_000):
        t = torch.ones(4)
        dist.all_reduce(t)  # the training step's collective
        time.sleep(0.03)
        say(event="step", step=step)
        if mgr.should_save(step):
            mgr.save(step, state(step))
            saved.append(step)
        if mgr.reached_preemption(step):
            break
    out = {"saved": saved, "agreed": mgr._preemption.step, "persistent": mgr.all_steps(),
           "local_error": mgr.local.last_error}
    mgr.close()
    return out


def held(mgr) -> dict:
    """{step: [the parts this host holds]}."""
    return {str(s): sorted(parts) for s, parts in mgr.local.folder.inventory(WORLD).items()}


def die(folder: Path) -> None:
    from xlakit.checkpoint.tier import peer_copy

    mgr = manager(folder, local_every=2, persistent_every=1000, keep=1, timeout_s=8)
    peer_copy.CHUNK_BYTES = 1 << 20  # a part of ~1.1 MiB: two rounds of copies
    errors = {}
    for step in range(1, 5):
        if RANK == 3 and step == 4:
            real, landed = peer_copy._land, []

            def dying(r, buf, writers):
                landed.append(1)
                if len(landed) == 2:
                    os.kill(os.getpid(), 9)
                return real(r, buf, writers)

            peer_copy._land = dying
        if mgr.should_save(step):
            mgr.save(step, state(step))
            errors[step] = mgr.local.last_error
    say(result={"errors": errors, "held": held(mgr)})
    store = torch.distributed.distributed_c10d._get_default_store()  # rank 3 is gone: no clean teardown
    store.set(f"die/{RANK}", "1")
    store.wait([f"die/{r}" for r in range(3)], timedelta(seconds=30))
    time.sleep(1 if RANK == 0 else 0)
    os._exit(0)


def late(folder: Path) -> dict:
    from xlakit.checkpoint.tier import peer_copy

    mgr = manager(folder, local_every=1, persistent_every=1000, keep=1, timeout_s=6)
    mgr.save(1, state(1))
    real_transfer, real_land, t0 = peer_copy.transfer, peer_copy._land, time.monotonic()

    def slow_land(r, buf, writers):  # a fake slow receiver: each chunk lands 0.5 s late
        time.sleep(0.5)
        return real_land(r, buf, writers)

    def late_transfer(*args, **kwargs):  # rank 3 reaches the digest exchange after the deadline
        sent = real_transfer(*args, **kwargs)
        if RANK == 3:
            time.sleep(max(0.0, t0 + 7.5 - time.monotonic()))
        return sent

    peer_copy.transfer, peer_copy._land, peer_copy.CHUNK_BYTES = late_transfer, slow_land, 1 << 18
    t0 = time.monotonic()
    whole = mgr.save(2, state(2))
    peer_copy.transfer, peer_copy._land = real_transfer, real_land
    time.sleep(max(0.0, t0 + 8 - time.monotonic()))  # rank 3's copy has ended: what it left is seen
    out = {"whole": whole, "error": mgr.local.last_error, "held": held(mgr), "steps": mgr.local.folder.steps()}
    mgr.close()
    return out


STALL_STEP = 3


def stall(folder: Path) -> dict:
    import signal

    import torch.distributed as dist

    from xlakit.checkpoint.tier import peer_copy

    mgr = manager(folder, local_every=1, persistent_every=1000, keep=2, timeout_s=6)
    last = STALL_STEP if os.environ.get("TIER_END") == "stall" else STALL_STEP + 4
    stalls = RANK == int(os.environ.get("TIER_STALL_RANK", "3"))
    if stalls and os.environ.get("TIER_STALL_AT") == "copy":  # in the middle of the save instead
        real = peer_copy.transfer

        def stopping(*args, **kwargs):
            if mgr.local.last_step == STALL_STEP:
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(*args, **kwargs)

        peer_copy.transfer = stopping
    for step in range(1, last + 1):
        if os.environ.get("TIER_SYNC") == "1":
            dist.all_reduce(torch.ones(4))  # the training step's collective
        time.sleep(0.1)
        if stalls and step == STALL_STEP and os.environ.get("TIER_STALL_AT") != "copy":
            os.kill(os.getpid(), signal.SIGSTOP)
        t0 = time.monotonic()
        whole = mgr.save(step, state(step))
        say(event="saved", step=step, whole=whole, seconds=round(time.monotonic() - t0, 2),
            error=mgr.local.last_error)
    if last == STALL_STEP:
        while True:  # the test kills this process
            time.sleep(1)
    mgr.local.holds(last)  # a round every rank passes once every host's last save is settled
    out = {"held": held(mgr), "steps": mgr.local.folder.steps(), "latest": mgr.latest_step()}
    mgr.close()
    return out


def retire(folder: Path) -> dict:
    """Local saves every step to 7 (persistent every 4), then three times: back to step 5 (restore,
    retire_steps_after) and on again with new states, saving 6 and 7 at once."""
    mgr = manager(folder, local_every=1, persistent_every=4, keep=3, timeout_s=30)
    for step in range(1, 8):
        mgr.save(step, state(step))
    rounds = []
    for i in range(1, 4):
        got = mgr.restore(5)
        retired = mgr.retire_steps_after(5)
        saved = {s: [mgr.save(s, state(s * 10 * i)), mgr.local.last_error] for s in (6, 7)}
        rounds.append({"restored": got["step"], "retired": retired, "saved": saved})
    got = mgr.restore()
    out = {"rounds": rounds, "last": mgr.local.restored_from["step"], "exact": digest(got) == digest(state(70 * 3))}
    mgr.close()
    return out


def odd(folder: Path) -> dict:
    """Odd settings, one manager each: peers=3 with 2 hosts; a setting one rank has otherwise;
    host1's folder of the tier blocked by a file (it cannot be made)."""
    import logging

    from xlakit.checkpoint.tier.local_tier import run_name

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("xlakit").addHandler(handler)
    out: dict = {}
    tier = xlakit.LocalTier(folder / "shm", peers=3, keep=1, timeout_s=30)
    with xlakit.CheckpointManager(folder / "a", layout=LAYOUT, save_interval_steps=1000, local=tier) as mgr:
        out["clamped"] = {"copies": getattr(mgr.local, "copies", None), "peers": mgr.local.peers,
                          "whole": mgr.save(1, state(1)),
                          "warned": [w for w in warned if "peers=3" in w]}

    def refused(directory: Path, tier: xlakit.LocalTier) -> dict:
        t0 = time.monotonic()
        try:
            xlakit.CheckpointManager(directory, layout=LAYOUT, save_interval_steps=1000, local=tier)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"error": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", []),
                    "seconds": time.monotonic() - t0}
        return {"error": None}

    out["disagree"] = refused(folder / "b", xlakit.LocalTier(folder / "shm", keep=3 if RANK == 3 else 2))
    blocked = folder / "shm" / run_name(folder / "c") / "host1"
    if RANK == 2:  # before the managers start: in the way of host1's folder when ranks 2 and 3 make it
        blocked.parent.mkdir(parents=True, exist_ok=True)
        blocked.write_text("not a folder")
    out["blocked"] = refused(folder / "c", xlakit.LocalTier(folder / "shm", timeout_s=10))
    return out


def main(scenario: str, folder: Path) -> dict:
    if scenario == "train":
        return train(folder)
    if scenario == "restore":
        return restore(folder)
    if scenario == "full":
        return full(folder)
    if scenario == "preempt":
        return preempt(folder)
    if scenario == "die":
        return die(folder)
    if scenario == "late":
        return late(folder)
    if scenario == "stall":
        return stall(folder)
    if scenario == "retire":
        return retire(folder)
    if scenario == "odd":
        return odd(folder)
    raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    say(result=main(sys.argv[1], Path(sys.argv[2])))
    store = dist.distributed_c10d._get_default_store()
    store.set(f"exit/{RANK}", "1")
    if RANK == 0:  # rank 0 hosts the store: it stays until the others are done with it
        store.wait([f"exit/{r}" for r in range(WORLD)], timedelta(seconds=30))
    dist.destroy_process_group()
