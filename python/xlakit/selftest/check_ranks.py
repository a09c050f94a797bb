"""The `ranks` check: several processes of one job agree, save sharded, and copy their local tier to a peer.

Runs only where a launcher started several ranks (torchrun, or torchrun on
every host of a pod slice: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`); a single
process skips it, saying how to launch it. Each rank's child joins a gloo
group and, timing each step:

1. **agreement**: every rank's stack (xlakit, Python, torch, torch_xla,
   TorchTPU, libtpu, jax versions, read from package metadata) must equal
   rank 0's; a rank that differs is named with what differs;
2. **a sharded save**: each rank's state (CPU tensors: the device path is the
   checkpoint check's) saved with `layout="sharded"` and restored bit-exact,
   into a folder every rank sees (`--shared-dir` across hosts; on one host
   the temporary folder);
3. **the local tier**: a `CheckpointManager` with a `LocalTier` in the
   temporary folder saves step 1 (each part copied to a rank on another
   host); the first host's folder is then removed, as on a recreated VM, and
   a new manager restores: that host's ranks must get their parts from
   their peers, bit-exact. On one host every rank plays a host of its own
   (`XLAKIT_HOST_ID`), so the copies still cross processes (said in the report).

Every folder is the self-test's own (named by a token rank 0 draws), removed
at the end by one rank per host.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from xlakit import _knobs
from xlakit.selftest import check_checkpoint, children, environment, report

NAME = "ranks"
_STACK = ("xlakit", "torch", "torch_xla", "torch-tpu", "libtpu", "jax", "jaxlib")


def _stack() -> dict[str, Any]:
    import platform

    from xlakit.runtime import pins

    return {"python": platform.python_version(), **{d: pins.installed_version(d) for d in _STACK}}


def _gather(dist, value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _agreement(dist, mine: dict[str, Any]) -> list[str]:
    everyone = _gather(dist, mine)
    return [f"rank {r} on {s['host']}: {k} {s[k]}, rank 0 has {everyone[0][k]}"
            for r, s in enumerate(everyone) for k in s if k != "host" and s[k] != everyone[0][k]]


def _sharded(dist, state: dict[str, Any], folder: Path, timeout_s: float, timings: dict) -> list[str]:
    import xlakit

    t0 = time.perf_counter()
    xlakit.save(state, folder, layout="sharded", timeout_s=timeout_s)
    timings["sharded_save"] = time.perf_counter() - t0
    template = check_checkpoint.map_tensors(state, lambda t: t.new_zeros(t.shape))
    t0 = time.perf_counter()
    restored = xlakit.restore(folder, template, timeout_s=timeout_s)
    timings["sharded_restore"] = time.perf_counter() - t0
    return [f"sharded save of rank {dist.get_rank()}: {d}" for d in check_checkpoint.differences(state, restored)]


def _local_tier(dist, state: dict[str, Any], base: Path, hosts: list[str], timeout_s: float,
                timings: dict) -> tuple[list[str], dict[str, Any]]:
    import xlakit

    rank = dist.get_rank()

    def manager():
        tier = xlakit.LocalTier(base / "local", interval_steps=1, peers=1, keep=1, timeout_s=timeout_s)
        return xlakit.CheckpointManager(base / "persistent", layout="sharded", save_interval_steps=10**9, local=tier)

    mgr = manager()
    t0 = time.perf_counter()
    mgr.save(1, state)
    timings["local_save_with_peer_copy"] = time.perf_counter() - t0
    problems = [f"rank {rank}: local save: {mgr.local.last_error}"] if mgr.local.last_error else []
    held = mgr.local.bytes_used()
    mgr.close()
    lost = hosts[0]  # the first host's folder goes, as on a recreated VM; its lowest rank removes it
    if rank == hosts.index(lost):
        for folder in (base / "local").glob(f"*/{lost}"):
            shutil.rmtree(folder)
    dist.barrier()
    mgr = manager()
    t0 = time.perf_counter()
    got = mgr.restore()
    timings["restore_after_host_loss"] = time.perf_counter() - t0
    sources = dict(mgr.local.restored_from["parts"])
    mgr.close()
    problems += [f"restore of rank {rank} after its host's loss: {d}" for d in check_checkpoint.differences(state, got)]
    want = "peer" if hosts[rank] == lost else "local"
    if sources.get(rank) != want:
        problems.append(f"rank {rank}'s part came from {sources.get(rank)}, expected {want}")
    return problems, {"sources": sources, "local_tier_bytes_on_host": held}


def _run(params: dict[str, Any], made) -> dict[str, Any]:
    import torch.distributed as dist

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=timedelta(seconds=params["timeout_s"]))
    timings["join"] = time.perf_counter() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    ours: list[Path] = []  # the folders this rank removes at the end, whatever happens: made for this run
    try:
        t0 = time.perf_counter()
        # Rank 0's token names the folders; its deadline is every rank's (the managers agree on it).
        token = [uuid.uuid4().hex[:12], round(params["timeout_s"])] if rank == 0 else [None, None]
        dist.broadcast_object_list(token, src=0)
        timeout_s = float(token[1])
        mine = {"host": socket.gethostname(), **_stack()}
        problems = _agreement(dist, mine)
        real_hosts = _gather(dist, mine["host"])
        timings["agreement"] = time.perf_counter() - t0
        simulated = len(set(real_hosts)) == 1
        if simulated:  # one host: each rank plays one, so the peer copies cross processes all the same
            os.environ[_knobs.HOST_ID] = f"selftest-rank{rank}"
        hosts = _gather(dist, _knobs.get_host_id())
        base = Path(params["tmp_base"]) / f"xlakit-selftest-ranks-{token[0]}"
        shared = (Path(params["shared_dir"]) if params.get("shared_dir") else base if simulated else None)
        sharded = shared / f"xlakit-selftest-sharded-{token[0]}" if shared is not None else None
        if rank == real_hosts.index(mine["host"]):  # one rank per real host removes what was made there
            ours += [base] + ([sharded] if sharded is not None and rank == 0 else [])
            made(ours)  # told first: a child stopped by the deadline or a signal cannot remove them itself
        base.mkdir(mode=0o700, exist_ok=True)
        state = check_checkpoint.host_state(params["bytes"], seed=rank)
        details: dict[str, Any] = {"world": world, "hosts": sorted(set(real_hosts)), "simulated_hosts": simulated,
                                   "rank_bytes": sum(t.numel() * t.element_size()
                                                     for t in check_checkpoint.tensors(state).values())}
        dist.barrier()
        op_timeout_s = check_checkpoint.op_timeout_s(details["rank_bytes"] * world, timeout_s)
        if sharded is not None:
            problems += _sharded(dist, state, sharded, op_timeout_s, timings)
        else:
            details["sharded_save"] = ("not run: the ranks are on several hosts and no --shared-dir names a folder "
                                       "all see")
        tier_problems, tier = _local_tier(dist, state, base, hosts, op_timeout_s, timings)
        details.update(tier)
        everyone = _gather(dist, problems + tier_problems)
        dist.barrier()
        return {"problems": [p for ps in everyone for p in ps], "timings": timings, "details": details}
    finally:
        dist.destroy_process_group()
        for folder in ours:
            shutil.rmtree(folder, ignore_errors=True)


def child(params: dict[str, Any], results) -> None:
    with results.part(NAME) as got:
        got.update(_run(params, lambda folders: results.put("made", [str(f) for f in folders])))


def _remove_left(outcome_file: Path) -> None:
    """Remove what a stopped child made and could not remove: the folders it named, each positively the
    self-test's (named `xlakit-selftest-...` with this run's token)."""
    try:
        made = json.loads(outcome_file.read_text())["parts"].get("made") or []
    except (OSError, ValueError, KeyError):
        return
    for folder in map(Path, made):
        if folder.name.startswith("xlakit-selftest-"):
            shutil.rmtree(folder, ignore_errors=True)


def run(job: dict[str, Any], *, quick: bool, tmp_base: Path, shared_dir: str | None, scratch: Path,
        deadline: float, env: dict[str, str]) -> dict[str, Any]:
    if job["world"] <= 1:
        return report.skipped(NAME, "a single process: start every rank with torchrun to check agreement, a "
                              "sharded save and the local tier's peer copies (`torchrun --nproc-per-node=N -m xlakit "
                              "selftest`; on a pod slice, on every host: docs/runtime.md)")
    missing = [v for v in (environment.MASTER_ADDR, environment.MASTER_PORT) if not os.environ.get(v)]
    if missing:
        return report.skipped(NAME, f"WORLD_SIZE={job['world']} but {' and '.join(missing)} unset: start the ranks "
                              "with torchrun, which sets them")
    params = {"timeout_s": max(10.0, deadline - time.monotonic() - 5), "tmp_base": str(tmp_base),
              "shared_dir": shared_dir, "bytes": (2 if quick else 32) << 20}
    try:
        outcome = children.run("ranks", params, scratch=scratch, deadline=deadline, env=env)
    finally:
        _remove_left(scratch / "ranks.out.json")
    got = outcome.parts.get(NAME)
    if got is None or "error" in got:
        what = got["error"] if got else f"its process {outcome.ended()}: {outcome.last_error()}"
        fix = ("a checkpoint operation failed on this rank: attach every rank's report to an issue"
               if what.startswith("Checkpoint") else "check that every rank runs the self-test and can reach "
               "MASTER_ADDR:MASTER_PORT; the other ranks' reports name their own failures")
        return report.failed(NAME, f"rank {job['rank']}: {what}", fix)
    timings, details = got["timings"], got["details"]
    if got["problems"]:
        return report.failed(NAME, "; ".join(got["problems"]), "install the same stack on every host, and give "
                             "--shared-dir a folder every host sees", timings_s=timings, details=details)
    hosts = (f"{details['world']} ranks on one host, each playing a host of its own" if details["simulated_hosts"]
             else f"{details['world']} ranks on {len(details['hosts'])} hosts")
    sharded = details.get("sharded_save") or "a sharded save restored bit-exact"
    return report.check(NAME, report.PASS, f"{hosts}: stacks agree; {sharded}; the local tier's step restored from "
                        f"peers after the first host's folder was removed ({details['sources']})", timings_s=timings,
                        details=details)
