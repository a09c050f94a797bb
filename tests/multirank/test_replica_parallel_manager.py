"""Replica-parallel checkpoints under the CheckpointManager, and loads by a job of another world size
(real gloo ranks, tests/support/replicas_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import xlakit
from tests.support import SUPPORT, ranks, replica_state

pytestmark = pytest.mark.multiproc
WORKER = SUPPORT / "replicas_worker.py"
WORLD = 4


def run_ranks(scenario: str, folder: Path, world: int = WORLD, env: dict | None = None) -> dict[int, dict]:
    """Each rank's JSON result, or its exit status and stderr when it printed none."""
    job = ranks.Job(WORKER, scenario, folder, world, env=env)
    results = job.results()
    return {r: job.lines[r][-1] if job.lines[r] else {"exit": results[r]["exit"], "stderr": job.errors[r][-3000:]}
            for r in range(world)}


def check_manager_results(results: dict[int, dict], share_suffix) -> None:
    for rank, r in results.items():
        assert r.get("steps") == [2, 3], (rank, r)  # max_to_keep=2: step 1 went
        assert r["digest"] == r["expected"], (rank, r)  # the latest, bit-exact on every rank
        assert r["restored_digest"] == r["restored_expected"], (rank, r)  # step 2 into a template
        # The restore read this rank's share of step 3 once; the other shares came by broadcast.
        assert len(r["read"]) == 1 and share_suffix(rank) in r["read"][0], (rank, r["read"])


def test_the_manager_saves_replica_parallel_steps_and_restores_them_by_broadcast(tmp_path):
    results = run_ranks("manager", tmp_path, env={"XLAKIT_TEST_TARGET": str(tmp_path / "run")})
    check_manager_results(results, lambda rank: f"share-{rank:05d}-of-{WORLD:05d}.")
    step = tmp_path / "run" / "3"
    record = json.loads((step / "xlakit-step.json").read_text())
    assert (record["version"], record["layout"], record["checkpoint"]) == (2, "replicated", "ckpt")
    commit = json.loads((step / "ckpt" / "xlakit-commit.json").read_text())
    assert (commit["format"], commit["version"], commit["world"]) == ("xlakit-replicated", 2, WORLD)
    total = replica_state.nbytes(replica_state.state(3))
    assert all(s["bytes"] <= total * (1 / WORLD + 0.05) for s in commit["shares"]), commit["shares"]
    # A reader outside the job (one process) reads every share.
    reader = xlakit.ReadOnlyCheckpointManager(tmp_path / "run")
    assert reader.all_steps() == [2, 3]
    assert replica_state.digest(reader.restore()) == replica_state.digest(replica_state.state(3))


def test_a_rank_killed_in_a_replica_parallel_step_leaves_the_previous_steps(tmp_path):
    run = tmp_path / "run"
    results = run_ranks("manager-2-dies", tmp_path, env={"XLAKIT_TEST_TARGET": str(run)})
    assert results[2]["exit"] == 17
    for rank in (0, 1, 3):
        r = results[rank]
        assert r.get("error") in ("CheckpointTimeoutError", "CheckpointPeerError"), (rank, r)
        assert r.get("rank_named") == 2 and r["steps"] == [1, 2], (rank, r)
    reader = xlakit.ReadOnlyCheckpointManager(run)
    assert reader.all_steps() == [1, 2]
    assert replica_state.digest(reader.restore()) == replica_state.digest(replica_state.state(2))
    with pytest.raises(xlakit.CheckpointIncompleteError, match="never committed"):
        reader.restore(3)  # its step record was written, its shares never committed


def test_replica_parallel_is_the_replicated_layout_s_and_the_manager_s_to_set(tmp_path):
    with pytest.raises(ValueError, match="replica_parallel=True applies to layout='replicated' only"):
        xlakit.CheckpointManager(tmp_path, replica_parallel=True)
    with pytest.raises(ValueError, match="options.layout is the manager's to set"):
        xlakit.CheckpointManager(tmp_path, options=xlakit.SaveOptions(layout="replicated", replica_parallel=True))


@pytest.mark.slow
def test_the_manager_saves_replica_parallel_steps_on_a_bucket_and_restores_them(bucket, tmp_path):
    url = f"{bucket}/run"
    results = run_ranks("manager", tmp_path, env={"XLAKIT_TEST_TARGET": url})
    check_manager_results(results, lambda rank: f".share-{rank:05d}-of-{WORLD:05d}.pt")
    reader = xlakit.ReadOnlyCheckpointManager(url)
    assert reader.all_steps() == [2, 3]
    assert replica_state.digest(reader.restore()) == replica_state.digest(replica_state.state(3))


@pytest.mark.parametrize("world", [2, 5])
def test_a_job_of_another_world_size_loads_a_replica_parallel_checkpoint(tmp_path, world):
    saved = run_ranks("roundtrip", tmp_path)  # 4 ranks; the folder ends holding state 2
    assert all(r.get("async_digest") == r.get("async_expected") for r in saved.values()), saved
    results = run_ranks("load-only", tmp_path, world=world)
    read = []
    for rank, r in results.items():
        assert r.get("digest") == r.get("expected"), (rank, r)
        assert r["restored_digest"] == r["expected"], (rank, r)
        # share s is read by rank s % world, once; the rest comes by broadcast
        assert [n.split(".")[0] for n in r["read"]] == [f"share-{s:05d}-of-{WORLD:05d}"
                                                       for s in range(WORLD) if s % world == rank], (rank, r)
        read += r["read"]
    assert len(read) == WORLD


@pytest.mark.slow
def test_a_job_of_another_world_size_loads_a_replica_parallel_checkpoint_from_a_bucket(bucket, tmp_path):
    url = f"{bucket}/run"
    run_ranks("roundtrip", tmp_path, env={"XLAKIT_TEST_TARGET": url})
    results = run_ranks("load-only", tmp_path, world=3, env={"XLAKIT_TEST_TARGET": url})
    for rank, r in results.items():
        assert r.get("digest") == r.get("expected"), (rank, r)
        assert r["restored_digest"] == r["expected"], (rank, r)
        assert len(r["read"]) == (2 if rank == 0 else 1), (rank, r["read"])  # shares 0 and 3; 1; 2


def test_ranks_holding_different_tensors_write_no_share_and_are_named(tmp_path):
    """A replica-parallel save needs the same tensors on every rank: the ranks agree on the plan first."""
    results = run_ranks("1-differs", tmp_path)
    for rank, r in results.items():
        assert r.get("error") == "CheckpointPeerError" and r.get("rank_named") == 1, (rank, r)
        assert "replicated_tensors" in r["message"] and "rank 1: '52 tensors" in r["message"], r["message"]
    record = json.loads((tmp_path / "ckpt" / "xlakit-commit.json").read_text())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(
        ["xlakit-commit.json"] + [s["file"] for s in record["shares"]])  # nothing of the refused save
    assert replica_state.digest(xlakit.load(tmp_path / "ckpt")) == replica_state.digest(replica_state.state(1))
