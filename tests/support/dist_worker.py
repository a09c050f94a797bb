"""One rank of a multi-process test: runs a named scenario, prints one JSON line.

Started by tests/multirank/test_distributed.py with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; torch.distributed runs on gloo over loopback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import xlakit  # noqa: E402
from tests.support import fakes  # noqa: E402
from tests.support.ranks import leave_together  # noqa: E402

RANK = int(os.environ["RANK"])


def state(version: int) -> dict:
    return {"version": version, "rank": RANK, "w": torch.full((1000,), float(version * 10 + RANK))}


class _Dies(fakes.HostTransfer):
    """A fake device whose process dies in the middle of the transfer."""

    def to_host(self, tensors, *, timeout_s):
        os._exit(17)


def _misbehave(kind: str) -> None:
    from xlakit.checkpoint.file import transfer

    backend = _Dies() if kind == "dies" else fakes.FakeHungDevice()
    transfer.backend_for = lambda device_type, sample, **_: backend


def _error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e), "rank_named": getattr(e, "rank", None)}


def run(scenario: str, folder: Path) -> dict:
    out: dict = {"rank": RANK}
    layout = "sharded" if scenario.startswith("sharded") else "replicated"
    target = folder / ("ckpt" if layout == "sharded" else "ckpt.pt")
    xlakit.save(state(1), target, layout=layout, timeout_s=20)  # the previous committed checkpoint
    if scenario.endswith("roundtrip"):
        loaded = xlakit.load(target, layout="replicated" if layout == "replicated" else "auto")
        out["loaded"] = {"version": loaded["version"], "rank": loaded["rank"], "w0": loaded["w"][0].item()}
        return out
    if scenario.endswith("corrupt-load"):
        if RANK == 1:  # damage one tensor byte of our shard
            commit = json.loads((target / "xlakit-commit.json").read_text())
            path = target / commit["shards"][1]["file"]
            off = torch._C.PyTorchFileReader(str(path)).get_record_offset("data/0")
            data = bytearray(path.read_bytes())
            data[off + 3] ^= 0xFF
            path.write_bytes(bytes(data))
        dist.barrier()
        try:
            xlakit.load(target)
        except xlakit.CheckpointError as e:
            out.update(_error(e))
        return out
    # "<layout>-<victim rank>-<dies|stalls>": the victim misbehaves in the second save
    _, victim, kind = scenario.split("-")
    if RANK == int(victim):
        _misbehave(kind)
    start = time.monotonic()
    try:
        xlakit.save(state(2), target, layout=layout, timeout_s=3)
        out["saved"] = True
    except xlakit.CheckpointError as e:
        out.update(_error(e))
    out["elapsed_s"] = time.monotonic() - start
    previous = xlakit.load(target, shard=RANK) if layout == "sharded" else xlakit.load(target)
    out["previous_version"] = previous["version"]
    return out


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = run(sys.argv[1], Path(sys.argv[2]))
    print(json.dumps(result), flush=True)
    leave_together(RANK, int(os.environ["WORLD_SIZE"]))  # a peer may die or stall on purpose here
