"""A training loop with a CheckpointManager, as a real process; announces its steps on stdout.

    manager_worker.py SCENARIO FOLDER

Started by tests/checkpoint/test_manager_faults.py, alone or as ranks of a gloo job
(`tests.ranks.Job` sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every
line is JSON: `{"event": ...}` marks a moment the test may act on (a signal
to this PID), `{"result": {...}}` is the outcome.

Scenarios:
  loop            save every step until killed (policy below), announcing each commit
  slow-retention  the same, on a fake slow disk where retention's renames and deletions
                  take 0.2 s each and a step record 0.1 s, announcing each retention
  async-loop      `loop` with asynchronous saves (a commit is announced once `wait` returned)
  preempt         (ranks) a loop of all-reduces; SIGTERM from the test on one rank
  preempt-drift   (ranks) no collectives, each rank at its own speed; SIGTERM on one rank
  retention-sharded, retention-dcp
                  (ranks) saves under max_to_keep=2; every rank restores (its shard, or into a template)
  async-failure   (ranks) rank 2's background write meets a fake full disk
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

import xlakit  # noqa: E402
from xlakit.checkpoint.stepstore import retention, steps  # noqa: E402

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
POLICY = {"max_to_keep": 2, "keep_every_n_steps": 5, "best_metric": "loss"}
GRACE_S = 20.0


def say(**line) -> None:
    print(json.dumps(line), flush=True)


def loss(step: int) -> float:
    """A loss with its minimum at step 7, so the best step is an old one."""
    return abs(step - 7) + 0.5


def state(step: int, mib: int = 8) -> dict:
    n = mib << 18  # float32 elements
    return {"w": torch.full((n,), float(step)), "b": torch.arange(1000) + step, "step": step, "rank": RANK}


def fake_slow_disk() -> None:
    """Retention's renames and deletions each take 0.2 s, a step record 0.1 s (a slow network file
    system), so that kills land inside them."""
    real_trash, real_remove, real_doomed = steps.to_trash, steps.remove_path, retention.doomed
    real_record = steps.write_record

    def slow_record(folder, record, op=None):
        time.sleep(0.1)
        real_record(folder, record, op)

    def slow_trash(folder):
        time.sleep(0.2)
        return real_trash(folder)

    def slow_remove(path):
        time.sleep(0.2)
        real_remove(path)

    def announced(found, policy, **kwargs):
        out = real_doomed(found, policy, **kwargs)
        if out:
            say(event="retention", doomed=out)
        return out

    steps.to_trash, steps.remove_path, retention.doomed = slow_trash, slow_remove, announced
    steps.write_record = slow_record


def loop(folder: Path, asynchronous: bool) -> dict:
    mgr = xlakit.CheckpointManager(folder, asynchronous=asynchronous, **POLICY)
    start = (mgr.latest_step() or 0) + 1
    for step in range(start, start + 10_000):
        mgr.save(step, state(step), metrics={"loss": loss(step)})
        if asynchronous:
            mgr.wait()
        say(event="committed", step=step)
    return {}


def preempt(folder: Path, lockstep: bool) -> dict:
    import torch.distributed as dist

    mgr = xlakit.CheckpointManager(folder, layout="replicated", save_interval_steps=25, max_to_keep=2)
    mgr.install_preemption_handler(grace_s=GRACE_S)
    saved, reached = [], None
    for step in range(1, 100_000):
        if lockstep:
            t = torch.ones(4)
            dist.all_reduce(t)  # the training step's collective
            time.sleep(0.03)
        else:
            time.sleep(0.01 * (RANK + 1))  # each rank at its own speed
        say(event="step", step=step)
        if mgr.should_save(step):
            mgr.save(step, state(step, mib=1))
            saved.append(step)
        if mgr.reached_preemption(step):
            reached = step
            break
    agreed = mgr._preemption.step
    mgr.close()
    return {"saved": saved, "reached": reached, "agreed": agreed, "exit_unix": time.time()}


def ranks_retention(folder: Path, layout: str) -> dict:
    mgr = xlakit.CheckpointManager(folder, layout=layout, max_to_keep=2)
    seen = []
    for step in range(1, 6):
        mgr.save(step, state(step, mib=1) if layout == "sharded" else {"w": torch.full((1024,), float(step)),
                                                                       "step": step})
        seen.append(mgr.all_steps())
    if layout == "sharded":
        mine = mgr.restore()  # each rank its own shard
    else:
        mine = {**mgr.restore(template={"w": torch.zeros(1024), "step": 0}), "rank": RANK}
    mgr.close()
    return {"seen": seen, "restored": [mine["step"], mine["rank"], float(mine["w"][0])]}


def async_failure(folder: Path) -> dict:
    from tests.support import fakes

    mgr = xlakit.CheckpointManager(folder, layout="sharded", asynchronous=True, max_to_keep=2)
    mgr.save(1, state(1, mib=1))
    mgr.wait()
    disk = fakes.FakeFullDisk()
    if RANK == 2:  # a fake full disk on this rank only
        disk.__enter__()
    mgr.save(2, state(2, mib=1))  # returns once staged; the failure comes behind it
    out = {}
    try:
        mgr.save(3, state(3, mib=1))
        out["next_call"] = {"ok": True}
    except xlakit.CheckpointError as e:
        out["next_call"] = {"ok": False, "error": type(e).__name__, "rank_named": getattr(e, "rank", None)}
    disk.__exit__(None, None, None)
    mgr.save(4, state(4, mib=1))
    mgr.wait()
    out["steps"] = mgr.all_steps()
    mgr.close()
    return out


def main(scenario: str, folder: Path) -> dict:
    if scenario == "slow-retention":
        fake_slow_disk()
    if scenario in ("loop", "slow-retention", "async-loop"):
        return loop(folder, asynchronous=scenario == "async-loop")
    if scenario in ("preempt", "preempt-drift"):
        return preempt(folder, lockstep=scenario == "preempt")
    if scenario.startswith("retention-"):
        return ranks_retention(folder, scenario.removeprefix("retention-"))
    if scenario == "async-failure":
        return async_failure(folder)
    raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    if WORLD == 1:
        say(result=main(sys.argv[1], Path(sys.argv[2])))
        sys.exit(0)
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    say(result=main(sys.argv[1], Path(sys.argv[2])))
    # Rank 0 hosts the store: it stays until the others are done with it.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"exit/{RANK}", "1")
    if RANK == 0:
        store.wait([f"exit/{r}" for r in range(WORLD)], timedelta(seconds=30))
    dist.destroy_process_group()
