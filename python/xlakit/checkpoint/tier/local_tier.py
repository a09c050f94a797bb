"""A CheckpointManager's local tier: frequent saves into host RAM (`/dev/shm`) or a local disk.

    <directory>/
      run-1f2e3d4c5b6a7988/         one folder per run: the xxh3 of its persistent folder (resolved)
        <host>/                     one folder per host (`XLAKIT_HOST_ID`, else the hostname)
          xlakit-local-tier.json    marks the folder as a local tier's (written first; names the run)
          150/                      a step
            part-00002-of-00004.pt  rank 2's part: saved there by rank 2 (its own copy) or
            part-00000-of-00004.pt  copied there from rank 0 on another host (its peer copy)
            xlakit-local-step.json  the step's marker: the job decided it whole; lists the parts
          .100.1f2e3d4c.xlakit-trash  a step retention gave up, being deleted

Two jobs given the same directory (e.g. "/dev/shm/ckpt") have different
persistent folders, so different run folders: one never restores, counts or
deletes the other's steps.

Each part is an ordinary xlakit file (`pipeline.save_file`) of
`{"xlakit-local-part": {"step", "rank", "world"}, "state": <the rank's state>}`
(`wrap`; a restore checks the identity against the folder and the name it was
found under, `unwrap`, so a part copied into another step's folder is refused): owned, checksummed
record by record, renamed into place whole under the save's deadline, so a
part file either is whole or is not there; a part that is there but damaged
(a torn or altered file) fails its verification at restore, is named and is
never used (`tier_restore.py`).

A step folder counts only with its marker, written by the host's lowest rank
once the whole job decided the save whole (`tier_rounds.py`), and only the
parts the marker lists count: what a save given up left (a stalled rank's part
written after the others gave up, a copy of a failed save) is never counted or
restored, and goes at the host's next save. Each writer removes a step's marker
before it writes into that step's folder. A step is restorable when every
rank's part is held, marked, on some host (or the persistent tier has the step).

Bounds: a host holds at most `keep + 1` steps (the new step is written before
the oldest goes); each step holds the parts of the ranks on this host plus the
parts copied to it from `peers` other hosts, so about `(keep + 1) * (1 + peers)`
times this host's share of the state. Retention is per host, run by the host's
lowest rank (`tidy`) at the start of each save it takes part in and once the
new step is whole on every rank: marked steps beyond the newest `keep` (never
after a failed save, so the newest whole step always stays) and unmarked ones
below the step being saved (saves given up). It counts and removes only the
tier's own step folders: under a marked host folder, holding nothing but parts,
the step's marker and xlakit's temporary names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

from xlakit import _knobs
from xlakit.checkpoint.core import paths
from xlakit.checkpoint.stepstore import steps
from xlakit.checkpoint.core.operation import remove_path
from xlakit.checkpoint.core.options import _count, _seconds
from xlakit.errors import CheckpointWriteError

MARKER = "xlakit-local-tier.json"
MARKER_FORMAT = "xlakit-local-tier"
MARKER_VERSION = 1
STEP_MARKER = "xlakit-local-step.json"
STEP_MARKER_FORMAT = "xlakit-local-step"
_PART_NAME = re.compile(r"part-(\d{5})-of-(\d{5})\.pt")
_STEP_NAME = re.compile(r"0|[1-9][0-9]{0,18}")
MAX_TIMEOUT_S = 86400.0  # a day: a gloo group's timeout must be finite


@dataclass(frozen=True)
class LocalTier:
    """Where and how often a `CheckpointManager` saves to host RAM or a local disk.

    Attributes:
        directory: a folder on every host, e.g. "/dev/shm/ckpt" (RAM) or a local SSD; each
            host uses `<directory>/<run>/<host>/` (`XLAKIT_HOST_ID`, else the hostname; the run: the
            manager's own directory, so jobs sharing `directory` never mix). Resolved once, here.
        interval_steps: save to the local tier every N steps (the persistent saves keep the
            manager's `save_interval_steps`).
        peers: how many ranks on other hosts receive a copy of each rank's part (at most
            the number of other hosts; 0: no copies).
        keep: steps each host keeps (its last `keep`); the persistent tier keeps its own.
        timeout_s: the deadline of one local save, peer copies included (at most a day).

    Example:
        >>> import torch, xlakit
        >>> tier = xlakit.LocalTier(getfixture("tmp_path") / "shm", interval_steps=2, keep=1)
        >>> with xlakit.CheckpointManager(getfixture("tmp_path") / "ckpt", save_interval_steps=10,
        ...                               local=tier) as mgr:
        ...     for step in range(1, 7):
        ...         _ = mgr.save(step, {"w": torch.full((2,), float(step))})
        ...     mgr.restore()["w"], mgr.local.restored_from["parts"], mgr.all_steps()
        (tensor([6., 6.]), {0: 'local'}, [])
    """

    directory: str | os.PathLike
    interval_steps: int = 1
    peers: int = 1
    keep: int = 2
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if os.fspath(self.directory) == "":
            raise ValueError("LocalTier(directory) cannot be the empty path: name a folder, e.g. '/dev/shm/ckpt'")
        if "://" in os.fspath(self.directory):
            raise ValueError(f"LocalTier(directory) is a folder on each host (RAM or a local disk), got the "
                             f"URL {os.fspath(self.directory)!r}: object storage is the persistent tier "
                             f"(the manager's own directory)")
        _count("interval_steps", self.interval_steps, minimum=1)
        _count("peers", self.peers, minimum=0)
        _count("keep", self.keep, minimum=1)
        _seconds("timeout_s", self.timeout_s)
        if not math.isfinite(self.timeout_s) or self.timeout_s > MAX_TIMEOUT_S:
            raise ValueError(f"LocalTier(timeout_s) is at most {MAX_TIMEOUT_S:g} s (a day; the ranks' copy "
                             f"groups need a finite timeout), got {self.timeout_s!r}: give a number of seconds")
        # Resolved once: a later chdir does not move the tier.
        object.__setattr__(self, "directory", Path(os.path.abspath(os.fspath(self.directory))))

    def config(self) -> dict:
        """What every rank must set alike (agreed when the managers start)."""
        return {**dataclasses.asdict(self), "directory": os.fspath(self.directory)}


def part_name(rank: int, world: int) -> str:
    return f"part-{rank:05d}-of-{world:05d}.pt"


PART_KEY = "xlakit-local-part"


def wrap(state, step: int, rank: int, world: int) -> dict:
    """What a part file holds: the rank's state and which part it is."""
    return {PART_KEY: {"step": step, "rank": rank, "world": world}, "state": state}


def unwrap(got, step: int, rank: int, world: int):
    """The state of a loaded part; ValueError when it is not the part of `step` and `rank` it was
    found as (moved or copied from another step's folder: never restored as this one)."""
    want = {"step": step, "rank": rank, "world": world}
    found = got.get(PART_KEY) if isinstance(got, dict) else None
    if found != want or "state" not in got:
        raise ValueError(f"the part holds {found or 'no part identity'}, expected {want}: it was moved or "
                         f"copied here from elsewhere, and is not used")
    return got["state"]


def run_name(persistent: str | os.PathLike) -> str:
    """The run folder of the job whose persistent folder is `persistent` (a URL, or a path, resolved)."""
    text = os.fspath(persistent)
    text = text.rstrip("/") if "://" in text else str(Path(text).resolve())
    return f"run-{xxhash.xxh3_64_hexdigest(text.encode())}"


class HostFolder:
    """This host's folder of a local tier, in the folder of the run whose persistent folder is `run`."""

    def __init__(self, tier: LocalTier, run: str | os.PathLike, host: str | None = None):
        self.host = host or _knobs.get_host_id()
        self.run = os.fspath(run)
        self.path = Path(tier.directory) / run_name(run) / self.host

    def make(self) -> None:
        """The host folder and its marker (every rank of the host may call it: the same bytes land)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not (self.path / MARKER).exists():
                text = json.dumps({"format": MARKER_FORMAT, "version": MARKER_VERSION, "host": self.host,
                                   "run": self.run})
                paths.write_file(self.path / MARKER, lambda f: f.write(text.encode()))
        except OSError as e:
            raise CheckpointWriteError(e.errno, f"cannot use {self.path} as host {self.host}'s local "
                                       f"checkpoint tier: {e.strerror} ({type(e).__name__})") from e

    def marked(self) -> bool:
        try:
            record = json.loads((self.path / MARKER).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and record.get("format") == MARKER_FORMAT

    def step_path(self, step: int) -> Path:
        return self.path / str(step)

    def part_path(self, step: int, rank: int, world: int) -> Path:
        return self.step_path(step) / part_name(rank, world)

    def make_step(self, step: int) -> Path:
        folder = self.step_path(step)
        try:
            folder.mkdir(exist_ok=True)
        except OSError as e:
            raise paths.write_error(e, folder, stage="mkdir") from e
        return folder

    def inventory(self, world: int) -> dict[int, dict[int, int]]:
        """{step: {rank: bytes}} of the parts of `world` ranks this host holds in marked steps, as
        their markers list them (none checked yet)."""
        held: dict[int, dict[int, int]] = {}
        for step in self.steps():
            listed = self.marked_parts(step, world)
            for rank in listed or ():
                try:
                    size = os.lstat(self.part_path(step, rank, world)).st_size
                except FileNotFoundError:
                    continue  # retention took it meanwhile, or the marker lists a part never written
                held.setdefault(step, {})[rank] = size
        return held

    def marked_parts(self, step: int, world: int) -> list[int] | None:
        """The parts the marker of `step` lists; None when the step is not marked (for `world` ranks)."""
        try:
            record = json.loads((self.step_path(step) / STEP_MARKER).read_text())
        except (OSError, ValueError):
            return None
        if not (isinstance(record, dict) and record.get("format") == STEP_MARKER_FORMAT
                and record.get("step") == step and record.get("world") == world
                and isinstance(record.get("parts"), list)):
            return None
        return sorted({int(p) for p in record["parts"] if isinstance(p, int) and 0 <= p < world})

    def mark(self, step: int, world: int, parts: list[int]) -> None:
        """(The host's lowest rank, once the job decided `step` whole.) Write the step's marker,
        listing `parts` and those a marker there already lists."""
        parts = sorted(set(parts) | set(self.marked_parts(step, world) or ()))
        text = json.dumps({"format": STEP_MARKER_FORMAT, "step": step, "world": world, "parts": parts})
        paths.write_file(self.step_path(step) / STEP_MARKER, lambda f: f.write(text.encode()))

    def unmark(self, step: int) -> None:
        """Before a write into the folder of `step`: it no longer counts until marked again."""
        try:
            (self.step_path(step) / STEP_MARKER).unlink()
        except FileNotFoundError:
            pass

    def steps(self) -> list[int]:
        """The tier's own step folders here (marked or not): nothing but parts, a marker, temporaries."""
        if not self.marked():
            return []
        return sorted(int(n) for n in os.listdir(self.path) if _STEP_NAME.fullmatch(n) and self._ours(int(n)))

    def marked_steps(self, world: int) -> list[int]:
        return [s for s in self.steps() if self.marked_parts(s, world) is not None]

    def _ours(self, step: int) -> bool:
        folder = self.step_path(step)
        if folder.is_symlink() or not folder.is_dir():
            return False
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return False
        return all((_PART_NAME.fullmatch(e.name) or e.name == STEP_MARKER or paths.parse_temp(e.name))
                   and e.is_file(follow_symlinks=False) for e in entries)

    def bytes_used(self) -> int:
        return steps.folder_bytes(self.path) if self.path.exists() else 0

    def tidy(self, world: int, keep: int, below: int | None) -> list[int]:
        """(The host's lowest rank, at a save of step `below` it takes part in, or at the start with
        None.) Remove the marked steps older than the newest `keep` and the unmarked ones below
        `below` (every one with None): saves given up, never counted. The steps removed."""
        marked = self.marked_steps(world)
        return self._remove([s for s in marked[:-keep] if s != below] + [
            s for s in self.steps() if s not in marked and (below is None or s < below)])

    def remove_step(self, step: int) -> None:
        """Remove the folder of `step` (a failed save's), if it is the tier's own."""
        self._remove([step])

    def retain_upto(self, last: int) -> list[int]:
        """Remove the step folders after `last` (a rollback); returns the steps removed."""
        return self._remove([s for s in self.steps() if s > last])

    def _remove(self, doomed: list[int]) -> list[int]:
        removed = []
        for step in sorted(doomed):
            folder = self.step_path(step)
            if not self._ours(step):
                continue  # not all ours: never touched
            remove_path(steps.to_trash(folder))
            removed.append(step)
        if removed:
            paths.fsync_dir(self.path)
        return removed

    def clean(self) -> None:
        """What killed saves left here: trash folders, temporaries of dead processes."""
        if self.marked():
            steps.empty_trash(self.path)
            for step in self.steps():
                paths.remove_stale_temps(self.step_path(step))
