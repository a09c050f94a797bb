"""`xlakit ckpt ls|inspect|verify|diff|convert`: look into and check checkpoints from the shell.

The work is done by the checkpoint package (`steps`, `describe`, `integrity`,
`tensors`); this module parses arguments, prints (a table, or `--json` on
stdout) and maps outcomes to exit codes:

  0  success (verify: every checksum matched; diff: no difference)
  1  verify: the checkpoint is damaged or incomplete (the first bad tensor or file is named);
     diff: the checkpoints differ
  2  an error: a bad argument, a missing path, something that is not a checkpoint,
     a source that cannot be read
  3  verify: nothing to verify (a plain torch.save file has no checksums, a manager folder
     has no committed step)
  130  interrupted (Ctrl-C); nothing was changed

Errors are one line on stderr, never a traceback, and name the file they are
about. The progress bar of `verify` appears on a terminal only. `--json`
output is strict JSON: a float that is not finite (a NaN metric, a NaN or
infinite difference) is written as the string "NaN", "Infinity" or "-Infinity".

`diff` compares names, the containers leading to them (a list is not a dict
keyed "0"), dtypes and shapes, then elements bit by bit, chunk by chunk; a
NaN equals a NaN, a NaN against a number is a difference whose size is NaN.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xlakit.errors import CheckpointCorruptError, CheckpointFormatError, XlakitError

OK, DIFFERENT, ERROR, NOTHING = 0, 1, 2, 3
_EPILOG = ("exit codes: 0 success; 1 verify found damage, or diff found differences; 2 error (bad argument, "
           "missing path, not a checkpoint, unreadable source); 3 verify found nothing to check (no checksums, "
           "no committed step); 130 interrupted")


def _size(n: float) -> str:
    from xlakit.checkpoint.operation import human_bytes

    return human_bytes(n)


def _emit(args: argparse.Namespace, data: dict, text: list[str]) -> None:
    if args.json:
        from xlakit.checkpoint.describe import json_safe

        print(json.dumps(json_safe(data), indent=1, default=str, allow_nan=False))
    else:
        print("\n".join(text))


@contextlib.contextmanager
def _about(path: Path | str) -> Iterator[None]:
    """An OSError that names no file is about `path`: say so ("Permission denied" alone names nothing)."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.strerror is not None:  # an errno error; not a CheckpointTimeoutError
            e.filename = str(path)
        raise


# -- ls -------------------------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import describe, retention, steps, storage

    if storage.is_url(args.dir):
        _check_manager_url(args.dir)
    else:
        path = Path(args.dir)
        if not path.exists():
            raise FileNotFoundError(2, f"{path} does not exist; ls lists a CheckpointManager folder", str(path))
        with _about(path):
            kind = describe.kind_of(path)
            if kind.kind == describe.FOLDER:
                raise CheckpointFormatError(f"{path} is not a CheckpointManager folder: it holds no step, no "
                                            f"interrupted save and no manager lock ({kind.note})")
            if kind.kind != describe.MANAGER:
                raise CheckpointFormatError(f"{path} is {describe.KIND_NAMES[kind.kind]}, not a CheckpointManager "
                                            f"folder; `xlakit ckpt inspect {path}` shows what it holds")
    where = steps.folder_at(args.dir)  # a folder, or a manager URL on object storage
    folder = where.directory
    with _about(folder):
        found = where.scan()
    records = [s.record for s in sorted(found.committed.values(), key=lambda s: s.step)]
    policy = retention.Retention(best_metric=records[-1].get("best_metric"),
                                 best_mode=records[-1].get("best_mode", "min")) if records else retention.Retention()
    best = retention.best(found.committed, policy)
    rows = [{"step": step.step, "state": "committed" if step.committed else "interrupted", "layout": step.layout,
             "bytes": where.step_bytes(step), "metrics": step.metrics, "best": step.step == best,
             "problem": step.problem} for step in {**found.committed, **found.pending}.values()]
    rows += [{"step": step, "state": "damaged", "layout": None,
              "bytes": steps.folder_bytes(folder / str(step)) if isinstance(folder, Path) else None,
              "metrics": {}, "best": False, "problem": f"its {steps.STEP_RECORD} is damaged: {why}"}
             for step, why in found.damaged.items()]
    rows.sort(key=lambda r: r["step"])
    data = {"directory": str(folder), "latest": found.latest, "best": best, "best_metric": policy.best_metric,
            "best_mode": policy.best_mode, "steps": rows, "trash": [str(p).rsplit("/", 1)[-1] for p in found.trash],
            "other": found.other}
    text = [f"{folder}: {len(found.committed)} committed step(s), latest {found.latest}"
            + (f", best {best} by {policy.best_metric} ({policy.best_mode})" if best is not None else "")
            + (f"; DAMAGED: step(s) {', '.join(map(str, sorted(found.damaged)))} (not steps until mended)"
               if found.damaged else "")]
    if rows:
        text.append(f"  {'step':>10}  {'state':<11}  {'layout':<10}  {'size':>10}  metrics")
    for r in rows:
        metrics = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["metrics"].items())
        text.append(f"  {r['step']:>10}  {r['state']:<11}  {r['layout'] or '-':<10}  {_size(r['bytes']) if r['bytes'] is not None else '-':>10}  "
                    f"{metrics}{'  (best)' if r['best'] else ''}{'  ' + r['problem'] if r['problem'] else ''}")
    if found.trash:
        text.append(f"  trash: {len(found.trash)} folder(s) a retention was deleting; the next manager "
                    f"removes them")
    for name, why in sorted(found.other.items()):
        text.append(f"  not the manager's: {name} ({why})")
    _emit(args, data, text)
    return OK


def _check_manager_url(url: str) -> None:
    from xlakit.checkpoint import describe
    from xlakit.checkpoint.storage import objinspect

    try:
        found = objinspect.kind_of(url)
    except FileNotFoundError as e:
        raise FileNotFoundError(2, f"{url} is not a CheckpointManager URL: it holds no step, no interrupted "
                                   f"save and no manager lease ({e.strerror})", url) from e
    if found.kind != objinspect.MANAGER:
        what = ("one step of a manager" if found.step else
                describe.KIND_NAMES.get(_url_kind(found.kind), found.kind).replace(" folder", ""))
        raise CheckpointFormatError(f"{url} is {what}, not a CheckpointManager URL; `xlakit ckpt inspect "
                                    f"{url}` shows what it holds")


def _url_kind(kind: str) -> str:
    """A bucket checkpoint's kind under the name a local one of that kind has."""
    from xlakit.checkpoint import describe
    from xlakit.checkpoint.storage import objinspect

    return {objinspect.FILE: describe.XLAKIT_FILE}.get(kind, kind)


# -- inspect --------------------------------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import storage

    if storage.is_url(args.path):
        return _inspect_url(args)
    with _about(args.path):
        return _inspect(args)


def _inspect_url(args: argparse.Namespace) -> int:
    """A checkpoint on object storage (a file, each shard, a DCP checkpoint's metadata), a manager's
    step, or a manager URL (listed as `ls` lists it)."""
    from xlakit.checkpoint.storage import objinspect

    found = objinspect.kind_of(args.path)
    if found.kind == objinspect.MANAGER:
        args.dir = args.path
        return cmd_ls(args)
    heading = (f"{found.url}: {{}} on object storage, committed (generation {found.record['generation']})")
    if found.kind == objinspect.FILE:
        tensors, values = _flat_infos(objinspect.read_state(found.url)[0])
        data = {"tensors": tensors, "values": values}
        text = [heading.format("xlakit checkpoint") + ", every checksum verified"]
        text += _tensor_table(tensors) + _values(values)
    elif found.kind == objinspect.SHARDED:
        shards = []
        for rank in range(found.record["world"]):
            name = found.record["shards"][rank]
            tensors, values = _flat_infos(objinspect.read_shard(found.loc, found.record, rank))
            shards.append({"rank": rank, "object": name, "bytes": found.record["objects"][name]["nbytes"],
                           "tensors": tensors, "values": values})
        data = {"commit": found.record, "shards": shards}
        text = [heading.format(f"sharded checkpoint, {found.record['world']} shard(s)")
                + ", every checksum verified"]
        for shard in shards:
            text += [f" shard {shard['rank']}: {shard['object']}, {_size(shard['bytes'])}"]
            text += _tensor_table(shard["tensors"]) + _values(shard["values"])
    else:
        from xlakit.checkpoint import describe

        tensors, values = describe.dcp_entries(objinspect.dcp_metadata(found.loc, found.record))
        nbytes = sum(e["nbytes"] for e in found.record["objects"].values())
        data = {"commit": found.record, "tensors": tensors, "values": values, "bytes": nbytes}
        text = [heading.format("torch.distributed.checkpoint") + f", {len(found.record['objects'])} file(s) "
                f"with checksums, {_size(nbytes)}"]
        text += _tensor_table(tensors) + ([f"  values: {', '.join(values)}"] if values else [])
    data = {"path": found.url, "kind": _url_kind(found.kind), "object_storage": True, **data}
    if found.step is not None:
        data["step"] = found.step
        text.insert(0, f"step {found.step['step']} ({found.step['layout']}), metrics {found.step['metrics']}")
    _emit(args, data, text)
    return OK


def _flat_infos(state: Any) -> tuple[list[dict], dict]:
    """A state's tensors (name, dtype, shape, bytes, shared storages) and other values, for printing."""
    import dataclasses

    from xlakit.checkpoint import describe

    tensors, values = describe.flatten(state)
    return ([dataclasses.asdict(t) for t in describe.tensor_infos(tensors)],
            {k: describe.jsonable(v) for k, v in values.items()})


def _inspect(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import describe

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
    else:
        data = describe.describe_dcp(kind.path, kind.record)
        text = [f"{kind.path}: torch.distributed.checkpoint folder, committed, {len(kind.record['files'])} "
                f"file(s) with checksums, {_size(data['bytes'])}"]
        text += _tensor_table(data["tensors"]) + ([f"  values: {', '.join(data['values'])}"] if data["values"] else [])
    if step_record is not None:
        data["step"] = step_record
        text.insert(0, f"step {step_record['step']} ({step_record['layout']}), metrics {step_record['metrics']}")
    _emit(args, data, text)
    return OK


def _file_heading(d: dict) -> str:
    if d["checksums"]:
        what = f"xlakit checkpoint, format version {d['format_version']}, {d['checksum_count']} checksums"
    else:
        what = f"{d['note']}"
    return f"{d['path']}: {what}, {_size(d['bytes'])}"


def _tensor_table(tensors: list[dict]) -> list[str]:
    if not tensors:
        return ["  (no tensors)"]
    width = min(max(4, *(len(t["name"]) for t in tensors)), 60)
    out = [f"  {'name':<{width}}  {'dtype':<9}  {'shape':<16}  {'bytes':>10}"]
    for t in tensors:
        shared = f"  shares its storage with {', '.join(t['shared_with'])}" if t.get("shared_with") else ""
        chunks = f"  {t['chunks']} chunk(s)" if "chunks" in t else ""
        out.append(f"  {t['name']:<{width}}  {t['dtype']:<9}  {str(t['shape']):<16}  {_size(t['bytes']):>10}"
                   f"{shared}{chunks}")
    return out


def _values(values: dict) -> list[str]:
    return ["  values: " + ", ".join(f"{k}={v!r}" for k, v in values.items())] if values else []


# -- verify ---------------------------------------------------------------------------------------

class _Bar:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, done: int, total: int, label: str) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r  [{bar:<30}] {frac:4.0%} {_size(done)} / {_size(total)}  {label[:40]:<40}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r" + " " * 110 + "\r")
        sys.stderr.flush()


def _verify_url(args: argparse.Namespace) -> int:
    """A checkpoint on object storage: every object of its newest committed generation read whole and
    verified (a file's and each shard's records as `xlakit.load` reads them; DCP files against the
    commit record); a step's checkpoint; every committed step of a manager URL."""
    from xlakit.checkpoint import steps
    from xlakit.checkpoint.options import LoadOptions
    from xlakit.checkpoint.storage import objinspect, objranks

    try:
        found = objinspect.kind_of(args.path)
        if found.kind == objinspect.MANAGER:
            return _verify_manager_url(args, steps.folder_at(args.path).scan())
        kind, checked = objranks.verify(found.url, LoadOptions())
    except CheckpointCorruptError as e:
        _emit(args, {"path": args.path, "status": "damaged", "tensor": getattr(e, "tensor", None),
                     "message": str(e)}, [f"DAMAGED: {e}"])
        return DIFFERENT
    _emit(args, {"path": found.url, "kind": _url_kind(kind), "status": "ok", "bytes": checked},
          [f"OK: {found.url} ({_url_kind(kind)} on object storage): every checksum over {_size(checked)} "
           f"matches"])
    return OK


def _verify_manager_url(args: argparse.Namespace, found) -> int:
    """A manager URL: every committed step's checkpoint verified; a damaged step record is a finding,
    and a URL with no committed step has nothing to verify (never "OK")."""
    from xlakit.checkpoint import steps
    from xlakit.checkpoint.options import LoadOptions
    from xlakit.checkpoint.storage import objranks

    url = args.path.rstrip("/")
    if found.damaged:
        step, why = min(found.damaged.items())
        message = f"step {step} of {url} is not a step: its {steps.STEP_RECORD} is damaged ({why})"
        _emit(args, {"path": url, "status": "damaged", "step": step, "message": message}, [f"DAMAGED: {message}"])
        return DIFFERENT
    if not found.committed:
        message = (f"{url} holds no committed step, so there is nothing to verify"
                   + (f"; step(s) {', '.join(map(str, sorted(found.pending)))} never committed (interrupted "
                      f"saves)" if found.pending else "") + f". `xlakit ckpt ls {url}` lists what it holds.")
        _emit(args, {"path": url, "status": "no-committed-step", "interrupted": sorted(found.pending),
                     "message": message}, [message])
        return NOTHING
    total = 0
    for step, chosen in sorted(found.committed.items()):
        try:
            _, checked = objranks.verify(str(chosen.checkpoint), LoadOptions())
        except CheckpointCorruptError as e:
            _emit(args, {"path": url, "status": "damaged", "step": step, "tensor": getattr(e, "tensor", None),
                         "message": str(e)}, [f"DAMAGED: step {step}: {e}"])
            return DIFFERENT
        total += checked
    _emit(args, {"path": url, "kind": "manager", "status": "ok", "steps": sorted(found.committed), "bytes": total},
          [f"OK: {url} (manager on object storage): {len(found.committed)} committed step(s), every checksum "
           f"over {_size(total)} matches"])
    return OK


def cmd_verify(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import describe, integrity, storage

    if storage.is_url(args.path):
        return _verify_url(args)
    path = Path(args.path)
    try:
        with _about(path):
            kind = describe.kind_of(path)
            if kind.kind == describe.FOLDER and not kind.unfinished:
                raise CheckpointFormatError(f"{path} is not a checkpoint: {kind.note}")
            kind, ranges = integrity.plan(path)
            if not ranges:
                return _nothing_committed(args, path)
            checked = _check_with_progress(ranges)
    except integrity.NothingToVerify as e:
        _emit(args, {"path": str(path), "status": "no-checksums", "message": str(e)}, [str(e)])
        return NOTHING
    except CheckpointCorruptError as e:
        _emit(args, {"path": str(path), "status": "damaged", "tensor": getattr(e, "tensor", None),
                     "message": str(e)}, [f"DAMAGED: {e}"])
        return DIFFERENT
    _emit(args, {"path": str(path), "kind": kind.kind, "status": "ok", "checksums": len(ranges), "bytes": checked},
          [f"OK: {path} ({kind.kind}): {len(ranges)} checksum(s) over {_size(checked)} match"])
    return OK


def _check_with_progress(ranges: list) -> int:
    from xlakit.checkpoint import integrity

    bar = _Bar() if sys.stderr.isatty() else None
    try:
        return integrity.check(ranges, bar)
    finally:
        if bar is not None:
            bar.close()


def _nothing_committed(args: argparse.Namespace, path: Path) -> int:
    """A manager folder without a committed step: nothing was verified, so never "OK"."""
    from xlakit.checkpoint import steps

    pending = sorted(steps.scan(path).pending)
    message = (f"{path} holds no committed step, so there is nothing to verify"
               + (f"; step(s) {', '.join(map(str, pending))} never committed (interrupted saves)" if pending else "")
               + f". `xlakit ckpt ls {path}` lists them.")
    _emit(args, {"path": str(path), "status": "no-committed-step", "interrupted": pending, "message": message},
          [message])
    return NOTHING


# -- diff -----------------------------------------------------------------------------------------

def cmd_diff(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import tensors

    with _about(args.a):
        a = _read_state(args.a)
    with _about(args.b):
        b = _read_state(args.b)
    result = tensors.compare(a, b)
    text = [f"only in A: {n}" for n in result["only_in_a"]] + [f"only in B: {n}" for n in result["only_in_b"]]
    text += [f"structure differs: {s['name']}: {s['a']} vs {s['b']}" for s in result["structure_different"]]
    text += [f"dtype/shape: {m['name']}: {m['a']} vs {m['b']}" for m in result["mismatched"]]
    text += [_difference_line(d) for d in result["different"]]
    text += [f"value differs: {v['name']}: {v['a']!r} vs {v['b']!r}" for v in result["values_different"]]
    text.append("identical" if result["identical"] else
                f"{len(result['different']) + len(result['mismatched'])} tensor(s) differ, {result['same']} equal"
                f"; {len(result['structure_different'])} structure and {len(result['values_different'])} "
                f"value difference(s)")
    _emit(args, {"a": args.a, "b": args.b, **result}, text)
    return OK if result["identical"] else DIFFERENT


def _difference_line(d: dict) -> str:
    nan = (f" ({d['nan_vs_number']} where a NaN stands against a number)" if d["nan_vs_number"] else "")
    return (f"differs: {d['name']}: {d['differing']} of {d['elements']} element(s), max abs difference "
            f"{d['max_abs_diff']:g}{nan}")


# -- convert --------------------------------------------------------------------------------------

def cmd_convert(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import storage

    if storage.is_url(args.out):
        _check_url_target(args)
    else:
        out = Path(args.out)
        if out.exists() and not args.force:
            raise FileExistsError(17, f"{out} exists; pass --force to replace it", str(out))
    with _about(args.path):
        state, kind = _read_state(args.path, with_kind=True)
    with _about(args.out):
        result = _write(state, args.out, args.to)
    _emit(args, {"source": args.path, "source_kind": kind, "to": args.to, "out": str(args.out), **result},
          [f"wrote {args.out} ({args.to}): {result['tensors']} tensor(s), {_size(result['bytes'])}"])
    return OK


def _check_url_target(args: argparse.Namespace) -> None:
    """`convert --to xlakit gs://...`: a new checkpoint in the bucket (replacing one only with --force)."""
    from xlakit.checkpoint.storage import objinspect

    if args.to != "xlakit":
        raise ValueError(f"{args.out}: convert writes {args.to} to a local file; to a bucket it writes an xlakit "
                         f"checkpoint (--to xlakit), which loads and verifies there")
    objinspect.check_target(args.out, args.force)


def _read_state(path: str, *, with_kind: bool = False) -> Any:
    """The state of a checkpoint, verified: a local path or a URL of any kind (a step's included)."""
    from xlakit.checkpoint import storage, tensors

    if storage.is_url(path):
        from xlakit.checkpoint.storage import objinspect

        state, found = objinspect.read_state(path)
        kind = _url_kind(found.kind)
    else:
        state, found = tensors.read_state(Path(path))
        kind = found.kind
    return (state, kind) if with_kind else state


def _write(state: Any, out: str, to: str) -> dict:
    from xlakit.checkpoint import describe, storage, tensors

    if to == "safetensors":
        return tensors.write_safetensors(state, Path(out))  # refuses a state whose names collide
    from xlakit import checkpoint

    checkpoint.save(state, out)  # keeps the state's structure: names cannot collide here
    if storage.is_url(out):
        from xlakit.checkpoint.storage import objinspect

        nbytes = sum(e["nbytes"] for e in objinspect.kind_of(out).record["objects"].values())
    else:
        nbytes = Path(out).stat().st_size
    return {"tensors": describe.tensor_count(state), "bytes": nbytes}


# -- the parser -----------------------------------------------------------------------------------

def _guarded(func):
    """Run a subcommand; any failure is one line on stderr and exit status 2 (never a traceback)."""
    def run(args: argparse.Namespace) -> int:
        from xlakit.checkpoint import storage

        try:
            for name in ("path", "dir", "a", "b", "out"):
                storage.check_url(getattr(args, name, None))  # az://, http://: refused by scheme
            return func(args)
        except KeyboardInterrupt:
            print(f"xlakit ckpt {args.ckpt_command}: interrupted; nothing was changed", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 - a client library's own error too: one line, never a traceback
            print(f"xlakit ckpt {args.ckpt_command}: {_error_message(e)}", file=sys.stderr)
            return ERROR
    return run


def _error_message(e: Exception) -> str:
    if isinstance(e, OSError) and e.strerror:
        if e.filename is None or str(e.filename) in e.strerror:  # xlakit's own messages name the path
            return e.strerror
        return f"{e.filename}: {e.strerror}"
    return str(e) if isinstance(e, XlakitError) else f"{type(e).__name__}: {e}"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ckpt", help="inspect, verify, compare and convert checkpoints",
                              epilog=_EPILOG)
    sub = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    commands: list[tuple[str, Any, str, list[tuple[str, str]]]] = [
        ("ls", cmd_ls, "list a CheckpointManager folder: steps, commit state, sizes, metrics, best",
         [("dir", "the manager folder (or its gs:// or s3:// URL)")]),
        ("inspect", cmd_inspect, "tensors (dtype, shape, bytes, shared storages), format, checksums, commit record",
         [("path", "a checkpoint file, a sharded or DCP folder, or a manager step folder (or their gs:// or "
                   "s3:// URLs)")]),
        ("verify", cmd_verify, "check every checksum, streamed; exit 1 naming the first bad tensor",
         [("path", "a checkpoint file, a sharded or DCP folder, a step folder or a manager folder")]),
        ("diff", cmd_diff, "which tensors differ between two checkpoints, and by how much",
         [("a", "the first checkpoint"), ("b", "the second checkpoint")]),
        ("convert", cmd_convert, "write a checkpoint (file, sharded or DCP folder) as one safetensors or "
                                 "xlakit file", [("path", "the checkpoint to convert")]),
    ]
    for name, func, help_text, positional in commands:
        q = sub.add_parser(name, help=help_text, epilog=_EPILOG)
        for arg, arg_help in positional:
            q.add_argument(arg, help=arg_help)
        if name == "convert":
            q.add_argument("--to", required=True, choices=("safetensors", "xlakit"), help="the output format")
            q.add_argument("out", help="the file to write (or, with --to xlakit, a gs:// or s3:// URL)")
            q.add_argument("--force", action="store_true", help="replace OUT if it exists")
        q.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
        q.set_defaults(func=_guarded(func))
