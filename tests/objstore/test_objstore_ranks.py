"""Coordinated saves to object storage with real processes: 4 ranks (gloo over loopback), one job
running every phase of tests/support/objstore_ranks_worker.py against a bucket on each local server.

The checkpoints are then checked from here, in this process, as a later job would read them.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import xlakit
from tests.support import ranks
from tests.support.objstore_ranks_worker import DEADLINE_S, VICTIM
from tests.support.objstore_servers import REFUSED
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, store_for
from tests.support import SUPPORT

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
WORKER = SUPPORT / "objstore_ranks_worker.py"
WORLD = 4
SCHEMES = ("s3", "gs")  # the rank is killed in the last one's phase
PHASES = "sharded,replicated,async,dcp,manager,kill"
MARGIN_S = 8.0  # the others wait for rank 0's verdict a few seconds more
# Parts of 5 MiB, one in flight: an 8 MiB shard is uploaded in several requests on both servers.
SMALL_PARTS = {"XLAKIT_OBJECT_PART_BYTES": str(5 << 20), "XLAKIT_OBJECT_PARTS_IN_FLIGHT": "1",
               "XLAKIT_OBJECT_CHUNK_BYTES": str(5 << 20)}


@pytest.fixture(scope="module")
def job(objstore_servers):
    """The job's reports per rank, by (phase, scheme); the victim is killed once it says it is uploading."""
    servers = {scheme: objstore_servers(scheme) for scheme in SCHEMES}
    urls = {scheme: f"{server.bucket()}/run" for scheme, server in servers.items()}
    env = {name: value for server in servers.values() for name, value in server.env().items()}
    started = ranks.Job(WORKER, PHASES, ",".join(urls[s] for s in SCHEMES), WORLD, env={**env, **SMALL_PARTS})
    started.wait_event(VICTIM, "uploading", timeout=300)
    started.signal(VICTIM, signal.SIGKILL)
    results = started.results(timeout=120)
    reports = {r: {(line["phase"], line["scheme"]): line for line in started.lines[r] if "phase" in line}
               for r in range(WORLD)}
    for r in range(WORLD):
        assert REFUSED not in results[r]["stderr"], results[r]["stderr"]
    return env, urls, reports, results


def _view(job, scheme: str, monkeypatch) -> tuple[str, dict, dict]:
    """This process pointed at the servers; one scheme's URL, reports (by phase) and results."""
    env, urls, reports, results = job
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    mine = {r: {phase: line for (phase, s), line in reports[r].items() if s == scheme} for r in range(WORLD)}
    return urls[scheme], mine, results


@pytest.fixture(params=SCHEMES)
def here(request, job, monkeypatch, loopback_only):
    return _view(job, request.param, monkeypatch)


@pytest.fixture
def killed(job, monkeypatch, loopback_only):
    """The server of the phase in which a rank was killed (once per job)."""
    return _view(job, SCHEMES[-1], monkeypatch)


def _names(url: str) -> list[str]:
    loc = Location.parse(url)
    return sorted(store_for(loc).list(None, loc))


def test_a_4_rank_sharded_save_to_a_bucket_loads_and_restores_on_every_rank(here):
    url, reports, results = here
    for r in range(WORLD):
        got = reports[r].get("sharded")
        assert got is not None, results[r]["stderr"]
        assert got["loaded"] == {"version": 1, "rank": r, "w0": 10.0 + r}
        assert got["restored"] == got["loaded"] and got["in_place"]
    shard = xlakit.load(f"{url}/sharded", shard=3)  # outside the job, one shard by number
    assert shard["version"] == 2 and torch.equal(shard["w"], torch.full((1000,), 23.0))
    with pytest.raises(xlakit.CheckpointFormatError, match="sharded checkpoint.*shard=N"):
        xlakit.load(f"{url}/sharded")  # one process, no shard named


def test_an_asynchronous_sharded_save_commits_one_record_naming_every_rank_s_shard(here):
    url, reports, _ = here
    for r in range(WORLD):
        assert reports[r]["async"]["loaded"] == {"version": 2, "rank": r, "w0": 20.0 + r}
    loc = Location.parse(f"{url}/sharded")
    record = generations.latest_record(store_for(loc), None, loc, "sharded")
    assert record["generation"] == 2 and record["world"] == WORLD
    assert [n.rsplit(".shard-", 1)[1] for n in record["shards"]] == [
        f"{r:05d}-of-{WORLD:05d}.pt" for r in range(WORLD)]
    assert {e["rank"] for e in record["objects"].values()} == set(range(WORLD))
    from xlakit import cli

    assert cli.main(["ckpt", "verify", f"{url}/sharded"]) == 0  # every shard read and verified


def test_a_replicated_save_is_written_by_its_writer_rank_and_loaded_by_every_rank(here):
    url, reports, _ = here
    for r in range(WORLD):
        assert reports[r]["replicated"]["loaded"] == {"version": 1, "rank": 1, "w0": 11.0}
    assert xlakit.load(f"{url}/replicated.pt")["rank"] == 1  # a file checkpoint: any process loads it


def test_a_4_rank_dcp_save_to_a_bucket_commits_last_and_loads_resharded(here):
    url, reports, _ = here
    for r in range(WORLD):
        assert reports[r]["dcp"]["mismatch"] == [], reports[r]["dcp"]
    loc = Location.parse(f"{url}/dcp")
    store = store_for(loc)
    record = generations.latest_record(store, None, loc, "dcp")
    files = sorted(n.rsplit("/", 1)[1] for n in record["objects"])
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(WORLD)]  # every rank's, hashed
    names = store.list(None, loc)
    for name, entry in record["objects"].items():
        assert names[name] == entry["nbytes"] and name.startswith(record["folder"] + "/")
    from tests.support.dcp_worker import full

    state = {"model": {k: torch.zeros_like(v) for k, v in full(0).items() if k != "plain"},
             "plain": torch.zeros(5), "step": 0}
    xlakit.dcp_load(state, f"{url}/dcp")  # one process reads what 4 wrote
    assert all(torch.equal(state["model"][k], full(1)[k]) for k in ("w", "b", "ids")) and state["step"] == 1


def test_a_rank_killed_mid_upload_commits_nothing_anywhere_and_the_previous_stays(killed):
    url, reports, results = killed
    assert "kill" not in reports[VICTIM] and results[VICTIM]["exit"] == -signal.SIGKILL
    for r in set(range(WORLD)) - {VICTIM}:
        got = reports[r]["kill"]
        assert got.get("error") == "CheckpointTimeoutError", got
        assert got["rank_named"] == VICTIM and f"[{VICTIM}]" in got["message"], got
        assert got["error_after_s"] < DEADLINE_S + MARGIN_S
        assert got["previous"] == {"version": 2, "rank": r, "w0": 20.0 + r}
    names = _names(f"{url}/sharded")
    assert generations.commit_name(3) not in names  # no commit anywhere
    assert xlakit.load(f"{url}/sharded", shard=VICTIM)["version"] == 2
    # What the aborted save uploaded can never be committed: the next save removes every object of it.
    xlakit.save({"after": torch.ones(2)}, f"{url}/sharded")
    left = [n for n in _names(f"{url}/sharded") if n.startswith(f"{3:020d}.") and ".shard-" in n]
    assert left == [], left


def test_a_4_rank_manager_on_a_bucket_saves_keeps_one_step_and_restores_every_rank_s_shard(here):
    url, reports, results = here
    for r in range(WORLD):
        got = reports[r].get("manager")
        assert got is not None, results[r]["stderr"][-2000:]
        assert got["steps"] == [3] and got["restored"] == {"version": 3, "rank": r, "w0": 30.0 + r}
    left = {n.split("/")[0] for n in _names(f"{url}/mgr")}
    assert left == {"3"}, left  # retention took steps 1 and 2 everywhere; the lease was released
    assert xlakit.ReadOnlyCheckpointManager(f"{url}/mgr").restore(shard=1)["w"][0].item() == 31.0

