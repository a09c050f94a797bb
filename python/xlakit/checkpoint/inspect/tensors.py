"""Any checkpoint as named tensors: read it (verified first), compare two, write safetensors.

Every source is verified before it is used (`integrity`; a plain torch.save
file has nothing to verify), then read weights-only: files through a memory
map, so tensors are paged in as they are compared or written; a DCP folder
is assembled into full tensors from its metadata (its non-tensor values go
through the weights-only unpickler, never torch.load's default). A sharded
folder becomes `{"shard0": ..., "shard1": ...}`, one entry per rank's shard.

safetensors is written here (a JSON header, then each tensor's bytes in
order), streamed from the source tensors into a temporary file renamed over
the target: no copy of the whole checkpoint in memory, no partial output.
Tensors that shared a storage are written once each, as safetensors wants.
"""

from __future__ import annotations

import io
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from xlakit.checkpoint.core import paths
from xlakit.checkpoint.format import archive
from xlakit.checkpoint.inspect import describe, integrity
from xlakit.errors import CheckpointFormatError, CheckpointIncompleteError, CheckpointSerializationError

_CHUNK = 4 << 20
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
                      torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def read_state(path: Path) -> tuple[Any, describe.Kind]:
    """The state a checkpoint holds, verified first; refuses a manager folder or an uncommitted one."""
    kind = describe.kind_of(path)
    if kind.kind == describe.STEP:
        kind = describe.step_checkpoint(kind)
    if kind.kind == describe.MANAGER:
        raise CheckpointFormatError(f"{path} is a manager folder holding several steps; name one "
                                    f"({path}/<step>; `xlakit ckpt ls {path}` lists them)")
    if kind.kind == describe.FOLDER:
        raise CheckpointIncompleteError(f"{path} is not a committed checkpoint: {kind.note}")
    if kind.kind != describe.TORCH_FILE:
        integrity.check(integrity.plan(kind.path)[1])
    if kind.kind in (describe.XLAKIT_FILE, describe.TORCH_FILE):
        return describe.load_mapped(kind.path), kind
    if kind.kind == describe.SHARDED:
        return {f"shard{e['rank']}": describe.load_mapped(kind.path / e["file"])
                for e in kind.record["shards"]}, kind
    if kind.kind == describe.REPLICATED:  # the whole state, as xlakit.load gives it
        return describe.replicated_state(kind.path, kind.record), kind
    from xlakit.checkpoint.format import dcp_metadata

    return read_dcp(dcp_metadata.folder_reader(kind.path), str(kind.path)), kind


def read_dcp(reader: Any, where: str) -> dict[str, Any]:
    """Every value of the DCP checkpoint `reader` reads (a folder's, or a bucket's through
    `bucket_describe.py`; its metadata read through `dcp_metadata`'s allowlist), flat by name:
    full tensors, other values weights-only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from xlakit.checkpoint.torch_dcp.dcp import run_dcp
    from xlakit.checkpoint.torch_dcp.dcp_plan import load_value

    template: dict[str, Any] = {}
    for fqn, item in reader.read_metadata().state_dict_metadata.items():
        template[fqn] = (torch.empty(tuple(item.size), dtype=item.properties.dtype)
                         if isinstance(item, TensorStorageMetadata) else None)

    class WeightsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn  # the template is flat already: its keys are the fqns
            self.original_state_dict[fqn] = load_value(value, fqn, where, map_location="cpu")

    run_dcp(dcp.load, template, None, storage_reader=reader, planner=WeightsOnly(flatten_state_dict=False))
    return template


# -- comparing ---------------------------------------------------------------------------------

def compare(a: Any, b: Any) -> dict:
    """What differs between two states: names on one side only, the containers leading to a name,
    dtypes/shapes, elements, values."""
    ta, va, ra = describe.flatten_routed(a)
    tb, vb, rb = describe.flatten_routed(b)
    out: dict[str, Any] = {
        "only_in_a": sorted(set(ta) - set(tb)), "only_in_b": sorted(set(tb) - set(ta)),
        "structure_different": [{"name": n, "a": ra[n], "b": rb[n]} for n in sorted(set(ra) & set(rb))
                                if ra[n] != rb[n]],
        "mismatched": [], "different": [], "same": 0, "values_different": []}
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            out["mismatched"].append({"name": name, "a": _sig(x), "b": _sig(y)})
        elif (diff := tensor_difference(x, y)) is None:
            out["same"] += 1
        else:
            out["different"].append({"name": name, **diff})
    absent = "<absent>"
    for name in sorted(set(va) | set(vb)):
        x, y = va.get(name, absent), vb.get(name, absent)
        if not _same_value(x, y):
            out["values_different"].append({"name": name, "a": describe.jsonable(x), "b": describe.jsonable(y)})
    out["identical"] = not any(out[k] for k in ("only_in_a", "only_in_b", "structure_different", "mismatched",
                                                  "different", "values_different"))
    return out


def _same_value(x: Any, y: Any) -> bool:
    """Equal values, containers compared element by element (a NaN equals a NaN); never raises."""
    if type(x) is not type(y):  # 1, 1.0 and True are different values in a checkpoint
        return False
    if isinstance(x, io.BytesIO):  # DCP's documented byte values: equal by their bytes, not identity
        return x.getvalue() == y.getvalue()
    if isinstance(x, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_value(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same_value(x[k], y[k]) for k in x)
    if isinstance(x, torch.Tensor):  # inside a DCP value
        return x.dtype == y.dtype and x.shape == y.shape and tensor_difference(x, y) is None
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, (numpy.ndarray, numpy.generic)):  # allowed by the user
        return x.dtype == y.dtype and x.shape == y.shape and _same_array(numpy, x, y)
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - an == that is not a truth value: compare what the user would see
        return repr(x) == repr(y)


def _same_array(numpy: Any, x: Any, y: Any) -> bool:
    """Equal numpy arrays of one dtype and shape: as tensors are (bit for bit, a NaN equals a NaN);
    an object array by its elements (its bytes are addresses)."""
    if x.dtype.hasobject:
        return _same_value(numpy.asarray(x).tolist(), numpy.asarray(y).tolist())
    try:
        a, b = (torch.from_numpy(numpy.array(v, order="C", ndmin=1)) for v in (x, y))
    except (TypeError, ValueError):  # no torch type (strings, datetimes, records; big-endian): their bytes
        return x.tobytes() == y.tobytes()
    return tensor_difference(a, b) is None


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> dict | None:
    """None when `a` and `b` hold the same elements (bit for bit, or NaN in both); else how many
    elements differ, how many of them are a NaN against a number, and the largest |a - b| (NaN
    when a NaN stands against a number). Read in chunks; any dtype (float8 is widened first)."""
    differing, nan_vs_number, worst = 0, 0, 0.0
    flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
    step = max(_CHUNK // max(a.element_size(), 1), 1)
    for start in range(0, flat_a.numel(), step):
        x, y = flat_a[start:start + step], flat_b[start:start + step]
        rows = (_element_bytes(x) != _element_bytes(y)).any(dim=1)
        if not bool(rows.any()):
            continue
        wide = torch.complex128 if x.is_complex() else torch.float64
        x, y = x.to(wide)[rows], y.to(wide)[rows]  # widened before indexing: float8 has no indexing
        nan_x, nan_y = torch.isnan(x), torch.isnan(y)
        numbers = ~nan_x & ~nan_y
        differing += int((nan_x ^ nan_y).sum()) + int(numbers.sum())
        nan_vs_number += int((nan_x ^ nan_y).sum())
        if bool(numbers.any()):
            worst = max(worst, float((x[numbers] - y[numbers]).abs().max()))
    if not differing:
        return None
    return {"differing": differing, "elements": flat_a.numel(), "nan_vs_number": nan_vs_number,
            "max_abs_diff": math.nan if nan_vs_number else worst}


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of a flat tensor as rows of raw bytes: equal rows are bitwise equal elements."""
    flat = t.contiguous()
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def _sig(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


# -- safetensors ---------------------------------------------------------------------------------

def write_safetensors(state: Any, out: Path) -> dict:
    """Write the tensors of `state` (named by path) as a safetensors file; non-tensor values go in
    its metadata as JSON under "xlakit.values". Atomic: a temporary sibling renamed over `out`."""
    tensors, values = describe.flatten(state)
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        code = SAFETENSORS_DTYPES.get(t.dtype)
        if code is None:
            raise CheckpointSerializationError(f"cannot write tensor {name!r} to safetensors: its dtype "
                                               f"{t.dtype} has no safetensors type")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    meta = {"format": "pt"}
    if values:
        # Strict JSON, as `--json` writes it: a NaN or infinite value is the string "NaN", "Infinity"...
        shown = {k: describe.jsonable(v, whole=True) for k, v in values.items()}
        meta["xlakit.values"] = json.dumps(describe.json_safe(shown), allow_nan=False)
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    paths.check_target(out)

    def fill(f) -> None:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            dense = t.detach().contiguous()  # held while its bytes are written: the view does not
            view = archive.tensor_bytes(dense)
            for start in range(0, len(view), _CHUNK):
                f.write(view[start:start + _CHUNK])
            del view, dense

    paths.write_file(out, fill)
    return {"tensors": len(tensors), "bytes": out.stat().st_size, "values": sorted(values)}
