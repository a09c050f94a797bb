"""`XLAKIT_KEEP_HOST_HEAP=1`: a copying save's batches reuse the host pages of the last one.

Real: torch_xla's stock copy on the CPU PJRT client (`transfer_backend="stock"`, the copy every
other PJRT client gets), glibc's malloc of this machine, and the kernel's count of minor page
faults. Without the setting every 32 MiB tensor of every save is a fresh mapping (glibc maps
blocks above 32 MiB anew): a second save faults in as many pages as the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from xlakit import _knobs
from xlakit.runtime import doctor, host_heap

pytestmark = pytest.mark.skipif(host_heap.allocator() != "glibc", reason="the setting is glibc's")

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
STATE_MIB = 256

SAVES = textwrap.dedent(f"""
    import json, os, resource, sys
    import torch, torch_xla, xlakit
    from xlakit.runtime import host_heap
    device = torch_xla.device()
    state = {{f"w{{i}}": torch.full(({32 * MiB // 4},), float(i)).to(device) for i in range({STATE_MIB // 32})}}
    torch_xla.sync(wait=True)
    faults = []
    for n in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        xlakit.save(state, os.path.join(sys.argv[1], f"s{{n}}.pt"), transfer_backend="stock",
                    max_inflight_bytes={64 * MiB})
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    back = xlakit.load(os.path.join(sys.argv[1], "s2.pt"))
    assert all(torch.equal(back[k], state[k].cpu()) for k in state)
    print(json.dumps({{"faults": faults, "kept": host_heap.kept()}}))
""")


def _faults(tmp_path, keep: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != _knobs.KEEP_HOST_HEAP}
    env.update(PJRT_DEVICE="CPU", **({_knobs.KEEP_HOST_HEAP: keep} if keep is not None else {}))
    proc = subprocess.run([sys.executable, "-c", SAVES, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kept_heap_the_saves_after_the_first_map_no_fresh_memory(tmp_path):
    pages = STATE_MIB * MiB // PAGE  # one copy of the state
    plain = _faults(tmp_path, None)
    assert not plain["kept"]
    # Without the setting each save faults its copies in again (the stock copy makes two per byte).
    assert min(plain["faults"][1:]) > pages // 2, plain
    kept = _faults(tmp_path, "1")
    assert kept["kept"]
    # The pages of the last save are reused (measured: 16 k faults a save against 131 k; the first save
    # grows the heap once).
    assert max(kept["faults"][1:]) < min(plain["faults"][1:]) / 4, (plain, kept)


def test_doctor_says_what_to_do_about_fresh_host_copies(monkeypatch):
    monkeypatch.delenv(_knobs.KEEP_HOST_HEAP, raising=False)
    monkeypatch.delenv(_knobs.THP_MEM_ALLOC_ENABLE, raising=False)
    warn = doctor.probe_host_heap("TPU")
    assert warn.verdict == "warn" and _knobs.KEEP_HOST_HEAP in warn.fix and "tcmalloc" in warn.fix
    assert doctor.probe_host_heap("CPU").verdict == "n/a"  # the CPU client's saves export without a copy
    monkeypatch.setenv(_knobs.THP_MEM_ALLOC_ENABLE, "1")
    assert doctor.probe_host_heap("TPU").verdict == "ok"
    monkeypatch.delenv(_knobs.THP_MEM_ALLOC_ENABLE)
    monkeypatch.setenv(_knobs.KEEP_HOST_HEAP, "1")
    assert doctor.probe_host_heap("TPU").verdict == "ok"
    # Regression: a bad value ended `xlakit doctor` mid-run (exit 2) at its host heap line instead of failing it.
    monkeypatch.setenv(_knobs.KEEP_HOST_HEAP, "ture")
    bad = doctor.probe_host_heap("TPU")
    assert bad.verdict == "fail" and "'ture'" in bad.detail and _knobs.KEEP_HOST_HEAP in bad.fix, bad
    monkeypatch.setenv(_knobs.KEEP_HOST_HEAP, "1")
    # A stand-in for a process that runs tcmalloc (none is installable here): xlakit leaves malloc alone.
    monkeypatch.setattr(host_heap, "allocator", lambda: "tcmalloc")
    assert doctor.probe_host_heap("TPU").verdict == "ok"
    assert host_heap._keep() is False
