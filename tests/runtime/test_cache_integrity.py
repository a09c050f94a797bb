"""A PJRT wrapper cache entry runs only as the program it was compiled for (issue 24, "Integrity first").

Each entry stores the key it was written under (envelope format 2), compared on load and, with
XLAKIT_CACHE_KEY, covered by the tag; entries are read streaming, header first, under a size cap. Real
plugins, fresh processes: jax 0.10 on lammps-jax-pjrt-cpu (XLA's CPU plugin) through the wrapper, two
jitted programs whose outputs tell them apart.
"""

from __future__ import annotations

import hmac
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO
from xlakit import _C
from xlakit.runtime import cache_files

ROOT = REPO
KEY = "k" * 40

pytestmark = [pytest.mark.pjrt, pytest.mark.slow]

# Two programs, compiled in this order: `x * 2`, then `x + 100`.
_JOB = textwrap.dedent("""
    import json, os, resource
    import numpy as np
    import lammps_jax_pjrt_cpu
    from xlakit.runtime import pjrt_wrap
    os.environ.setdefault("XLAKIT_PJRT_PLUGIN", str(lammps_jax_pjrt_cpu.PLUGIN_PATH))
    os.environ["JAX_PLATFORMS"] = "xlakitcpu"
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    from jax._src import xla_bridge
    xla_bridge.register_plugin("xlakitcpu", library_path=str(pjrt_wrap.library_path()))
    x = np.arange(4, dtype=np.float32)
    doubled = jax.device_get(jax.jit(lambda a: a * 2)(x)).tolist()
    shifted = jax.device_get(jax.jit(lambda a: a + 100)(x)).tolist()
    print(json.dumps({"results": [doubled, shifted], "status": pjrt_wrap.status(),
                      "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
""")
RIGHT = [[0.0, 2.0, 4.0, 6.0], [100.0, 101.0, 102.0, 103.0]]


def job(folder: Path, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")}
    # This checkout's xlakit (an editable install may point at another checkout).
    base.update(PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT)]), XLAKIT_PJRT_CACHE_DIR=str(folder),
                **env)
    run = subprocess.run([sys.executable, "-c", _JOB], env=base, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    out["stderr"] = run.stderr
    return out


def programs(folder: Path) -> tuple[Path, Path]:
    """The entries of `x * 2` and `x + 100`, in the order they were written."""
    found = sorted((p for p in folder.iterdir() if len(p.name) == 64), key=lambda p: p.stat().st_mtime_ns)
    assert len(found) == 2, found
    return found[0], found[1]


def counts(out: dict) -> dict:
    return out["status"]["counts"]


def warm(folder: Path, **env: str) -> tuple[Path, Path]:
    first = job(folder, **env)
    assert first["results"] == RIGHT and counts(first)["writes"] == 2
    return programs(folder)


def refused_then_healed(folder: Path, reason: str, n: int, *, hits: int | None = None, **env: str) -> dict:
    """The next run refuses `n` entries for `reason` (and hits `hits`, by default the others), computes the right
    answers, and the run after it hits both."""
    out = job(folder, **env)
    assert out["results"] == RIGHT
    assert out["status"]["refused_entries"] == {reason: n}, out["stderr"][-2000:]
    hits = 2 - n if hits is None else hits
    assert counts(out)["hits"] == hits and counts(out)["misses"] == 2 - hits
    healed = job(folder, **env)
    assert healed["results"] == RIGHT and counts(healed)["hits"] == 2 and not healed["status"]["refused_entries"]
    return out


def test_swapped_keyed_entries_are_refused_misses_with_the_right_answers(tmp_path):
    # Regression (issue 24): two keyed entries swapped in the folder ran as each other: 2 hits, outputs exchanged.
    folder = tmp_path / "cache"
    doubled, shifted = warm(folder, XLAKIT_CACHE_KEY=KEY)
    a, b = doubled.read_bytes(), shifted.read_bytes()
    assert a.startswith(_C.AUTH_MAGIC) and b.startswith(_C.AUTH_MAGIC)
    doubled.write_bytes(b)
    shifted.write_bytes(a)
    # The tools say so without the key too: the stored key is not the file name.
    assert {r.name: r.status for r in cache_files.scan(folder, full=False) if r.is_entry} == {
        doubled.name: "key_mismatch", shifted.name: "key_mismatch"}
    assert {r.status for r in cache_files.scan(folder, full=True)} == {"key_mismatch", "parts"}  # and key records
    out = refused_then_healed(folder, "key_mismatch", 2, XLAKIT_CACHE_KEY=KEY)
    assert counts(out)["writes"] == 2 and "renamed, copied or swapped" in out["stderr"]


def test_a_renamed_or_copied_keyed_entry_is_a_refused_miss(tmp_path):
    # Regression (issue 24): an entry renamed to another program's name was loaded as that program.
    folder = tmp_path / "cache"
    doubled, shifted = warm(folder, XLAKIT_CACHE_KEY=KEY)
    doubled.replace(shifted)  # x*2's executable, under the name x+100 looks up (x*2's own is gone)
    refused_then_healed(folder, "key_mismatch", 1, hits=0, XLAKIT_CACHE_KEY=KEY)
    doubled, shifted = programs(folder)
    shutil.copyfile(shifted, doubled)  # x+100's executable, copied over x*2's
    refused_then_healed(folder, "key_mismatch", 1, XLAKIT_CACHE_KEY=KEY)


def test_without_a_key_a_swapped_entry_is_refused_too(tmp_path):
    # Regression (issue 24): the stored key is compared with or without XLAKIT_CACHE_KEY.
    folder = tmp_path / "cache"
    doubled, shifted = warm(folder)
    a, b = doubled.read_bytes(), shifted.read_bytes()
    doubled.write_bytes(b)
    shifted.write_bytes(a)
    refused_then_healed(folder, "key_mismatch", 2)


def _claiming(entry: bytes, payload_bytes: int) -> bytes:
    """`entry` (an empty payload) with its header claiming `payload_bytes`."""
    skip = 4 + 2 + 32 if entry.startswith(_C.AUTH_MAGIC) else 0
    at = len(entry) - 16  # u64 payload length, u64 checksum, no payload
    assert struct.unpack_from("<Q", entry, at)[0] == 0 and skip < at
    return entry[:at] + struct.pack("<Q", payload_bytes) + entry[at + 8:]


def test_a_huge_claimed_entry_is_refused_unread_with_bounded_memory(tmp_path):
    # Regression (issue 24): a sparse entry claiming a 3 GiB payload was read whole: RSS 4.5 GB, then refused.
    folder = tmp_path / "cache"
    doubled, _ = warm(folder, XLAKIT_CACHE_KEY=KEY)
    baseline = job(folder, XLAKIT_CACHE_KEY=KEY)["max_rss_kib"]
    info = _C.verify_entry(doubled.read_bytes())
    fields = {k: info[k] for k in ("platform_name", "platform_version", "torch_xla_revision", "patch_series_id")}
    header = _C.encode_entry(b"", kind="executable", key=KEY.encode(), cache_key=doubled.name, **fields)
    huge = 3 << 30
    with open(doubled, "r+b") as f:  # sparse: the claimed size is the file's size
        f.truncate(0)
        f.write(_claiming(header, huge))
        f.truncate(len(header) + huge)
    assert doubled.stat().st_size > _C.PJRT_DEFAULT_MAX_ENTRY_BYTES
    listed = {r.name: r.status for r in cache_files.scan(folder, full=False)}
    assert listed[doubled.name] == "ok"  # its header is consistent with the file: only the cap refuses it
    out = refused_then_healed(folder, "too_large", 1, XLAKIT_CACHE_KEY=KEY)
    assert out["max_rss_kib"] < baseline + (64 << 10)  # KiB: none of the 3 GiB was read
    assert "more than the 2147483648 an entry may have here" in out["stderr"]


def test_the_entry_size_cap_is_a_knob_and_a_bad_value_turns_the_cache_off(tmp_path):
    folder = tmp_path / "cache"
    warm(folder)
    small = {_C.PJRT_CACHE_MAX_ENTRY_BYTES_ENV: "1000"}
    out = job(folder, **small)
    assert out["results"] == RIGHT and out["status"]["refused_entries"] == {"too_large": 2}
    assert counts(out)["writes"] == 0 and counts(out)["write_failures"] == 2  # nothing written it would refuse
    bad = job(tmp_path / "other", **{_C.PJRT_CACHE_MAX_ENTRY_BYTES_ENV: "2G"})
    assert not bad["status"]["cache"]["on"] and "XLAKIT_PJRT_CACHE_MAX_ENTRY_BYTES='2G'" in \
        bad["status"]["cache"]["why_off"]
    assert bad["results"] == RIGHT and not (tmp_path / "other").exists()


def _format1(entry: bytes, key: bytes | None) -> bytes:
    """The entry as xlakit wrote it before format 2: four identity strings, no cache key."""
    info = _C.verify_entry(entry)
    body = b"XLKC" + struct.pack("<HBB", 1, 1, 0)
    for field in ("platform_name", "platform_version", "torch_xla_revision", "patch_series_id"):
        raw = info[field].encode()
        body += struct.pack("<H", len(raw)) + raw
    payload = entry[len(entry) - info["payload_length"]:]
    body += struct.pack("<Q", len(payload))
    h = 14695981039346656037
    for c in body + payload:
        h = ((h ^ c) * 1099511628211) & (2**64 - 1)
    inner = body + struct.pack("<Q", h) + payload
    if key is None:
        return inner
    return _C.AUTH_MAGIC + struct.pack("<H", 1) + hmac.new(key, inner, "sha256").digest() + inner


@pytest.mark.parametrize("key", [None, KEY])
def test_an_old_format_entry_is_a_counted_refused_miss(tmp_path, key):
    # Regression guard (issue 24): format-1 entries, not bound to their key, must never load (nor crash).
    folder = tmp_path / "cache"
    env = {"XLAKIT_CACHE_KEY": key} if key else {}
    doubled, _ = warm(folder, **env)
    old = _format1(doubled.read_bytes(), key.encode() if key else None)
    doubled.write_bytes(old)
    assert _C.verify_entry(old, key=key.encode() if key else None)["status"] == "old_format"
    report = {r.name: r for r in cache_files.scan(folder, full=True)}[doubled.name]
    assert report.status == "old_format" and "an older xlakit wrote it" in report.message
    prune = subprocess.run([sys.executable, "-m", "xlakit", "cache", "prune", "--dry-run", str(folder)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert prune.returncode == 0 and f"would remove: {doubled.name} (old_format)" in prune.stdout, prune.stderr
    out = refused_then_healed(folder, "old_format", 1, **env)
    assert "envelope format 1" in out["stderr"]


def test_the_tools_report_a_stored_key_that_is_not_the_file_name(tmp_path):
    # Regression (issue 24): `xlakit cache verify` called a renamed entry loadable.
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    name, other = "a" * 64, "b" * 64
    fields = dict(kind="executable", platform_name="cpu", platform_version="v", torch_xla_revision="",
                  patch_series_id="pjrt-wrap/1")
    (folder / name).write_bytes(_C.encode_entry(b"exe", cache_key=name, **fields))
    (folder / other).write_bytes(_C.encode_entry(b"exe", cache_key=name, **fields))
    (folder / "123").write_bytes(_C.encode_entry(b"exe", **fields))  # the patched torch_xla stores no key
    (folder / "456").write_bytes(_C.encode_entry(b"exe", cache_key=name, **fields))
    (folder / ("c" * 64)).write_bytes(_C.encode_entry(b"exe", **fields))  # no key under a wrapper name
    for full in (False, True):
        got = {r.name: r.status for r in cache_files.scan(folder, full=full)}
        assert got == {name: "ok", other: "key_mismatch", "123": "ok", "456": "key_mismatch",
                       "c" * 64: "key_mismatch"}, full
    run = subprocess.run([sys.executable, "-m", "xlakit", "cache", "verify", str(folder)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "python")})
    assert run.returncode == 1 and "key_mismatch" in run.stdout and "not its file name" in run.stdout, run.stderr
