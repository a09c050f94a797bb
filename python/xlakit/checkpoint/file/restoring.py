"""Restore a checkpoint straight into a training state: in place, on its devices, in batches.

A resume usually reads the whole file into host memory, then copies every
tensor to its device: twice the work, and the whole state on the host at
once. Here the template (a state dict whose tensors already sit where they
should: CPU, CUDA, an XLA device, SPMD-sharded) is matched against the
checkpoint's structure first, and every difference (missing or extra keys,
shapes, dtypes) is reported at once, before anything is changed. Then the
storages are read in batches of at most `max_inflight_bytes`, each record
once and hashed as read, and each batch goes to its devices before the next
is read:

* CPU: read straight into the template tensor's memory when it covers its
  storage, else copied in place;
* XLA: one batched host-to-device transfer (`_xla_tensors_from_aten`) for the
  batch's plain tensors, each template tensor then pointed at its new buffer
  (`copy_` from device data: no compile, and it reaches the parameter behind a
  `state_dict()` alias); tiled SPMD tensors receive exactly their local shards
  (`spmd.load_from_host`); other shardings are copied;
* other devices (CUDA): copied in place.

Plain torch.save files (and earlier xlakit files) have no structure record:
they are loaded to the host whole, then copied the same way.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
import xxhash

from xlakit.checkpoint.file import loading, spmd
from xlakit.checkpoint.format import structure
from xlakit.checkpoint.format.archive import HASH, digest, tensor_bytes
from xlakit.checkpoint.file.matching import Target, match
from xlakit.checkpoint.core.operation import Operation, Watch
from xlakit.checkpoint.core.workers import check_idle, collection_paused
from xlakit.checkpoint.core.options import LoadOptions
from xlakit.checkpoint.format.structure import TensorSpec

_CONFIRM_PART = 8 << 20  # bytes read at a time to confirm a record on a private buffer
PARTLY = ("nothing on disk was changed; tensors restored before the failure hold the checkpoint's "
          "values, the one being read may hold part of them, the rest their previous ones: restore "
          "again from a good checkpoint before using the template")


def restore(path: Path, template: Any, opts: LoadOptions, check_index: loading.CheckIndex | None = None) -> Any:
    """See `xlakit.restore`; `check_index` as for `loading.read_file` (a shard)."""
    if not path.is_file():
        raise FileNotFoundError(2, f"no checkpoint at {path}", str(path))
    check_idle(writing_ok=True)  # a stuck transfer of an earlier save must not be queued behind
    op = Operation("restore", path, Watch.of(opts), bytes_total=path.stat().st_size, untouched=PARTLY)
    with collection_paused():
        return op.run(lambda op: _restore(op, path, template, opts, check_index))


def _restore(op: Operation, path: Path, template: Any, opts: LoadOptions,
             check_index: loading.CheckIndex | None) -> Any:
    with loading.CountedFile(path, op.stats) as f:
        index = loading.open_index(f, path)
        if index is None:
            op.enter("read")
            if opts.verify:
                meta = loading.verify_file(path, op)
                if check_index is not None:
                    check_index(meta)
            saved = loading.load_after_check(path, checked=opts.verify, mmap_=False)
            targets, restored = match(saved, template, path, opts, None)
            op.enter("copy")
            _apply(op, [(t, t.source) for t in targets])
            return restored
        if opts.verify and check_index is not None:
            check_index(index)
        return restore_records(op, f, path, index, template, opts)


def restore_records(op: Operation, f, path: Path, index: dict, template: Any, opts: LoadOptions) -> Any:
    """Restore from an open xlakit file `f` with index `index` (a local file, or an object's reader)."""
    reader = loading.RecordReader(f, path)
    reader.expect(loading.header_extents(index, opts.verify))
    layout = loading.read_structure(op, reader, index, opts.verify)
    saved = structure.decode(layout, structure.spec, str(path))
    targets, restored = match(saved, template, path, opts, index["storages"][HASH])
    users: dict[int, int] = {}  # how many template tensors each storage fills
    for t in targets:
        users[t.source.storage] = users.get(t.source.storage, 0) + 1
    cols = index["storages"]
    reader.expect((cols["offset"][r], cols["nbytes"][r]) for r in users)  # only what the template takes
    op.bytes_total = sum(cols["nbytes"][r] for r in users)
    arena = Arena()
    filled = 0
    try:
        for batch in _batches(targets, index, opts.max_inflight_bytes):
            _restore_batch(op, reader, index, batch, opts.verify, arena, users)
            filled += len(batch)
    except Exception as e:
        e.add_note(f"The template is partly restored: {filled} of {len(targets)} tensors hold the "
                   f"checkpoint's values, those of the batch being read (the tensor named above among "
                   f"them) may hold its bytes as read, the rest their previous values. Restore again "
                   f"from a good checkpoint before using it.")
        raise
    return restored


# -- reading and placing ----------------------------------------------------------------------

def _batches(targets: list[Target], index: dict, cap: int) -> list[list[Target]]:
    """Targets in file order (sequential reads), grouped so that each group's storages hold at most
    `cap` bytes (one big one alone); the targets of one storage stay together."""
    sizes, offsets = index["storages"]["nbytes"], index["storages"]["offset"]
    at = [offsets[t.source.storage] for t in targets]
    if any(a > b for a, b in zip(at, at[1:])):
        order = sorted(range(len(targets)), key=at.__getitem__)  # stable: one storage's targets adjacent
        targets = [targets[i] for i in order]
    batches, batch, held, last = [], [], 0, None
    for t in targets:
        row = t.source.storage
        if row != last:
            if batch and held + sizes[row] > cap:
                batches.append(batch)
                batch, held = [], 0
            held += sizes[row]
            last = row
        batch.append(t)
    if batch:
        batches.append(batch)
    return batches


class Arena:
    """One reused host buffer for a batch's records: touched once, not once per batch.

    A host-to-device transfer may still read a batch after the call that issued it
    returned (torch_xla's keeps its source tensor until the transfer completes). So
    each batch is lent out as a storage of its own over the buffer
    (`torch.frombuffer` of an object xlakit made, which that storage holds until
    its last user, the transfer included, lets go), and the buffer is reused only
    once that object was freed: xlakit's own record of its copies, not a reference
    counter of torch's (whose values changed between torch releases).
    """

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._returned = threading.Event()
        self._returned.set()

    def fit(self, nbytes: int, op: Operation) -> torch.Tensor:
        """A host tensor of `nbytes` bytes over the buffer, once the previous batch's copies are done."""
        self._wait_returned(op)
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        lent = (ctypes.c_uint8 * nbytes).from_address(self.buffer.data_ptr())
        lent.buffer = self.buffer  # the memory outlives the arena while a copy still reads it
        returned = threading.Event()
        weakref.finalize(lent, returned.set)
        self._returned = returned
        return torch.frombuffer(lent, dtype=torch.uint8)

    def _wait_returned(self, op: Operation) -> None:
        while not self._returned.wait(0.01):
            op.check()  # the deadline: the owner cancels; what is in flight is named by the stage


def _restore_batch(op: Operation, reader: loading.RecordReader, index: dict, batch: list[Target],
                   verify: bool, arena: Arena, users: dict[int, int]) -> None:
    cols = index["storages"]
    sizes = cols["nbytes"]
    direct = [t for t in batch
              if t.direct and users[t.source.storage] == 1 and t.tensor.nbytes == sizes[t.source.storage]]
    chosen = {id(t) for t in direct}
    rows = sorted({t.source.storage for t in batch if id(t) not in chosen}, key=cols["offset"].__getitem__)
    places, end = {}, 0
    for row in rows:  # each record's place in the arena, 64-byte aligned for every dtype
        places[row] = end
        end += -(-sizes[row] // 64) * 64
    buffer = arena.fit(end, op)
    if direct:  # CPU: the file's bytes go straight into the template's memory
        _read_direct(op, reader, cols, direct, verify)
    for row in rows:
        n = sizes[row]
        _read_record(op, reader, cols, row, tensor_bytes(buffer[places[row]:places[row] + n]),
                     cols["path"][row], verify)
    hosts = [(t, _host_view(buffer, places[t.source.storage], sizes[t.source.storage], t.source))
             for t in batch if id(t) not in chosen]
    op.enter("copy", hosts[0][0].path if hosts else None)
    _apply(op, hosts)


def _read_direct(op: Operation, reader: loading.RecordReader, cols: dict, targets: list[Target],
                 verify: bool) -> None:
    """Each target's record straight into its memory, checked as read; in file order. Small records
    come through the reader's window (one copy into place, one hash of the bytes as read)."""
    offsets, sizes, digests = cols["offset"], cols["nbytes"], cols[loading.archive.HASH]
    op.enter("read", targets[0].path)
    pending = 0
    for t in targets:  # in file order (`_batches`)
        row = t.source.storage
        n = sizes[row]
        if n < loading.SMALL:
            reader.read_small_to(offsets[row], n, t.tensor.data_ptr(), t.path, digests[row] if verify else None,
                                 row)
            pending += n
            if pending >= loading.SMALL:
                op.advance(pending)
                pending = 0
                op.tensor = t.path
        else:
            _read_record(op, reader, cols, row, tensor_bytes(t.tensor), t.path, verify, shared=True)
    op.advance(pending)


def _read_record(op: Operation, reader: loading.RecordReader, cols: dict, row: int, dst: memoryview,
                 name: str, verify: bool, *, shared: bool = False) -> None:
    """Record `row` into `dst`, checked as read. `shared`: `dst` is the template's memory, which
    others may write too: a mismatch there is confirmed on a private read before the file is blamed."""
    op.enter("read", name)
    reader.read_into(cols["offset"][row], dst, f"tensor {name!r}", name)
    if verify and digest(dst) != cols[HASH][row]:
        if shared and _record_is_intact(reader, cols, row, name):
            raise RuntimeError(
                f"tensor {name!r} of the template changed while it was restored: its record in "
                f"{reader.path} is intact (read again privately, it has its checksum), so something "
                f"else wrote the tensor meanwhile (another thread, or a tensor sharing its memory); let "
                f"nothing write the template during a restore, then restore again")
        loading.check_record(reader.path, dst, cols[HASH][row], f"tensor {name!r}", f"data/{row}", name)
    op.advance(len(dst))


def _record_is_intact(reader: loading.RecordReader, cols: dict, row: int, name: str) -> bool:
    """Whether record `row` has its recorded digest, hashed from xlakit's own buffer in parts."""
    hasher = xxhash.xxh3_64()
    offset, left = cols["offset"][row], cols["nbytes"][row]
    part = memoryview(bytearray(min(left, _CONFIRM_PART)))
    while left:
        chunk = part[:min(left, len(part))]
        reader.read_into(offset, chunk, f"tensor {name!r}", name)
        hasher.update(chunk)
        offset, left = offset + len(chunk), left - len(chunk)
    return hasher.hexdigest() == cols[HASH][row]


def _host_view(buffer: torch.Tensor, place: int, nbytes: int, s: TensorSpec) -> torch.Tensor:
    """The saved tensor `s` as a view of its record's bytes in the arena."""
    typed = buffer[place:place + nbytes].view(s.dtype)
    t = typed.as_strided(s.size, s.stride, typed.storage_offset() + s.offset)
    return structure.set_math_bits(t, structure.CONJ * s.conj | structure.NEG * s.neg)


def apply_pairs(op: Operation, pairs: list[tuple[Target, torch.Tensor]]) -> None:
    """Copy each host tensor into its target (a state loaded whole elsewhere: `replicas.restore`)."""
    _apply(op, pairs)


def _apply(op: Operation, pairs: list[tuple[Target, torch.Tensor]]) -> None:
    """Put each host tensor's values into its template tensor, in place, on its device."""
    plain_xla: list[tuple[Target, torch.Tensor]] = []
    with torch.no_grad():
        for t, host in pairs:
            dst = t.tensor
            if dst.device.type != "xla":
                dst.copy_(host.detach())
            elif spmd.is_sharded(dst):
                spmd.load_from_host(dst, host.detach().resolve_conj().resolve_neg())
            elif _sharding(dst) != "":
                dst.copy_(host.detach())  # replicated or other annotated shardings keep theirs
            else:
                plain_xla.append((t, host))
        if plain_xla:
            import torch_xla

            xlac = torch_xla._XLAC
            hosts = [h.detach().resolve_conj().resolve_neg().contiguous() for _, h in plain_xla]
            fresh = xlac._xla_tensors_from_aten(hosts, [str(t.tensor.device) for t, _ in plain_xla])
            for (t, _), new in zip(plain_xla, fresh):
                # copy_ from device data only points the tensor at the new buffer (no compile), and
                # reaches the parameter behind a state_dict()'s detached alias.
                t.tensor.copy_(new)
    op.advance(0)


def _sharding(t: torch.Tensor) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)
