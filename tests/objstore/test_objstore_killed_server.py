"""A server killed mid-save: a transient failure, retried to the deadline, then an xlakit error.

Regression (issue 25, item 4): a part of a gs:// upload retried five times and then raised the raw
`aiohttp.ClientConnectorError`, naming neither the object nor what the store last answered.
"""

from __future__ import annotations

import time

import pytest
import torch

import xlakit
from tests.support import objstore_servers as servers

DEADLINE_S = 20.0
SETTLE_S = 3.0  # the bound of the removals a failed save sends without waiting


def _requests_settled() -> None:
    """Wait for the requests sent without waiting (the failed upload's removal) to end: gcsfs reads
    STORAGE_EMULATOR_HOST per request, so one retried after the test restored the environment
    would go to Google."""
    import asyncio

    import fsspec.asyn

    loop = fsspec.asyn.get_loop()

    async def others() -> int:
        return len(asyncio.all_tasks(loop)) - 1

    end = time.monotonic() + SETTLE_S + 5
    while time.monotonic() < end and asyncio.run_coroutine_threadsafe(others(), loop).result(5):
        time.sleep(0.1)


@pytest.mark.parametrize("scheme", [servers.GCS, servers.S3])
def test_a_server_killed_mid_save_gives_an_xlakit_error_naming_the_object_and_the_last_answer(
        scheme, tmp_path, monkeypatch, loopback_only):
    why = servers.installed()[scheme]
    if why is not None:
        pytest.skip(f"no {scheme}:// test server: {why}")
    server = servers.Server(scheme, tmp_path / "server")  # its own: this test kills it
    try:
        for name, value in {**server.env(), "XLAKIT_OBJECT_PART_BYTES": str(5 << 20),
                            "XLAKIT_OBJECT_CHUNK_BYTES": str(5 << 20),
                            "XLAKIT_OBJECT_REQUEST_TIMEOUT_S": str(SETTLE_S)}.items():
            monkeypatch.setenv(name, value)
        url = f"{server.bucket()}/k.pt"

        def kill_once_uploading(p: xlakit.Progress) -> None:
            if p.bytes_done > (8 << 20) and server.proc.poll() is None:
                server.proc.kill()

        start = time.monotonic()
        with pytest.raises((xlakit.CheckpointTimeoutError, xlakit.CheckpointWriteError)) as info:
            xlakit.save({"w": torch.randn(16 << 20)}, url, timeout_s=DEADLINE_S,
                        progress_callback=kill_once_uploading, progress_interval_s=0.05)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
        _requests_settled()
    assert server.proc.returncode is not None
    err = info.value
    assert url in str(err), str(err)
    assert any("last answer" in n for n in getattr(err, "__notes__", [])), err.__notes__
    assert DEADLINE_S / 2 < elapsed < DEADLINE_S + 3  # retried for most of the deadline, never past it
