"""A template against a checkpoint's structure: what fills what, every difference found first.

`xlakit.restore` changes the template in place, so everything that could go
wrong with the pairing is found before a byte is read: keys on one side only,
containers that differ, shapes and dtypes, template tensors that cannot hold
values (meta, overlapping elements), and tied template tensors (two entries
sharing memory, like an embedding and an output layer) that the checkpoint
holds different values for: filling one would overwrite the other. Whether
tied entries receive the same values is decided from metadata: the same
stored tensor, a view with the same relation to one storage, or records
with equal digests (equal bytes). With `strict=False` the checkpoint's
entries that the template lacks are allowed: they are not read, not in the
result, and are reported (logged, and given to `extra_keys_callback`). The
template's entries that the checkpoint lacks are a difference, except in a
`MayBeAbsent` mapping (an optimizer's state that xlakit created for the restore).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xlakit.checkpoint.format import structure
from xlakit.checkpoint.core.options import LoadOptions
from xlakit.checkpoint.format.structure import TensorSpec
from xlakit.errors import CheckpointMismatchError

_SHOWN = 20  # problems listed in the message (all are in `.problems`)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MATH_BITS = structure.CONJ | structure.NEG
log = logging.getLogger("xlakit")


@dataclass(eq=False, slots=True)
class Target:
    """One template tensor and what fills it: a spec (xlakit file) or a host tensor (torch file).

    `direct`: a contiguous CPU tensor that a contiguous saved tensor covering its whole storage
    fills as it is (no conj/neg bits): its record can be read straight into its memory.
    """

    path: str
    tensor: torch.Tensor
    source: TensorSpec | torch.Tensor
    direct: bool = False


class MayBeAbsent(dict):
    """A template mapping whose entries the checkpoint may lack: those are left out of the result,
    not a difference (the optimizer state that `live.py` created for parameters that had none saved)."""


def drop_absent(template: Any, saved_keys: Any, where: str = "") -> None:
    """Remove, in place, the entries of each `MayBeAbsent` mapping in `template` that a DCP checkpoint
    lacks; `saved_keys`: its flattened keys ("optimizer.state.0.step"), or a set of their prefixes."""
    if not isinstance(saved_keys, set):
        saved_keys = {key[:i] for key in saved_keys for i, c in enumerate(key + ".") if c == "."}
    if isinstance(template, dict):
        items = list(template.items())
    elif isinstance(template, (list, tuple)):
        items = list(enumerate(template))
    else:
        return
    for k, v in items:
        child = f"{where}.{k}" if where else str(k)
        if isinstance(template, MayBeAbsent) and child not in saved_keys:
            del template[k]
        else:
            drop_absent(v, saved_keys, child)


def match(saved: Any, template: Any, path: Path, opts: LoadOptions,
          digests: list[str] | None) -> tuple[list[Target], Any]:
    """Every (template tensor, saved tensor) pair, and the restored state: the saved structure with
    the template's tensors in the tensors' places, less the checkpoint's entries the template lacks
    (allowed by `strict=False`, and reported); raises naming every difference. `digests` are the
    index's, by row. One walk: on 100,000 small tensors it is most of a restore's own time."""
    targets: list[Target] = []
    problems: list[str] = []
    extra: list[str] = []
    strict = opts.strict

    def kind(v: Any) -> str:
        if isinstance(v, (TensorSpec, torch.Tensor)):
            return "a tensor"
        return f"a {type(v).__name__}"

    add, spec, plain, math_bits = targets.append, TensorSpec, _PLAIN, _MATH_BITS

    def quick(s: Any, t: Any, where: str) -> bool:
        """The common pair (a plain contiguous CPU tensor of the saved shape and dtype), taken at once."""
        if (type(s) is spec and type(t) in plain and t.is_cpu and t.dtype == s.dtype and s.size == t.shape
                and t.is_contiguous()):
            direct = (not s.offset and not s.flags & math_bits and (s.stride == t.stride() or s.contiguous)
                      and not (t.is_conj() or t.is_neg()))
            add(Target(where, t, s, direct))
            return True
        return False

    def walk(s: Any, t: Any, where: str) -> Any:
        name = where or "the state"
        if quick(s, t, name):
            return t
        s_tensor = isinstance(s, (TensorSpec, torch.Tensor))
        if s_tensor and isinstance(t, torch.Tensor):
            shape, dtype = tuple(s.size if isinstance(s, TensorSpec) else s.shape), s.dtype
            if shape != tuple(t.shape) or dtype != t.dtype:
                problems.append(f"{name}: the checkpoint has {dtype} {list(shape)}, the template "
                                f"{t.dtype} {list(t.shape)}")
            elif t.device.type == "meta":
                problems.append(f"{name}: the template tensor is on the meta device: it has no memory "
                                f"to fill (materialize the model first, e.g. module.to_empty(device=...))")
            elif t.device.type != "xla" and torch._debug_has_internal_overlap(t) == 1:
                problems.append(f"{name}: the template tensor's elements overlap in memory (an "
                                f"expand() or a stride of 0): it cannot hold {list(shape)} values")
            else:
                targets.append(Target(name, t, s))
            return t
        if s_tensor or isinstance(t, torch.Tensor):
            problems.append(f"{name}: the checkpoint has {kind(s)}, the template {kind(t)}")
        elif isinstance(s, dict) and isinstance(t, dict):
            if not isinstance(t, MayBeAbsent):
                for k in t.keys() - s.keys():
                    problems.append(f"{_child(where, k)}: missing from the checkpoint")
            out = {}
            for k, x in s.items():  # in the checkpoint's order, which is (mostly) the file's
                child = f"{where}/{k}" if where else str(k)
                if k in t:
                    y = t[k]
                    out[k] = y if quick(x, y, child) else walk(x, y, child)
                elif strict:
                    problems.append(f"{child}: in the checkpoint, not in the template")
                else:
                    extra.append(child)
            if type(out) is not type(s):
                out = type(s)(out)
            for attr, value in getattr(s, "__dict__", {}).items():  # state_dict()'s _metadata
                setattr(out, attr, value)
            return out
        elif isinstance(s, (list, tuple)) and isinstance(t, (list, tuple)):
            if len(s) != len(t):
                problems.append(f"{name}: the checkpoint has {len(s)} items, the template {len(t)}")
            return type(s)(walk(x, y, _child(where, i)) for i, (x, y) in enumerate(zip(s, t)))
        elif isinstance(s, (dict, list, tuple)) != isinstance(t, (dict, list, tuple)):
            problems.append(f"{name}: the checkpoint has {kind(s)}, the template {kind(t)}")
        return s

    try:
        restored = walk(saved, template, "")
    finally:
        del walk  # a closure that calls itself is a cycle: it would hold the tensors until a gc
    problems += _tied_problems(targets, digests)
    if problems:
        problems.sort()
        shown = "\n  - ".join(problems[:_SHOWN]) + (f"\n  ... and {len(problems) - _SHOWN} more"
                                                     if len(problems) > _SHOWN else "")
        err = CheckpointMismatchError(f"{path} does not fit the template ({len(problems)} "
                                      f"difference(s)); nothing was changed:\n  - {shown}",
                                      problems=problems)
        err.add_note("Build the template like the state that was saved (same model and optimizer "
                     "configuration; pass the optimizer itself, e.g. optimizer=opt, rather than the "
                     "state_dict() of one that has not stepped yet, which has no state), restore part "
                     "of it with strict=False (the checkpoint's entries the template lacks are then "
                     "skipped), or load the checkpoint with xlakit.load and pick what you need.")
        raise err
    if extra:
        names = sorted(extra)
        log.info("xlakit: restoring %s without %d checkpoint entr%s the template lacks (strict=False; "
                 "not read): %s", path, len(names), "y" if len(names) == 1 else "ies",
                 ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""))
        if opts.extra_keys_callback is not None:
            opts.extra_keys_callback(names)
    return targets, restored


def _tied_problems(targets: list[Target], digests: list[str] | None) -> list[str]:
    """Template tensors sharing memory (tied weights) that the checkpoint fills with different values.

    Filling one would overwrite the other: unless both receive the same values for the memory
    they share (the same stored tensor, or records with equal bytes), it is a difference.
    """
    by_memory: dict[int, list[Target]] = {}
    for t in targets:
        x = t.tensor
        ptr = x.data_ptr()  # where its storage starts, cheaper to ask than the storage; none on XLA
        key = ptr - x.storage_offset() * x.element_size() if ptr else x.untyped_storage()._cdata if x.numel() else None
        if key is not None:
            by_memory.setdefault(key, []).append(t)
    problems = []
    for tied in by_memory.values():
        if len(tied) < 2:
            continue
        group = sorted(((*_span(t.tensor), t) for t in tied), key=lambda g: g[:2])
        for i, (_, end, a) in enumerate(group):  # sorted by start: a sweep finds the overlaps
            for start, _, b in group[i + 1:]:
                if start >= end:
                    break
                if not _same_values(a, b, digests):
                    first, second = sorted((a.path, b.path))
                    problems.append(f"{first} and {second}: the template's tensors share memory (tied), "
                                    f"but the checkpoint holds different values for them: restoring both "
                                    f"would leave each with the values of one (untie them, or leave one "
                                    f"out of the template and restore with strict=False)")
    return problems


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor's elements lie within (an XLA tensor: all of them)."""
    if t.device.type == "xla":
        return 0, 1 << 62
    size = t.element_size()
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (last + 1) * size


def _same_values(a: Target, b: Target, digests: list[str] | None) -> bool:
    """Whether restoring `a` and `b` writes the same value into every element they share."""
    x, y, sa, sb = a.tensor, b.tensor, a.source, b.source
    same_view = (x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
                 and x.storage_offset() == y.storage_offset())
    if isinstance(sa, TensorSpec) and isinstance(sb, TensorSpec):
        same_layout = (sa.offset, sa.size, sa.stride, sa.conj, sa.neg) == (sb.offset, sb.size, sb.stride,
                                                                          sb.conj, sb.neg)
        if sa.storage != sb.storage:  # two records: the same values only as equal bytes, viewed alike
            return same_view and same_layout and digests is not None and digests[sa.storage] == digests[sb.storage]
        if same_view:
            return same_layout
        return (x.device.type != "xla" and (sa.conj, sa.neg) == (sb.conj, sb.neg)
                and x.stride() == sa.stride and y.stride() == sb.stride
                and x.storage_offset() - y.storage_offset() == sa.offset - sb.offset)
    if same_view:  # host tensors of a torch.save file: compare them
        return torch.equal(_raw(sa), _raw(sb))
    return (sa.untyped_storage()._cdata == sb.untyped_storage()._cdata and x.device.type != "xla"
            and x.stride() == sa.stride() and y.stride() == sb.stride()
            and x.storage_offset() - y.storage_offset() == sa.storage_offset() - sb.storage_offset())


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, so that a NaN equals the same NaN."""
    return t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def _child(where: str, key: object) -> str:
    return f"{where}/{key}" if where else str(key)
