"""Coordinated saves with real processes (torch.distributed on gloo over loopback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import xlakit
from tests.support import ranks
from tests.support import SUPPORT

pytestmark = pytest.mark.multiproc
WORKER = SUPPORT / "dist_worker.py"
DEADLINE_S, MARGIN_S = 3.0, 8.0  # the worker's timeout_s; peers may wait 5 s more for a report


def run_ranks(scenario: str, folder: Path, world: int = 3) -> dict[int, dict]:
    """Each rank's JSON result, or its exit status and stderr when it printed none."""
    results = {}
    for rank, (code, out, err) in enumerate(ranks.run(WORKER, scenario, folder, world)):
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results[rank] = json.loads(lines[-1]) if lines else {"exit": code, "stderr": err[-2000:]}
    return results


def test_replicated_save_and_load_round_trip(tmp_path):
    results = run_ranks("replicated-roundtrip", tmp_path)
    for rank, r in results.items():
        assert r.get("loaded") == {"version": 1, "rank": 0, "w0": 10.0}, (rank, r)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_sharded_save_and_load_round_trip(tmp_path):
    results = run_ranks("sharded-roundtrip", tmp_path)
    for rank, r in results.items():
        assert r.get("loaded") == {"version": 1, "rank": rank, "w0": 10.0 + rank}, (rank, r)
    commit = json.loads((tmp_path / "ckpt" / "xlakit-commit.json").read_text())
    assert [s["rank"] for s in commit["shards"]] == [0, 1, 2]
    shard = xlakit.load(tmp_path / "ckpt", shard=2)  # outside the job, one shard by number
    assert torch.equal(shard["w"], torch.full((1000,), 12.0))


@pytest.mark.slow
def test_a_rank_dying_mid_save_is_named_by_every_other_rank_and_the_previous_loads(tmp_path):
    results = run_ranks("sharded-1-dies", tmp_path)
    assert results[1]["exit"] == 17
    for rank in (0, 2):
        r = results[rank]
        assert r["error"] == "CheckpointTimeoutError" and "rank(s) [1]" in r["message"], r
        assert r["elapsed_s"] < DEADLINE_S + MARGIN_S
        assert r["previous_version"] == 1
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "xlakit-commit.json" in names


@pytest.mark.slow
def test_a_stalled_rank_times_out_and_the_others_name_it(tmp_path):
    results = run_ranks("sharded-2-stalls", tmp_path)
    assert results[2]["error"] == "CheckpointTimeoutError" and "stage 'transfer'" in results[2]["message"]
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] == "CheckpointTimeoutError" and r["rank_named"] == 2, r
        assert "rank(s) [2]" in r["message"] or "rank 2:" in r["message"], r
        assert r["elapsed_s"] < DEADLINE_S + MARGIN_S
    assert all(r["previous_version"] == 1 for r in results.values())


@pytest.mark.slow
def test_a_dead_replicated_writer_is_named_by_the_waiting_ranks(tmp_path):
    results = run_ranks("replicated-0-dies", tmp_path, world=2)
    assert results[0]["exit"] == 17
    r = results[1]
    # Rank 0 hosts the job's store here: its death is seen at once, as a peer that is gone.
    assert r.get("error") in ("CheckpointTimeoutError", "CheckpointPeerError"), r
    assert r["rank_named"] == 0 and "rank 0" in r["message"] and r["elapsed_s"] < DEADLINE_S + MARGIN_S
    assert torch.equal(xlakit.load(tmp_path / "ckpt.pt")["w"], torch.full((1000,), 10.0))


def test_a_corrupt_shard_fails_the_load_on_every_rank(tmp_path):
    results = run_ranks("sharded-corrupt-load", tmp_path)
    assert results[1]["error"] == "CheckpointCorruptError", results[1]
    assert "tensor 'w' is corrupt" in results[1]["message"]
    for rank in (0, 2):
        assert results[rank]["error"] == "CheckpointPeerError", results[rank]
        assert "rank 1:" in results[rank]["message"]


def test_a_folder_without_commit_record_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    xlakit.save({"w": torch.ones(2)}, folder / "shard-00000-of-00001.x.pt")
    for shard in (0, None):
        with pytest.raises(xlakit.CheckpointIncompleteError, match="no commit record.*interrupted sharded"):
            xlakit.load(folder, shard=shard)


def test_coordinated_layout_without_torch_distributed_says_how_to_fix(tmp_path):
    with pytest.raises(xlakit.XlakitError, match="init_process_group"):
        xlakit.save({"w": torch.ones(2)}, tmp_path / "c.pt", layout="replicated")


def test_a_dcp_folder_is_not_read_as_a_sharded_checkpoint(tmp_path):
    from xlakit.checkpoint.format import folders

    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / "xlakit-commit.json").write_text(json.dumps({"format": folders.DCP_FORMAT, "files": {}}))
    with pytest.raises(xlakit.CheckpointFormatError, match="load it with xlakit.dcp_load"):
        xlakit.load(folder, shard=0)


def test_stale_temporary_folders_of_dead_processes_are_removed_too(tmp_path):
    from xlakit.checkpoint.core import paths

    final = tmp_path / "ckpt"
    stale = paths.temp_path(final)
    stale = stale.with_name(stale.name.replace(f".{os.getpid()}.", ".999999999."))
    stale.mkdir()
    (stale / "shard").write_bytes(b"x")
    assert paths.remove_stale_temps(tmp_path, stem="ckpt") == [stale] and not stale.exists()


def test_a_shard_that_cannot_be_written_names_itself_and_its_missing_folder(tmp_path, one_rank, monkeypatch):
    # Regression (issue 36's store split): a shard's write error named the folder as the file, and lost
    # the diagnosis ("the folder ... does not exist") for "No such file or directory; check the disk".
    import shutil

    from xlakit.checkpoint.core import paths

    folder, real = tmp_path / "ckpt", paths.temp_path

    def vanishing(final, *args, **kwargs):  # the folder gone when the shard is opened (storage this rank lost)
        if final.name.startswith("shard-"):
            shutil.rmtree(folder)
        return real(final, *args, **kwargs)

    monkeypatch.setattr(paths, "temp_path", vanishing)
    with pytest.raises(xlakit.CheckpointWriteError, match=rf"cannot save .*ckpt/shard-00000-of-00001\.\S+\.pt "
                                                          rf"\(open\): the folder {folder} does not exist") as e:
        xlakit.save({"w": torch.ones(2)}, folder, layout="sharded", timeout_s=30)
    assert e.value.filename.startswith(str(folder / "shard-00000-of-00001.")), e.value.filename


def test_a_commit_record_that_cannot_be_written_is_a_checkpoint_write_error(tmp_path, one_rank, monkeypatch):
    # Regression: the committing rank raised the raw OSError of writing a sharded save's commit record
    # (a full disk), where every other failure of the save is a CheckpointWriteError naming what it wrote.
    import errno

    from xlakit.checkpoint.store import local

    class FullDisk:  # a fake: the disk fills up exactly when the commit record is written
        dumps = staticmethod(json.dumps)

        @staticmethod
        def dump(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "json", FullDisk)
    folder = tmp_path / "ckpt"
    with pytest.raises(xlakit.CheckpointWriteError, match=r"cannot save .*ckpt/xlakit-commit\.json \(\w+\): no "
                                                          r"space for the checkpoint"):
        xlakit.save({"w": torch.ones(2)}, folder, layout="sharded", timeout_s=30)
    assert [p.name for p in folder.iterdir()] == [], "nothing committed, the shard and the temporaries removed"
