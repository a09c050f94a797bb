"""The store interface: where a checkpoint's parts are written, and how they become the checkpoint.

One flow saves every layout over a `Destination`, as torch.distributed.checkpoint's save runs
over a `StorageWriter`: `pipeline.write` (one file, alone) and `multirank/ranks.py` (a file
or a part per rank, agreed) call, in this order:

1. `propose` (the committing rank, before the ranks agree) and `adopt` (every rank, after):
   what the parts' names share (a save id on disk; a generation and a token in a bucket);
2. `tidy`: what dead processes and saves that can never commit left, before a byte is written;
3. `open_part`: a `Part`, the binary stream one rank's archive is written into. Its `finish`
   makes it complete under its part's name and returns its entry (this rank's vote); `abort`
   gives it up. Until the commit the operation owns it (`Operation.own`);
4. `commit` (the committing rank, once every vote is in): the one step that makes the parts
   the checkpoint, inside the operation's commit point;
5. `after_commit`: what the new commit makes removable (earlier parts, older generations).

The flow is one; the destinations are two (`local.py`, `bucket.py`) because the stores differ
exactly here: a local file is committed by its rename, a folder of parts by its commit record's
rename; an object store has no rename, so a bucket's parts are written under names no other save
uses and committed by a create-only commit record of a new generation (`objstore/generations.py`).

Every byte of a part passes through `Part.write`: the one place to count the bytes a save writes,
or to overlap its device-to-host copies with the write.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation


@dataclass(frozen=True)
class Parts:
    """What a layout's parts are called and how its commit record lists them.

    `name` is empty for a checkpoint that is one file (the single and replicated layouts); else
    each rank writes one part (`shard`, `share`), listed in rank order under `listed_as`.
    `folder_record` opens the commit record of the folder on disk (its format and version),
    `object_record` goes into the commit record in a bucket (its kind); `not_a_folder` is the
    note when a file stands where the folder goes.
    """

    name: str = ""
    listed_as: str = ""
    folder_record: dict = field(default_factory=dict)
    object_record: dict = field(default_factory=dict)
    writer_rank: int | None = None
    not_a_folder: str | None = None


FILE = Parts()


class Part(Protocol):
    """One rank's part being written: a write-only binary stream (a temporary file, an upload)."""

    def write(self, data) -> int: ...

    def finish(self) -> dict:
        """Complete and durable under the part's name; its entry (what this rank votes)."""

    def abort(self) -> None:
        """Give it up (its leftovers are the operation's to remove)."""


class Destination(ABC):
    """Where one checkpoint is written, and how it becomes the checkpoint (see the module docstring).

    Attributes:
        identity: what every rank must name alike (agreed before anything is touched).
    """

    identity: str

    def check_target(self) -> None:
        """Refuse a target that cannot be written, before any work (nothing by default)."""

    def label(self, rank: int, world: int) -> "str | os.PathLike":
        """What `rank`'s part is called in messages and its save's handle (its path once adopted)."""
        return self.identity

    def propose(self, op: "Operation") -> dict:
        """(The committing rank, before the agreement.) What every rank's part names share."""
        return {}

    def adopt(self, proposal: dict) -> None:
        """(Every rank, after the agreement.) The committing rank's proposal."""

    @abstractmethod
    def tidy(self, op: "Operation", committer: bool) -> None:
        """Before any part is written: remove what no commit can name any more."""

    @abstractmethod
    def open_part(self, op: "Operation", rank: int, world: int) -> Part:
        """`rank`'s part, to write into; the operation owns it until a commit names it."""

    @abstractmethod
    def commit(self, op: "Operation", votes: dict[int, dict]) -> None:
        """(The committing rank.) Make the parts the checkpoint: `votes` are their entries by rank."""

    def after_commit(self, op: "Operation") -> None:
        """(The committing rank, after the commit, every rank told.) Remove what it made obsolete."""

    @contextlib.contextmanager
    def writing(self, op: "Operation") -> Iterator[None]:
        """Around writing and committing a part: the store's errors as xlakit's."""
        yield
