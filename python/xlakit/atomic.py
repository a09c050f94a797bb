"""Atomic replacement of a file: temporary name, fsync, rename, fsync the folder.

Whatever moment a process dies, the final name holds either the previous file
or the complete new one. Temporary files carry host and pid in their name
(`.<name>.<host>.<pid>.<random>.xlakit-tmp`), so the next save in the same
folder removes only leftovers of dead processes on this host and never a
temporary file another live process (or another host) is still writing.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
from pathlib import Path

from xlakit.errors import CheckpointWriteError

log = logging.getLogger("xlakit")

TMP_SUFFIX = ".xlakit-tmp"


def _host() -> str:
    return socket.gethostname().replace(".", "_") or "host"


def temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(final: Path) -> list[Path]:
    """Delete temporaries of `final` left by dead processes on this host; returns them."""
    prefix, host, removed = f".{final.name}.", _host(), []
    try:
        names = os.listdir(final.parent)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(TMP_SUFFIX)):
            continue
        parts = name[len(prefix):-len(TMP_SUFFIX)].rsplit(".", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if int(parts[1]) == os.getpid() or _pid_alive(int(parts[1])):
            continue
        if (final.parent / name).is_dir():
            continue  # a folder checkpoint's temporary (dcp); its own cleanup handles those
        try:
            os.unlink(final.parent / name)
            removed.append(final.parent / name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("xlakit: removed %d temporary file(s) of interrupted saves of %s", len(removed), final)
    return removed


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Make `tmp` (already written and fsynced) the file at `final`, durably."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def discard(tmp: Path) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def write_error(e: OSError, final: Path, *, stage: str, bytes_done: int = 0) -> CheckpointWriteError:
    """A CheckpointWriteError explaining `e`, keeping its errno; the old file is untouched."""
    folder = final.parent
    if e.errno == errno.ENOENT and not folder.is_dir():
        what, fix = f"the folder {folder} does not exist", "create it first (xlakit does not create folders)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what, fix = f"no permission to write in {folder}", "save to a folder this user can write"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        what = f"no space for the checkpoint ({os.strerror(e.errno)}) after {bytes_done} bytes"
        fix = "free space, raise the quota or file-size limit, or save elsewhere"
    else:
        what, fix = f"{os.strerror(e.errno) if e.errno else e}", "check the folder and the disk"
    err = CheckpointWriteError(e.errno, f"cannot save {final} ({stage}): {what}")
    err.filename = str(final)
    err.add_note(f"How to fix: {fix}. The previous checkpoint at {final}, if any, is untouched.")
    return err
