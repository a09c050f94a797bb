"""One rank of a multi-process `dcp_save` / `dcp_load` test; prints a JSON line per phase.

Started by tests/multirank/test_dcp_multirank.py with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set; torch.distributed runs on gloo over loopback and the state
is CPU DTensors (SPMD XLA is one process per host, so multi-rank CPU jobs are
what this machine can run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import xlakit  # noqa: E402
from tests.support.ranks import leave_together  # noqa: E402

# Defaults only for the test module, which imports `full` and DEADLINE_S from here.
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def full(version: int) -> dict[str, torch.Tensor]:
    """The global values of every tensor, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(10, 6, generator=g),  # 10 rows: uneven over 3 ranks
            "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-2**40, 2**40, (9, 4), generator=g),
            "plain": torch.randn(5, generator=g)}


def saved_state(version: int) -> dict:
    """As saved: DTensors sharded on dim 0 over every rank, a replicated plain tensor, a step."""
    mesh = init_device_mesh("cpu", (WORLD,))
    values = full(version)
    return {"model": {k: distribute_tensor(values[k], mesh, [Shard(0)]) for k in ("w", "b", "ids")},
            "plain": values["plain"], "step": version}


def target_state() -> dict:
    """As loaded: other placements on this job's mesh, and a DTensor read as a plain tensor."""
    mesh = init_device_mesh("cpu", (WORLD,))
    zeros = {k: torch.zeros_like(v) for k, v in full(0).items()}
    return {"model": {"w": distribute_tensor(zeros["w"], mesh, [Shard(1)]),
                      "b": distribute_tensor(zeros["b"], mesh, [Replicate()]),
                      "ids": zeros["ids"]},
            "plain": distribute_tensor(zeros["plain"], mesh, [Shard(0)]), "step": 0}


def mismatches(state: dict, version: int) -> list[str]:
    expected, bad = full(version), []
    got = {**state["model"], "plain": state["plain"]}
    for name, value in got.items():
        if isinstance(value, DTensor):
            # This rank's shard against the same slice of the expected values, bit for bit.
            local = value.to_local()
            want = distribute_tensor(expected[name], value.device_mesh, value.placements).to_local()
        else:
            local, want = value, expected[name]
        if local.dtype != want.dtype or not torch.equal(_bytes(local), _bytes(want)):
            bad.append(name)
    if state["step"] != version:
        bad.append("step")
    return bad


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _error(e: BaseException) -> dict:
    return {"error": type(e).__name__, "message": str(e), "rank_named": getattr(e, "rank", None)}


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def report(phase: str, start: float, **values) -> None:
    print(json.dumps({"phase": phase, "elapsed_s": time.monotonic() - start, **values}), flush=True)


def failing_save(phase: str, target: Path, version: int) -> None:
    """Rank 1 fails to write ("fails") or dies ("dies") inside DCP's write."""
    real = dist.checkpoint.FileSystemWriter.write_data
    if RANK == 1:
        def misbehave(self, plan, planner):
            if phase == "dies":
                os._exit(17)
            raise OSError(28, "No space left on device")

        dist.checkpoint.FileSystemWriter.write_data = misbehave
    start = time.monotonic()
    try:
        xlakit.dcp_save(saved_state(version), target, timeout_s=DEADLINE_S)
        report(phase, start, saved=True)
    except xlakit.CheckpointError as e:
        report(phase, start, **_error(e))
    finally:
        dist.checkpoint.FileSystemWriter.write_data = real


def run(scenario: str, folder: Path) -> None:
    target = folder / "ckpt"
    start = time.monotonic()
    if scenario == "save":
        xlakit.dcp_save(saved_state(1), target, timeout_s=30)
        report("save", start)
    elif scenario == "save one tensor":  # rank 1 is given nothing to write: its file is empty
        xlakit.dcp_save({"plain": full(1)["plain"]}, target, timeout_s=30)
        report("save", start)
    elif scenario == "load":
        state = target_state()
        xlakit.dcp_load(state, target, timeout_s=30)
        report("load", start, mismatch=mismatches(state, 1))
        # Then a damaged file: the ranks that read its damaged item see it; every rank must hear.
        damaged = target / "__1_0.distcp"
        if RANK == 0:
            flip(damaged)
        dist.barrier()
        try:
            xlakit.dcp_load(target_state(), target, timeout_s=30)
            report("corrupt", start, loaded=True)
        except xlakit.CheckpointError as e:
            report("corrupt", start, **_error(e))
        dist.barrier()
        if RANK == 0:
            flip(damaged)
    elif scenario == "interrupted":
        # Rank 1 is interrupted (Ctrl-C: a SIGINT its worker sends itself, a fake) just before the save's
        # fresh group is made, after the agreement: rank 0 waits in the group's rendezvous, which only rank 1
        # could end.
        xlakit.dcp_save(saved_state(1), target, timeout_s=30)
        if RANK == 1:
            from xlakit.checkpoint.coordination import agreement

            real = agreement.Coordination.group

            def interrupted(self, op):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(3.0)
                return real(self, op)

            agreement.Coordination.group = interrupted
        start = time.monotonic()
        try:
            xlakit.dcp_save(saved_state(2), target, timeout_s=INTERRUPTED_DEADLINE_S)
            report("save2", start, saved=True)
        except KeyboardInterrupt:
            report("save2", start, error="KeyboardInterrupt")
        except xlakit.CheckpointError as e:
            report("save2", start, **_error(e))
    elif scenario == "failures":
        # One job: a committed save, a save rank 1 cannot write, then one during which it dies.
        xlakit.dcp_save(saved_state(1), target, timeout_s=30)
        failing_save("fails", target, 2)
        failing_save("dies", target, 3)


DEADLINE_S = 4.0
INTERRUPTED_DEADLINE_S = 20.0


if __name__ == "__main__":
    import torch.distributed.checkpoint  # noqa: F401 - patched by the "dies" scenario

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    run(sys.argv[1], Path(sys.argv[2]))
    # Rank 0 hosts the store: it stays until the others are done reading it (or 15 s).
    leave_together(RANK, WORLD, dead={1} if sys.argv[1] == "failures" else set())
