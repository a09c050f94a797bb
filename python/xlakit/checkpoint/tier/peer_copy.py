"""Copying part files between ranks of different hosts over the job's process group (gloo).

Which rank copies to which (`peers_of`) depends only on every rank's host, so
every rank computes the same plan: the hosts in the order of their lowest
rank, and the rank at position i on host h sends its part to the rank at
position i (modulo its size) on each of the next `peers` hosts. Two hosts of
two ranks each (0, 1 | 2, 3) pair 0<->2 and 1<->3.

`transfer` moves whole files in chunks of `CHUNK_BYTES` (what a copy holds in
memory per file in flight), every send and receive posted at once (no order
between pairs to deadlock on), each wait bounded by what is left of the
deadline; the group is a fresh one the caller made with that deadline as its
timeout. A received file is written to a temporary sibling, hashed as it is
written and fsynced; `settle` renames it into place only when its xxh3 is the
one the sender read while sending (the ranks exchange them after the copy),
or, given no digests, leaves the verification to the reader (a load checks
every record's checksum).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import xxhash

from xlakit.checkpoint.core import paths
from xlakit.checkpoint.core.operation import remove_path
from xlakit.errors import CheckpointCorruptError, CheckpointTimeoutError

CHUNK_BYTES = 64 << 20


def hosts_in_order(hosts: list[str]) -> list[list[int]]:
    """The ranks of each host, hosts ordered by their lowest rank."""
    order: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        order.setdefault(host, []).append(rank)
    return list(order.values())


def peers_of(hosts: list[str], peers: int) -> dict[int, list[int]]:
    """{rank: the ranks on other hosts that hold a copy of its part}."""
    groups = hosts_in_order(hosts)
    n = min(peers, len(groups) - 1)
    plan: dict[int, list[int]] = {}
    for h, ranks in enumerate(groups):
        for i, rank in enumerate(ranks):
            plan[rank] = [groups[(h + k) % len(groups)][i % len(groups[(h + k) % len(groups)])]
                          for k in range(1, n + 1)]
    return plan


@dataclass
class Send:
    to: int
    path: Path
    size: int


@dataclass
class Receive:
    source: int
    path: Path  # where the file lands
    size: int
    error: str | None = None
    tmp: Path | None = None  # the received bytes, durable, until `settle` renames them
    got: str | None = None  # their xxh3


def transfer(group, sends: list[Send], receives: list[Receive], deadline: float, what: str) -> list[str]:
    """Run this rank's sends and receives: the xxh3 of each file sent, as read while sending.

    Each `Receive` ends with its bytes in a durable temporary (`tmp`, hashed: `got`) for
    `settle` to rename, or with its `error` set.

    Raises:
        CheckpointTimeoutError: the deadline (time.monotonic) passed with transfers in flight.
    """
    import torch.distributed as d

    readers = {id(s): open(s.path, "rb") for s in sends}
    sent = {id(s): xxhash.xxh3_64() for s in sends}
    writers: dict[int, tuple] = {}
    try:
        for r in receives:
            tmp = paths.temp_path(r.path)
            writers[id(r)] = (tmp, open(tmp, "xb"), xxhash.xxh3_64())
        rounds = max([math.ceil(x.size / CHUNK_BYTES) for x in (*sends, *receives)], default=0)
        for j in range(rounds):
            works, landed = [], []
            for s in sends:
                n = min(CHUNK_BYTES, s.size - j * CHUNK_BYTES)
                if n > 0:
                    buf = torch.empty(n, dtype=torch.uint8)
                    if readers[id(s)].readinto(buf.numpy()) != n:
                        raise CheckpointCorruptError(f"{s.path} shrank while it was being copied to rank {s.to}")
                    sent[id(s)].update(buf.numpy())
                    works.append((d.isend(buf, dst=s.to, group=group, tag=j), buf))
            for r in receives:
                n = min(CHUNK_BYTES, r.size - j * CHUNK_BYTES)
                if n > 0:
                    buf = torch.empty(n, dtype=torch.uint8)
                    works.append((d.irecv(buf, src=r.source, group=group, tag=j), buf))
                    landed.append((r, buf))
            for work, _ in works:
                left = deadline - time.monotonic()
                if left <= 0 or not work.wait(timeout=timedelta(seconds=left)):
                    raise CheckpointTimeoutError(
                        f"{what}: the copies between ranks did not finish within the deadline (round {j + 1} "
                        f"of {rounds} of {CHUNK_BYTES >> 20} MiB)", stage="peer copy")
            for r, buf in landed:
                if id(r) in writers:
                    _land(r, buf, writers)
        for r in receives:
            if id(r) not in writers:
                continue  # its write failed: named in its error
            tmp, f, h = writers[id(r)]
            f.flush()
            os.fsync(f.fileno())
            f.close()
            del writers[id(r)]
            r.tmp, r.got = tmp, h.hexdigest()
        return [sent[id(s)].hexdigest() for s in sends]
    except BaseException as e:
        if isinstance(e, RuntimeError) and not isinstance(e, CheckpointTimeoutError):
            raise CheckpointTimeoutError(f"{what}: a copy between ranks failed ({e}); a rank on the other "
                                         f"end stalled or died", stage="peer copy") from e
        raise
    finally:
        for f in readers.values():
            f.close()
        for tmp, f, _ in writers.values():
            f.close()
            remove_path(tmp)


def settle(receives: list[Receive], digests: dict[int, str | None] | None) -> None:
    """Rename each received file into place; with `digests` ({sending rank: the xxh3 it read}),
    only one that arrived with the sender's xxh3 (else it is removed, and the error says why)."""
    for r in receives:
        if r.tmp is None:
            continue
        tmp, r.tmp = r.tmp, None
        want = None if digests is None else digests.get(r.source)
        if digests is not None and want != r.got:
            r.error = (f"the copy of {r.path.name} from rank {r.source} arrived with xxh3 {r.got}, the sender "
                       f"read {want or 'nothing whole'}: it was not kept")
            remove_path(tmp)
            continue
        os.replace(tmp, r.path)
        paths.fsync_dir(r.path.parent)


def discard(receives: list[Receive]) -> None:
    """Remove what `settle` was not given to rename."""
    for r in receives:
        if r.tmp is not None:
            remove_path(r.tmp)
            r.tmp = None


def _land(r: Receive, buf: torch.Tensor, writers: dict) -> None:
    """Write one received chunk; a failed write (a full disk) is the receive's error, the others go on."""
    tmp, f, h = writers[id(r)]
    view = buf.numpy()
    try:
        h.update(view)
        f.write(view)
    except OSError as e:
        writers.pop(id(r))
        f.close()
        remove_path(tmp)
        r.error = f"{paths.write_error(e, r.path, stage='peer copy')}"


def fresh_group(seconds: float):
    """A fresh gloo group of every rank, whose collectives time out after `seconds`."""
    import torch.distributed as d

    return d.new_group(backend="gloo", timeout=timedelta(seconds=max(seconds, 0.1)))


def gather(group, value: object) -> list:
    """Every rank's `value`, by rank (all_gather_object over `group`)."""
    import torch.distributed as d

    out: list = [None] * d.get_world_size()
    d.all_gather_object(out, value, group=group)
    return out


def close_group(group) -> None:
    import torch.distributed as d

    try:
        d.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - a broken group is dropped all the same
        pass
