"""A process that saves to object storage for tests/objstore/test_objstore.py, announcing moments as JSON lines.

Usage: objstore_worker.py SCENARIO URL [FOLDER]; the server comes from the
standard variables in the environment.

* `race`: save, but wait before the commit until FOLDER holds two `ready-*`
  files (two such processes then race for one generation's commit record);
  prints the outcome.
* `stop-before-commit`: save, announce `uploaded` when the data object is
  complete, then sleep until killed (the commit never comes).
* `slow-upload`: save 48 MiB, announcing `uploading` once bytes move; killed mid-upload.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import xlakit  # noqa: E402
from tests.support import objstore_servers  # noqa: E402
from xlakit.checkpoint.objstore import generations  # noqa: E402


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> None:
    objstore_servers.loopback_only()
    scenario, url = sys.argv[1], sys.argv[2]
    state = {"w": torch.full((1000,), float(os.getpid())), "pid": os.getpid()}
    real_commit = generations.commit
    if scenario == "race":
        folder = Path(sys.argv[3])

        def waiting_commit(store, op, loc, record):
            (folder / f"ready-{os.getpid()}").touch()
            end = time.monotonic() + 60
            while len(list(folder.glob("ready-*"))) < 2 and time.monotonic() < end:
                time.sleep(0.01)
            return real_commit(store, op, loc, record)

        generations.commit = waiting_commit
        try:
            xlakit.save(state, url, timeout_s=60)
            say(result="committed", pid=os.getpid())
        except xlakit.CheckpointError as e:
            say(result=type(e).__name__, message=str(e), pid=os.getpid())
    elif scenario == "stop-before-commit":
        def never(store, op, loc, record):
            say(event="uploaded", objects=sorted(record["objects"]))
            time.sleep(600)

        generations.commit = never
        xlakit.save(state, url, timeout_s=600)
    elif scenario == "slow-upload":
        state["big"] = torch.randn(12 << 20)  # 48 MiB: many parts
        announced = []

        def progress(p):
            if p.stage == "write" and p.bytes_done and not announced:
                announced.append(True)
                say(event="uploading")

        xlakit.save(state, url, timeout_s=600, progress_callback=progress)
        say(result="committed")


if __name__ == "__main__":
    main()
