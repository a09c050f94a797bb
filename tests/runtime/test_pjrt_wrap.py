"""xlakit's PJRT wrapping plugin on real PJRT C API plugins, in fresh processes.

Every hit/miss test runs a real framework on a real plugin from PyPI (no fake
plugin): jax 0.10 on lammps-jax-pjrt-cpu (XLA's CPU plugin, C API 0.115) and
stock torch_xla 2.9 on OpenXLA's xla-cpu-pjrt (C API 0.81). A first process
compiles and writes entries; a second one must load them without compiling,
with results bit-exact. The one fake is a plugin of another major C API
version, which no registry ships.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import pjrt_job
from xlakit import _C
from xlakit.runtime import pins, cache_files, pjrt_wrap
from tests.support import REPO

ROOT = REPO
JOB = Path(pjrt_job.__file__)
# This checkout's xlakit first (an editable install may point at another checkout), then `tests`.
PYTHONPATH = os.pathsep.join([str(ROOT / "python"), str(ROOT)])
XLA_CPU_PLUGIN = pjrt_job.xla_cpu_plugin() if importlib.util.find_spec("xla_plugins") else ""
KEY1, KEY2 = "k" * 40, "q" * 40
# The xlakit under test first (a worktree's), then the repository for `tests`: PYTHONPATH=ROOT alone
# imported whichever xlakit the environment had installed.
PYTHONPATH = os.pathsep.join([str(Path(pjrt_wrap.__file__).resolve().parents[2]), str(ROOT)])

pytestmark = [pytest.mark.pjrt, pytest.mark.slow]


def job(framework: str, env: dict[str, str] | None = None, *args: str, ok: bool = True,
        preexec=None) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")}
    base.update(PYTHONPATH=PYTHONPATH, **(env or {}))
    run = subprocess.run([sys.executable, str(JOB), framework, *args], env=base, capture_output=True, text=True,
                         timeout=240, preexec_fn=preexec)
    if not ok:
        assert run.returncode != 0, run.stdout
        return {"stderr": run.stderr}
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    out["stderr"] = run.stderr
    return out


def cache_env(folder: Path, **extra: str) -> dict[str, str]:
    return {"XLAKIT_PJRT_CACHE_DIR": str(folder), **extra}


def entries(folder: Path) -> dict[str, bytes]:
    """The wrapper's entries by name, in the order they were written."""
    found = sorted((p for p in folder.iterdir() if len(p.name) == 64), key=lambda p: p.stat().st_mtime_ns)
    return {p.name: p.read_bytes() for p in found}


def payload(entry: bytes) -> bytes:
    """The serialized executable inside an entry (plain or authenticated)."""
    info = _C.verify_entry(entry)
    return entry[len(entry) - info["payload_length"]:]


def plain(entry: bytes) -> bytes:
    """The plain entry inside an authenticated one: its tag dropped."""
    return entry[4 + 2 + 32:] if entry.startswith(_C.AUTH_MAGIC) else entry


def reencode(entry: bytes, new_payload: bytes, **override: str) -> bytes:
    info = _C.verify_entry(entry)
    fields = {k: info[k] or "" for k in ("platform_name", "platform_version", "torch_xla_revision",
                                         "patch_series_id", "cache_key")}
    fields.update(override)
    return _C.encode_entry(new_payload, kind="executable", **fields)


def test_jax_restart_hits_bit_exact_and_counted(tmp_path):
    folder = tmp_path / "cache"
    first = job("jax", cache_env(folder))
    c1 = first["status"]["counts"]
    assert first["status"]["active"] and first["status"]["plugin_api"] == "0.115"
    assert c1["compiles"] >= 2 and c1["misses"] == c1["compiles"] == c1["writes"] and c1["hits"] == 0
    assert f"compile cache {folder} (owner-only)" in first["stderr"]
    written = entries(folder)
    assert len(written) == c1["writes"]
    assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {"0o600"}

    second = job("jax", cache_env(folder))
    c2 = second["status"]["counts"]
    assert c2["hits"] == c2["compiles"] == c1["compiles"]  # the real compile was never called
    assert c2["misses"] == c2["writes"] == 0 and c2["compile_s"] == 0 and c2["load_s"] > 0
    assert second["results"] == first["results"]
    assert entries(folder) == written

    # The cache tools read the wrapper's entries as the runtime does.
    reports = [r for r in cache_files.scan(folder, full=True) if r.status != "parts"]  # each entry's key record
    assert [r.status for r in reports] == ["ok"] * len(written)
    assert {(r.platform_name, r.patch_series_id) for r in reports} == {("cpu", f"pjrt-wrap/{first['status']['wrapper_version']}")}


def test_bad_entries_are_counted_misses_and_the_job_computes_right(tmp_path):
    folder = tmp_path / "cache"
    first = job("jax", cache_env(folder))
    names = sorted(entries(folder))
    assert len(names) >= 4
    corrupt, truncated, other_platform, foreign = names[:4]
    data = (folder / corrupt).read_bytes()
    (folder / corrupt).write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    data = (folder / truncated).read_bytes()
    (folder / truncated).write_bytes(data[: len(data) // 2])
    data = (folder / other_platform).read_bytes()
    (folder / other_platform).write_bytes(reencode(data, payload(data), platform_name="tpu"))
    (folder / foreign).write_bytes(b"not an entry at all")
    # `xlakit cache verify` judges them as the wrapper will.
    verdicts = {r.name: r.status for r in cache_files.scan(folder, full=True)}
    assert [verdicts[n] for n in (corrupt, truncated, foreign)] == ["checksum_mismatch", "truncated", "foreign"]
    assert verdicts[other_platform] == "ok"  # without an identity the tool cannot know the platform is wrong

    second = job("jax", cache_env(folder))
    refused = second["status"]["refused_entries"]
    assert refused == {"checksum_mismatch": 1, "truncated": 1, "platform_mismatch": 1, "bad_magic": 1}
    c = second["status"]["counts"]
    assert c["misses"] == 4 and c["hits"] == c["compiles"] - 4 and c["writes"] == 4
    assert second["results"] == first["results"]
    # Each refused entry was replaced by the new compile's; a third process hits everything.
    third = job("jax", cache_env(folder))
    assert third["status"]["counts"]["hits"] == third["status"]["counts"]["compiles"]


def test_keyed_entries_refuse_tampering_other_keys_and_untagged(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = job("jax", cache_env(a, XLAKIT_CACHE_KEY=KEY1))
    assert first["status"]["cache"]["authenticated"]
    signed = entries(a)
    assert all(e.startswith(_C.AUTH_MAGIC) for e in signed.values())
    # Another key: other names, so the two jobs never use or replace each other's entries.
    other = job("jax", cache_env(b, XLAKIT_CACHE_KEY=KEY2))
    assert other["results"] == first["results"] and not set(entries(b)) & set(signed)
    # Key-1 entries planted under the names a key-2 job looks up (both jobs compile the same programs in
    # the same order; serialized executables differ between processes, so the order pairs them): refused.
    c.mkdir(mode=0o700)
    for name, entry in zip(entries(b), signed.values(), strict=True):
        (c / name).write_bytes(entry)
        (c / name).chmod(0o600)
    planted = job("jax", cache_env(c, XLAKIT_CACHE_KEY=KEY2))
    assert planted["status"]["refused_entries"] == {"bad_tag": len(signed)}
    assert planted["results"] == first["results"]

    # Tampered: another real executable under the old tag, the inner checksum recomputed
    # (a job without the key would load it); untagged: a plain entry in a keyed job's folder.
    (tampered, victim), untagged = sorted(signed)[:2], sorted(signed)[2]
    donor = signed[victim]
    forged = signed[tampered][:4 + 2 + 32] + reencode(plain(signed[tampered]), payload(donor))
    (a / tampered).write_bytes(forged)
    assert _C.verify_entry(plain(forged))["status"] == "ok"
    (a / untagged).write_bytes(plain(signed[untagged]))
    again = job("jax", cache_env(a, XLAKIT_CACHE_KEY=KEY1))
    assert again["status"]["refused_entries"] == {"bad_tag": 1, "unauthenticated": 1}
    assert again["status"]["counts"]["hits"] == len(signed) - 2
    assert again["results"] == first["results"]


def test_a_changed_program_misses_and_read_only_writes_nothing(tmp_path):
    folder = tmp_path / "cache"
    job("jax", cache_env(folder))
    before = entries(folder)
    changed = job("jax", cache_env(folder, XLAKIT_PJRT_CACHE_READ_ONLY="1"), "--variant", "1")
    c = changed["status"]["counts"]
    assert c["misses"] >= 1 and c["hits"] >= 1 and c["writes"] == 0  # the step changed, the sum did not
    assert entries(folder) == before
    reference = job("jax", {}, "--variant", "1")  # no cache at all
    assert reference["status"]["counts"]["bypassed"] == reference["status"]["counts"]["compiles"]
    assert changed["results"] == reference["results"]


def test_a_folder_others_can_write_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o770)
    out = job("jax", cache_env(folder))
    cache = out["status"]["cache"]
    assert not cache["on"] and cache["folder"] == "untrusted"
    assert "writable by group" in cache["why_off"] and "chmod g-w" in cache["why_off"]
    assert out["status"]["counts"]["bypassed"] == out["status"]["counts"]["compiles"]
    assert not list(folder.iterdir())
    # The same rule, and the same words, as enable_persistent_cache (one implementation).
    with pytest.raises(Exception, match="writable by group"):
        from xlakit.runtime import compile_cache

        compile_cache._trusted(folder, trust_shared=False)


def test_a_full_disk_is_a_counted_write_failure(tmp_path):
    import resource
    import signal

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # stays ignored across exec: writes fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    folder = tmp_path / "cache"
    out = job("jax", cache_env(folder), preexec=small_files)
    c = out["status"]["counts"]
    assert c["write_failures"] >= 1 and c["writes"] + c["write_failures"] == c["misses"]
    assert "cannot write cache entry" in out["stderr"]
    assert all(p.stat().st_size <= 4096 for p in folder.iterdir())  # no temporary left
    assert not [p for p in folder.iterdir() if p.name.startswith(_C.TEMP_PREFIX)]
    assert out["results"] == job("jax", {})["results"]


def _fake_plugin(tmp_path: Path, major: int) -> Path:
    # A stand-in for a plugin of another C API major version (none is published): only its version is read.
    src = tmp_path / "fake.c"
    src.write_text(textwrap.dedent(f"""
        #include <stddef.h>
        struct version {{ size_t struct_size; void* ext; int major; int minor; }};
        struct api {{ size_t struct_size; void* ext; struct version v; void* fns[200]; }};
        static struct api a = {{sizeof(struct api), 0, {{sizeof(struct version), 0, {major}, 3}}, {{0}}}};
        const struct api* GetPjrtApi(void) {{ return &a; }}
    """))
    lib = tmp_path / "libfake_pjrt.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_a_plugin_of_another_major_version_or_none_is_refused_with_the_reason(tmp_path):
    fake = _fake_plugin(tmp_path, major=1)
    out = job("jax", {"XLAKIT_PJRT_PLUGIN": str(fake)}, ok=False)
    assert "implements PJRT C API 1.3, and this wrapper was built for 0.80" in out["stderr"]
    missing = job("jax", {"XLAKIT_PJRT_PLUGIN": str(tmp_path / "nowhere.so")}, ok=False)
    assert "cannot load the real plugin" in missing["stderr"] and "XLAKIT_PJRT_PLUGIN" in missing["stderr"]


def test_torch_xla_restart_hits_through_enable_persistent_cache(tmp_path):
    root = tmp_path / "cache"
    first = job("torch_xla", {}, "--enable", str(root))
    folder = root / "pjrt-xlacpu"
    s1 = first["status"]
    assert s1["active"] and s1["plugin_api"] == "0.81" and s1["cache"]["dir"] == str(folder)
    c1 = s1["counts"]
    assert c1["misses"] == c1["compiles"] == c1["writes"] >= 2
    # Stock torch_xla 2.9 passes an 80-byte PJRT_ExecuteOptions, which this plugin refuses; the wrapper pads it.
    assert c1["execute_options_padded"] >= 1
    assert first["cache_stats"]["via"] == "pjrt-wrap" and first["cache_stats"]["misses"] == c1["misses"]

    # Compiler flags torch_xla's plugin reads from the environment are part of the key: a miss, right values.
    fast = job("torch_xla", {"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"}, "--enable", str(root))
    assert fast["status"]["counts"]["hits"] == 0

    second = job("torch_xla", {}, "--enable", str(root))
    c2 = second["status"]["counts"]
    assert c2["hits"] == c2["compiles"] == c1["compiles"] and c2["misses"] == 0
    assert second["results"] == first["results"]
    assert second["cache_stats"]["hits"] == c2["hits"]
    # What a run log and `xlakit doctor` say of it.
    assert f"| pjrt-wrap 0.81 cache {c2['hits']} hits 0 misses" in second["manifest_line"]
    assert second["doctor"].startswith(f"ok    pjrt wrapper: wrapping {XLA_CPU_PLUGIN} (PJRT C API 0.81; built for 0.80)")
    assert f"{c2['hits']} hits, 0 misses (0 refused entries)" in second["doctor"]

    # The same entries serve a job that turns the wrapper on through the environment alone.
    env_only = job("torch_xla", {"XLAKIT_TEST_REAL_PLUGIN": str(pjrt_wrap.library_path()),
                                 "XLAKIT_PJRT_PLUGIN": XLA_CPU_PLUGIN,
                                 "XLAKIT_PJRT_CACHE_DIR": str(folder)})
    assert env_only["status"]["counts"]["hits"] == c1["compiles"]
    assert env_only["results"] == first["results"]


def test_the_default_plugin_is_the_libtpu_installed_beside_xlakit(tmp_path):
    # A site-packages of its own: the wrapper in xlakit/_lib, a real plugin installed as libtpu/libtpu.so.
    site = tmp_path / "site"
    (site / "xlakit" / "_lib").mkdir(parents=True)
    (site / "libtpu").mkdir()
    wrapper = site / "xlakit" / "_lib" / pjrt_wrap.LIBRARY.name
    wrapper.write_bytes(pjrt_wrap.LIBRARY.read_bytes())
    script = textwrap.dedent(f"""
        import ctypes, json, os
        lib = ctypes.CDLL({str(wrapper)!r})
        lib.GetPjrtApi.restype = ctypes.c_void_p
        lib.GetPjrtApi()
        lib.xlakit_pjrt_wrap_status.restype = ctypes.c_size_t
        buf = ctypes.create_string_buffer(1 << 16)
        lib.xlakit_pjrt_wrap_status(buf, 1 << 16)
        print(buf.value.decode())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")}

    def status() -> dict:
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return {**json.loads(run.stdout), "stderr": run.stderr}

    none = status()
    assert not none["active"] and "XLAKIT_PJRT_PLUGIN is unset and no libtpu is installed beside xlakit" in \
        none["refused"]
    os.symlink(pjrt_job.lammps_plugin(), site / "libtpu" / "libtpu.so")
    found = status()
    assert found["active"] and found["plugin"] == str(site / "libtpu" / "libtpu.so")
    assert found["plugin_from"] == "default: the libtpu installed beside xlakit"
    assert "compile cache off: no cache folder (XLAKIT_PJRT_CACHE_DIR unset or empty)" in found["stderr"]


def test_a_linked_entry_is_refused_and_concurrent_jobs_agree(tmp_path):
    folder = tmp_path / "cache"
    runs = [subprocess.Popen([sys.executable, str(JOB), "jax"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**{k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")},
                                             "PYTHONPATH": PYTHONPATH, **cache_env(folder)}) for _ in range(2)]
    outs = [r.communicate(timeout=240) for r in runs]
    assert all(r.returncode == 0 for r in runs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1])["results"] for o in outs]
    assert results[0] == results[1]
    assert all(r.status == "ok" for r in cache_files.scan(folder, full=True) if r.is_entry)
    # An entry that is a symbolic link is never followed (O_NOFOLLOW): refused, compiled instead.
    name, data = next(iter(entries(folder).items()))
    (tmp_path / "elsewhere").write_bytes(data)
    (folder / name).unlink()
    os.symlink(tmp_path / "elsewhere", folder / name)
    linked = job("jax", cache_env(folder))
    assert linked["status"]["refused_entries"] == {"unreadable": 1}
    assert linked["results"] == results[0]


def test_each_entry_is_judged_as_it_is_read_and_a_bad_one_is_only_a_miss(tmp_path):
    # Issue 24 item 7: a start judges the folders only (no stat per entry); each entry is judged on the
    # descriptor it is read from. One others can write, or another user's, is a refused miss with its fix,
    # and the cache stays on for every other entry (it used to turn the whole cache off).
    folder = tmp_path / "cache"
    first = job("jax", cache_env(folder))
    names = list(entries(folder))
    assert len(names) >= 2, names
    (folder / names[0]).chmod(0o666)
    bad = [folder / names[0]]
    if os.geteuid() == 0:  # giving a file to another user needs root
        os.chown(folder / names[1], 65534, 65534)
        bad.append(folder / names[1])
    from xlakit.runtime import cache_trust  # the tools judge every file for their report, by the same rule

    assert not cache_trust.judge(folder).trusted and cache_trust.judge(folder, entries=False).trusted
    out = job("jax", cache_env(folder))
    cache = out["status"]["cache"]
    assert cache["on"] and cache["folder"] == "owner-only", cache
    assert out["status"]["refused_entries"] == {"untrusted_entry": len(bad)}, out["status"]
    c = out["status"]["counts"]
    assert c["hits"] == len(names) - len(bad) and c["misses"] == len(bad), c
    said = [line for line in out["stderr"].splitlines() if "untrusted_entry" in line]
    assert len(said) == 1 and ("is writable by every user" in said[0] and f"chmod go-w {bad[0]}" in said[0]
                               or "not by you or root" in said[0]), out["stderr"][-3000:]
    assert out["results"] == first["results"]
    for path in bad:  # compiled again, and written as any miss is: replaced whole, owner-only
        assert path.stat().st_uid == os.geteuid() and path.stat().st_mode & 0o777 == 0o600


def test_enable_on_a_tpu_points_torch_xla_at_the_wrapper(tmp_path):
    # Only the routing: this host has no TPU, so the runtime is never started.
    script = textwrap.dedent(f"""
        import json, os
        import xlakit
        where = xlakit.enable_persistent_cache({str(tmp_path / "cache")!r})
        print(json.dumps({{"where": str(where), **{{k: os.environ.get(k) for k in (
            "TPU_LIBRARY_PATH", "XLAKIT_PJRT_PLUGIN", "XLAKIT_PJRT_CACHE_DIR", "XLAKIT_PJRT_CACHE_READ_ONLY")}}}}))
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")}, "PYTHONPATH": PYTHONPATH,
           "PJRT_DEVICE": "TPU", "TPU_LIBRARY_PATH": pjrt_job.lammps_plugin()}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    where = str((tmp_path / "cache" / "pjrt-tpu").resolve())
    assert out == {"where": where, "TPU_LIBRARY_PATH": str(pjrt_wrap.library_path()),
                   "XLAKIT_PJRT_PLUGIN": pjrt_job.lammps_plugin(), "XLAKIT_PJRT_CACHE_DIR": where,
                   "XLAKIT_PJRT_CACHE_READ_ONLY": "0"}
    # `xlakit pjrt env` of the same path names the same folder (issue 25: it named the path itself).
    lines = subprocess.run([sys.executable, "-m", "xlakit", "pjrt", "env", str(tmp_path / "cache")], env=env,
                           capture_output=True, text=True, timeout=60)
    assert lines.returncode == 0, lines.stderr
    assert lines.stdout.splitlines() == [f"export TPU_LIBRARY_PATH={pjrt_wrap.library_path()}",
                                         f"export XLAKIT_PJRT_PLUGIN={pjrt_job.lammps_plugin()}",
                                         f"export XLAKIT_PJRT_CACHE_DIR={where}"]
    # After those exports (libtpu named only by them), code that also calls enable_persistent_cache still
    # goes through the wrapper around the same plugin, never the wrapper around itself.
    followed = {**env, "TPU_LIBRARY_PATH": str(pjrt_wrap.library_path()),
                "XLAKIT_PJRT_PLUGIN": pjrt_job.lammps_plugin()}
    run = subprocess.run([sys.executable, "-c", script], env=followed, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["XLAKIT_PJRT_PLUGIN"] == pjrt_job.lammps_plugin()
    # A TPU run with no libtpu at all: the error says so, before anything starts.
    bare = {k: v for k, v in env.items() if k != "TPU_LIBRARY_PATH"}
    run = subprocess.run([sys.executable, "-c", script], env=bare, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "CompileCacheError: PJRT_DEVICE=TPU, but there is no libtpu to run on" in \
        run.stderr


def test_torch_xla_refuses_an_untrusted_folder_before_the_runtime_starts(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    out = job("torch_xla", {}, "--enable", str(folder), ok=False)
    assert "CacheFolderTrustError" in out["stderr"] and "writable by every user" in out["stderr"]


def test_status_without_a_runtime_and_the_library_it_reports():
    s = pjrt_wrap.status()
    pin = pins.load()["pjrt_wrap"]["header"]["api_version"]
    assert s["built"] and not s["loaded"] and not s["active"] and s["built_api"] == pin
    # Regression (CI): status() maps the file itself; a second call must not call that a runtime's load.
    assert not pjrt_wrap.status()["loaded"]
    out = subprocess.run([sys.executable, "-m", "xlakit", "pjrt", "path"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH}, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(pjrt_wrap.library_path())


def test_the_library_exports_its_entry_point_and_reports_and_loads_on_glibc_2_34():
    # TPU VM images are Ubuntu 22.04 (glibc 2.35): a newer symbol version would not load there.
    lib = str(pjrt_wrap.library_path())
    exported = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True)
    assert sorted(line.split()[-1] for line in exported.stdout.splitlines()) == [
        "GetPjrtApi", "xlakit_pjrt_wrap_canonical_program", "xlakit_pjrt_wrap_memory", "xlakit_pjrt_wrap_status"]
    needed = subprocess.run(["objdump", "-T", lib], capture_output=True, text=True, check=True).stdout

    def newest(prefix: str) -> tuple[int, ...]:
        import re

        found = {tuple(int(x) for x in v.split(".")) for v in re.findall(prefix + r"_([0-9.]+)\)", needed)}
        return max(found, default=())  # none: a libc++ linked in statically (the zig-built wheel)

    assert newest("GLIBC") <= (2, 34) and newest("GLIBCXX") <= (3, 4, 21)


# -- what an attack as a new user found ----------------------------------------------------------------

def test_another_build_of_the_plugin_or_other_compiler_flags_miss(tmp_path):
    # Two builds can report the same platform strings: another file under the same plugin name
    # (here the plugin with bytes appended, a different file that loads the same) must not hit.
    folder = tmp_path / "cache"
    first = job("jax", cache_env(folder))
    rebuilt = tmp_path / "other-build.so"
    rebuilt.write_bytes(Path(pjrt_job.lammps_plugin()).read_bytes() + b"\0another build")
    other = job("jax", cache_env(folder, XLAKIT_PJRT_PLUGIN=str(rebuilt)))
    assert other["status"]["counts"]["hits"] == 0 and other["results"] == first["results"]
    # Flags the plugin reads from the environment, not from the compile options (torch_xla passes none).
    flagged = job("jax", cache_env(folder, XLA_FLAGS="--xla_cpu_enable_fast_math=true"))
    assert flagged["status"]["counts"]["hits"] == 0


def test_torch_xla_fails_fast_on_a_plugin_past_the_tested_bridge(tmp_path):
    # Stock torch_xla 2.9 hung in its second execution on a C API 0.115 plugin with padded options.
    out = job("torch_xla", {"XLAKIT_TEST_REAL_PLUGIN": str(pjrt_wrap.library_path()),
                            "XLAKIT_PJRT_PLUGIN": pjrt_job.lammps_plugin()}, ok=False)
    assert "not padded for a plugin of C API 0.115 (padding is tested up to 0.81)" in out["stderr"]
    assert "expected 112, got 80" in out["stderr"]


def test_odd_files_under_entry_names_never_block_or_bloat_the_job(tmp_path):
    folder = tmp_path / "cache"
    first = job("jax", cache_env(folder))
    fifo, huge, nul = list(entries(folder))[:3]
    (folder / fifo).unlink()
    os.mkfifo(folder / fifo)  # an open() that would wait for a writer forever
    (folder / huge).unlink()
    with open(folder / huge, "wb") as f:  # 2 GiB of garbage (sparse): refused from its first bytes
        f.truncate(2 << 30)
    (folder / nul).write_bytes(b"\0\x1b[31mred" * 10)
    out = job("jax", cache_env(folder))
    assert out["max_rss_kib"] < first["max_rss_kib"] + (1 << 20)  # KiB: the 2 GiB file was never read whole
    assert out["status"]["refused_entries"] == {"unreadable": 1, "bad_magic": 2}
    assert out["results"] == first["results"]
    line = next(ln for ln in out["stderr"].splitlines() if "(bad_magic)" in ln)
    assert "\\x00" in line and "\x1b" not in out["stderr"] and "compiling instead" in line


def test_a_file_as_cache_folder_turns_the_cache_off_saying_so(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    out = job("jax", cache_env(afile))
    assert not out["status"]["cache"]["on"] and "is not a folder" in out["status"]["cache"]["why_off"]
    assert afile.read_text() == "not a folder"


def test_a_mistyped_flag_turns_the_cache_off_naming_the_variable(tmp_path):
    # Regression (issue 18): XLAKIT_PJRT_CACHE_READ_ONLY=ture was read as false, and the job wrote.
    out = job("jax", cache_env(tmp_path / "c", XLAKIT_PJRT_CACHE_READ_ONLY="ture"))
    why = out["status"]["cache"]["why_off"]
    assert not out["status"]["cache"]["on"] and "XLAKIT_PJRT_CACHE_READ_ONLY='ture'" in why
    assert not (tmp_path / "c").exists() and out["status"]["counts"]["compiles"] > 0


def test_a_key_python_refuses_turns_the_cache_off_by_the_same_rule(tmp_path):
    # One rule for the key's length, in bytes (core/envelope.h): 11 characters of 3 bytes each is a
    # 33-byte secret for Python, the runtime and the wrapper alike; 31 ASCII bytes is refused by all.
    from xlakit import _C

    long_enough, short = "\u20ac" * 11, "k" * 31
    assert _C.cache_key_problem(long_enough.encode()) is None and _C.cache_key_problem(short.encode())
    out = job("jax", cache_env(tmp_path / "short", XLAKIT_CACHE_KEY=short))
    cache = out["status"]["cache"]
    assert not cache["on"] and "holds 31 bytes, expected a secret of at least 32" in cache["why_off"]
    assert short not in json.dumps(out["status"]) and not (tmp_path / "short").exists()
    out = job("jax", cache_env(tmp_path / "long", XLAKIT_CACHE_KEY=long_enough))
    assert out["status"]["cache"]["on"] and out["status"]["cache"]["authenticated"]


def test_status_survives_counters_growing_between_calls():
    # status() read the length in one call and the text in another; a compile between them broke the JSON.
    import ctypes

    calls = []

    def grows(buf, capacity):
        text = json.dumps({"counts": {"hits": 10 ** len(calls)}, "pad": "x" * (len(calls) * 40)}).encode()
        calls.append(capacity)
        if buf is not None and capacity:
            ctypes.memmove(buf, text[:capacity - 1] + b"\0", min(len(text), capacity - 1) + 1)
        return len(text)

    class Handle:
        xlakit_pjrt_wrap_status = staticmethod(grows)

    assert pjrt_wrap._report(Handle())["counts"]["hits"] == 1


def test_pjrt_env_quotes_what_it_prints_and_refuses_wrong_paths(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    spaced = tmp_path / "my cache $(touch pwned)"
    run = subprocess.run([sys.executable, "-m", "xlakit", "pjrt", "env", str(spaced), "--plugin",
                          pjrt_job.lammps_plugin()], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    shell = subprocess.run(["bash", "-c", run.stdout + '\nprintf %s "$XLAKIT_PJRT_CACHE_DIR"'], cwd=tmp_path,
                           capture_output=True, text=True, timeout=30)
    assert shell.stdout == str(spaced / "pjrt-tpu") and not (tmp_path / "pwned").exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    for args, says in (([str(afile)], "which is a regular file"), (["", "--plugin", str(afile)], "empty path"),
                       ([str(tmp_path / "c"), "--plugin", str(tmp_path / "none.so")], "found nothing"),
                       ([str(tmp_path / "c"), "--plugin", str(pjrt_wrap.library_path())], "the wrapper itself")):
        bad = subprocess.run([sys.executable, "-m", "xlakit", "pjrt", "env", *args], env=env, capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr, (args, bad.stderr)


def test_pjrt_env_of_a_symbolic_link_loop_is_one_line_exit_2(tmp_path):
    # Regression: pathlib's RuntimeError("Symlink loop from ...") reached the user as a traceback, exit 1.
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    for given in (tmp_path / "loop1", tmp_path / "loop1" / "x"):
        run = subprocess.run([sys.executable, "-m", "xlakit", "pjrt", "env", str(given), "--plugin",
                              pjrt_job.lammps_plugin()], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.splitlines()) == 1, run.stderr
        assert run.stderr.startswith(f"xlakit pjrt: {given}: a symbolic link loop"), run.stderr


def test_a_shared_scratch_folder_is_refused_with_a_fix_that_spares_it():
    # The fix for a world-writable sticky cache folder was `chmod 700 /tmp`.
    verdict = pjrt_wrap.cache_trust.judge("/tmp")
    assert verdict.state == "untrusted" and verdict.fix.startswith("use a folder of your own inside it (mkdir -m 700 /tmp/")
