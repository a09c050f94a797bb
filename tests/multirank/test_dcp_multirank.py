"""xlakit.dcp_save / dcp_load with real ranks: one commit for the job, resharding on load.

Each test starts its ranks as processes (tests/support/dcp_worker.py, gloo over
loopback) holding CPU DTensors; the checkpoint is then checked from here,
in this single process, as any later job would read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import xlakit
from tests.support import ranks
from tests.support.dcp_worker import DEADLINE_S, INTERRUPTED_DEADLINE_S
from xlakit.checkpoint.core import load_stats
from xlakit.checkpoint.format import folders
from tests.support import SUPPORT

pytestmark = pytest.mark.multiproc
WORKER = SUPPORT / "dcp_worker.py"
MARGIN_S = 6.0  # rank 0 waits 1 s more for reports, the others 5 s more for its verdict


def run_ranks(scenario: str, folder: Path, world: int) -> dict[int, dict]:
    """Each rank's reports by phase, and its exit status."""
    results = {}
    for rank, (code, out, err) in enumerate(ranks.run(WORKER, scenario, folder, world)):
        reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results[rank] = {"exit": code, "stderr": err[-3000:], **{r.pop("phase"): r for r in reports}}
    return results


def _load_here(path: Path) -> dict:
    """The checkpoint read back in this process, as plain full tensors."""
    state = {"model": {"w": torch.zeros(10, 6), "b": torch.zeros(7, dtype=torch.bfloat16),
                       "ids": torch.zeros(9, 4, dtype=torch.int64)},
             "plain": torch.zeros(5), "step": 0}
    xlakit.dcp_load(state, path)
    return state


def _expected(version: int) -> dict:
    from tests.support.dcp_worker import full

    return full(version)


def _assert_version(state: dict, version: int) -> None:
    want = _expected(version)
    for name in ("w", "b", "ids"):
        assert torch.equal(state["model"][name], want[name]), name
    assert torch.equal(state["plain"], want["plain"]) and state["step"] == version


@pytest.mark.slow
def test_two_ranks_save_three_ranks_load_resharded_bit_exactly(tmp_path):
    saved = run_ranks("save", tmp_path, world=2)
    assert all("save" in r for r in saved.values()), saved
    # One folder for the job, committed once: every rank's files are in its record.
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    record = json.loads((tmp_path / "ckpt" / folders.COMMIT_RECORD).read_text())
    assert sorted(record["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    loaded = run_ranks("load", tmp_path, world=3)
    for rank, r in loaded.items():
        assert r.get("load", {}).get("mismatch") == [], (rank, r)
    _assert_version(_load_here(tmp_path / "ckpt"), 1)
    # The same job then loaded with one file damaged: each rank checks every item it reads as it reads
    # it (one pass), so each rank that reads the damaged item names it, and the others name such a rank.
    found = {rank for rank, r in loaded.items() if r["corrupt"].get("error") == "CheckpointCorruptError"}
    assert found and all("__1_0.distcp" in loaded[rank]["corrupt"]["message"] for rank in found), loaded
    for rank in set(loaded) - found:
        r = loaded[rank]["corrupt"]
        assert r.get("error") == "CheckpointPeerError" and r["rank_named"] in found, (rank, r)



@pytest.mark.slow
def test_a_rank_with_nothing_to_write_leaves_the_load_one_pass(tmp_path):
    # Regression: rank 1's empty file is listed without items, and one such file sent the whole load back
    # to the two-pass path (every file read whole first, then DCP's reads).
    saved = run_ranks("save one tensor", tmp_path, world=2)
    assert all("save" in r for r in saved.values()), saved
    files = json.loads((tmp_path / "ckpt" / folders.COMMIT_RECORD).read_text())["files"]
    assert files["__1_0.distcp"]["nbytes"] == 0, files
    state = {"plain": torch.zeros(5)}
    with load_stats.collecting() as stats:
        xlakit.dcp_load(state, tmp_path / "ckpt")
    assert torch.equal(state["plain"], _expected(1)["plain"])
    assert stats.bytes_read == sum(e["nbytes"] for e in files.values()), (stats, files)

@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """One 3-rank job: save version 1, rank 1 fails to write 2, rank 1 dies while saving 3."""
    folder = tmp_path_factory.mktemp("failures")
    return folder, run_ranks("failures", folder, world=3)


@pytest.mark.slow
def test_a_rank_failing_to_write_is_named_and_nothing_commits(failures):
    _, results = failures
    assert results[1]["fails"].get("error") == "CheckpointWriteError", results[1]
    assert "no space" in results[1]["fails"]["message"]
    for rank in (0, 2):
        r = results[rank]["fails"]
        assert r.get("error") == "CheckpointPeerError" and r["rank_named"] == 1, (rank, r)
        assert "rank 1: CheckpointWriteError" in r["message"]
        assert r["elapsed_s"] < DEADLINE_S


@pytest.mark.slow
def test_a_rank_dying_mid_save_is_named_by_the_others_and_the_previous_loads(failures):
    folder, results = failures
    assert results[1]["exit"] == 17 and "dies" not in results[1], results[1]
    for rank in (0, 2):
        r = results[rank]["dies"]
        assert r.get("error") == "CheckpointTimeoutError" and r["rank_named"] == 1, (rank, r)
        assert "rank(s) [1]" in r["message"]
        assert r["elapsed_s"] < DEADLINE_S + MARGIN_S
    # No temporary folder is left, and neither failed save replaced version 1.
    assert sorted(os.listdir(folder)) == ["ckpt"]
    _assert_version(_load_here(folder / "ckpt"), 1)


@pytest.mark.slow
def test_ctrl_c_on_one_rank_ends_the_others_wait_in_a_collective_before_their_deadline(tmp_path):
    # Regression: rank 1 interrupted after the agreement left rank 0 in the rendezvous of the save's gloo group
    # until its deadline (an hour by default); it now raises rank 1's abort a few seconds after it was claimed.
    results = run_ranks("interrupted", tmp_path, world=2)
    assert results[1]["save2"] == {**results[1]["save2"], "error": "KeyboardInterrupt"}, results[1]
    r = results[0]["save2"]
    assert r.get("error") == "CheckpointPeerError" and r["rank_named"] == 1, r
    assert "rank 1 gave up (KeyboardInterrupt in the caller)" in r["message"], r
    assert r["elapsed_s"] < INTERRUPTED_DEADLINE_S / 2, r
    _assert_version(_load_here(tmp_path / "ckpt"), 1)
