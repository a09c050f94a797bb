"""Temporary names, atomic replacement and the cleanup of what dead processes left.

Whatever moment a process dies, the final name holds either the previous
checkpoint or the complete new one: files and folders are written under a
temporary sibling name, fsynced, and renamed (files) or exchanged
(`renameat2(RENAME_EXCHANGE)`, folders) over the final name.

Temporary names carry their owner: `.<stem>.<host>.<pid>.<random>.xlakit-tmp`,
the stem being the final name (shortened, with a digest, where the whole name
would pass the file system's 255-byte limit). The cleanup removes only names
of exactly that shape whose host is this one and whose process is dead:
never a temporary another live process, or another host, is still writing,
and never a file xlakit did not name.

Where a folder cannot be exchanged atomically, the previous one is moved
aside first, to `.<stem>.<host>.<pid>.<random>.xlakit-old`, and removed once
the new one is in place. A process that died between those steps left the
aside: the next save to that name (`recover_asides`) removes it when the
final name holds a checkpoint again, and otherwise renames it back, since it
then is the last committed checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import xxhash

from xlakit.checkpoint.core.operation import remove_path
from xlakit.errors import CheckpointError, CheckpointWriteError

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation

log = logging.getLogger("xlakit")

TMP_SUFFIX = ".xlakit-tmp"
ASIDE_SUFFIX = ".xlakit-old"
_NAME_MAX = 255
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def host() -> str:
    return socket.gethostname().replace(".", "_") or "host"


def temp_stem(name: str) -> str:
    """The final name as it appears in its temporary names, short enough for any host and pid."""
    room = _NAME_MAX - len(f"..{host()}.{2**32}.{'0' * 8}{TMP_SUFFIX}".encode())
    raw = name.encode()
    if len(raw) <= room:
        return name
    tag = "~" + xxhash.xxh3_64_hexdigest(raw)[:12]
    return raw[:room - len(tag)].decode(errors="ignore") + tag


def temp_path(final: Path, suffix: str = TMP_SUFFIX) -> Path:
    return final.with_name(f".{temp_stem(final.name)}.{host()}.{os.getpid()}."
                           f"{secrets.token_hex(4)}{suffix}")


def parse_temp(name: str, suffix: str = TMP_SUFFIX) -> tuple[str, str, int] | None:
    """(stem, host, pid) of a temporary (or, with ASIDE_SUFFIX, aside) name xlakit made; None for any other."""
    if not (name.startswith(".") and name.endswith(suffix)):
        return None
    parts = name[1:-len(suffix)].rsplit(".", 3)
    if len(parts) != 4 or not parts[2].isdigit() or len(parts[3]) != 8:
        return None
    try:
        int(parts[3], 16)
    except ValueError:
        return None
    return parts[0], parts[1], int(parts[2])


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs: a zombie (ended, not yet reaped by its parent)
    does not, it can write nothing more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return True  # no /proc (macOS): kill(0) is all there is
    return state != [b"Z"]


def remove_stale_temps(folder: Path, *, stem: str | None = None, stem_prefix: str | None = None) -> list[Path]:
    """Remove temporaries in `folder` left by dead processes of this host; returns them.

    Args:
        stem: only temporaries of this final name (`temp_stem` is applied).
        stem_prefix: only temporaries whose final name starts with this (e.g. every
            shard of a sharded folder, whatever save it belonged to).
    """
    removed = []
    want = temp_stem(stem) if stem is not None else None
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        parsed = parse_temp(name)
        if parsed is None:
            continue
        their_stem, their_host, pid = parsed
        if want is not None and their_stem != want:
            continue
        if stem_prefix is not None and not their_stem.startswith(stem_prefix):
            continue
        if not _dead_here(their_host, pid):
            continue
        remove_path(folder / name)
        removed.append(folder / name)
    if removed:
        log.info("xlakit: removed %d temporary file(s) of interrupted saves in %s", len(removed), folder)
    return removed


def _dead_here(host_: str, pid: int) -> bool:
    """Whether a name's owner is a process of this host that is gone (never this process)."""
    return host_ == host() and pid != os.getpid() and not pid_alive(pid)


def recover_asides(final: Path) -> list[Path]:
    """Deal with what dead processes moved aside while replacing folder `final`; the asides handled.

    An aside is the previous checkpoint, moved away for the moment between two renames. If the
    process died in that moment and `final` is missing, the aside is the last committed
    checkpoint: it is renamed back. Otherwise (`final` holds a newer one) it is removed.
    """
    handled = []
    try:
        names = os.listdir(final.parent)
    except OSError:
        return handled
    want = temp_stem(final.name)
    for name in sorted(names):
        parsed = parse_temp(name, ASIDE_SUFFIX)
        if parsed is None or parsed[0] != want or not _dead_here(parsed[1], parsed[2]):
            continue
        aside = final.parent / name
        if not os.path.lexists(final):
            os.rename(aside, final)
            log.warning("xlakit: %s was missing (a save was killed while replacing it); the previous "
                        "checkpoint, moved aside to %s, is back in place", final, name)
        else:
            remove_path(aside)
            log.info("xlakit: removed %s, the checkpoint a killed save had moved aside from %s", name, final)
        handled.append(aside)
    if handled:
        fsync_dir(final.parent)
    return handled


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(final: Path, fill: Callable[[BinaryIO], None], *, op: "Operation | None" = None) -> None:
    """Write `final` whole or not at all: `fill(f)` into a temporary sibling, fsync, rename, fsync
    the folder. With `op`, the rename happens only while its owner still wants it (`op.guarded`);
    the temporary goes on any failure."""
    tmp = temp_path(final)
    try:
        with open(tmp, "xb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        with op.guarded() if op is not None else contextlib.nullcontext():
            os.replace(tmp, final)
    except BaseException:
        remove_path(tmp)
        raise
    fsync_dir(final.parent)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the platform or file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_folder(tmp: Path, final: Path) -> Path | None:
    """Put the complete folder `tmp` at `final`; returns where the previous folder went, if any.

    With an atomic exchange the previous checkpoint is at `tmp` afterwards; without
    one it is first moved aside (a short window with no folder at `final`).
    """
    if not final.exists():
        os.rename(tmp, final)
        return None
    if exchange(tmp, final):
        return tmp
    aside = temp_path(final, ASIDE_SUFFIX)  # named with its owner, for `recover_asides`
    os.rename(final, aside)
    os.rename(tmp, final)
    return aside


def write_error(e: OSError, final: Path, *, stage: str, bytes_done: int = 0) -> CheckpointWriteError:
    """A CheckpointWriteError explaining `e`, keeping its errno; the old checkpoint is untouched."""
    folder = final.parent
    if e.errno == errno.ENOENT and not folder.is_dir():
        what, fix = f"the folder {folder} does not exist", "create it first (xlakit does not create folders)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what, fix = f"no permission to write in {folder}", "save to a folder this user can write"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        what = f"no space for the checkpoint ({os.strerror(e.errno)}) after {bytes_done} bytes"
        fix = "free space, raise the quota or file-size limit, or save elsewhere"
    elif e.errno == errno.ENAMETOOLONG:
        what, fix = "the name is too long for the file system", "choose a shorter file name"
    else:
        what, fix = f"{os.strerror(e.errno) if e.errno else e}", "check the folder and the disk"
    err = CheckpointWriteError(e.errno, f"cannot save {final} ({stage}): {what}")
    err.filename = str(final)
    err.add_note(f"How to fix: {fix}. The previous checkpoint at {final}, if any, is untouched.")
    return err


@contextlib.contextmanager
def writing(final: Path | Callable[[], Path], op: "Operation") -> Iterator[None]:
    """Around writing `final` (or the file `final()` names once it fails, where that is decided
    inside): an OSError becomes its `write_error`; xlakit's own errors pass."""
    try:
        yield
    except OSError as e:
        if isinstance(e, CheckpointError):  # CheckpointTimeoutError is an OSError too
            raise
        where = final() if callable(final) else final
        raise write_error(e, where, stage=op.stage, bytes_done=op.bytes_done) from e


def check_target(final: Path) -> None:
    """Refuse a file target that cannot be written, before any work: a folder, no parent, a bad name."""
    try:
        is_dir = final.is_dir()
    except OSError as e:  # a name too long for the file system
        raise write_error(e, final, stage="open") from e
    if is_dir:
        err = CheckpointWriteError(errno.EISDIR, f"cannot save {final}: it is a folder; a checkpoint "
                                   f"file needs a file name")
        err.filename = str(final)
        err.add_note("Pass a file path such as <folder>/ckpt.pt, or layout='sharded' (or "
                     "xlakit.dcp_save) for a checkpoint folder.")
        raise err
    if not final.parent.is_dir():
        raise write_error(FileNotFoundError(errno.ENOENT, "No such file or directory"), final,
                          stage="open")
