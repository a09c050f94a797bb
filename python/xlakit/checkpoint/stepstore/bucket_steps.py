"""A `CheckpointManager` URL on object storage: the steps of `steps.py` as prefixes of a bucket.

The object-storage sibling of `steps.LocalFolder`; `step_folders.folder_at` hands a manager URL here.
The manager runs one flow over either (the same methods: scan, prepare, hold, discard, clean); the
two stay two because the stores differ in each of them: a bucket has no folder to make, no lock
file (a lease instead), and no rename to take a step out of every scan at once (a deletion record
instead).

    M/xlakit-lease.<n>.json            the manager that holds M (lease.py)
    M/<step>/xlakit-step.json          step, layout, metrics: created before the save
    M/<step>/ckpt.pt/...               layouts "single", "replicated": a checkpoint URL
    M/<step>/ckpt/...                  layouts "sharded", "dcp" (generations.py inside)
    M/<step>/xlakit-step.deleting.json a step retention dropped: what is being deleted

As on disk there is no index: a step exists when its prefix holds a valid
step record *and* its checkpoint has a commit record, which the save creates
last, create-only. A step record without a committed checkpoint is an
interrupted save; a prefix without a step record is not the manager's and is
never touched.

Deleting a step is two steps, as on disk. First its *deletion record* is
created, listing exactly what goes: the step record, the checkpoint's commit
records, every object those records name, and the checkpoint's other data
objects (leftovers of saves of that step, which can never commit: steps are
never saved twice, and the lease makes this manager the URL's only writer).
From that moment the step is in no scan (atomic, like the rename to the trash
on disk). Then `clean` deletes what the record lists, commit records first,
and the record last; a kill in between leaves the record, and the next
manager finishes the deletion. Nothing a deletion record does not list is
deleted.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from xlakit.checkpoint.stepstore import steps
from xlakit.checkpoint.objstore import generations
from xlakit.checkpoint.objstore.client import Location, store_for
from xlakit.checkpoint.objstore.lease import Lease, is_lease

DELETING = "xlakit-step.deleting.json"
_STEP = re.compile(r"0|[1-9][0-9]{0,18}")
_CHECKPOINTS = (steps.CHECKPOINT_FILE, steps.CHECKPOINT_FOLDER)


@dataclass(frozen=True)
class BucketStep(steps.StepFolder):
    """A step on object storage: `path` is its prefix's URL; `nbytes` what it holds."""

    nbytes: int = 0

    @property
    def checkpoint(self) -> str:  # type: ignore[override]
        return f"{self.path}/{self.record['checkpoint']}"


def _split(names: dict[str, int]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The manager URL's objects by first name part (a step's, or anything else's)."""
    parts: dict[str, dict[str, int]] = defaultdict(dict)
    for name, size in names.items():
        first, _, rest = name.partition("/")
        parts[first][rest] = size
    return parts, sorted(parts)


def _commits(inside: dict[str, int], checkpoint: str) -> list[str]:
    """The commit records of a step's checkpoint (names relative to the step)."""
    return sorted(n for n in inside if n.startswith(checkpoint + "/")
                  and generations.is_commit_name(n[len(checkpoint) + 1:]))


class BucketFolder:
    """A manager URL, as `CheckpointManager` uses it (`steps.LocalFolder` on disk)."""

    def __init__(self, url: str):
        self.loc = Location.parse(url)
        self.store = store_for(self.loc)
        self.directory = self.loc.url
        self.lease = Lease(self.store, self.loc)

    def make(self) -> None:
        """Nothing to make: prefixes exist once objects do (the bucket must exist)."""

    def identity(self, step: int | None = None) -> str:
        return self.loc.url if step is None else self.step_path(step)

    def step_path(self, step: int) -> str:
        return f"{self.loc.url}/{step}"

    def target(self, step: int, record: dict) -> str:
        return f"{self.step_path(step)}/{record['checkpoint']}"

    # -- reading ------------------------------------------------------------------------------
    def scan(self, op=None) -> steps.Scan:
        """Every step of the manager URL, from one listing and the step records; nothing changes."""
        found = steps.Scan()
        parts, firsts = _split(self.store.list(op, self.loc))
        candidates = []
        for first in firsts:
            inside = parts[first]
            if is_lease(first) and list(inside) == [""]:
                continue  # the manager's own
            if not _STEP.fullmatch(first) or "" in inside:
                found.other[first] = "not named like a step folder"
            elif DELETING in inside:
                found.trash.append(self.step_path(int(first)))
            elif steps.STEP_RECORD not in inside:
                found.other[first] = f"no {steps.STEP_RECORD}: not a step of an xlakit manager"
            else:
                candidates.append(first)
        texts = self.store.get_many(op, [self.loc.child(f"{c}/{steps.STEP_RECORD}") for c in candidates])
        for first, text in zip(candidates, texts):
            inside = parts[first]
            if text is None:  # deleted while the URL was read: a retention took it
                continue
            try:
                record = steps.check_record(text, first)
            except ValueError as e:  # a finding, named, never left out silently (nor reused, nor deleted)
                found.damaged[int(first)] = str(e)
                continue
            problem = None if _commits(inside, record["checkpoint"]) else \
                f"{record['checkpoint']} was never committed (an interrupted save)"
            step = BucketStep(int(first), self.step_path(int(first)), record, problem, sum(inside.values()))
            (found.committed if step.committed else found.pending)[step.step] = step
        return found

    # -- saving -------------------------------------------------------------------------------
    def prepare(self, op, step: int, record: dict) -> None:
        """(Rank 0, before every rank saves.) Refuse a prefix that is not the manager's; write the
        step record (create-only; an interrupted save's record is replaced)."""
        prefix = self.loc.child(str(step))
        inside = self.store.list(op, prefix)
        foreign = sorted(n for n in inside if n != steps.STEP_RECORD and n.split("/")[0] not in _CHECKPOINTS)
        if inside and steps.STEP_RECORD not in inside:
            foreign = sorted(inside)
        if foreign:
            raise steps.not_a_step(step, prefix, foreign)
        if steps.STEP_RECORD in inside:
            steps.check_record(self.store.get(op, prefix.child(steps.STEP_RECORD)), str(step))
            if _commits(inside, record["checkpoint"]):
                raise ValueError(f"step {step} is already committed in {self.loc}")
        body = json.dumps(record, indent=1, sort_keys=True).encode()
        # Not a commit (the checkpoint's record is): a record a cancelled save still wrote makes an
        # interrupted step, which retention drops. So the request is cancelled, not fenced by the gate.
        op.check()
        self.store.put(op, prefix.child(steps.STEP_RECORD), body, create_only=steps.STEP_RECORD not in inside)

    def withdraw(self, step: int, record: dict) -> bool:
        """`LocalFolder.withdraw`: remove the step record `prepare` put, when it is all the prefix holds
        and is this very record; whether it was removed."""
        prefix = self.loc.child(str(step))
        try:
            if list(self.store.list(None, prefix)) != [steps.STEP_RECORD]:
                return False
            if steps.check_record(self.store.get(None, prefix.child(steps.STEP_RECORD)), str(step)) != record:
                return False
            self.store.delete(None, [prefix.child(steps.STEP_RECORD)])
        except Exception:  # noqa: BLE001 - tidying after a refused save: it stays an interrupted step
            return False
        return True

    def hold(self, op) -> Callable[[], None]:
        """Take the URL's lease (waiting for an expiring one within `op`'s deadline); the call that
        gives it up."""
        self.lease.acquire(op)
        return self.lease.release

    def renew(self, op=None, cover_s: float = 0.0) -> None:
        """(The holder.) Make sure the lease covers `cover_s` from now, and half its duration."""
        self.lease.renew(op, cover_s)

    def step_bytes(self, step: BucketStep) -> int:
        return step.nbytes

    # -- deleting -----------------------------------------------------------------------------
    def discard(self, doomed: list[int]) -> None:
        """Take steps out of every scan at once: each gets its deletion record (see above)."""
        for step in doomed:
            prefix = self.loc.child(str(step))
            inside = self.store.list(None, prefix)
            listed = set()
            for checkpoint in _CHECKPOINTS:
                commits = _commits(inside, checkpoint)
                for name, text in zip(commits, self.store.get_many(None, [prefix.child(c) for c in commits])):
                    try:
                        named = json.loads(text or b"{}").get("objects") or {}
                    except ValueError:
                        named = {}  # a damaged record: the data shapes below still say what is ours
                    listed.update(f"{checkpoint}/{n}" for n in named if f"{checkpoint}/{n}" in inside)
                    listed.add(name)
                listed.update(n for n in inside if n.startswith(checkpoint + "/")
                              and generations.is_data_name(n[len(checkpoint) + 1:]))
            if steps.STEP_RECORD in inside:
                listed.add(steps.STEP_RECORD)
            body = json.dumps({"format": "xlakit-step-deletion", "version": 1, "step": step,
                               "objects": sorted(listed)}, indent=1).encode()
            self.store.put(None, prefix.child(DELETING), body)

    def clean(self) -> list[str]:
        """Finish every deletion a deletion record lists (commit records first, the record last)."""
        removed = []
        for url in self.scan().trash:
            prefix = Location.parse(url)
            try:
                listed = json.loads(self.store.get(None, prefix.child(DELETING)))["objects"]
            except (ValueError, KeyError, TypeError, FileNotFoundError):
                continue  # unreadable: nothing is deleted on its word
            first = [n for n in listed if generations.is_commit_name(n.rsplit("/", 1)[-1])]
            self.store.delete(None, [prefix.child(n) for n in first])
            self.store.delete(None, [prefix.child(n) for n in listed if n not in first])
            self.store.delete(None, [prefix.child(DELETING)])
            removed.append(url)
        return removed
