"""A manager folder on disk: one folder per step, found from commit records alone.

    <directory>/
      100/                      a step: the manager's record, then the checkpoint
        xlakit-step.json        step, layout, metrics (written first, atomically)
        ckpt.pt                 layouts "single" and "replicated": committed by its rename
        ckpt/                   layouts "sharded" and "dcp", and "replicated" saved replica-parallel
                                (step record version 2): committed by its xlakit-commit.json
      .60.1f2e3d4c.xlakit-trash a step retention gave up, being deleted

There is no index to keep in sync: a step exists when its folder holds a
valid step record *and* its checkpoint's own commit (the rename of `ckpt.pt`,
the commit record of `ckpt/`), which the save makes last and atomically. A
crash at any moment therefore leaves every step either committed, whole, or
not a step. A folder with a record but no committed checkpoint is an
interrupted save (`pending`); anything without a record is not the
manager's (`other`) and is never touched. A step folder whose record cannot
be read as this step's (truncated, altered, copied from another step's
folder, written by a newer xlakit) is `damaged`: never a step, never
touched, and named wherever the folder is looked at (the manager logs it,
`xlakit ckpt ls` lists it, `verify` fails on it, a save of that step refuses).
A new step folder is made under a temporary name with its record inside, then
renamed, so the manager never leaves an empty step folder it could not tell
from someone else's.

Deleting is two steps: a step folder is first renamed to a trash name
(atomic: the step is gone from every scan at once), then removed. A kill in
between leaves a trash folder, which no scan lists as a step and the next
manager removes; only names of exactly the trash shape are ever removed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import numbers
import os
import re
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xlakit.checkpoint.core import paths
from xlakit.checkpoint.format import folders
from xlakit.checkpoint.core.operation import remove_path
from xlakit.errors import CheckpointBusyError, CheckpointCorruptError, CheckpointError, CheckpointWriteError


STEP_RECORD = "xlakit-step.json"
STEP_FORMAT = "xlakit-step"
STEP_VERSION = 2  # the newest read; 2 only for a replica-parallel step (see `record_fields`), else 1
CHECKPOINT_FILE = "ckpt.pt"  # layouts single and replicated
CHECKPOINT_FOLDER = "ckpt"  # layouts sharded and dcp, and replicated saved replica-parallel (a folder of shares)
LAYOUTS = ("single", "replicated", "sharded", "dcp")
TRASH_SUFFIX = ".xlakit-trash"
LOCK_FILE = ".xlakit-manager.lock"
_STEP_NAME = re.compile(r"0|[1-9][0-9]{0,18}")
MAX_STEP = 10**19 - 1  # the largest step `_STEP_NAME` recognizes
_TRASH_NAME = re.compile(r"\.(0|[1-9][0-9]{0,18})\.[0-9a-f]{8}" + re.escape(TRASH_SUFFIX))


def check_step(step: object) -> int:
    """`step` as an int (numpy's integers too); refuses what is no step number, naming it."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be a whole number, got {step!r} ({type(step).__name__})")
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be 0 or more, got {step}")
    if step > MAX_STEP:
        raise ValueError(f"step must be at most {MAX_STEP} (19 digits, a folder name every reader "
                         f"recognizes), got {step}")
    return step


def checkpoint_name(layout: str, replica_parallel: bool = False) -> str:
    return CHECKPOINT_FILE if layout in ("single", "replicated") and not replica_parallel else CHECKPOINT_FOLDER


def record_fields(layout: str, replica_parallel: bool = False) -> dict:
    """A new step record's version, layout and checkpoint name.

    A replica-parallel replicated step is a folder of shares (`replicas.py`); its record is
    version 2, so an older xlakit (which reads version 1, and knows no `ckpt/` of a replicated
    step) calls the step damaged, saying a newer xlakit wrote it, and never deletes or reuses it.
    Every other step stays version 1, readable by older xlakit as before.
    """
    return {"version": 2 if replica_parallel else 1, "layout": layout,
            "checkpoint": checkpoint_name(layout, replica_parallel)}


@dataclass(frozen=True)
class StepFolder:
    """One folder named like a step that holds a step record."""

    step: int
    path: Path
    record: dict
    problem: str | None  # why it is not committed; None when it is

    @property
    def committed(self) -> bool:
        return self.problem is None

    @property
    def layout(self) -> str:
        return self.record["layout"]

    @property
    def checkpoint(self) -> Path:
        return self.path / self.record["checkpoint"]

    @property
    def metrics(self) -> dict:
        return self.record.get("metrics") or {}


@dataclass
class Scan:
    """What a manager folder holds: committed steps, interrupted saves, trash, and the rest."""

    committed: dict[int, StepFolder] = field(default_factory=dict)
    pending: dict[int, StepFolder] = field(default_factory=dict)
    damaged: dict[int, str] = field(default_factory=dict)  # step -> what is wrong with its record
    trash: list[Path] = field(default_factory=list)
    other: dict[str, str] = field(default_factory=dict)  # name -> why it is not the manager's
    locked: bool = False  # it holds a manager's lock file: a manager used it, even if it never saved

    @property
    def latest(self) -> int | None:
        return max(self.committed) if self.committed else None

    def describe(self) -> str:
        """What the folder holds besides committed steps, for messages."""
        parts = []
        if self.pending:
            parts.append(f"interrupted saves of steps {sorted(self.pending)}")
        if self.damaged:
            parts.append(f"steps {sorted(self.damaged)} with a damaged {STEP_RECORD}")
        if self.other:
            parts.append(f"entries that are not the manager's: {', '.join(sorted(self.other)[:5])}")
        return "; ".join(parts) or "it is empty"


def read_record(folder: Path) -> dict | None:
    """The step record of `folder`: None when it has none.

    Raises:
        CheckpointCorruptError: it has one, which is not this step's record.
    """
    try:
        return record_of(folder)
    except ValueError as e:
        raise CheckpointCorruptError(f"{folder / STEP_RECORD} is damaged: {e}") from e


def record_of(folder: Path) -> dict | None:
    """`read_record`, raising ValueError saying what is wrong with a damaged record."""
    try:
        text = (folder / STEP_RECORD).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"it cannot be read ({e.strerror})") from e
    return check_record(text, folder.name)


def not_a_step(step: int, where: Path | str, foreign: list[str]) -> CheckpointWriteError:
    """The error of a save into a step folder (or prefix) holding what the manager did not make."""
    err = CheckpointWriteError(errno.EEXIST, f"cannot save step {step} into {where}: it holds entries that "
                               f"are not a step of an xlakit manager ({', '.join(foreign[:5])}); they are "
                               f"left untouched")
    err.add_note("Move them away, or give the manager a folder (or URL) of its own.")
    return err


def damage_note(folder: Path | str) -> str:
    """How to mend a step folder (or a step's prefix on object storage) whose record is damaged."""
    return (f"xlakit never deletes or reuses {folder}: move it away (or delete it, if its checkpoint is not "
            f"needed); `xlakit ckpt inspect {folder}/{CHECKPOINT_FILE}` (or {CHECKPOINT_FOLDER}/) shows "
            f"what it holds.")


def check_record(text: str | bytes, name: str) -> dict:
    """The step record `text` of the step folder (or prefix) `name`; raises ValueError when it is not one."""
    try:
        record = json.loads(text)
    except ValueError as e:
        raise ValueError(f"it is not whole JSON, truncated or altered: {e}") from e
    if not isinstance(record, dict) or record.get("format") != STEP_FORMAT:
        raise ValueError(f"format {record.get('format') if isinstance(record, dict) else None!r}, "
                         f"expected {STEP_FORMAT!r}")
    version = record.get("version")
    if not isinstance(version, int) or version > STEP_VERSION:
        raise ValueError(f"version {version!r}; this xlakit reads version {STEP_VERSION} (a newer "
                         f"xlakit wrote it?)")
    shares = record.get("layout") == "replicated" and version >= 2 and record.get("checkpoint") == CHECKPOINT_FOLDER
    if (record.get("layout") not in LAYOUTS or record.get("checkpoint") != checkpoint_name(record["layout"], shares)
            or not isinstance(record.get("metrics", {}), dict)):
        raise ValueError(f"layout {record.get('layout')!r} with checkpoint {record.get('checkpoint')!r}")
    if str(record.get("step")) != name:
        raise ValueError(f"it records step {record.get('step')!r} in folder {name!r} (a copy of "
                         f"another step's folder?)")
    return record


def commit_problem(folder: Path, record: dict) -> str | None:
    """Why the checkpoint of a step folder is not committed; None when it is."""
    target = folder / record["checkpoint"]
    if record["checkpoint"] == CHECKPOINT_FILE:
        return None if target.is_file() else f"{target.name} was never committed (an interrupted save)"
    try:
        commit = folders.read_json_record(target) if target.is_dir() else None
    except CheckpointError as e:
        return f"its commit record is unreadable ({e})"
    if commit is None:
        return f"{target.name}/ has no {folders.COMMIT_RECORD} (an interrupted save)"
    want = {"sharded": folders.SHARDED_FORMAT, "dcp": folders.DCP_FORMAT,
            "replicated": folders.REPLICATED_FORMAT}[record["layout"]]
    if commit.get("format") != want:
        return f"{target.name}/ is committed as {commit.get('format')!r}, its record says {want!r}"
    return None


def scan(directory: Path) -> Scan:
    """Read every entry of a manager folder; nothing is changed.

    Safe against a manager working in the folder meanwhile: a step it commits is found
    whole or not at all, and one its retention moves away while it is being read is left
    out, never reported as interrupted or foreign.
    """
    found = Scan()
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if _TRASH_NAME.fullmatch(name):
            found.trash.append(path)
            continue
        if name == LOCK_FILE:  # the manager's own
            found.locked = True
            continue
        if not _STEP_NAME.fullmatch(name) or not path.is_dir() or path.is_symlink():
            if paths.parse_temp(name) is None:
                found.other[name] = "not named like a step folder"
            continue
        try:
            record = record_of(path)
        except ValueError as e:
            if os.path.lexists(path):  # else retention took it (to the trash) while it was read
                found.damaged[int(name)] = str(e)
            continue
        if record is None:
            if os.path.lexists(path):
                found.other[name] = f"no {STEP_RECORD}: not a step of an xlakit manager"
            continue
        step = StepFolder(int(name), path, record, commit_problem(path, record))
        if not step.committed and not os.path.lexists(path):
            continue  # retention took it while it was read: it is no step, not a broken one
        (found.committed if step.committed else found.pending)[step.step] = step
    return found


def foreign_entries(folder: Path) -> list[str]:
    """Entries of a would-be step folder that xlakit did not make there (none: it may be used)."""
    if not folder.exists():
        return []
    if not folder.is_dir() or folder.is_symlink():
        return ["(it is not a folder)"]
    if read_record(folder) is not None:
        return []
    return sorted(n for n in os.listdir(folder) if paths.parse_temp(n) is None)


def write_record(folder: Path, record: dict, op=None) -> None:
    """Put the step record in place atomically (no rename once `op`'s owner gave up)."""
    paths.remove_stale_temps(folder, stem=STEP_RECORD)
    text = json.dumps(record, indent=1, sort_keys=True).encode()
    paths.write_file(folder / STEP_RECORD, lambda f: f.write(text), op=op)


def prepare(op, folder: Path, record: dict) -> None:
    """(Rank 0, before every rank saves.) Refuse a folder that is not the manager's; write the record."""
    try:
        foreign = foreign_entries(folder)
    except CheckpointCorruptError as e:
        err = CheckpointWriteError(errno.EEXIST, f"cannot save step {record['step']} into {folder}: {e}; "
                                   f"it is left untouched")
        err.add_note(damage_note(folder))
        raise err from e
    if foreign:
        raise not_a_step(record["step"], folder, foreign)
    existing = read_record(folder) if folder.exists() else None
    if existing is not None and commit_problem(folder, existing) is None:
        raise ValueError(f"step {record['step']} is already committed in {folder.parent}")
    if folder.exists():  # an interrupted save of this step: its record is replaced
        write_record(folder, record, op)
        return
    # A new step folder appears with its record in it, never empty: made under a temporary
    # name (removed by `clean` if this process dies first), then renamed.
    tmp = op.own(paths.temp_path(folder))
    tmp.mkdir()
    write_record(tmp, record)
    with op.guarded():
        os.rename(tmp, folder)
        op.disown(tmp)
    paths.fsync_dir(folder.parent)


def lock_folder(directory: Path) -> int:
    """Hold `directory`'s manager lock for this process: a file descriptor; closing it releases it.

    The lock (flock on `.xlakit-manager.lock`, which stays in place) is released by the
    kernel when the process dies, so a killed job never leaves it held.

    Raises:
        CheckpointBusyError: another manager holds it, in any process, this one included.
    """
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that did not say which"
        os.close(fd)
        err = CheckpointBusyError(f"another checkpoint manager is using {directory} ({holder}); two "
                                  f"managers on one folder would delete each other's saves in progress")
        err.add_note("Close the other manager (manager.close(), or a with block), stop the other job, "
                     "or give this run a folder of its own.")
        raise err from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def to_trash(folder: Path) -> Path:
    """Take a step folder out of every scan at once: rename it to a trash name."""
    trash = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}{TRASH_SUFFIX}")
    os.rename(folder, trash)
    return trash


def clean(directory: Path) -> list[Path]:
    """Remove what killed managers left: trash, and step folders half made by dead processes."""
    return empty_trash(directory) + paths.remove_stale_temps(directory)


def empty_trash(directory: Path) -> list[Path]:
    """Remove the trash folders of `directory` (names of exactly the trash shape only)."""
    removed = []
    for path in scan(directory).trash:
        remove_path(path)
        removed.append(path)
    if removed:
        paths.fsync_dir(directory)
    return removed


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


class LocalFolder:
    """A manager folder on a file system, as `CheckpointManager` uses it (`bucket_steps.py` is
    the same on object storage)."""

    def __init__(self, directory: Path):
        self.directory = directory

    def make(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            what = "it is a file" if self.directory.is_file() else e.strerror
            raise CheckpointWriteError(e.errno, f"cannot use {self.directory} as a manager folder: "
                                       f"{what}") from e

    def identity(self, step: int | None = None) -> str:
        """What every rank must name alike: the folder, or one step's."""
        return str((self.directory if step is None else self.step_path(step)).absolute())

    def step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def target(self, step: int, record: dict) -> Path:
        return self.step_path(step) / record["checkpoint"]

    def scan(self, op=None) -> Scan:
        return scan(self.directory)  # a local listing needs no deadline of its own

    def prepare(self, op, step: int, record: dict) -> None:
        prepare(op, self.step_path(step), record)

    def hold(self, op) -> Callable[[], None]:
        """Lock the folder (`lock_folder`); the call that releases it."""
        fd = lock_folder(self.directory)
        return lambda: os.close(fd)

    def renew(self, op=None, cover_s: float = 0.0) -> None:
        """A lock held by the kernel needs no renewing."""

    def step_bytes(self, step: StepFolder) -> int:
        return folder_bytes(step.path)

    def withdraw(self, step: int, record: dict) -> bool:
        """(One process, its save of `step` failed before it wrote anything.) Remove the step folder
        `prepare` made, when it holds nothing but this very record; whether it was removed.

        Otherwise `xlakit ckpt ls` would list a refused save as an interrupted one until the next commit.
        """
        folder = self.step_path(step)
        try:
            if os.listdir(folder) != [STEP_RECORD] or record_of(folder) != record:
                return False
            os.unlink(folder / STEP_RECORD)
            os.rmdir(folder)  # fails if anything appeared meanwhile: then it stays, as an interrupted step
        except (OSError, ValueError):
            return False
        paths.fsync_dir(self.directory)
        return True

    def discard(self, doomed: list[int]) -> None:
        """Take steps out of every scan at once (to the trash); `clean` removes them."""
        for s in doomed:
            to_trash(self.step_path(s))
        paths.fsync_dir(self.directory)

    def clean(self) -> list:
        return clean(self.directory)
