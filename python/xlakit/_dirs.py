"""Atomic replacement of a checkpoint *folder*: temporary sibling, commit record, exchange.

A folder cannot be renamed over a non-empty one, so the committed folder is
swapped with the new one by `renameat2(RENAME_EXCHANGE)` (Linux >= 3.15, local
file systems): every reader sees either the old checkpoint or the new one.
Where the exchange is unavailable, the old folder is first moved aside to a
`.xlakit-old` name (never deleted automatically before the new one is in
place), which leaves a short window without a folder at the final name.

The commit record, written last and fsynced, lists every file with its size
and xxh3-64; a folder without it is an interrupted save and is never loaded.
Temporary folders use `atomic.temp_path` names, so leftovers of dead
processes on this host are removed by the next save, as for single files.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import secrets
import shutil
from pathlib import Path

import xxhash

from xlakit import _archive, atomic
from xlakit.distributed import COMMIT_RECORD, SHARDED_FORMAT
from xlakit.errors import (CheckpointCorruptError, CheckpointFormatError, CheckpointIncompleteError,
                           CheckpointWriteError)

log = logging.getLogger("xlakit")

FORMAT = "xlakit-dcp"
FORMAT_VERSION = 1
# `xlakit.save(..., layout="sharded")` folders share the record name, told apart by format.
_DCP_METADATA = ".metadata"
_DCP_DATA_SUFFIX = ".distcp"
_CHUNK = 8 << 20
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100

write_error = atomic.write_error


def temp_dir(final: Path) -> Path:
    return atomic.temp_path(final)


def _is_checkpoint_file(name: str) -> bool:
    return name in (COMMIT_RECORD, _DCP_METADATA) or name.endswith(_DCP_DATA_SUFFIX)


def check_replaceable(final: Path) -> None:
    """Refuse to replace `final` unless it is absent or holds only checkpoint files."""
    if not final.exists():
        return
    foreign = (["(it is a file)"] if not final.is_dir()
               else sorted(n for n in os.listdir(final) if not _is_checkpoint_file(n)))
    if foreign:
        err = CheckpointWriteError(errno.EEXIST, f"cannot save {final}: it exists and is not a "
                                   f"DCP checkpoint folder (found {', '.join(foreign[:5])})")
        err.filename = str(final)
        err.add_note(f"A save replaces a folder holding only {_DCP_METADATA}, *{_DCP_DATA_SUFFIX} "
                     f"and {COMMIT_RECORD}; choose another path or move those files away.")
        raise err


def remove_stale_temps(final: Path) -> None:
    """Delete temporary folders of `final` left by dead processes on this host."""
    prefix, host = f".{final.name}.", atomic._host()
    for name in os.listdir(final.parent):
        if not (name.startswith(prefix) and name.endswith(atomic.TMP_SUFFIX)):
            continue
        parts = name[len(prefix):-len(atomic.TMP_SUFFIX)].rsplit(".", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid != os.getpid() and not atomic._pid_alive(pid) and (final.parent / name).is_dir():
            log.info("xlakit: removing %s, left by an interrupted save of %s", name, final)
            discard(final.parent / name)


def discard(folder: Path) -> None:
    def report(_fn, path, exc_info):
        log.warning("xlakit: could not remove %s: %s", path, exc_info[1])

    if folder.exists():
        shutil.rmtree(folder, onerror=report)


def _file_digest(path: Path) -> tuple[int, str]:
    h, n = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def file_entry(path: Path) -> dict:
    """A file's line in the commit record: its size and xxh3-64."""
    nbytes, digest = _file_digest(path)
    return {"nbytes": nbytes, _archive.HASH: digest}


def write_commit_record(tmp: Path, known: dict[str, dict] | None = None) -> None:
    """List every file of `tmp` with size and checksum in the commit record; fsync it all.

    `known` entries (hashed by the ranks that wrote them) are taken as they are
    once their size matches, so the committing rank does not read every file.
    """
    known = known or {}
    present = sorted(os.listdir(tmp))
    missing = sorted(set(known) - set(present))
    if missing:
        raise CheckpointIncompleteError(f"{tmp}: {', '.join(missing[:5])} reported written but not "
                                        f"found; the folder is not on storage every rank shares")
    files = {}
    for name in present:
        files[name] = known.get(name) or file_entry(tmp / name)
        size = os.stat(tmp / name).st_size
        if size != files[name]["nbytes"]:
            raise CheckpointIncompleteError(f"{tmp / name}: reported {files[name]['nbytes']} bytes "
                                            f"by the rank that wrote it, found {size}")
    record = {"format": FORMAT, "version": FORMAT_VERSION, "files": files}
    with open(tmp / COMMIT_RECORD, "x") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    atomic.fsync_dir(tmp)


def _exchange(a: Path, b: Path) -> bool:
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


def replace(tmp: Path, final: Path) -> None:
    """Make the complete folder `tmp` the checkpoint at `final`, durably."""
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):
        discard(tmp)  # now holds the previous checkpoint
    else:
        aside = final.with_name(f".{final.name}.{secrets.token_hex(4)}.xlakit-old")
        os.rename(final, aside)
        os.rename(tmp, final)
        discard(aside)
    atomic.fsync_dir(final.parent)


def read_commit_record(final: Path) -> dict:
    """The commit record of `final`; refuses folders that have none."""
    if not final.is_dir():
        raise FileNotFoundError(2, f"no checkpoint folder at {final}", str(final))
    try:
        text = (final / COMMIT_RECORD).read_text()
    except FileNotFoundError:
        found = sorted(os.listdir(final))
        err = CheckpointIncompleteError(
            f"{final} has no commit record ({COMMIT_RECORD}): its save did not finish, or it was "
            f"not written by xlakit.dcp_save (found: {', '.join(found[:6]) or 'nothing'})")
        err.add_note("It is never loaded; the next xlakit.dcp_save to this path replaces it. If it "
                     "is a plain torch.distributed.checkpoint folder you trust, load it with "
                     "torch.distributed.checkpoint.load.")
        raise err from None
    try:
        record = json.loads(text)
        ok = record.get("format") == FORMAT and isinstance(record.get("files"), dict)
    except (json.JSONDecodeError, AttributeError):
        record, ok = None, False
    if ok is False and isinstance(record, dict) and record.get("format") == SHARDED_FORMAT:
        raise CheckpointFormatError(
            f"{final} is a sharded xlakit.save checkpoint (format {SHARDED_FORMAT!r}), not a "
            f"DCP folder (format {FORMAT!r}); load it with xlakit.load")
    if not ok:
        raise CheckpointCorruptError(f"{final / COMMIT_RECORD} is not an xlakit commit record "
                                     f"(expected JSON with format {FORMAT!r}); found {text[:80]!r}")
    return record


def verify_file(final: Path, name: str, expected: dict) -> None:
    path = final / name
    if not path.is_file():
        raise CheckpointIncompleteError(
            f"{final}: {name} is listed in the commit record but missing")
    nbytes, digest = _file_digest(path)
    if nbytes != expected["nbytes"] or digest != expected[_archive.HASH]:
        raise CheckpointCorruptError(
            f"{path}: expected {expected['nbytes']} bytes with {_archive.HASH} "
            f"{expected[_archive.HASH]}, found {nbytes} bytes with {digest}; the file was "
            f"changed or damaged after the save committed")
