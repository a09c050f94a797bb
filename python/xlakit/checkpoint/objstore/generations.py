"""The commit protocol on an object store: generations of create-only commit records.

An object store has no rename and no folder, so a checkpoint at URL `U` is a
prefix holding:

* data objects `U/<generation>.<host>.<pid>.<random><suffix>`, written under a
  name no other save uses (`<suffix>`: `.pt`, `.shard-00001-of-00004.pt`,
  `.dcp/...`);
* commit records `U/xlakit-commit.<generation>.json`, each written last, in one
  request, with a create-only precondition (GCS `ifGenerationMatch=0`, S3
  `If-None-Match: *`), naming the data objects of its generation with their
  sizes and xxh3-64.

The checkpoint at `U` is the highest generation that has a commit record.
Saving again (a `latest` checkpoint every N steps) writes generation
latest+1: two writers that both start from the same latest aim at the same
record name, and the store lets exactly one create it; the other gets
`CheckpointConflictError` and removes what it uploaded. A crash at any moment
leaves no record (nothing committed) or the whole record; the previous
generation is untouched either way.

What may be deleted, by anyone, is known from names alone:

* after generation N commits, the records of generations below N-1 first
  (each delete is atomic: that generation stops being a checkpoint at once),
  then their data; generation N-1 stays whole, so a reader that began on it
  while N was written finishes (one that is overtaken twice is told to load
  again);
* a data object of generation g that the record of g does not name, once a
  record of g or higher exists: that save can never commit (its record name
  is taken or below the latest);
* a data object of a higher generation only when it is this host's and its
  process is dead (the rule of local temporaries). Anything not named in
  these shapes is never touched.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xlakit.checkpoint.core import paths
from xlakit.checkpoint.objstore.client import Location, Store
from xlakit.errors import (CheckpointConflictError, CheckpointCorruptError, CheckpointFormatError,
                           CheckpointIncompleteError)

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation

log = logging.getLogger("xlakit")

FORMAT = "xlakit-object-commit"
VERSION = 1
_COMMIT = re.compile(r"xlakit-commit\.(\d{20})\.json")
_DATA = re.compile(r"(\d{20})\.([A-Za-z0-9_-]+)\.(\d+)\.([0-9a-f]{8})([./].+)")


def commit_name(generation: int) -> str:
    return f"xlakit-commit.{generation:020d}.json"


def is_commit_name(name: str) -> bool:
    return _COMMIT.fullmatch(name) is not None


def is_data_name(name: str) -> bool:
    """Whether `name` (under a checkpoint's prefix) has the shape of a save's data object."""
    return _DATA.fullmatch(name) is not None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", paths.host())


def operation_id(token: str | None = None) -> str:
    """This save's part of its data objects' names: host, pid, random (as local temporaries).

    The ranks of one save share `token` (the committing rank's), each with its own host and pid."""
    return f"{_host()}.{os.getpid()}.{token or secrets.token_hex(4)}"


def data_name(generation: int, op_id: str, suffix: str) -> str:
    return f"{generation:020d}.{op_id}{suffix}"


@dataclass
class DataObject:
    name: str
    generation: int
    host: str
    pid: int
    nbytes: int
    token: str = ""


@dataclass
class Listing:
    """What a checkpoint prefix holds: commit records by generation, data objects, other names."""

    loc: Location
    commits: dict[int, str] = field(default_factory=dict)
    data: list[DataObject] = field(default_factory=list)
    other: list[str] = field(default_factory=list)

    @property
    def latest(self) -> int | None:
        return max(self.commits) if self.commits else None


def scan(store: Store, op: "Operation | None", loc: Location) -> Listing:
    found = Listing(loc)
    for name, nbytes in sorted(store.list(op, loc).items()):
        if m := _COMMIT.fullmatch(name):
            found.commits[int(m.group(1))] = name
        elif m := _DATA.fullmatch(name):
            found.data.append(DataObject(name, int(m.group(1)), m.group(2), int(m.group(3)), nbytes, m.group(4)))
        else:
            found.other.append(name)
    return found


def read_record(store: Store, op: "Operation | None", loc: Location, generation: int) -> dict:
    """The commit record of `generation`, checked for its format."""
    where = loc.child(commit_name(generation))
    text = store.get(op, where)
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"format {record.get('format') if isinstance(record, dict) else None!r}")
        if not isinstance(record.get("objects"), dict) or record.get("generation") != generation:
            raise ValueError("no object list, or another generation than its name")
    except ValueError as e:
        raise CheckpointCorruptError(f"{where} is not an xlakit commit record ({e}); found {text[:80]!r}") from e
    if isinstance(record.get("version"), int) and record["version"] > VERSION:
        raise CheckpointFormatError(f"{where} was written in commit format version {record['version']}; this "
                                    f"xlakit reads up to {VERSION}: upgrade xlakit to load it")
    return record


def plain_object_error(store: Store, op: "Operation | None", loc: Location) -> CheckpointFormatError | None:
    """Where `loc` itself is one object (another tool's file, e.g. a torch.save file copied to the
    bucket): the error that says so; its `plain_object` is the object's size. None otherwise."""
    try:
        size = store.size(op, loc)
    except FileNotFoundError:
        return None
    err = CheckpointFormatError(f"{loc} is one object of {size} bytes, not an xlakit checkpoint (xlakit saves "
                                f"a checkpoint as objects under {loc}/ with a commit record): another tool "
                                f"wrote it, e.g. a torch.save file copied there")
    err.add_note(f"xlakit.load({loc.url!r}, verify=False) reads it as a local torch.save file is read (weights "
                 f"only; it has no xlakit checksums to verify). Saving it with xlakit.save gives a checkpoint "
                 f"that xlakit verifies.")
    err.plain_object = size  # type: ignore[attr-defined]
    return err


def latest_record(store: Store, op: "Operation | None", loc: Location, kind: str | None = None) -> dict:
    """The record of the newest committed generation at `loc`; refuses a prefix without one."""
    found = scan(store, op, loc)
    if found.latest is None:
        what = (f"it holds {len(found.data)} object(s) of saves that never committed" if found.data
                else f"it holds {len(found.other)} object(s), none an xlakit checkpoint's (e.g. "
                     f"{found.other[0]!r})" if found.other else "nothing is there")
        message = f"no committed checkpoint at {loc}: no commit record ({commit_name(0)[:14]}*.json); {what}"
        if found.data:
            raise CheckpointIncompleteError(message)
        if not found.other and (plain := plain_object_error(store, op, loc)) is not None:
            raise plain
        raise FileNotFoundError(errno.ENOENT, message, loc.url)
    record = read_record(store, op, loc, found.latest)
    if kind is not None and record.get("kind") != kind:
        raise kind_error(loc, record, kind)
    return record


def kind_error(loc: Location, record: dict, wanted: str) -> CheckpointFormatError:
    """`loc` holds another kind of checkpoint than the reader reads: say which, and what reads it."""
    found = record.get("kind")
    return CheckpointFormatError(f"{loc} is a {found!r} checkpoint, not a {wanted!r} one"
                                 + {"dcp": "; load it with xlakit.dcp_load(state, url)",
                                    "sharded": "; each rank of the job loads its shard (or pass shard=N)",
                                    "file": "; load it with xlakit.load(url)"}.get(found, ""))


def next_generation(found: Listing) -> int:
    return (found.latest or 0) + 1


def commit(store: Store, op: "Operation", loc: Location, record: dict) -> None:
    """Create the commit record, at the operation's commit point; the point of no return.

    Raises:
        CheckpointConflictError: another save created this generation's record first.
    """
    generation = record["generation"]
    where = loc.child(commit_name(generation))
    body = json.dumps({"format": FORMAT, "version": VERSION, **record}, indent=1, sort_keys=True).encode()
    op.enter("commit")
    op.object = where.url
    with op.commit_point():
        try:
            store.put(op, where, body, create_only=True)
        except FileExistsError:
            theirs = _owner(store, op, where)
            if theirs != record["operation"]:
                err = CheckpointConflictError(
                    17, f"cannot commit {loc}: another save (operation {theirs}) committed generation "
                        f"{generation} of this checkpoint first; this save committed nothing")
                err.filename = loc.url
                err.add_note("Two jobs (or two processes) save to one checkpoint URL at the same time; give "
                             "each its own, or let one of them save. The other save's checkpoint is whole.")
                raise err from None
    op.object = None


def _owner(store: Store, op: "Operation", where: Location) -> str | None:
    """Which operation's record holds `where` (a create-only request that was answered 'taken')."""
    try:
        return json.loads(store.get(op, where)).get("operation")
    except (ValueError, OSError):
        return None


def garbage(found: Listing, named: dict[int, set[str]], keep_token: str | None = None) -> list[str]:
    """Data objects no commit can name any more (see the module docstring); never those of the save
    whose token is `keep_token` (its ranks' objects, a dead rank's included: its vote may be in)."""
    latest, me = found.latest, _host()
    out = []
    for d in found.data:
        if d.name in named.get(d.generation, set()) or (keep_token and d.token == keep_token):
            continue
        if latest is not None and d.generation <= latest:
            if d.generation in found.commits and d.generation not in named:
                continue  # its record could not be read: keep what it may name
            out.append(d.name)
        elif d.host == me and d.pid != os.getpid() and not paths.pid_alive(d.pid):
            out.append(d.name)
    return out


def tidy(store: Store, op: "Operation | None", loc: Location, *, keep_from: int | None = None,
         keep_token: str | None = None) -> list[str]:
    """Remove generations below `keep_from` (records first) and garbage (never the objects of the
    save `keep_token`, which is under way); the names removed.

    Failures are logged, never raised: what stays is found and removed by the next save.
    """
    try:
        found = scan(store, op, loc)
        old = sorted(g for g in found.commits if keep_from is not None and g < keep_from)
        store.delete(op, [loc.child(found.commits[g]) for g in old])
        for g in old:
            del found.commits[g]
        named: dict[int, set[str]] = {}
        for g in found.commits:
            try:
                named[g] = set(read_record(store, op, loc, g)["objects"])
            except (CheckpointCorruptError, CheckpointFormatError, FileNotFoundError) as e:
                log.warning("xlakit: %s: %s; its objects are kept", loc, e)
        doomed = garbage(found, named, keep_token)
        store.delete(op, [loc.child(n) for n in doomed])
        return [found.commits.get(g, commit_name(g)) for g in old] + doomed
    except (OSError, ValueError) as e:
        log.warning("xlakit: could not tidy %s (%s); the next save tries again", loc, e)
        return []


class Leftover:
    """An object this operation uploaded: removed (without waiting) if the operation does not commit."""

    def __init__(self, store: Store, loc: Location):
        self.store, self.loc = store, loc

    def remove(self) -> None:
        self.store.delete_soon([self.loc])

    def __repr__(self) -> str:
        return f"<Leftover {self.loc}>"
