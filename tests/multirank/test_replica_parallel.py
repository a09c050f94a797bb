"""Replica-parallel replicated saves and broadcast loads with real ranks (gloo, 4 processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import xlakit
from tests.support import SUPPORT, ranks, replica_state

pytestmark = pytest.mark.multiproc
WORKER = SUPPORT / "replicas_worker.py"
WORLD = 4


def run_ranks(scenario: str, folder: Path, env: dict | None = None) -> dict[int, dict]:
    """Each rank's JSON result, or its exit status and stderr when it printed none."""
    job = ranks.Job(WORKER, scenario, folder, WORLD, env=env)
    results = job.results()
    out = {}
    for r in range(WORLD):
        lines = job.lines[r]
        out[r] = lines[-1] if lines else {"exit": results[r]["exit"], "stderr": job.errors[r][-3000:]}
    return out


def check_shares(record: dict, version: int) -> None:
    """Every rank wrote a share, each at most 1/R + 5% of the state's bytes."""
    total = replica_state.nbytes(replica_state.state(version))
    written = [s["bytes"] for s in record["shares"]]
    assert [s["rank"] for s in record["shares"]] == list(range(WORLD))
    assert sum(written) >= total  # every byte written once (plus each file's index and pickle)
    for b in written:
        assert b <= total * (1 / WORLD + 0.05), (written, total)


def test_replica_parallel_save_and_broadcast_load_bit_exact_on_disk(tmp_path):
    results = run_ranks("roundtrip", tmp_path)
    folder = tmp_path / "ckpt"
    record = json.loads((folder / "xlakit-commit.json").read_text())
    assert (record["format"], record["version"], record["world"]) == ("xlakit-replicated", 2, WORLD)
    assert record["writer_rank"] == WORLD - 1
    total = replica_state.nbytes(replica_state.state(1))
    for rank, r in results.items():
        assert r.get("digest") == r.get("expected"), (rank, r)
        assert r.get("async_digest") == r.get("async_expected"), (rank, r)
        assert r.get("restored_digest") == r.get("async_expected"), (rank, r)  # xlakit.restore in the job
        assert r["wchar"] <= total * (1 / WORLD + 0.05), (rank, r["wchar"], total)  # counted by the kernel
        assert r["view_shares_storage"] and r["tied_shares_storage"], r
        assert r["wchar"] >= total / WORLD * 0.95, (rank, r["wchar"], total)
        # its own share, once; the rest came by broadcast
        assert len(r["read"]) == 1 and r["read"][0].startswith(f"share-{rank:05d}-of-{WORLD:05d}."), r
    # Outside the job (one process): every share is read and the whole state comes back.
    assert replica_state.digest(xlakit.load(folder)) == replica_state.digest(replica_state.state(2))
    restored = xlakit.restore(folder, replica_state.zeroed(replica_state.state(2)))
    assert replica_state.digest(restored) == replica_state.digest(replica_state.state(2))
    record = json.loads((folder / "xlakit-commit.json").read_text())  # the asynchronous save's
    check_shares(record, 2)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["xlakit-commit.json"] + [s["file"] for s in record["shares"]])


@pytest.mark.parametrize("when", ["transfer", "writing"])
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, when):
    results = run_ranks("2-dies" + ("-writing" if when == "writing" else ""), tmp_path)
    assert results[2]["exit"] == 17
    for rank in (0, 1, 3):
        r = results[rank]
        assert r.get("error") == "CheckpointTimeoutError" and r.get("rank_named") == 2, (rank, r)
    record = json.loads((tmp_path / "ckpt" / "xlakit-commit.json").read_text())
    committed = {"xlakit-commit.json", *(s["file"] for s in record["shares"])}
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name not in committed]
    # Its share's temporary file, partly written, is never loaded; a survivor's tidy removes it once the
    # dead rank's process is gone (a zombie counts as gone: it can write nothing more).
    assert all("share-00002" in n for n in leftovers), leftovers
    assert replica_state.digest(xlakit.load(tmp_path / "ckpt")) == replica_state.digest(replica_state.state(1))


def test_an_old_single_file_replicated_checkpoint_still_loads(tmp_path):
    results = run_ranks("old-format", tmp_path)
    for rank, r in results.items():
        assert r.get("digest") == r.get("expected"), (rank, r)
    assert (tmp_path / "old.pt").is_file()
    assert replica_state.digest(xlakit.load(tmp_path / "old.pt")) == replica_state.digest(replica_state.state(3))


def _bucket_record(url: str) -> dict:
    from xlakit.checkpoint.objstore import generations
    from xlakit.checkpoint.objstore.client import Location, store_for

    loc = Location.parse(url)
    return generations.latest_record(store_for(loc), None, loc)


@pytest.mark.slow
def test_replica_parallel_save_and_broadcast_load_bit_exact_on_a_bucket(bucket, tmp_path):
    url = f"{bucket}/run"
    results = run_ranks("roundtrip", tmp_path, env={"XLAKIT_TEST_TARGET": url})
    record = _bucket_record(url)
    assert (record["kind"], record["layout_version"], record["world"]) == ("replicated", 2, WORLD)
    shares = [{"rank": record["objects"][n]["rank"], "bytes": record["objects"][n]["nbytes"]}
              for n in record["shares"]]
    check_shares({"shares": shares}, 2)
    for rank, r in results.items():
        assert r.get("digest") == r.get("expected"), (rank, r)
        assert r.get("async_digest") == r.get("async_expected"), (rank, r)
        assert r.get("restored_digest") == r.get("async_expected"), (rank, r)
        assert r["view_shares_storage"] and r["tied_shares_storage"], r
        assert len(r["read"]) == 1 and r["read"][0].endswith(f".share-{rank:05d}-of-{WORLD:05d}.pt"), r
    assert replica_state.digest(xlakit.load(url)) == replica_state.digest(replica_state.state(2))
    restored = xlakit.restore(url, replica_state.zeroed(replica_state.state(2)))
    assert replica_state.digest(restored) == replica_state.digest(replica_state.state(2))


@pytest.mark.slow
def test_a_rank_killed_mid_save_to_a_bucket_leaves_the_previous_checkpoint(bucket, tmp_path):
    url = f"{bucket}/run"
    results = run_ranks("2-dies", tmp_path, env={"XLAKIT_TEST_TARGET": url})
    assert results[2]["exit"] == 17
    for rank in (0, 1, 3):
        r = results[rank]
        assert r.get("error") == "CheckpointTimeoutError" and r.get("rank_named") == 2, (rank, r)
    assert replica_state.digest(xlakit.load(url)) == replica_state.digest(replica_state.state(1))


@pytest.mark.slow
def test_an_old_single_object_replicated_checkpoint_still_loads_from_a_bucket(bucket, tmp_path):
    url = f"{bucket}/run"
    results = run_ranks("old-format", tmp_path, env={"XLAKIT_TEST_TARGET": url})
    for rank, r in results.items():
        assert r.get("digest") == r.get("expected"), (rank, r)
    assert replica_state.digest(xlakit.load(url + "-old.pt")) == replica_state.digest(replica_state.state(3))


def _read_once(results: dict[int, dict], slack: int) -> None:
    for rank, r in results.items():
        assert r.get("bit_exact"), (rank, r)
        assert r["bytes_read"] <= r["share_bytes"] + slack, (rank, r)


def test_a_broadcast_restore_reads_each_share_once_on_disk(tmp_path):
    # Regression (issue 35): a broadcast restore of 2 MiB shares read each share about twice.
    _read_once(run_ranks("read-once", tmp_path), 0)


@pytest.mark.slow
def test_a_broadcast_restore_downloads_each_share_once_from_a_bucket(bucket, tmp_path):
    # Regression (issue 35): the same, on gs:// and s3://; the commit records it reads are small.
    _read_once(run_ranks("read-once", tmp_path, env={"XLAKIT_TEST_TARGET": f"{bucket}/run"}), 64 << 10)
