"""`xlakit cache ls|verify|prune DIR`: inspect a persistent compilation cache.

The patched torch_xla wraps every cache entry in an envelope (csrc/core/
envelope.h); this tool reads it through the same C++ (`xlakit._C`) so what it
calls valid is exactly what the runtime will load. `ls` reads headers only
(cheap on multi-GB caches); `verify` checksums every payload, streaming it in
bounded pieces.

`prune` deletes only files it positively identifies as the cache's own: an
entry (named like torch_xla's cache keys, a 128-bit hash in decimal) whose
envelope the runtime would reject (corrupt, or for another platform version
or patch series given `--platform-version` and friends), and temporary files
of the atomic writer old enough that no writer is still on them. Entries
without an envelope (a stock torch_xla's) are `foreign` and removed only on
request (`--foreign`), and only in a folder `xlakit.enable_persistent_cache`
made (it holds its key file), since a stock runtime may still be using them.
Beside each of its entries the PJRT wrapper writes the key's parts,
`KEY.parts.json` (a diagnostic for `xlakit cache explain`, never loaded; see
cache_explain): listed as `parts`, never an entry (so never called corrupt);
prune removes it with its entry, and once its entry is gone (`stale_parts`).
Everything else in the folder (a README, a lock file, `__init__.py`, a
subfolder, a link) is listed as `other` and never touched.

With `XLAKIT_CACHE_KEY` set, `verify` and `prune` check every entry's tag
as the runtime does: an entry without one, or whose tag does not verify
(written with another key, or altered with its checksum recomputed), is not
loadable. Every command compares the cache key an entry stores with its file
name, as the PJRT wrapper does on load: an entry renamed, copied or swapped is
`key_mismatch` (torch_xla's hooks store no key, so an entry under a decimal
name may have none). Each command first says who can put entries into the
folder (`cache_trust`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from xlakit import _C, _knobs
from xlakit.runtime import cache_explain, cache_trust
from xlakit.runtime.compile_cache import KEY_FILE, key_id
from xlakit.errors import XlakitError

# torch_xla's PersistentCache names a file `ss << key` (torch_xla/csrc/runtime/cache.h), the key being a
# torch::lazy::hash_t, a 128-bit integer that an ostream writes in decimal; xlakit's PJRT wrapper names
# its entries by a SHA-256 in hex (csrc/pjrt_wrap/compile_cache.h).
_ENTRY_NAME = re.compile(r"[0-9]{1,39}")
_WRAPPER_ENTRY_NAME = re.compile(r"[0-9a-f]{64}")
# A temporary file younger than this may still be written to; a killed writer's is older.
TEMP_MIN_AGE_S = 15 * 60
_MAGICS = (_C.ENVELOPE_MAGIC, _C.AUTH_MAGIC)

LOADABLE = "ok"
TEMPORARY, IN_PROGRESS = "temporary", "in_progress"
FOREIGN, UNREADABLE, KEY, OTHER = "foreign", "unreadable", "key", "other"
PARTS, STALE_PARTS = "parts", "stale_parts"  # a wrapper entry's key record (cache_explain), its entry gone
KEY_MISMATCH = "key_mismatch"  # the runtime's name for it (csrc/core/envelope.cc EntryStatusName)


@dataclass(frozen=True)
class EntryReport:
    name: str
    size_bytes: int
    status: str  # "ok", an envelope status name, or one of the constants above
    kind: str | None
    platform_name: str | None
    platform_version: str | None
    patch_series_id: str | None
    torch_xla_revision: str | None
    message: str

    @property
    def valid(self) -> bool:
        return self.status == LOADABLE

    @property
    def is_entry(self) -> bool:
        """A cache entry (loadable or not), as opposed to a temporary, the key file or a stranger."""
        return self.status not in (TEMPORARY, IN_PROGRESS, KEY, OTHER, PARTS, STALE_PARTS)


def _is_entry_name(name: str) -> bool:
    if _WRAPPER_ENTRY_NAME.fullmatch(name):
        return True
    return _ENTRY_NAME.fullmatch(name) is not None and int(name) < 1 << 128


def is_entry_name(name: str) -> bool:
    """Whether `name` is an entry's: the wrapper's SHA-256 in hex, or the patched runtime's decimal hash."""
    return _is_entry_name(name)


def has_envelope(path: Path) -> bool:
    """Whether the file starts with xlakit's envelope (a name alone is anyone's: a file called `1234`)."""
    try:
        with open(path, "rb") as f:
            return f.read(4).startswith(_MAGICS)
    except OSError:
        return False


def _is_temporary(name: str) -> bool:
    """A temporary of the atomic writer for an entry or its key record (its name format is the C++ writer's,
    csrc/core/atomic_file.h)."""
    target = _C.temp_file_target(name) or ""
    return _is_entry_name(target) or cache_explain.PARTS_NAME.fullmatch(target) is not None


def _plain(name: str, st: os.stat_result, status: str, message: str) -> EntryReport:
    return EntryReport(name=name, size_bytes=st.st_size, status=status, kind=None, platform_name=None,
                       platform_version=None, patch_series_id=None, torch_xla_revision=None, message=message)


def _from_envelope(name: str, st: os.stat_result, info: dict) -> EntryReport:
    return EntryReport(name=name, size_bytes=st.st_size, status=info["status"], kind=info.get("kind"),
                       platform_name=info.get("platform_name"), platform_version=info.get("platform_version"),
                       patch_series_id=info.get("patch_series_id"),
                       torch_xla_revision=info.get("torch_xla_revision"), message=info["message"])


def classify(path: Path, st: os.stat_result, *, full: bool, identity: dict[str, str] | None,
              key: bytes | None, now: float) -> EntryReport:
    name = path.name
    if name == KEY_FILE:
        return _plain(name, st, KEY, "")
    if _is_temporary(name):
        age = now - st.st_mtime
        if age < TEMP_MIN_AGE_S:
            return _plain(name, st, IN_PROGRESS, f"a writer's temporary file, modified {age:.0f} s ago: "
                          f"it may still be written (kept until it is {TEMP_MIN_AGE_S} s old)")
        return _plain(name, st, TEMPORARY, "left by a writer that did not finish (killed)")
    if cache_explain.PARTS_NAME.fullmatch(name):
        record, why = cache_explain.read_record(path)
        if record is None:
            return _plain(name, st, OTHER, f"named like a key record, but {why}; left alone")
        if os.path.lexists(path.parent / name[:64]):  # whatever is there, as prune (stale_parts) reads it
            return _plain(name, st, PARTS, f"the key record of entry {name[:16]}… (read by `xlakit cache explain`, "
                          "never loaded)")
        return _plain(name, st, STALE_PARTS, "a key record whose entry is gone: prune removes it")
    if not _is_entry_name(name):
        return _plain(name, st, OTHER, "not a cache file (torch_xla names entries by a decimal hash, xlakit's PJRT "
                      "wrapper by a SHA-256 in hex); left alone")
    try:
        deep = full or identity or key
        with open(path, "rb") as f:
            prefix = f.read(4 if deep else _C.MAX_HEADER_BYTES)
        if not prefix.startswith(_MAGICS):
            return _plain(name, st, FOREIGN, f"no xlakit envelope (expected magic {' or '.join(map(repr, _MAGICS))},"
                          f" found {prefix[:4]!r}): a stock torch_xla's entry, which the patched runtime never loads")
        if deep:
            info = _C.verify_entry_file(str(path), key=key, **(identity or {}))
        else:
            info = _C.inspect_header(prefix, st.st_size)
    except OSError as e:
        return _plain(name, st, UNREADABLE, f"cannot read it: {e}")
    mismatch = _key_mismatch(name, info)
    if mismatch:
        info = {**info, "ok": False, "status": KEY_MISMATCH, "message": mismatch}
    report = _from_envelope(name, st, info)
    if info["ok"] and info["authenticated"] and not info["tag_checked"]:
        report = EntryReport(**{**asdict(report), "message": "authenticated (tag not checked: `xlakit cache "
                                f"verify` with {_knobs.CACHE_KEY} set checks it)"})
    return report


def _key_mismatch(name: str, info: dict) -> str | None:
    """Why the cache key an accepted envelope stores does not bind it to its file name, or None."""
    stored = info.get("cache_key")
    if not info["ok"] or stored is None or stored == name:
        return None
    if stored == "" and not _WRAPPER_ENTRY_NAME.fullmatch(name):
        return None  # the patched torch_xla's cache hooks are not given the key they write under
    return (f"the entry stores cache key {stored[:80]!r}, not its file name: it was renamed, copied or swapped "
            "from another program's name, and the runtime refuses it (it never runs as another program)")


def _listing(directory: Path) -> list[tuple[Path, os.stat_result]]:
    """Every name in the folder, its own lstat (links are not followed)."""
    with os.scandir(directory) as it:
        return sorted((Path(d.path), d.stat(follow_symlinks=False)) for d in it)


def regular_files(directory: Path) -> list[tuple[Path, os.stat_result]]:
    # Never follow links and never descend: the runtime writes plain files, flat.
    return [(p, st) for p, st in _listing(directory) if stat.S_ISREG(st.st_mode)]


def _not_a_file(path: Path, st: os.stat_result) -> EntryReport:
    """A link, a subfolder or another special name: listed, never read, never removed."""
    what = ("a link" if stat.S_ISLNK(st.st_mode) else "a subfolder" if stat.S_ISDIR(st.st_mode)
            else "not a plain file")
    named = " named like an entry" if _is_entry_name(path.name) else ""
    return _plain(path.name, st, OTHER, f"{what}{named}: the runtime writes plain files; left alone")


def require_folder(directory: str | os.PathLike) -> Path:
    if str(directory) == "":
        raise XlakitError("expected a cache folder, found an empty path (an unset variable?), which would mean "
                          "the current directory; pass the folder explicitly, e.g. the value of "
                          "XLA_PERSISTENT_CACHE_PATH")
    path = Path(directory)
    if not path.is_dir():
        raise XlakitError(f"{path}: not a directory (expected an XLA_PERSISTENT_CACHE_PATH folder)")
    try:
        with os.scandir(path):
            pass
    except PermissionError:
        err = XlakitError(f"{path}: permission denied: you cannot list this folder")
        err.add_note(f"chmod u+rx {path} (u+rwx to prune it), or run this as its owner")
        raise err from None
    return path


def key_from_env() -> bytes | None:
    try:
        return _knobs.get_cache_key()
    except ValueError as e:
        raise XlakitError(str(e)) from None


def scan(directory: str | os.PathLike, *, full: bool, identity: dict[str, str] | None = None,
         key: bytes | None = None) -> list[EntryReport]:
    """Report every plain file in a cache folder; `full` checksums payloads (in bounded pieces), `key` checks tags."""
    folder = require_folder(directory)
    now = time.time()
    return [classify(p, st, full=full, identity=identity, key=key, now=now) if stat.S_ISREG(st.st_mode)
            else _not_a_file(p, st) for p, st in _listing(folder)]


def made_by_xlakit(directory: Path) -> bool:
    """Whether `directory` holds the key file `enable_persistent_cache` writes (so its entries are a cache's)."""
    try:
        with open(directory / KEY_FILE, "rb") as f:
            key = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return False
    return isinstance(key, dict) and {"patch_set", "platform_version"} <= key.keys()


def summary(reports: list[EntryReport]) -> str:
    entries = [r for r in reports if r.is_entry]
    bad = sum(not r.valid for r in entries)
    temporary = sum(r.status in (TEMPORARY, IN_PROGRESS) for r in reports)
    other = sum(r.status == OTHER for r in reports)
    records = sum(r.status in (PARTS, STALE_PARTS) for r in reports)
    return (f"{len(reports)} files, {sum(r.size_bytes for r in reports)} bytes: {len(entries)} entries "
            f"({bad} not loadable), {records} key records, {temporary} temporary, {other} not cache files")


def folder_trust(directory: str | os.PathLike) -> cache_trust.FolderTrust:
    return cache_trust.judge(Path(directory).resolve(), trust_shared=_knobs.get_flag(_knobs.CACHE_TRUST_SHARED))


# Entries whose only fault is their tag: written without the key, or under another one (or forged).
TAG_FAULTS = ("unauthenticated", "bad_tag")


def removable(r: EntryReport, *, foreign: bool, tag_faults: bool = True) -> bool:
    """What prune deletes: a rejected envelope, an abandoned temporary, a foreign entry when asked; an entry
    refused only for its tag when `tag_faults` (the folder is positively this key's)."""
    if r.status == TEMPORARY:
        return True
    if r.status == FOREIGN:
        return foreign
    if r.status in TAG_FAULTS:
        return tag_faults
    return r.is_entry and not r.valid and r.status != UNREADABLE


def keyed_for(directory: Path, key: bytes) -> bool:
    """Whether `directory` is the folder enable_persistent_cache made for this very key (its key file says so).

    Elsewhere an entry refused for its tag may be another job's good entry: the PJRT wrapper keeps the
    entries of every key (and of none) in one folder, named apart.
    """
    try:
        with open(directory / KEY_FILE, "rb") as f:
            recorded = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded.get("key_id") == key_id(key)


def unchanged_since(path: Path, st: os.stat_result) -> bool:
    # A writer may have renamed a fresh entry over the one judged; never delete what was not judged.
    try:
        now = path.lstat()
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_dev, st.st_ino, st.st_size,
                                                                      st.st_mtime_ns)


def parts_of(entry: Path) -> Path:
    """Where the PJRT wrapper records the key's parts of `entry` (cache_explain)."""
    return entry.with_name(entry.name + cache_explain.PARTS_SUFFIX)


def remove_parts(entry: Path) -> bool:
    """Removes the key record of an entry just removed; True if there was one (a plain file holding a record;
    anything else under its name is left alone)."""
    record = parts_of(entry)
    if cache_explain.read_record(record)[0] is None:
        return False
    try:
        record.unlink()
        return True
    except FileNotFoundError:
        return False


def stale_parts(directory: Path, *, gone: set[str] = frozenset()) -> list[tuple[Path, os.stat_result]]:
    """The key records whose entry is missing, or in `gone` (entries a dry run would remove): plain files that
    hold a record, nothing else named like one."""
    files = regular_files(directory)
    return [(p, st) for p, st in files if cache_explain.PARTS_NAME.fullmatch(p.name)
            and (not os.path.lexists(p.with_name(p.name[:64])) or p.name[:64] in gone)
            and cache_explain.read_record(p)[0] is not None]
