"""`xlakit ckpt ls`: a CheckpointManager folder or URL, step by step."""

from __future__ import annotations

import argparse
from pathlib import Path

from xlakit.cli.ckpt.common import OK, size, emit, about, url_kind
from xlakit.errors import CheckpointFormatError


def cmd_ls(args: argparse.Namespace) -> int:
    from xlakit.checkpoint import objstore
    from xlakit.checkpoint.inspect import describe
    from xlakit.checkpoint.stepstore import retention, step_folders, steps

    if objstore.is_url(args.dir):
        _check_manager_url(args.dir)
    else:
        path = Path(args.dir)
        if not path.exists():
            raise FileNotFoundError(2, f"{path} does not exist; ls lists a CheckpointManager folder", str(path))
        with about(path):
            kind = describe.kind_of(path)
            if kind.kind == describe.FOLDER:
                raise CheckpointFormatError(f"{path} is not a CheckpointManager folder: it holds no step, no "
                                            f"interrupted save and no manager lock ({kind.note})")
            if kind.kind != describe.MANAGER:
                raise CheckpointFormatError(f"{path} is {describe.KIND_NAMES[kind.kind]}, not a CheckpointManager "
                                            f"folder; `xlakit ckpt inspect {path}` shows what it holds")
    where = step_folders.folder_at(args.dir)  # a folder, or a manager URL on object storage
    folder = where.directory
    with about(folder):
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
        text.append(f"  {r['step']:>10}  {r['state']:<11}  {r['layout'] or '-':<10}  {size(r['bytes']) if r['bytes'] is not None else '-':>10}  "
                    f"{metrics}{'  (best)' if r['best'] else ''}{'  ' + r['problem'] if r['problem'] else ''}")
    if found.trash:
        text.append(f"  trash: {len(found.trash)} folder(s) a retention was deleting; the next manager "
                    f"removes them")
    for name, why in sorted(found.other.items()):
        text.append(f"  not the manager's: {name} ({why})")
    emit(args, data, text)
    return OK


def _check_manager_url(url: str) -> None:
    from xlakit.checkpoint.inspect import describe
    from xlakit.checkpoint.inspect import bucket_describe

    try:
        found = bucket_describe.kind_of(url)
    except FileNotFoundError as e:
        raise FileNotFoundError(2, f"{url} is not a CheckpointManager URL: it holds no step, no interrupted "
                                   f"save and no manager lease ({e.strerror})", url) from e
    if found.kind != bucket_describe.MANAGER:
        what = ("one step of a manager" if found.step else
                describe.KIND_NAMES.get(url_kind(found.kind), found.kind).replace(" folder", ""))
        raise CheckpointFormatError(f"{url} is {what}, not a CheckpointManager URL; `xlakit ckpt inspect "
                                    f"{url}` shows what it holds")
