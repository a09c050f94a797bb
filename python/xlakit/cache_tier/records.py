"""Key records beside a shared tier's entries, so `xlakit cache explain` works on a bucket and a pulled folder.

The wrapper writes `<entry>.parts.json` beside each entry it writes
(`runtime/cache_explain.py`: the key's parts, for explaining misses). A
record is a diagnostic, never code and never trusted for loading; still, one
read from a bucket is checked as `cache_explain.parse_record` checks a local
one (at most 64 KiB, the record format, naming the entry it sits beside)
before it is written into a local folder or used. Records are published after
their entries, create-only, and pulled for the entries a pull wrote.
"""

from __future__ import annotations

import contextlib
import os

from xlakit import _C
from xlakit.runtime import cache_explain

SUFFIX = cache_explain.PARTS_SUFFIX


def is_record_name(name: str) -> bool:
    return cache_explain.PARTS_NAME.fullmatch(name) is not None


def _read_local(path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(cache_explain.MAX_PARTS_BYTES + 1)
    record, _ = cache_explain.parse_record(os.path.basename(path), data)
    return data if record is not None and len(data) <= cache_explain.MAX_PARTS_BYTES else None


def publish(tier, op) -> int:
    """Send the records of entries the bucket holds that it lacks; how many were sent (never raises)."""
    sent = 0
    try:
        with os.scandir(tier.folder) as found:
            names = [e.name for e in found if is_record_name(e.name)]
    except OSError:
        return 0
    for name in names:
        if name in tier.remote or name[:64] not in tier.remote or op.remaining() <= 0:
            continue
        data = _read_local(tier.folder / name)
        if data is None:
            continue
        try:
            tier.store.put(op, tier.prefix.child(name), data, create_only=True)
            sent += 1
        except FileExistsError:
            pass
        except Exception:  # noqa: BLE001 - a record only explains; the next publish tries again
            continue
        tier.remote.add(name)
    return sent


def pull(tier, op, listed: dict) -> int:
    """Write the records the bucket holds for entries the folder has and whose record it lacks; how many."""
    wrote = 0
    for name, (size, _) in listed.items():
        if not is_record_name(name) or size > cache_explain.MAX_PARTS_BYTES or op.remaining() <= 0:
            continue
        target = tier.folder / name
        if os.path.lexists(target) or not (tier.folder / name[:64]).is_file():
            continue
        with contextlib.suppress(Exception):  # a record only explains: one the bucket garbled is skipped
            data = tier.store.get(op, tier.prefix.child(name), 0, cache_explain.MAX_PARTS_BYTES + 1)
            record, _ = cache_explain.parse_record(name, data)
            if record is not None and len(data) <= cache_explain.MAX_PARTS_BYTES:
                _C.write_file_atomic(str(target), data)
                wrote += 1
    return wrote


def read_bucket(url: str) -> tuple[list[tuple[str, dict]], list[str]]:
    """Every key record under a shared tier's URL (all devices and keys), as `cache_explain.read_folder`
    returns a folder's: (entry name, record) and notes on what could not be used."""
    from xlakit.checkpoint.objstore import client

    root = client.Location.parse(url)
    store = client.store_for(root)
    listed = store.list_dated(None, root)
    entries = {n.rsplit("/", 1)[-1] for n in listed if not n.endswith(SUFFIX)}
    records, notes = [], []
    for path, (size, written) in sorted(listed.items()):
        name = path.rsplit("/", 1)[-1]
        if not is_record_name(name):
            continue
        if size > cache_explain.MAX_PARTS_BYTES:
            notes.append(f"ignored {path}: more than {cache_explain.MAX_PARTS_BYTES} bytes")
            continue
        record, why = cache_explain.parse_record(name, store.get(None, root.child(path), 0,
                                                                  cache_explain.MAX_PARTS_BYTES + 1))
        if record is None:
            notes.append(f"ignored {path}: {why}")
            continue
        if name[:64] not in entries:
            record["entry_gone"] = True
        if not record["written_unix_s"]:
            record["written_unix_s"] = written
        records.append((name[:64], record))
    return records, notes
