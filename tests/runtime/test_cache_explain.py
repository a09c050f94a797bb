"""Misses explained (issue 24 item 6): the key records beside the PJRT wrapper's entries, `xlakit cache explain`
and the wrapper's miss log (XLAKIT_PJRT_CACHE_EXPLAIN=1).

Real plugins in fresh processes, as in test_cache_keys: stock torch_xla 2.9 on xla-cpu-pjrt (HLO programs) and
jax 0.10 on lammps-jax-pjrt-cpu (MLIR) through the wrapper. Folders of junk are made by hand: the reader must
never crash on them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.test_cache_keys import PYTHONPATH, counts, job, run
from tests.support import pjrt_job
from xlakit.runtime import cache_explain, pjrt_wrap
from xlakit.runtime.compile_cache import key_id

SUFFIX = cache_explain.PARTS_SUFFIX


def torch_env(**env: str) -> dict[str, str]:
    return dict(XLAKIT_TEST_REAL_PLUGIN=str(pjrt_wrap.library_path()), XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(),
                **env)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlakit", "cache", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": PYTHONPATH})


def explain_json(folder: Path, *args: str) -> dict:
    done = cli("explain", str(folder), "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def miss_lines(out: dict) -> list[str]:
    return [line for line in out["stderr"].splitlines() if "xlakit-pjrt: cache miss, module " in line]


def records(folder: Path) -> dict[str, dict]:
    return {p.name[:64]: json.loads(p.read_text()) for p in folder.iterdir() if p.name.endswith(SUFFIX)}


# -- what the wrapper records ------------------------------------------------------------------------------

@pytest.mark.pjrt
@pytest.mark.slow
def test_each_entry_records_its_key_parts_and_no_secret(tmp_path):
    folder = tmp_path / "cache"
    secret, key = "libtpu-token-hunter2-zq", os.urandom(24).hex()
    out = job("jax", folder, LIBTPU_INIT_ARGS=f"--xla_tpu_secret_arg={secret}", XLAKIT_CACHE_KEY=key,
              XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    entries = {p.name for p in folder.iterdir() if len(p.name) == 64}
    recorded = records(folder)
    assert set(recorded) == entries and len(entries) == counts(out)["writes"] > 0  # one record per entry
    step = [r for r in recorded.values() if r["module"] == "jit_step"]  # jax's module name, found in bytecode
    assert len(step) == 1 and step[0]["program_format"] == "mlir"
    for name, r in recorded.items():
        assert r["entry"] == name and r["format"] == cache_explain.PARTS_FORMAT
        assert set(r["parts"]) == set(cache_explain.EXPLAINED)  # no constant-free hash for MLIR
        assert r["parts"]["key_id"] == key_id(key.encode()) and r["parts"]["wrapper_version"] == "3"
        assert r["details"]["XLA_FLAGS"] == "sorted: --xla_cpu_enable_fast_math=false"
        assert "LIBTPU_INIT_ARGS" not in r["details"]
    text = "".join(p.read_text() for p in folder.iterdir() if p.name.endswith(SUFFIX))
    assert secret not in text and key not in text
    # The layout the wrapper's own reader (csrc/pjrt_wrap/key_record.cc ParseKeyRecord) relies on: one field a line.
    layout = re.compile(r'[{}]|  \}|  \},|  "\w+": \{|  ( {2})?"\w+": ("[^"\\]*"|[0-9.]+),?')
    assert all(layout.fullmatch(line) for line in text.splitlines()), text[:2000]
    # Recorded, not keyed: the same job hits every entry (the key did not change with the records). A mistyped
    # XLAKIT_PJRT_CACHE_EXPLAIN is said and leaves the cache on.
    again = job("jax", folder, LIBTPU_INIT_ARGS=f"--xla_tpu_secret_arg={secret}", XLAKIT_CACHE_KEY=key,
                XLA_FLAGS="--xla_cpu_enable_fast_math=false", XLAKIT_PJRT_CACHE_EXPLAIN="maybe")
    assert counts(again)["hits"] == counts(again)["compiles"] and again["results"] == out["results"]
    assert "XLAKIT_PJRT_CACHE_EXPLAIN='maybe': expected 1 or 0" in again["stderr"]
    assert "misses go unexplained" in again["stderr"]


# -- a changed flag ----------------------------------------------------------------------------------------

@pytest.mark.pjrt
@pytest.mark.slow
def test_explain_and_the_miss_log_name_a_changed_xla_flag(tmp_path):
    folder = tmp_path / "cache"
    first = job("torch_xla", folder, **torch_env(XLAKIT_PJRT_CACHE_EXPLAIN="1",
                                                  XLA_FLAGS="--xla_cpu_enable_fast_math=false"))
    assert miss_lines(first) and all("no entry of this module yet" in line for line in miss_lines(first)[:1])
    assert all(r["module"].startswith("SyncTensorsGraph.") and "program_without_constants" in r["parts"]
               for r in records(folder).values())  # torch_xla's HLO module names; HLO gets the constant-free hash
    second = job("torch_xla", folder, **torch_env(XLAKIT_PJRT_CACHE_EXPLAIN="1",
                                                   XLA_FLAGS="--xla_cpu_enable_fast_math=true"))
    assert counts(second)["hits"] == 0
    named = [line for line in miss_lines(second) if "XLA_FLAGS (this job: --xla_cpu_enable_fast_math=true; "
             "the entry: --xla_cpu_enable_fast_math=false)" in line]
    assert named, second["stderr"][-3000:]
    out = explain_json(folder)
    assert out["findings"], out
    for f in out["findings"]:  # each module's newest entry: its twin of the first run is the nearest
        assert [d["part"] for d in f["differences"]] == ["XLA_FLAGS"], f
        assert "--xla_cpu_enable_fast_math=true" in f["differences"][0]["words"]
        assert "--xla_cpu_enable_fast_math=false" in f["differences"][0]["words"]
        assert not f["constant_trap"]
    text = cli("explain", str(folder))
    assert text.returncode == 0 and "XLA_FLAGS: this entry has --xla_cpu_enable_fast_math=true" in text.stdout
    # Without the variable the wrapper says nothing at a miss.
    quiet = job("torch_xla", folder, **torch_env(XLA_FLAGS="--xla_cpu_enable_fast_math=false "
                                                           "--xla_cpu_fast_math_honor_nans=false"))
    assert counts(quiet)["misses"] > 0 and not miss_lines(quiet)


# -- the constant trap -------------------------------------------------------------------------------------

_TRAP = """
import json, os, sys
import torch, torch_xla
import torch_xla.experimental.plugins as plugins
from xlakit.runtime import pjrt_wrap


class XlaCpuPlugin(plugins.DevicePlugin):
    def library_path(self):
        return os.environ["XLAKIT_TEST_REAL_PLUGIN"]


os.environ["PJRT_DEVICE"] = "XLACPU"
plugins.use_dynamic_plugins()
plugins.register_plugin("XLACPU", XlaCpuPlugin())
device = torch_xla.device()
w = torch.linspace(0.5, 2.0, int(sys.argv[1]), device=device)
base = (w.mean() * 0.5).item()  # a Python number read back from the device
for step in range(int(sys.argv[2])):
    y = w.pow(base + step).sum()  # baked into each step's graph as a constant: a new program per step
    torch_xla.sync()
print(json.dumps({"results": [], "status": pjrt_wrap.status()}))
"""


@pytest.mark.pjrt
@pytest.mark.slow
def test_explain_names_the_constant_trap_of_a_python_number_baked_into_the_graph(tmp_path):
    folder = tmp_path / "cache"
    script = tmp_path / "trap.py"
    script.write_text(_TRAP)
    out = run([str(script), "8", "4"], folder, **torch_env(XLAKIT_PJRT_CACHE_EXPLAIN="1"))
    trap = [line for line in miss_lines(out) if "differs in only the program's constants: the constant trap" in line]
    assert trap and "capturable=True" in trap[0], out["stderr"][-3000:]
    found = explain_json(folder)["findings"]
    (f,) = [f for f in found if f["constant_trap"]]
    assert [d["part"] for d in f["differences"]] == ["constants"] and f["constant_only"]
    assert f["constant_pairs"] == f["pairs"] >= 1 and "capturable=True" in f["fix"]
    text = cli("explain", str(folder)).stdout
    assert "differ only in the program's constants: the constant trap" in text
    assert "torch.optim.AdamW(..., capturable=True)" in text
    # Another shape is another program, not the trap: one step of it, explained against the entries above.
    before = set(records(folder))
    run([str(script), "16", "1"], folder, **torch_env())
    new = set(records(folder)) - before
    assert new
    for name in new:
        (g,) = explain_json(folder, "--entry", name[:20])["findings"]
        assert g["nearest"] in before and not g["constant_only"], g
        assert [d["part"] for d in g["differences"]] == ["program"], g


# -- tools around the folder -------------------------------------------------------------------------------

@pytest.mark.pjrt
@pytest.mark.slow
def test_prune_removes_records_with_their_entries_and_verify_passes(tmp_path):
    folder = tmp_path / "cache"
    job("jax", folder)
    entries = sorted(p for p in folder.iterdir() if len(p.name) == 64)
    assert len(entries) >= 3 and all((folder / (p.name + SUFFIX)).is_file() for p in entries)
    verify = cli("verify", str(folder))
    assert verify.returncode == 0 and "key records" in verify.stdout and "parts" in verify.stdout, verify.stdout
    corrupt, dropped = entries[0], entries[1]
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    dropped.unlink()  # by hand: its record stays behind, stale
    assert f"{dropped.name}{SUFFIX}" in cli("ls", str(folder)).stdout
    dry = cli("prune", str(folder), "--dry-run")
    assert f"would remove: {dropped.name}{SUFFIX}" in dry.stdout
    assert f"would remove: {corrupt.name}{SUFFIX}" in dry.stdout
    assert (folder / (dropped.name + SUFFIX)).exists()
    prune = cli("prune", str(folder))
    assert prune.returncode == 0, prune.stderr
    left = {p.name for p in folder.iterdir()}
    assert corrupt.name not in left and corrupt.name + SUFFIX not in left and dropped.name + SUFFIX not in left
    assert {e.name for e in entries[2:]} | {e.name + SUFFIX for e in entries[2:]} == left
    assert cli("verify", str(folder)).returncode == 0


def _record(entry: str, module: str, when: float, **parts: str) -> str:
    base = {p: "0" * 32 for p in cache_explain.EXPLAINED}
    base.update(parts)
    return json.dumps({"format": cache_explain.PARTS_FORMAT, "entry": entry, "module": module,
                       "program_format": "hlo", "written_unix_s": when, "parts": base,
                       "details": {"XLA_FLAGS": "sorted: --a=1" if parts.get("XLA_FLAGS") else "sorted:"}})


def test_explain_never_crashes_on_junk_missing_or_lonely_records(tmp_path):
    folder = tmp_path / "junk"
    folder.mkdir()
    a, b, c, d, e = (ch * 64 for ch in "abcde")
    (folder / (a + SUFFIX)).write_text(_record(a, "m", 1.0))  # records whose entries are gone (pruned by hand)
    (folder / (b + SUFFIX)).write_text(_record(b, "m", 2.0, XLA_FLAGS="1" * 32))
    (folder / (c + SUFFIX)).write_bytes(b"\x00\xff not json")
    (folder / (d + SUFFIX)).write_text(_record(a, "m", 3.0))  # copied under another entry's name
    (folder / (e + SUFFIX)).mkdir()  # a folder under a record's name
    (folder / ("f" * 64)).write_bytes(b"an entry without a record")
    (folder / ("0" * 64 + SUFFIX)).write_text(json.dumps({"format": cache_explain.PARTS_FORMAT, "entry": "0" * 64,
                                                           "parts": [1, 2]}))
    (folder / ("1" * 64 + SUFFIX)).write_bytes(b"{" * (cache_explain.MAX_PARTS_BYTES + 10))
    (folder / "README").write_text("not ours")
    out = explain_json(folder)
    (f,) = out["findings"]
    assert f["entry"] == b and f["nearest"] == a and [x["part"] for x in f["differences"]] == ["XLA_FLAGS"]
    notes = "\n".join(out["notes"])
    for name, why in ((c, "not JSON"), (d, "not its name's"), (e, "not a plain file"), ("0" * 64, "not a map"),
                      ("1" * 64, "not a plain file of at most")):
        (line,) = [n for n in out["notes"] if n.startswith(f"ignored {name}{SUFFIX}: ")]
        assert why in line, notes
    assert "1 entries have no key record" in notes
    assert cli("explain", str(folder)).returncode == 0
    listing = cli("ls", str(folder)).stdout
    assert "stale_parts" in listing and "corrupt" not in listing and "named like a key record, but not JSON" in listing
    # Prune removes the records of entries no longer there, and nothing that is not a record.
    assert cli("prune", str(folder)).returncode == 0
    left = {p.name for p in folder.iterdir()}
    assert a + SUFFIX not in left and b + SUFFIX not in left
    assert {n + SUFFIX for n in (c, d, e, "0" * 64, "1" * 64)} | {"README", "f" * 64} == left
    # An empty folder, and an entry asked for by a name nothing has.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no key records to compare" in cli("explain", str(empty)).stdout
    missing = cli("explain", str(folder), "--entry", "9" * 10)
    assert missing.returncode == 2 and "expected one entry named" in missing.stderr
    assert "Traceback" not in missing.stderr
    # The reading takes records from anywhere (a bucket's listing, later): a list of (name, record) pairs.
    record, why = cache_explain.parse_record(a + SUFFIX, _record(a, "m", 1.0).encode())
    assert why == "" and cache_explain.explain([(a, record)])[0].nearest is None
    assert cache_explain.explain([("x", None), ("y", {"parts": "junk"})]) == []


def test_a_hostile_record_is_ignored_and_printed_harmlessly(tmp_path):
    # Attack findings: a record nested 60,000 deep crashed every `xlakit cache` command (RecursionError);
    # a record's text reached the terminal raw (escape sequences); a record beside a symlinked entry was
    # called kept by `ls` and removed by `prune`; prune's summary did not count the records it removed.
    from xlakit.runtime import cache_explain, cache_files

    name = "a" * 64
    assert cache_explain.parse_record(name + ".parts.json", b"[" * 60000)[0] is None
    record = {"format": cache_explain.PARTS_FORMAT, "entry": name, "module": "m\x1b]0;pwned\x07",
              "written_unix_s": float("nan"), "parts": {"program": "1"}, "details": {"XLA_FLAGS": "x\x1b[2J\ud800"}}
    parsed, _ = cache_explain.parse_record(name + ".parts.json", json.dumps(record).encode())
    assert parsed["written_unix_s"] == 0 and parsed["module"].isprintable()
    assert all(v.isprintable() and v.encode("utf-8") for v in parsed["details"].values())
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    (folder / (name + ".parts.json")).write_text(json.dumps(record))
    (folder / name).symlink_to(tmp_path / "elsewhere")  # an entry name taken by a link (dangling)
    (folder / ("b" * 64 + ".parts.json")).write_bytes(b"[" * 60000)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    for command in (["ls"], ["verify"], ["explain"], ["prune"]):
        run = subprocess.run([sys.executable, "-m", "xlakit", "cache", *command, str(folder)], env=env,
                             capture_output=True, text=True, timeout=120)
        assert "Traceback" not in run.stderr and "\x1b" not in run.stdout, (command, run.stderr[-2000:])
    assert (folder / (name + ".parts.json")).exists()  # its entry's name is taken: never a stale record
    assert cache_files.stale_parts(folder) == []


@pytest.mark.pjrt
@pytest.mark.slow
def test_the_wrappers_miss_line_escapes_a_hostile_records_text(tmp_path):
    # A record is text from the folder: what the wrapper's own miss line quotes of it (another entry's
    # XLA_FLAGS) must not carry an escape sequence to the terminal, raw ESC, C1 CSI (U+009B) or bad UTF-8.
    folder = tmp_path / "cache"
    job("torch_xla", folder, **torch_env(XLA_FLAGS="--xla_cpu_enable_fast_math=false"))
    hostile = " --x=\x1b]0;pwned\x07 --y=\x9b2J --z=caf\u00e9"  # ESC, BEL, C1 CSI; and a plain accent
    for name, record in records(folder).items():  # each becomes another entry's record, its flags hostile
        other = format(int(name, 16) ^ 1, "064x")
        record.update(entry=other, details={**record["details"],
                                            "XLA_FLAGS": record["details"]["XLA_FLAGS"] + hostile})
        record["parts"]["XLA_FLAGS"] = "f" * 32
        (folder / (other + SUFFIX)).write_bytes(json.dumps(record, indent=2, ensure_ascii=False).encode())
        (folder / (name + SUFFIX)).unlink()
        (folder / name).unlink()
    second = job("torch_xla", folder, **torch_env(XLAKIT_PJRT_CACHE_EXPLAIN="1",
                                                   XLA_FLAGS="--xla_cpu_enable_fast_math=false"))
    lines = [line for line in miss_lines(second) if "XLA_FLAGS" in line]
    assert lines, second["stderr"][-3000:]
    for line in lines:
        assert "\x1b" not in line and "\x07" not in line and "\u009b" not in line, repr(line)
        assert "\\x1b]0;pwned\\x07" in line and "\\xc2\\x9b2J" in line and "caf\u00e9" in line, repr(line)

