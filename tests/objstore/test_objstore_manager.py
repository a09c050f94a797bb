"""CheckpointManager on object storage against the real local servers (each test on both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import xlakit
from xlakit.checkpoint.core import paths
from xlakit.checkpoint.objstore import lease
from xlakit.checkpoint.stepstore import bucket_steps
from xlakit.checkpoint.objstore.client import Location, store_for


def names(url: str) -> list[str]:
    loc = Location.parse(url)
    return sorted(store_for(loc).list(None, loc))


def put(url: str, body: bytes) -> None:
    loc = Location.parse(url)
    store_for(loc).put(None, loc, body)


def test_retention_on_a_bucket_deletes_only_what_commit_records_name_and_ls_lists_the_steps(bucket, capsys):
    from xlakit import cli

    url = f"{bucket}/run"
    with xlakit.CheckpointManager(url, max_to_keep=2, best_metric="loss") as mgr:
        mgr.save(1, {"w": torch.full((3,), 1.0)}, metrics={"loss": 0.1})  # the best: kept
        put(f"{url}/2/notes.txt", b"a user's file")  # a step-shaped prefix that is not the manager's
        put(f"{url}/readme.txt", b"not a step")
        for step in (3, 4, 5, 6):
            mgr.save(step, {"w": torch.full((3,), float(step))}, metrics={"loss": float(step)})
            if step == 3:
                put(f"{url}/3/notes.txt", b"a user's file in a step retention drops")
        assert mgr.all_steps() == [1, 5, 6] and mgr.best_step() == 1
        assert torch.equal(mgr.restore()["w"], torch.full((3,), 6.0))
        assert torch.equal(mgr.restore(1)["w"], torch.full((3,), 1.0))
        with pytest.raises(ValueError, match="cannot save step 2 .*latest committed step is 6"):
            mgr.save(2, {"w": torch.ones(3)}, metrics={"loss": 9.0}, force=True)  # the user's file stays
    left = names(url)
    # Dropped steps: everything the manager wrote is gone; nothing else was touched.
    assert [n for n in left if n.split("/")[0] in ("2", "3", "4")] == ["2/notes.txt", "3/notes.txt"], left
    assert "readme.txt" in left
    assert not [n for n in left if n.startswith("xlakit-lease.")]  # released at close
    assert xlakit.cli.main(["ckpt", "ls", "--json", url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["state"], s["best"]) for s in shown["steps"]] == [
        (1, "committed", True), (5, "committed", False), (6, "committed", False)]
    assert set(shown["other"]) == {"2", "3", "readme.txt"} and all(s["bytes"] > 0 for s in shown["steps"])
    assert cli.main(["ckpt", "ls", url]) == 0
    assert "3 committed step(s), latest 6" in capsys.readouterr().out


def test_a_retention_killed_after_its_deletion_record_is_finished_by_the_next_manager(bucket):
    url = f"{bucket}/run"
    with xlakit.CheckpointManager(url, layout="dcp") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step)), "step": step})
    bucket_steps.BucketFolder(url).discard([1])  # what a retention does before a kill could stop it
    assert [n for n in names(url) if n.startswith("1/")]  # still there, but not a step any more
    with xlakit.CheckpointManager(url, layout="dcp") as mgr:
        assert mgr.all_steps() == [2]
        state = {"w": torch.zeros(4), "step": 0}
        assert mgr.restore(template=state)["step"] == 2 and torch.equal(state["w"], torch.full((4,), 2.0))
    assert not [n for n in names(url) if n.startswith("1/")]  # the next manager finished the deletion


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _lease(url: str, n: int, **body) -> None:
    loc = Location.parse(url)
    store_for(loc).put(None, loc.child(lease.lease_name(n)), json.dumps(body).encode(), create_only=True)


def test_one_manager_per_url_a_lease_names_its_holder_and_a_dead_or_expired_one_is_taken_over(bucket):
    url = f"{bucket}/run"
    with xlakit.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        with pytest.raises(xlakit.CheckpointBusyError, match=f"pid {os.getpid()} on"):
            xlakit.CheckpointManager(url)  # the holder is alive, here
    # A holder on another host, its lease running for longer than this manager may wait: refused.
    _lease(url, 5, holder="pid 1 on elsewhere", host="elsewhere", pid=1, expires_unix=time.time() + 600)
    with pytest.raises(xlakit.CheckpointBusyError, match="pid 1 on elsewhere") as e:
        xlakit.CheckpointManager(url, options=xlakit.SaveOptions(timeout_s=5))
    assert "xlakit-lease.00000000000000000005.json" in str(e.value.__notes__)
    # A dead process of this host, or an expired lease: taken over (exactly one lease object after).
    _lease(url, 6, holder="a dead one", host=paths.host(), pid=_dead_pid(), expires_unix=time.time() + 600)
    with xlakit.CheckpointManager(url) as mgr:
        assert [n for n in names(url) if n.startswith("xlakit-lease.")] == ["xlakit-lease.00000000000000000007.json"]
    _lease(url, 8, holder="pid 1 on elsewhere", host="elsewhere", pid=1, expires_unix=time.time() - 600)
    with xlakit.CheckpointManager(url) as mgr:
        assert mgr.all_steps() == [1]


def test_a_manager_whose_lease_was_taken_over_stops_before_it_writes(bucket, monkeypatch):
    url = f"{bucket}/run"
    monkeypatch.setattr(lease, "SKEW_S", 0.0)
    monkeypatch.setenv("XLAKIT_MANAGER_LEASE_S", "1")
    first = xlakit.CheckpointManager(url)
    try:
        time.sleep(1.2)  # silent for longer than its lease
        monkeypatch.delenv("XLAKIT_MANAGER_LEASE_S")
        with xlakit.CheckpointManager(url) as second:
            second.save(1, {"w": torch.ones(2)})
            with pytest.raises(xlakit.CheckpointBusyError, match="lost its lease"):
                first.save(2, {"w": torch.zeros(2)})
            assert second.all_steps() == [1] and not [n for n in names(url) if n.startswith("2/")]
    finally:
        first.close()


def test_a_read_only_manager_reads_a_bucket_the_writer_holds_and_changes_nothing(bucket):
    url = f"{bucket}/watched"
    with xlakit.CheckpointManager(url) as writer:
        writer.save(1, {"w": torch.full((2,), 1.0)}, metrics={"loss": 0.5})
        put(f"{url}/7/{xlakit.checkpoint.stepstore.steps.STEP_RECORD}", b"{not json")  # a damaged step record
        before = names(url)
        reader = xlakit.ReadOnlyCheckpointManager(url)  # while the writer holds the URL's lease
        assert reader.all_steps() == [1] and reader.latest_step() == 1 and reader.metrics(1) == {"loss": 0.5}
        assert torch.equal(reader.restore()["w"], torch.full((2,), 1.0))
        with pytest.raises(xlakit.CheckpointCorruptError, match="step 7 .* is damaged") as info:
            reader.restore(7)
        assert "never deletes or reuses" in "".join(info.value.__notes__)
        assert names(url) == before  # the reader wrote and deleted nothing
        writer.save(2, {"w": torch.full((2,), 2.0)})
        assert reader.wait_for_step(1, timeout_s=30, poll_interval_s=0.05) == 2
        assert torch.equal(reader.restore()["w"], torch.full((2,), 2.0))


def test_a_refused_save_leaves_no_step_record_in_the_bucket(bucket):
    # Regression: a refused save left <step>/xlakit-step.json, listed as an interrupted save.
    url = f"{bucket}/refused"
    with xlakit.CheckpointManager(url) as mgr:
        with pytest.raises(xlakit.CheckpointSerializationError, match="cannot save bad"):
            mgr.save(1, {"w": torch.ones(2), "bad": object()})
        assert not any(n.startswith("1/") for n in names(url)), names(url)
        mgr.save(1, {"w": torch.ones(2)})
        assert mgr.all_steps() == [1]


def test_verify_of_a_manager_url_checks_every_committed_step(bucket, capsys):
    from xlakit import cli

    url = f"{bucket}/verified"
    record = xlakit.checkpoint.stepstore.steps.STEP_RECORD
    with xlakit.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": torch.full((1000,), 1.0)})
        mgr.save(2, {"w": torch.full((1000,), 2.0)})
    assert cli.main(["ckpt", "verify", "--json", url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "ok" and shown["steps"] == [1, 2] and shown["bytes"] >= 8000
    # A step record without its checkpoint: a save that never committed, nothing to verify.
    loc = Location.parse(f"{url}/1/{record}")
    put(f"{bucket}/empty/1/{record}", store_for(loc).get(None, loc))
    assert cli.main(["ckpt", "verify", f"{bucket}/empty"]) == 3
    assert "holds no committed step" in capsys.readouterr().out
    # One object of step 1 with a byte changed (its commit record still names the old digest).
    name = next(n for n in names(url) if n.startswith("1/") and n.endswith(".pt"))
    loc = Location.parse(f"{url}/{name}")
    body = bytearray(store_for(loc).get(None, loc))
    body[len(body) // 2] ^= 0xFF
    put(f"{url}/{name}", bytes(body))
    assert cli.main(["ckpt", "verify", url]) == 1
    assert "DAMAGED: step 1" in capsys.readouterr().out
    put(f"{url}/2/{record}", b"{not json")
    assert cli.main(["ckpt", "verify", url]) == 1
    out = capsys.readouterr().out
    assert "step 2 of" in out and "is damaged" in out
