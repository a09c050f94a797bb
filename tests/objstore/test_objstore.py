"""Checkpoints on object storage against real local servers (fake-gcs-server, moto): one file.

Every test runs on both servers (`bucket` fixture, conftest.py); the clients
find them through STORAGE_EMULATOR_HOST / AWS_ENDPOINT_URL only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import xlakit
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, store_for
from tests.support import SUPPORT

WORKER = SUPPORT / "objstore_worker.py"
SMALL_PARTS = {"XLAKIT_OBJECT_PART_BYTES": str(5 << 20), "XLAKIT_OBJECT_CHUNK_BYTES": str(5 << 20)}


def listing(url: str) -> list[str]:
    loc = Location.parse(url)
    return sorted(store_for(loc).list(None, loc))


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
            "tied": None, "step": seed, "lr": 0.5, "name": "run"}


def test_each_server_lets_exactly_one_of_two_creates_of_one_name_succeed(bucket):
    # The protocol rests on this: if a server ignored the precondition, the race tests would prove nothing.
    loc = Location.parse(f"{bucket}/x/record.json")
    store = store_for(loc)
    outcomes = []
    for body in (b"first", b"second"):
        try:
            store.put(None, loc, body, create_only=True)
            outcomes.append("created")
        except FileExistsError:
            outcomes.append("refused")
    assert outcomes == ["created", "refused"]
    assert store.get(None, loc) == b"first"


def test_no_credential_lookup_leaves_the_machine_in_the_test_environment(loopback_only):
    # Guards the GCE metadata probe stage 1 saw: google-auth honours NO_GCE_CHECK only when it is "true".
    import google.auth
    from google.auth.compute_engine import _metadata

    from tests.support.objstore_servers import CLOSED_PORT

    with pytest.raises(google.auth.exceptions.DefaultCredentialsError):
        google.auth.default()  # no GCE check, so no request at all (the fixture fails on any)
    assert CLOSED_PORT in _metadata._get_metadata_root(False)  # and a direct one would go nowhere


def test_round_trip_is_bit_exact_and_saving_again_keeps_the_previous_generation(bucket):
    url = f"{bucket}/run/latest.pt"
    for seed in (1, 2, 3):
        s = state(seed)
        s["tied"] = s["model"]["w"][1:3]  # a view: shares the storage, as on disk
        xlakit.save(s, url)
    out = xlakit.load(url)
    want = state(3)
    assert torch.equal(out["model"]["w"], want["model"]["w"]) and out["model"]["b"].dtype == torch.bfloat16
    assert torch.equal(out["model"]["b"], want["model"]["b"]) and out["step"] == 3 and out["name"] == "run"
    assert out["tied"].untyped_storage().data_ptr() == out["model"]["w"].untyped_storage().data_ptr()
    names = listing(url)
    assert [n for n in names if n.startswith("xlakit-commit.")] == [generations.commit_name(2),
                                                                    generations.commit_name(3)]
    assert len([n for n in names if n.endswith(".pt")]) == 2  # generation 1 went with its record


def test_restore_fills_the_template_in_place_from_a_bucket(bucket):
    url = f"{bucket}/latest.pt"
    xlakit.save(state(5), url)
    template = state(0)
    w = template["model"]["w"]
    out = xlakit.restore(url, template)
    assert out["model"]["w"] is w and torch.equal(w, state(5)["model"]["w"]) and out["step"] == 5


def test_an_asynchronous_save_commits_in_the_background(bucket, no_pending_save):
    url = f"{bucket}/async.pt"
    handle = xlakit.save(state(4), url, asynchronous=True)
    handle.result()
    assert xlakit.load(url)["step"] == 4


def test_a_damaged_object_is_found_by_load_and_names_the_tensor(bucket):
    url = f"{bucket}/damaged.pt"
    xlakit.save(state(1), url)
    loc = Location.parse(url)
    store = store_for(loc)
    (name,) = [n for n in listing(url) if n.endswith(".pt")]
    data = bytearray(store.get(None, loc.child(name)))
    w = state(1)["model"]["w"].numpy().tobytes()
    data[bytes(data).index(w[:64]) + 100] ^= 0x01  # one bit of model/w
    store.put(None, loc.child(name), bytes(data))
    with pytest.raises(xlakit.CheckpointCorruptError, match="model/w") as e:
        xlakit.load(url)
    assert e.value.tensor == "model/w"


def test_a_url_without_a_committed_checkpoint_is_refused_saying_what_is_there(bucket):
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        xlakit.load(f"{bucket}/nothing.pt")
    with pytest.raises(ValueError, match="needs a bucket and a name"):
        xlakit.save(state(1), bucket)
    with pytest.raises(ValueError, match="not supported"):
        xlakit.save(state(1), "ftp://host/x.pt")


def test_dcp_save_commits_a_record_naming_every_file_and_load_verifies_them(bucket):
    url = f"{bucket}/dcp"
    saved = {"model": {"w": torch.randn(300, 20)}, "ids": torch.arange(12), "step": 4}
    xlakit.dcp_save({**saved, "step": 3}, url)
    xlakit.dcp_save(saved, url)  # the next generation; the first stays whole until a third commits
    loc = Location.parse(url)
    record = generations.latest_record(store_for(loc), None, loc, "dcp")
    assert record["generation"] == 2 and sorted(n.rsplit("/", 1)[1] for n in record["objects"]) == [
        ".metadata", "__0_0.distcp"]
    state = {"model": {"w": torch.zeros(300, 20)}, "ids": torch.zeros(12, dtype=torch.int64), "step": 0}
    assert xlakit.restore(url, state) is state  # a DCP checkpoint restores through dcp_load
    assert torch.equal(state["model"]["w"], saved["model"]["w"]) and state["step"] == 4
    with pytest.raises(xlakit.CheckpointFormatError, match="dcp_load"):
        xlakit.load(url)
    from xlakit import cli

    assert cli.main(["ckpt", "verify", url]) == 0  # every file read and checked against the record
    (data,) = [n for n in record["objects"] if n.endswith(".distcp")]
    body = bytearray(store_for(loc).get(None, loc.child(data)))
    body[len(body) // 2] ^= 0x01
    store_for(loc).put(None, loc.child(data), bytes(body))
    with pytest.raises(xlakit.CheckpointCorruptError, match=r"__0_0\.distcp"):
        xlakit.dcp_load(state, url)
    assert cli.main(["ckpt", "verify", url]) == 1



@pytest.mark.parametrize("change", ["cut short", "appended"])
def test_a_dcp_object_of_another_size_than_committed_is_named_before_it_is_read(bucket, change):
    # Regression: the one-pass reader asked for the committed byte range of a shorter object (the server's
    # bare 416 came out), and never saw bytes appended to one.
    url = f"{bucket}/dcp"
    xlakit.dcp_save({"w": torch.randn(300, 20)}, url)
    loc = Location.parse(url)
    record = generations.latest_record(store_for(loc), None, loc, "dcp")
    (data,) = [n for n in record["objects"] if n.endswith(".distcp")]
    body = store_for(loc).get(None, loc.child(data))
    store_for(loc).put(None, loc.child(data), body[:-10] if change == "cut short" else body + b"junk")
    state = {"w": torch.zeros(300, 20)}
    with pytest.raises(xlakit.CheckpointCorruptError, match=rf"__0_0\.distcp.*commit record says {len(body)}"):
        xlakit.dcp_load(state, url)
    assert not state["w"].any()

def _worker(scenario: str, url: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), scenario, url, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _wait_line(proc: subprocess.Popen, timeout_s: float = 60) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return json.loads(line)
        if not line and proc.poll() is not None:
            raise AssertionError(f"the worker exited ({proc.returncode}): {proc.stderr.read()[-3000:]}")
    raise AssertionError("the worker said nothing in time")


@pytest.mark.slow
def test_two_concurrent_writers_of_one_checkpoint_exactly_one_commits_the_other_leaves_nothing(bucket, tmp_path):
    url = f"{bucket}/shared.pt"
    xlakit.save(state(1), url)  # generation 1: both writers aim at generation 2
    with _worker("race", url, str(tmp_path)) as a, _worker("race", url, str(tmp_path)) as b:
        results = [_wait_line(a), _wait_line(b)]
        a.wait(30), b.wait(30)
    outcomes = sorted(r["result"] for r in results)
    assert outcomes == ["CheckpointConflictError", "committed"], results
    loser = next(r for r in results if r["result"] != "committed")
    winner = next(r for r in results if r["result"] == "committed")
    assert "committed generation 2 of this checkpoint first" in loser["message"]
    assert xlakit.load(url)["pid"] == winner["pid"]
    names = listing(url)
    assert not [n for n in names if f".{loser['pid']}." in n], names  # the loser left nothing


@pytest.mark.slow
def test_a_writer_killed_before_its_commit_commits_nothing_and_the_next_save_removes_its_object(bucket):
    url = f"{bucket}/killed.pt"
    xlakit.save(state(1), url)
    with _worker("stop-before-commit", url) as proc:
        event = _wait_line(proc)
        assert event["event"] == "uploaded"
        (orphan,) = event["objects"]
        assert orphan in listing(url)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert xlakit.load(url)["step"] == 1  # nothing committed; the previous checkpoint is whole
    assert generations.commit_name(2) not in listing(url)
    xlakit.save(state(2), url)  # same host, its process dead: its object is a leftover
    assert orphan not in listing(url)
    assert xlakit.load(url)["step"] == 2


@pytest.mark.slow
def test_kill_9_mid_upload_leaves_the_previous_checkpoint_and_no_commit(bucket):
    url = f"{bucket}/mid.pt"
    xlakit.save(state(1), url)
    before = listing(url)
    with _worker("slow-upload", url, env=SMALL_PARTS) as proc:
        assert _wait_line(proc)["event"] == "uploading"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert listing(url) == before  # an unfinished upload is no object; no record was made
    assert xlakit.load(url)["step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_server_that_stops_answering_raises_the_deadline_naming_the_object(scheme, tmp_path, monkeypatch,
                                                                            loopback_only):
    from tests.support.objstore_servers import Server

    server = Server(scheme, tmp_path / "server")  # its own: it is stopped with SIGSTOP
    try:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        for name, value in SMALL_PARTS.items():
            monkeypatch.setenv(name, value)
        url = f"{server.bucket()}/stalled.pt"
        xlakit.save(state(1), url)

        def pause_once_moving(p):
            if p.bytes_done and server.proc.poll() is None and not getattr(server, "paused", False):
                server.paused = True
                server.pause()

        big = {**state(2), "big": torch.zeros(6 << 20)}  # 24 MiB: several parts
        start = time.monotonic()
        with pytest.raises(xlakit.CheckpointTimeoutError, match=r"stalled\.pt/0+2\.") as e:  # the object in flight
            xlakit.save(big, url, timeout_s=4, progress_callback=pause_once_moving)
        assert time.monotonic() - start < 4 + 3
        assert "nothing was committed" in str(e.value.__notes__)
        server.resume()
        assert xlakit.load(url)["step"] == 1
    finally:
        server.stop()


def test_xlakit_ckpt_verifies_inspects_diffs_and_converts_a_checkpoint_in_a_bucket(bucket, tmp_path, capsys):
    from xlakit import cli

    url = f"{bucket}/cli.pt"
    xlakit.save(state(1), url)
    assert cli.main(["ckpt", "verify", url]) == 0
    assert cli.main(["ckpt", "inspect", "--json", url]) == 0
    shown = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert {t["name"]: t["shape"] for t in shown["tensors"]}["model/w"] == [300, 200]
    local = tmp_path / "local.pt"
    xlakit.save(state(1), local)
    assert cli.main(["ckpt", "diff", url, str(local)]) == 0
    assert cli.main(["ckpt", "convert", url, "--to", "safetensors", str(tmp_path / "out.safetensors")]) == 0
    loc = Location.parse(url)
    (name,) = [n for n in listing(url) if n.endswith(".pt")]
    data = bytearray(store_for(loc).get(None, loc.child(name)))
    w = state(1)["model"]["w"].numpy().tobytes()
    data[bytes(data).index(w[:64]) + 8] ^= 0x10
    store_for(loc).put(None, loc.child(name), bytes(data))
    assert cli.main(["ckpt", "verify", url]) == 1
    assert "model/w" in capsys.readouterr().out
