"""Fault injection: saves under random faults by PID, then every checkpoint checked. One line out.

    python tests/support/fault_injection.py [--rounds N] [--seed S]

Each round starts real processes that save versioned checkpoints in a loop
and report every commit on stdout, then hits one of them with a fault at a
random moment: SIGKILL, SIGINT, SIGSTOP (SIGCONT later), or a thread that
mutates the state during the saves. Rounds alternate between one process
writing a file (CPU or XLA state) and a 4-rank job writing a sharded
checkpoint. After each round the checkpoint on disk is read back:

* torn: it does not load whole (missing or truncated parts, shards of
  different saves);
* rollback: its version is older than one a process reported committed;
* false corrupt: xlakit.load says a checksum does not match although nothing
  touched the file after it was written;
* hang: a process did not end within its bound after the fault.

Prints `fault injection: N faults injected, T torn, R rollbacks, C false corrupt, H hangs`
and exits 1 unless the last four are 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FAULTS = ("kill", "int", "stop", "mutate")
SAVE_TIMEOUT_S = 3.0
END_S = 30.0  # how long a process may take to end once told to (deadline, grace, exit)
ROTATE = 8  # files a mutating saver rotates through


# -- the savers ---------------------------------------------------------------------------------

def single_saver(path: str, device: str, mutate: bool) -> None:
    import torch

    import xlakit

    if device == "xla":
        import torch_xla

        dev = torch_xla.device()
        state = {f"w{i}": torch.full((1 << 20,), 0.0).to(dev) for i in range(16)}
        torch_xla.sync()
    else:
        state = {f"w{i}": torch.zeros(1 << 20) for i in range(16)}
    if mutate:
        def churn() -> None:
            while True:
                for t in state.values():
                    t.add_(1.0)

        threading.Thread(target=churn, daemon=True).start()
    print(json.dumps({"event": "ready"}), flush=True)
    for version in range(1, 10_000):
        for t in state.values():
            t.fill_(float(version))
        # Under mutation every file is kept and checked: each one is a chance to hash torn bytes.
        where = f"{path}.{version % ROTATE}" if mutate else path
        xlakit.save({"version": version, **state}, where, timeout_s=30, max_inflight_bytes=8 << 20)
        print(json.dumps({"committed": version}), flush=True)


def rank_saver(folder: str) -> None:
    import torch
    import torch.distributed as dist

    import xlakit

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    print(json.dumps({"event": "ready"}), flush=True)
    state = {"w": torch.zeros(1 << 18)}
    end = time.monotonic() + float(os.environ["XLAKIT_FI_SECONDS"])
    version = 0
    while time.monotonic() < end:
        version += 1
        state["w"].fill_(float(version))
        try:
            xlakit.save({"version": version, "rank": rank, **state}, folder, layout="sharded",
                        timeout_s=SAVE_TIMEOUT_S)
            print(json.dumps({"committed": version}), flush=True)
        except xlakit.CheckpointError as e:
            print(json.dumps({"failed": version, "error": type(e).__name__}), flush=True)
            if "store stopped answering" in str(e):
                break  # rank 0, which hosts the store, is gone: nothing more can be agreed
    os._exit(0)  # leave without process-group teardown: a dead peer must not hang the exit


# -- the harness --------------------------------------------------------------------------------

class Round:
    """One fault against live savers; what their stdout said they committed."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.committed: list[int] = []
        self.ready = threading.Semaphore(0)
        self.readers = [threading.Thread(target=self._read, args=(p,), daemon=True) for p in procs]
        for t in self.readers:
            t.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg.get("event") == "ready":
                self.ready.release()
            if "committed" in msg:
                self.committed.append(msg["committed"])

    def wait_ready(self) -> bool:
        return all(self.ready.acquire(timeout=120) for _ in self.procs)

    def end(self, bound_s: float) -> bool:
        """Wait for every process; False (a hang) if one outlives `bound_s`."""
        end, hung = time.monotonic() + bound_s, False
        for p in self.procs:
            try:
                p.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                hung = True
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
        for t in self.readers:
            t.join(5)
        for p in self.procs:
            p.stdout.close()
        return not hung


def _spawn(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env})


def _judge(load, latest_committed: int | None) -> tuple[int, int, int]:
    """(torn, rollback, false corrupt) of the checkpoint `load()` reads."""
    import xlakit

    try:
        version = load()
    except FileNotFoundError:
        return (0, 1, 0) if latest_committed else (0, 0, 0)
    except xlakit.CheckpointCorruptError as e:
        structural = isinstance(e, xlakit.CheckpointIncompleteError) or "truncated" in str(e) \
            or "not a readable" in str(e) or "missing" in str(e)
        return (1, 0, 0) if structural else (0, 0, 1)
    except xlakit.CheckpointError:
        return 1, 0, 0
    if version is None:
        return 1, 0, 0
    return 0, int(latest_committed is not None and version < latest_committed), 0


def single_round(rng: random.Random, folder: Path, fault: str) -> tuple[int, int, int, int, int]:
    import xlakit

    path = folder / "c.pt"
    device = rng.choice(["cpu", "xla"])
    rnd = Round([_spawn(["single", str(path), device, str(int(fault == "mutate"))], {"PJRT_DEVICE": "CPU"})])
    if not rnd.wait_ready():
        return 0, 0, 0, 1, 0
    time.sleep(rng.uniform(0.2, 2.5))
    proc = rnd.procs[0]
    if fault == "kill":
        proc.kill()
    elif fault == "stop":
        proc.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(0.2, 2.0))
        proc.send_signal(signal.SIGCONT)
        time.sleep(rng.uniform(0.1, 1.0))
    if fault != "kill":
        proc.send_signal(signal.SIGINT)  # every other fault ends the same way: Ctrl-C
    hang = 0 if rnd.end(END_S) else 1
    latest = max(rnd.committed, default=None)

    if fault == "mutate":  # values are the caller's race; every file must still load
        found = [_judge(lambda: xlakit.load(f"{path}.{k}")["version"], None)
                 for k in range(ROTATE) if os.path.exists(f"{path}.{k}")]
        return (*[sum(col) for col in zip((0, 0, 0), *found)], hang, len(rnd.committed))

    def load():
        state = xlakit.load(path)
        if any(not bool((state[f"w{i}"] == state["version"]).all()) for i in range(16)):
            return None  # tensors of another version than the file says
        return state["version"]

    return (*_judge(load, latest), hang, len(rnd.committed))


def ranks_round(rng: random.Random, folder: Path, fault: str, world: int = 4) -> tuple[int, int, int, int, int]:
    import xlakit

    from tests.support.ranks import private_port

    target = folder / "ckpt"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(private_port()), "WORLD_SIZE": str(world),
           "XLAKIT_FI_SECONDS": "12", "PJRT_DEVICE": "CPU"}
    rnd = Round([_spawn(["rank", str(target)], {**env, "RANK": str(r)}) for r in range(world)])
    if not rnd.wait_ready():
        return 0, 0, 0, 1, 0
    time.sleep(rng.uniform(1.0, 6.0))
    victim = rnd.procs[rng.randrange(world)]
    if fault == "kill":
        victim.kill()
    elif fault == "int":
        victim.send_signal(signal.SIGINT)
    elif fault == "stop":
        victim.send_signal(signal.SIGSTOP)
        time.sleep(rng.uniform(0.5, SAVE_TIMEOUT_S + 3))
        victim.send_signal(signal.SIGCONT)
    hang = 0 if rnd.end(12 + END_S) else 1
    latest = max(rnd.committed, default=None)

    def load():
        record = json.loads((target / "xlakit-commit.json").read_text())
        versions = {xlakit.load(target, shard=r)["version"] for r in range(record["world"])}
        return versions.pop() if len(versions) == 1 else None

    return (*_judge(load, latest), hang, len(rnd.committed))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--seed", type=int, default=8)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    from tests.support.ranks import let_children_take_ctrl_c

    let_children_take_ctrl_c()  # the "int" fault is a Ctrl-C
    rng = random.Random(args.seed)
    totals = [0, 0, 0, 0]
    with tempfile.TemporaryDirectory(prefix="xlakit-faults-") as tmp:
        for i in range(args.rounds):
            folder = Path(tmp) / f"round-{i}"
            folder.mkdir()
            if i % 2 == 0:
                fault = rng.choice(FAULTS)
                found = single_round(rng, folder, fault)
            else:
                fault = rng.choice(("kill", "int", "stop"))
                found = ranks_round(rng, folder, fault)
            *bad, commits = found
            totals = [a + b for a, b in zip(totals, bad)]
            if args.verbose or any(bad):
                kind = "single" if i % 2 == 0 else "4 ranks"
                print(f"round {i}: {kind}, {fault} after {commits} commits: torn {bad[0]}, rollback "
                      f"{bad[1]}, false corrupt {bad[2]}, hang {bad[3]}", file=sys.stderr, flush=True)
    torn, rollbacks, corrupt, hangs = totals
    print(f"fault injection: {args.rounds} faults injected, {torn} torn, {rollbacks} rollbacks, "
          f"{corrupt} false corrupt, {hangs} hangs")
    return 1 if any(totals) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "single":
        single_saver(sys.argv[2], sys.argv[3], sys.argv[4] == "1")
    elif len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_saver(sys.argv[2])
    else:
        sys.exit(main())
