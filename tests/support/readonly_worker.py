"""Two real processes on one manager folder: a trainer saving with retention, an evaluator reading.

    readonly_worker.py write DIR LAYOUT STEPS      CheckpointManager(max_to_keep=2) saves steps 1..STEPS
    readonly_worker.py read DIR LAYOUT DONE_FILE   ReadOnlyCheckpointManager reads until DONE_FILE exists
                                                   (DONE_FILE.ready is made once it is reading)

The reader records, through Python's audit hooks, every event that could change a file or
take a lock (opens for writing, renames, removals, mkdir, rmtree, chmod, flock), and checks
every state it reads against the step it claims to be. Each prints one JSON line.
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

N = 4096


def state(step: int) -> dict:
    return {"w": torch.full((N,), float(step)), "b": torch.arange(8) + step, "step": step}


def template() -> dict:
    return {"w": torch.zeros(N), "b": torch.zeros(8, dtype=torch.int64), "step": 0}


def write(folder: Path, layout: str, count: int) -> dict:
    with xlakit.CheckpointManager(folder, max_to_keep=2, layout=layout) as mgr:
        for step in range(1, count + 1):
            mgr.save(step, state(step))
        return {"steps": mgr.all_steps()}


_WRITES = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.truncate", "os.chmod",
           "os.chown", "os.link", "os.symlink", "os.utime", "fcntl.flock", "fcntl.lockf"}


def watch_for_writes(folder: Path) -> list[str]:
    """Audit events of this process that could change anything under `folder`, or take a lock."""
    seen: list[str] = []
    root = str(folder.resolve())

    def under(path) -> bool:
        try:
            return os.path.abspath(os.fsdecode(path)).startswith(root)
        except TypeError:  # a file descriptor
            return True

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writing and path is not None and under(path):
                seen.append(f"open {path} {mode} {flags}")
        elif event in _WRITES and (event.startswith("fcntl") or any(under(a) for a in args[:2]
                                                                     if isinstance(a, (str, bytes, os.PathLike)))):
            seen.append(f"{event} {args}")

    sys.addaudithook(hook)
    return seen


def warm_up(layout: str) -> None:
    """One save and read elsewhere first: the first use of torch.distributed.checkpoint imports for
    seconds, long enough for the writer to finish before the reader's first read."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        if layout == "dcp":
            xlakit.dcp_save(state(0), Path(scratch, "ckpt"))
            xlakit.dcp_load(template(), Path(scratch, "ckpt"))
        else:
            xlakit.save(state(0), Path(scratch, "ckpt.pt"))
            xlakit.load(Path(scratch, "ckpt.pt"))


def read(folder: Path, layout: str, done: Path) -> dict:
    warm_up(layout)
    writes = watch_for_writes(folder)
    out = {"reads": 0, "steps_read": [], "explicit_ok": 0, "explicit_deleted": 0, "bad": []}
    reader = xlakit.ReadOnlyCheckpointManager(folder)

    def check(got: dict, step: int | None, where: str) -> None:
        s = got["step"]
        if step is not None and s != step:
            out["bad"].append(f"{where}: asked for step {step}, got {s}")
        if not (torch.equal(got["w"], torch.full((N,), float(s))) and torch.equal(got["b"], torch.arange(8) + s)):
            out["bad"].append(f"{where}: step {s} holds values of another step")

    deadline = time.monotonic() + 300
    Path(f"{done}.ready").touch()
    while time.monotonic() < deadline:
        finished = done.exists()  # read once more after the writer finished
        listed = reader.all_steps()
        if listed != sorted(listed):
            out["bad"].append(f"listing out of order: {listed}")
        if listed:
            latest = reader.restore(template=template() if layout == "dcp" else None)
            check(latest, None, "latest")
            out["reads"] += 1
            out["steps_read"].append(latest["step"])
            oldest = listed[0]
            try:
                check(reader.restore(oldest, template=template() if layout == "dcp" else None), oldest, "explicit")
                out["explicit_ok"] += 1
            except FileNotFoundError as e:
                if "deleted by the writer's retention" not in str(e) and "no committed step" not in str(e):
                    raise
                out["explicit_deleted"] += 1
        if finished:
            break
    out["writes"] = writes
    out["final_steps"] = reader.all_steps()
    return out


def main() -> None:
    mode, folder, layout, arg = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    result = write(folder, layout, int(arg)) if mode == "write" else read(folder, layout, Path(arg))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
