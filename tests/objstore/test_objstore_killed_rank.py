"""A rank SIGKILLed during a coordinated sharded save to a bucket, at each phase, with real processes.

Issue 25 item 4: three ranks save sharded to a bucket and rank 1 dies. Whatever the moment, the
agreement must hold on buckets as on disk: a kill before the victim's vote commits nothing (the
survivors name rank 1, the previous checkpoint stays whole); a kill after its vote either commits the
whole save (every shard the record names exists with its recorded size and loads bit for bit) or
nothing; never a record naming a missing or partial shard, never a survivor reporting success without
such a record. Each case is one job of tests/support/objstore_ranks_worker.py's `killat` phase (the
victim kills itself at a hook; rank 0 holds, where the phase says, until the victim is dead and reaped,
as torchrun reaps it), checked from here as a later job would read it.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

import xlakit
from tests.support import SUPPORT, ranks
from tests.support.objstore_ranks_worker import KILLAT_DEADLINE_S, KILLAT_VICTIM, killat_tensor
from tests.support.objstore_servers import REFUSED
from xlakit.checkpoint.format import folders
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, store_for

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
WORKER = SUPPORT / "objstore_ranks_worker.py"
WORLD = 3
SURVIVORS = [r for r in range(WORLD) if r != KILLAT_VICTIM]
# Small parts, one in flight (the smallest S3 allows is 5 MiB): the 4 MiB shards stay cheap to upload.
SMALL_PARTS = {"XLAKIT_OBJECT_PART_BYTES": str(5 << 20), "XLAKIT_OBJECT_PARTS_IN_FLIGHT": "1",
               "XLAKIT_OBJECT_CHUNK_BYTES": str(5 << 20)}
MARGIN_S = 8.0


@pytest.fixture(params=["gs", "s3", "disk"])
def where(request, tmp_path, objstore_servers, monkeypatch, loopback_only):
    """A fresh bucket's URL on each server (the clients pointed at it), or a local folder."""
    if request.param == "disk":
        return str(tmp_path)
    server = objstore_servers(request.param)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return server.bucket()


def _run(url: str, at: str) -> tuple[dict, dict]:
    if _on_disk(url):
        Path(url).mkdir()
    job = ranks.Job(WORKER, "killat", url, WORLD, env={"XLAKIT_TEST_KILL_AT": at, **SMALL_PARTS})
    # Reap the victim as soon as it dies (as torchrun would): a zombie still counts as a live process.
    job.procs[KILLAT_VICTIM].wait(120)
    results = job.results(timeout=120)
    for r in range(WORLD):
        assert REFUSED not in results[r]["stderr"], results[r]["stderr"]
    reports = {r: next((line for line in job.lines[r] if line.get("phase") == "killat"), None)
               for r in range(WORLD)}
    events = {r: [line for line in job.lines[r] if "event" in line] for r in range(WORLD)}
    # Shown whole when it fails: the victim's own report says why it did not reach its kill point.
    assert results[KILLAT_VICTIM]["exit"] == -signal.SIGKILL, (reports, results[KILLAT_VICTIM]["stderr"][-4000:])
    assert events[KILLAT_VICTIM] == [{"event": "killing", "at": at}]
    assert reports[KILLAT_VICTIM] is None
    for r in SURVIVORS:
        assert reports[r] is not None and results[r]["exit"] == 0, results[r]["stderr"][-3000:]
    return reports, events


def _on_disk(url: str) -> bool:
    return url.startswith("/")


def _record(url: str) -> dict:
    """The newest commit record, with the generation (a bucket) or save id (disk) it names."""
    if _on_disk(url):
        return json.loads((Path(url) / folders.COMMIT_RECORD).read_text())
    loc = Location.parse(url)
    return generations.latest_record(store_for(loc), None, loc, "sharded")


def _shards(url: str, record: dict) -> list[tuple[int, str, int, int | None]]:
    """(rank, name, recorded size, size found) of every shard the record names."""
    if _on_disk(url):
        out = []
        for s in record["shards"]:
            path = Path(url) / s["file"]
            out.append((s["rank"], s["file"], s["bytes"], path.stat().st_size if path.exists() else None))
        return out
    loc = Location.parse(url)
    names = store_for(loc).list(None, loc)
    return [(record["objects"][n]["rank"], n, record["objects"][n]["nbytes"], names.get(n))
            for n in record["shards"]]


def _check_whole(url: str, record: dict, version: int) -> None:
    """Every shard the record names exists with its recorded size and loads bit for bit."""
    assert record["world"] == WORLD and len(record["shards"]) == WORLD
    for r, (rank, name, recorded, found) in enumerate(_shards(url, record)):
        assert rank == r and f"{r:05d}-of-{WORLD:05d}" in name, name
        assert found == recorded, (name, found, recorded)  # there, whole
        got = xlakit.load(url, shard=r)
        assert (got["version"], got["rank"]) == (version, r)
        assert torch.equal(got["w"], killat_tensor(version, r))
    from xlakit import cli

    assert cli.main(["ckpt", "verify", url]) == 0  # every object against its size and xxh3-64


def test_a_rank_killed_before_its_vote_commits_nothing_and_the_survivors_name_it(where):
    url = f"{where}/run"
    reports, _ = _run(url, "before-vote")
    for r in SURVIVORS:
        got = reports[r]
        assert got.get("error") in ("CheckpointTimeoutError", "CheckpointPeerError"), got
        assert got["rank_named"] == KILLAT_VICTIM and f"[{KILLAT_VICTIM}]" in got["message"], got
        assert got["returned_after_s"] < KILLAT_DEADLINE_S + MARGIN_S
        assert got["loaded"] == {"version": 1, "rank": r, "exact": True}, got
    record = _record(f"{url}/killat")
    if not _on_disk(url):
        assert record["generation"] == 1  # no record of generation 2 anywhere
        assert generations.commit_name(2) not in store_for(Location.parse(f"{url}/killat")).list(
            None, Location.parse(f"{url}/killat"))
    _check_whole(f"{url}/killat", record, 1)  # the previous checkpoint, whole, the victim's shard too


@pytest.mark.parametrize("at", ["after-vote", "after-vote-before-tidy", "after-commit"])
def test_a_rank_killed_after_its_vote_leaves_the_whole_save_committed(where, at):
    if at == "after-vote-before-tidy" and _on_disk(where):
        pytest.skip("a bucket's committing rank tidies before its upload; a folder has no such step")
    url = f"{where}/run"
    reports, events = _run(url, at)
    if at != "after-commit":  # the kill landed between the victim's vote and rank 0's commit
        assert events[0] == [{"event": "held", "at": "tidy" if "tidy" in at else "votes",
                              "victim_gone": True}], events[0]
    record = _record(f"{url}/killat")
    saved = [reports[r].get("saved", False) for r in SURVIVORS]
    # Success anywhere means a whole commit; here every vote was in, so the save committed whole.
    assert saved == [True] * len(SURVIVORS), reports
    assert _on_disk(url) or record["generation"] == 2
    _check_whole(f"{url}/killat", record, 2)
    for r in SURVIVORS:
        assert reports[r]["loaded"] == {"version": 2, "rank": r, "exact": True}, reports[r]
