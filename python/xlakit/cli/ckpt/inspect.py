"""`xlakit ckpt inspect`: what a checkpoint holds (tensors, values, format, commit record), local or on a bucket."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from xlakit.cli.ckpt.common import OK, size, emit, about, url_kind
from xlakit.cli.ckpt.ls import cmd_ls
from xlakit.errors import CheckpointCorruptError


def cmd_inspect(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import objstore

    if objstore.is_url(args.path):
        return _inspect_url(args)
    with about(args.path):
        return _inspect(args)


def _inspect_url(args: argparse.Namespace) -> int:
    """A checkpoint on object storage (a file, each shard, a DCP checkpoint's metadata), a manager's
    step, or a manager URL (listed as `ls` lists it)."""
    from xlakit.checkpoint.inspect import bucket_describe

    found = bucket_describe.kind_of(args.path)
    if found.kind == bucket_describe.MANAGER:
        args.dir = args.path
        return cmd_ls(args)
    heading = (f"{found.url}: {{}} on object storage, committed (generation {found.record['generation']})")
    if found.kind == bucket_describe.FILE:
        tensors, values = _flat_infos(bucket_describe.read_state(found.url)[0])
        data = {"tensors": tensors, "values": values}
        text = [heading.format("xlakit checkpoint") + ", every checksum verified"]
        text += _tensor_table(tensors) + _values(values)
    elif found.kind == bucket_describe.SHARDED:
        shards = []
        for rank in range(found.record["world"]):
            name = found.record["shards"][rank]
            tensors, values = _flat_infos(bucket_describe.read_shard(found.loc, found.record, rank))
            shards.append({"rank": rank, "object": name, "bytes": found.record["objects"][name]["nbytes"],
                           "tensors": tensors, "values": values})
        data = {"commit": found.record, "shards": shards}
        text = [heading.format(f"sharded checkpoint, {found.record['world']} shard(s)")
                + ", every checksum verified"]
        for shard in shards:
            text += [f" shard {shard['rank']}: {shard['object']}, {size(shard['bytes'])}"]
            text += _tensor_table(shard["tensors"]) + _values(shard["values"])
    elif found.kind == bucket_describe.REPLICATED:
        rec = found.record
        tensors, values = _flat_infos(bucket_describe.read_state(found.url)[0])
        shares = [{"rank": rec["objects"][n]["rank"], "object": n, "bytes": rec["objects"][n]["nbytes"]}
                  for n in rec["shares"]]
        data = {"commit": rec, "format": rec["kind"], "version": rec["layout_version"], "world": rec["world"],
                "writer_rank": rec["writer_rank"], "shares": shares, "bytes": sum(e["bytes"] for e in shares),
                "tensors": tensors, "values": values}
        text = [heading.format(_replicated_heading(data)) + ", every checksum verified"]
        text += [f" share {e['rank']}: {e['object']}, {size(e['bytes'])}" for e in shares]
        text += _tensor_table(tensors) + _values(values)
    else:
        from xlakit.checkpoint.inspect import describe

        tensors, values = describe.dcp_entries(bucket_describe.dcp_metadata(found.loc, found.record))
        nbytes = sum(e["nbytes"] for e in found.record["objects"].values())
        data = {"commit": found.record, "tensors": tensors, "values": values, "bytes": nbytes}
        text = [heading.format("torch.distributed.checkpoint") + f", {len(found.record['objects'])} file(s) "
                f"with checksums, {size(nbytes)}"]
        text += _tensor_table(tensors) + ([f"  values: {', '.join(values)}"] if values else [])
    data = {"path": found.url, "kind": url_kind(found.kind), "object_storage": True, **data}
    if found.step is not None:
        data["step"] = found.step
        text.insert(0, f"step {found.step['step']} ({found.step['layout']}), metrics {found.step['metrics']}")
    emit(args, data, text)
    return OK


def _flat_infos(state: Any) -> tuple[list[dict], dict]:
    """A state's tensors (name, dtype, shape, bytes, shared storages) and other values, for printing."""
    import dataclasses

    from xlakit.checkpoint.inspect import describe

    tensors, values = describe.flatten(state)
    return ([dataclasses.asdict(t) for t in describe.tensor_infos(tensors)],
            {k: describe.jsonable(v) for k, v in values.items()})


def _inspect(args: argparse.Namespace) -> int:
    from xlakit.checkpoint.inspect import describe

    path = Path(args.path)
    kind = describe.kind_of(path)
    step_record = None
    if kind.kind == describe.STEP:
        step_record = kind.record
        kind = describe.step_checkpoint(kind)
    if kind.kind == describe.MANAGER:
        args.dir = str(path)
        return cmd_ls(args)
    if kind.kind == describe.FOLDER:
        raise CheckpointCorruptError(f"{path} is not a committed checkpoint: {kind.note}")
    if kind.kind in (describe.XLAKIT_FILE, describe.TORCH_FILE):
        data = describe.describe_file(kind.path, kind)
        text = [_file_heading(data)] + _tensor_table(data["tensors"]) + _values(data["values"])
    elif kind.kind == describe.SHARDED:
        shards = [describe.describe_file(kind.path / e["file"], describe.kind_of(kind.path / e["file"]))
                  for e in kind.record["shards"]]
        data = {"path": str(kind.path), "kind": kind.kind, "commit": kind.record, "shards": shards}
        text = [f"{kind.path}: sharded checkpoint, {kind.record['world']} shard(s), committed "
                f"(id {kind.record['id']})"]
        for e, shard in zip(kind.record["shards"], shards):
            text += [f" shard {e['rank']}: {_file_heading(shard)}"] + _tensor_table(shard["tensors"])
    elif kind.kind == describe.REPLICATED:
        data = describe.describe_replicated(kind.path, kind.record)
        text = [f"{kind.path}: {_replicated_heading(data)}, committed (id {data['id']})"]
        text += [f" share {e['rank']}: {e['file']}, {size(e['bytes'])}" for e in data["shares"]]
        text += _tensor_table(data["tensors"]) + _values(data["values"])
    else:
        data = describe.describe_dcp(kind.path, kind.record)
        text = [f"{kind.path}: torch.distributed.checkpoint folder, committed, {len(kind.record['files'])} "
                f"file(s) with checksums, {size(data['bytes'])}"]
        text += _tensor_table(data["tensors"]) + ([f"  values: {', '.join(data['values'])}"] if data["values"] else [])
    if step_record is not None:
        data["step"] = step_record
        text.insert(0, f"step {step_record['step']} ({step_record['layout']}), metrics {step_record['metrics']}")
    emit(args, data, text)
    return OK


def _replicated_heading(d: dict) -> str:
    """What a replica-parallel checkpoint is (local or on a bucket: `d` has format, version, world)."""
    return (f"replica-parallel replicated checkpoint (format {d['format']!r}, version {d['version']}), "
            f"{d['world']} share(s), {size(d['bytes'])}, commit record by rank {d['writer_rank']}")


def _file_heading(d: dict) -> str:
    if d["checksums"]:
        what = f"xlakit checkpoint, format version {d['format_version']}, {d['checksum_count']} checksums"
    else:
        what = f"{d['note']}"
    return f"{d['path']}: {what}, {size(d['bytes'])}"


def _tensor_table(tensors: list[dict]) -> list[str]:
    if not tensors:
        return ["  (no tensors)"]
    width = min(max(4, *(len(t["name"]) for t in tensors)), 60)
    out = [f"  {'name':<{width}}  {'dtype':<9}  {'shape':<16}  {'bytes':>10}"]
    for t in tensors:
        shared = f"  shares its storage with {', '.join(t['shared_with'])}" if t.get("shared_with") else ""
        chunks = f"  {t['chunks']} chunk(s)" if "chunks" in t else ""
        out.append(f"  {t['name']:<{width}}  {t['dtype']:<9}  {str(t['shape']):<16}  {size(t['bytes']):>10}"
                   f"{shared}{chunks}")
    return out


def _values(values: dict) -> list[str]:
    return ["  values: " + ", ".join(f"{k}={v!r}" for k, v in values.items())] if values else []
