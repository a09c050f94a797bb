"""`xlakit doctor` on TorchTPU: its stack, its compile cache and its memory, nothing of torch_xla.

Each probe is a tuple (name, verdict, detail, fix) that `doctor.py` prints as
its other lines. Memory figures need TorchTPU started: in this process when
it already runs (a training script calling the doctor), otherwise in a child
under the doctor's deadline, because starting it where no PJRT plugin can
load aborts the process that tries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from xlakit import _knobs
from xlakit.runtime import manifest, torchtpu

ProbeTuple = tuple[str, str, str, str | None]
_MARK = "xlakit-torchtpu-memory: "
_CHILD = f"""
import json, torch, torch_tpu
torch_tpu._loader._init_device("tpu")  # registered already on a TPU host; by hand on a PJRT plugin
torch.empty(1, device="tpu")
from xlakit.runtime import torchtpu
print({_MARK!r} + json.dumps(torchtpu.memory_stats()), flush=True)
"""


def probe_stack(profile: str | None, pins: str | None) -> list[ProbeTuple]:
    hazard = torchtpu.start_hazard()
    if hazard:
        return [("stack", "fail", "TorchTPU cannot start in this environment", hazard)]
    m = manifest.manifest(profile=profile, pins=pins)
    line = manifest.manifest_line(m)
    if m["drift"]:
        items = "; ".join(f"{d['what']}: expected {d['expected']}, found {d['found']}" for d in m["drift"])
        return [("stack", "warn", f"{line}; drift: {items}", f"install the {m['profile']['name']} profile "
                 "(make setup PROFILE=... ) or pass --profile")]
    return [("stack", "ok", line, None)]


def probe_cache() -> list[ProbeTuple]:
    r = torchtpu.cache_report()
    t3, t2 = r["tier3"], r["tier2"]
    out: list[ProbeTuple] = []
    if not t3["enabled"]:
        out.append(("torchtpu cache (tier 3)", "n/a", f"off: {t3['why']}", None))
    elif t3.get("folder") in (None, "untrusted"):
        out.append(("torchtpu cache (tier 3)", "fail", f"on, {t3['path']}: {t3['problem']}",
                    t3.get("fix") or "point it at a folder only you can write"))
    else:
        out.append(("torchtpu cache (tier 3)", "ok" if t3["folder"] == "owner-only" else "warn",
                    f"on, {t3['path']} ({t3['folder']}); entries are TorchTPU's own (no xlakit envelope or key)",
                    None if t3["folder"] == "owner-only" else "every member of the groups can put code into "
                                                               "your jobs"))
    where = t2["path"] if t2.get("folder") else f"{t2['path']} (not made yet)"
    out.append(("torchtpu cache (tier 2)", "ok" if t2.get("folder") != "untrusted" else "warn",
                f"{where}: {t2.get('folder') or 'judged when made'}; {t2['note']}",
                t2.get("fix") if t2.get("folder") == "untrusted" else None))
    return out


def probe_memory(timeout_s: float) -> list[ProbeTuple]:
    if torchtpu.started():
        stats: dict[str, Any] = torchtpu.memory_stats()
    else:
        try:
            done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                  timeout=timeout_s, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            return [("torchtpu memory", "fail", f"TorchTPU did not start within {timeout_s:.0f} s",
                     f"raise {_knobs.DOCTOR_TIMEOUT_S}, or check that the chips are free")]
        lines = [x for x in done.stdout.splitlines() if x.startswith(_MARK)]
        if not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return [("torchtpu memory", "fail", f"TorchTPU did not start (exit {done.returncode}): {tail}",
                     "run `python -c 'import torch_tpu'` to see the whole error")]
        stats = json.loads(lines[-1][len(_MARK):])
    if "why_not" in stats:
        return [("torchtpu memory", "n/a", stats["why_not"], None)]
    detail = (f"in use {stats['bytes_in_use']}, peak {stats['peak_bytes_in_use']}, reserved "
              f"{stats['bytes_reserved']} bytes (via {stats['source']})")
    if "note" in stats:
        return [("torchtpu memory", "n/a", f"{detail}; {stats['note']}", None)]
    return [("torchtpu memory", "ok", detail, None)]


def probes(*, profile: str | None, pins: str | None, timeout_s: float) -> list[ProbeTuple]:
    """Every TorchTPU probe, in the order the doctor prints them."""
    out = probe_stack(profile, pins) + probe_cache()
    if out[0][1] != "fail":
        out += probe_memory(timeout_s)
    return out
