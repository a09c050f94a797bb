"""Transient failures between xlakit and the real local servers (each test on both).

The servers never fail on their own, so a fake network stands between them and
the client (`tests/support/flaky_proxy.py`, named as the fake it is): requests it picks
are answered 503 before reaching the server, or carried out with their answer
replaced by a 503 (a lost answer). The client libraries and servers are real.
"""

from __future__ import annotations

import time

import pytest
import torch

import xlakit
from tests.support.flaky_proxy import FAIL, LOSE, FlakyProxy
from xlakit.checkpoint.objstore.client import Location, store_for

MiB = 1 << 20


@pytest.fixture(params=["gs", "s3"])
def flaky(request, objstore_servers, monkeypatch, loopback_only):
    """(proxy, bucket URL, scheme): the clients pointed at a proxy in front of a fresh bucket."""
    server = objstore_servers(request.param)
    proxy = FlakyProxy(server)
    for name, value in proxy.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XLAKIT_OBJECT_PART_BYTES", str(5 * MiB))  # several parts of a small state
    monkeypatch.setenv("XLAKIT_OBJECT_CHUNK_BYTES", str(5 * MiB))
    yield proxy, server.bucket(), request.param
    proxy.stop()


def part(scheme: str):
    """A request carrying a part of an upload (S3 UploadPart, a GCS resumable session's chunk)."""
    if scheme == "gs":
        return lambda method, path, headers: "upload_id=" in path
    return lambda method, path, headers: method == "PUT" and "partNumber=" in path


def commit(scheme: str):
    """The create-only request of a commit record."""
    if scheme == "gs":
        return lambda method, path, headers: method == "POST" and "ifGenerationMatch=0" in path
    return lambda method, path, headers: method == "PUT" and "xlakit-commit." in path


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8 * MiB // 4 * 3 + 5, generator=g), "step": seed}  # 24 MiB: five parts or more


def commits(url: str) -> list[str]:
    loc = Location.parse(url)
    return [n for n in store_for(loc).list(None, loc) if n.startswith("xlakit-commit.")]


def test_parts_answered_503_are_sent_again_and_the_save_commits(flaky):
    proxy, bucket, scheme = flaky
    url = f"{bucket}/x.pt"
    proxy.add(part(scheme), FAIL, times=3)
    xlakit.save(state(1), url)
    assert len(proxy.injected()) == 3  # the faults happened, and the save went through them
    assert torch.equal(xlakit.load(url)["w"], state(1)["w"])
    assert len(commits(url)) == 1


def test_a_lost_answer_to_the_commit_is_recognised_as_the_saves_own_record(flaky):
    """The commit record was created but its answer lost: the client's resend is refused as taken,
    and xlakit reads the record back: its own, so the save committed (not a conflict)."""
    proxy, bucket, scheme = flaky
    url = f"{bucket}/x.pt"
    proxy.add(commit(scheme), LOSE, times=1)
    xlakit.save(state(2), url)
    assert [s.action for s in proxy.injected()] == [LOSE]
    assert torch.equal(xlakit.load(url)["w"], state(2)["w"])
    assert len(commits(url)) == 1


def test_a_part_resent_after_its_answer_was_lost_never_commits_a_wrong_object(flaky):
    """S3 replaces a part by its number, so the resend is harmless there; fake-gcs-server appends a
    resumable chunk sent twice, and xlakit's size check must refuse that object before any commit."""
    proxy, bucket, scheme = flaky
    url = f"{bucket}/x.pt"
    xlakit.save(state(3), url)
    proxy.add(part(scheme), LOSE, times=2)
    try:
        xlakit.save(state(4), url)
        saved = True
    except xlakit.CheckpointWriteError as e:
        assert "were sent" in str(e) and "nothing was committed" in str(e)
        saved = False
    assert len(proxy.injected()) == 2
    assert saved == (scheme == "s3"), "fake-gcs-server appended the chunk: the size check did not refuse it"
    assert torch.equal(xlakit.load(url)["w"], state(4 if saved else 3)["w"])  # never a corrupt checkpoint
    assert len(commits(url)) == (2 if saved else 1)
    xlakit.save(state(5), url)  # the next save goes on from whatever was left
    assert torch.equal(xlakit.load(url)["w"], state(5)["w"])


def test_a_store_failing_every_request_ends_the_save_at_its_deadline(flaky):
    proxy, bucket, scheme = flaky
    url = f"{bucket}/x.pt"
    xlakit.save(state(6), url)
    proxy.add(lambda *_: True, FAIL, times=10 ** 9)
    start = time.monotonic()
    with pytest.raises(xlakit.CheckpointTimeoutError):
        xlakit.save(state(7), url, timeout_s=6)
    assert time.monotonic() - start < 6 + 5
    proxy.rules.clear()
    assert torch.equal(xlakit.load(url)["w"], state(6)["w"]) and len(commits(url)) == 1


def test_a_request_outside_any_operation_ends_at_the_request_timeout(flaky, monkeypatch, capsys):
    """A manager URL's scan (`xlakit ckpt ls`) runs outside any operation: its requests, retries
    included, end at XLAKIT_OBJECT_REQUEST_TIMEOUT_S (they were retried for ever)."""
    from xlakit import cli
    from xlakit.checkpoint.stepstore import bucket_steps

    proxy, bucket, scheme = flaky
    monkeypatch.setenv("XLAKIT_OBJECT_REQUEST_TIMEOUT_S", "4")
    monkeypatch.setenv("XLAKIT_SAVE_TIMEOUT_S", "4")  # the deadline of the CLI's reads
    proxy.add(lambda *_: True, FAIL, times=10 ** 9)
    start = time.monotonic()
    with pytest.raises(xlakit.CheckpointTimeoutError, match="deadline"):
        bucket_steps.BucketFolder(f"{bucket}/run").scan()
    assert time.monotonic() - start < 4 + 3
    start = time.monotonic()
    assert cli.main(["ckpt", "ls", f"{bucket}/run"]) == 2
    assert time.monotonic() - start < 4 + 3
    # The store's own bound or the command's deadline, whichever fires first under load: both name it.
    err = capsys.readouterr().err
    assert "deadline" in err or "timed out after" in err, err


def test_s3_failures_that_s3fs_turns_into_oserrors_are_retried_by_xlakit(objstore_servers, monkeypatch,
                                                                         loopback_only, caplog):
    """s3fs raises a 503 as OSError(EBUSY), its status only in the cause: still transient."""
    server = objstore_servers("s3")
    proxy = FlakyProxy(server)
    try:
        for name, value in proxy.env().items():
            monkeypatch.setenv(name, value)
        url = f"{server.bucket()}/x.pt"
        proxy.add(lambda method, path, headers: method == "GET" and "list-type=2" in path, FAIL, times=12)
        xlakit.save(state(8), url, timeout_s=120)
        assert len(proxy.injected()) == 12
        assert any("retrying" in r.getMessage() for r in caplog.records)  # xlakit's own retry, not only botocore's
        assert torch.equal(xlakit.load(url)["w"], state(8)["w"])
    finally:
        proxy.stop()


def test_ctrl_c_of_the_cli_reading_a_stalled_store_is_one_line_and_exit_130(flaky, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    proxy, bucket, scheme = flaky
    url = f"{bucket}/x.pt"
    xlakit.save(state(9), url)
    proxy.server.pause()
    try:
        env = {**os.environ, "PJRT_DEVICE": "CPU"}
        proc = subprocess.Popen([sys.executable, "-m", "xlakit", "ckpt", "verify", url], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        time.sleep(4)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proxy.server.resume()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []
