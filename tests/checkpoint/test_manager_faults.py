"""CheckpointManager under real faults: SIGKILL during saves and retention, SIGTERM on one rank of four.

Each test runs tests/support/manager_worker.py as real processes and checks the
folder from here afterwards, as the next job would: the last committed step
is never lost, every listed step restores, and the policy holds exactly once
the next save ran. Moments are random; the seed is in every failure message.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.support.manager_worker import GRACE_S, POLICY, loss
from tests.support.ranks import Job
from tests.support.manager_folders import names
from xlakit.checkpoint.stepstore import steps
from xlakit.checkpoint.manager.checkpoint_manager import CheckpointManager
from tests.support import SUPPORT

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
WORKER = SUPPORT / "manager_worker.py"
TRIALS = 4
WORLD = 4


def _check_restorable(folder: Path, last_reported: int | None, why: str) -> int:
    """Every step the folder lists restores whole; the last reported commit is still there."""
    mgr = CheckpointManager(folder, **POLICY)  # a new job: it also empties the trash
    latest = mgr.latest_step()
    if last_reported is not None:
        assert latest is not None and latest >= last_reported, (why, latest, last_reported)
    for step in mgr.all_steps():
        got = mgr.restore(step)
        assert got["step"] == step and torch.equal(got["b"], torch.arange(1000) + step), (why, step)
        assert got["w"].min() == got["w"].max() == step, (why, step)
    assert not steps.scan(folder).trash, why
    return latest


def _wait_nth(job: Job, event: str, n: int, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while sum(1 for line in job.lines[0] if line.get("event") == event) < n:
        assert time.monotonic() < end and job.procs[0].poll() is None, (event, n, job.errors[0][-2000:])
        time.sleep(0.01)


@pytest.mark.parametrize("scenario", ["loop", "async-loop", "slow-retention"])
def test_sigkill_at_random_moments_never_loses_the_last_committed_step(tmp_path, scenario):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    folder = tmp_path / "run"
    for trial in range(TRIALS):
        why = f"{scenario} trial {trial} seed {seed}"
        job = Job(WORKER, scenario, folder, 1)
        if scenario == "slow-retention":
            # Inside the k-th retention: its renames and deletions take 0.2 s each (a fake slow disk).
            _wait_nth(job, "retention", rng.randint(1, 3))
            time.sleep(rng.uniform(0.0, 0.7))
        else:
            job.wait_event(0, "committed", timeout=120)
            time.sleep(rng.uniform(0.0, 1.5))
        job.signal(0, signal.SIGKILL)
        result = job.results()
        assert result[0]["exit"] == -signal.SIGKILL, (why, result[0]["stderr"])
        committed = [l["step"] for l in job.lines[0] if l.get("event") == "committed"]
        _check_restorable(folder, committed[-1] if committed else None, why)
    # Every step 1..latest was committed once; the next save leaves exactly what the policy keeps.
    mgr = CheckpointManager(folder, **POLICY)
    latest = mgr.latest_step()
    final = latest + 100
    mgr.save(final, {"w": torch.full((4,), float(final)), "b": torch.arange(1000) + final, "step": final},
             metrics={"loss": loss(final)})
    every = POLICY["keep_every_n_steps"]
    expected = {s for s in range(1, latest + 1) if s % every == 0} | {latest, final}
    if latest >= 7:
        expected.add(7)  # the best loss
    assert mgr.all_steps() == sorted(expected), (seed, latest)
    assert names(folder) == sorted(map(str, expected)), seed


@pytest.mark.parametrize("scenario,fixed", [
    ("preempt", None),
    ("preempt-drift", None),
    # Rank 0, four times as fast, already waits in its step-25 save for the others, which block
    # at their posted steps for rank 0's post: it must post from inside its wait.
    ("preempt-drift", (3, 20)),
])
def test_sigterm_on_one_rank_saves_one_agreed_step_everywhere_and_the_job_exits(tmp_path, scenario, fixed):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    victim, at = fixed or (rng.randrange(WORLD), rng.randrange(5, 40))
    job = Job(WORKER, scenario, tmp_path, WORLD)
    job.wait_event(victim, "step", timeout=120, step=at)
    sent = time.time()
    job.signal(victim, signal.SIGTERM)
    results = job.results(timeout=GRACE_S + 60)
    took = time.time() - sent
    why = (scenario, seed, victim, at, results)
    assert all(results[r]["exit"] == 0 for r in range(WORLD)), why
    agreed = results[0]["agreed"]
    assert agreed is not None and agreed > at - 40, why
    for r in range(WORLD):
        assert results[r]["agreed"] == agreed and results[r]["reached"] == agreed, why
        assert results[r]["saved"][-1] == agreed, why
    assert took < GRACE_S, why
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest_step() == agreed and mgr.restore()["step"] == agreed, why


@pytest.mark.parametrize("layout", ["sharded", "dcp"])
def test_ranks_agree_on_retention_and_each_restores(tmp_path, layout):
    results = Job(WORKER, f"retention-{layout}", tmp_path, WORLD).results()
    for r in range(WORLD):
        assert results[r]["exit"] == 0, results[r]["stderr"]
        assert results[r]["seen"] == [[1], [1, 2], [2, 3], [3, 4], [4, 5]], results[r]
        assert results[r]["restored"] == [5, r, 5.0], results[r]
    assert names(tmp_path) == ["4", "5"]


def test_an_asynchronous_failure_on_one_rank_is_raised_by_the_next_call_everywhere(tmp_path):
    results = Job(WORKER, "async-failure", tmp_path, WORLD).results()
    for r in range(WORLD):
        out = results[r]
        assert out["exit"] == 0 and out["next_call"]["ok"] is False, out
        assert out["next_call"]["error"] == ("CheckpointWriteError" if r == 2 else "CheckpointPeerError"), out
        if r != 2:
            assert out["next_call"]["rank_named"] == 2, out
        assert out["steps"] == [1, 4], out
    assert names(tmp_path) == ["1", "4"]
