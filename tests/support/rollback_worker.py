"""A manager rolled back by every rank of a real gloo job (tests/checkpoint/test_manager_rollback.py).

    rollback_worker.py SCENARIO FOLDER

Started by `tests.support.ranks.Job` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set). The last
stdout line is `{"result": {...}}`.

Scenarios:
  rollback   save 10, 20, 100; restore(20); save 30 (refused on every rank);
             retire_steps_after(20) on every rank; save 30; the steps each rank sees
  disagree   save 10, 20, 100; rank 1 retires after 10, the others after 20: refused
             everywhere, nothing deleted
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import xlakit  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": step}


def error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}


def main(scenario: str, folder: Path) -> dict:
    mgr = xlakit.CheckpointManager(folder, layout="replicated")
    for step in (10, 20, 100):
        mgr.save(step, state(step))
    out: dict = {}
    if scenario == "rollback":
        out["restored"] = mgr.restore(20)["step"]
        try:
            mgr.save(30, state(30))
            out["first_save"] = {"ok": True}
        except (ValueError, xlakit.CheckpointError) as e:
            out["first_save"] = error(e)
        out["retired"] = mgr.retire_steps_after(20)
        out["saved"] = mgr.save(30, state(30))
    elif scenario == "disagree":
        try:
            out["retired"] = mgr.retire_steps_after(10 if RANK == 1 else 20)
        except (ValueError, xlakit.CheckpointError) as e:
            out["retire"] = error(e)
    out["steps"] = mgr.all_steps()
    out["latest"] = mgr.latest_step()
    mgr.close()
    return out


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    print(json.dumps({"result": main(sys.argv[1], Path(sys.argv[2]))}), flush=True)
    # Rank 0 hosts the store: it stays until the others are done with it.
    store = dist.distributed_c10d._get_default_store()
    store.set(f"exit/{RANK}", "1")
    if RANK == 0:
        store.wait([f"exit/{r}" for r in range(WORLD)], timedelta(seconds=30))
    dist.destroy_process_group()
