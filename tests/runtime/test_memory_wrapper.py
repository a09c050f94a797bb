"""Memory per raw runtime device through xlakit's PJRT wrapper, on real plugins, in fresh processes.

Stock torch_xla 2.9 runs under SPMD with `PJRT_DEVICE=TPU` and the wrapper
as its libtpu, in front of OpenXLA's xla-cpu-pjrt plugin with 4 devices; jax
runs on lammps-jax-pjrt-cpu through the wrapper. A tensor sharded over the
4-device mesh must raise each device's live bytes by its shard and lower them
when freed, the peak kept; the CPU plugins keep no allocator statistics, so
those are reported unavailable with the plugin's reason. The struct-size
rules of PJRT_Device_MemoryStats are checked by calling the wrapper's table
directly (ctypes), as a framework would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO, memory_job, pjrt_job
from xlakit.runtime import pjrt_wrap

pytestmark = [pytest.mark.pjrt, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("xla_plugins") is None,
                                 reason="needs the xla-cpu-pjrt plugin from PyPI (the pjrt test tools)")]

SHARD = memory_job.ROWS * memory_job.COLS * 4 // 4  # float32 rows split over 4 devices
DEVICES = [f"CPU:{i}" for i in range(4)]
UNIMPLEMENTED = "PJRT_Device_MemoryStats: UNIMPLEMENTED"


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")}
    # The subprocess imports this xlakit (and its wrapper), not whichever one is installed.
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)
    base["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    base.update(extra)
    return base


def torch_env(**extra: str) -> dict[str, str]:
    """Stock torch_xla, SPMD, on the wrapper in front of xla-cpu-pjrt (4 devices)."""
    return _env(PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=str(pjrt_wrap.library_path()),
                XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(), XLA_USE_SPMD="1", XLA_NO_SPECIAL_SCALARS="1", **extra)


def run_job(which: str, env: dict[str, str]) -> dict:
    run = subprocess.run([sys.executable, str(Path(memory_job.__file__)), which], env=env, capture_output=True,
                         text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_torch_xla_spmd_each_device_counts_its_shard_through_the_wrapper(tmp_path):
    # Twice on one compile cache: the second run's executables are DeserializeAndLoad'ed, not compiled.
    first = run_job("torch_xla", torch_env(XLAKIT_PJRT_CACHE_DIR=str(tmp_path / "cache")))
    assert first["counts"]["writes"] > 0
    check_torch_xla_job(first)
    second = run_job("torch_xla", torch_env(XLAKIT_PJRT_CACHE_DIR=str(tmp_path / "cache")))
    assert second["counts"]["hits"] == second["counts"]["compiles"] > 0
    check_torch_xla_job(second)


def check_torch_xla_job(out: dict) -> None:
    assert out["runtime_devices"] == DEVICES
    for d in DEVICES:
        before, live, freed = out["before"][d], out["live"][d], out["freed"][d]
        assert live["source"] == "pjrt_wrap" and live["unsupported"] is None
        # torch_xla may keep a scalar it made on the way (4 bytes per device, live until the end): the shard is
        # what freeing the tensor gives back.
        assert SHARD <= live["live_bytes"] - before["live_bytes"] < SHARD + 64
        assert live["live_bytes"] - freed["live_bytes"] == SHARD
        assert live["live_buffers"] - freed["live_buffers"] == 1
        assert freed["peak_live_bytes"] >= before["live_bytes"] + SHARD  # the peak outlives the tensor
        # The CPU plugin keeps no allocator statistics: said, with the plugin's own reason.
        assert live["bytes_used"] is None and live["plugin_unavailable"].startswith(UNIMPLEMENTED)
    # A leak would grow each device by the model's size (about 66 KB) per step; a scalar the runtime frees a
    # moment later is 4 bytes.
    steps = out["steps"]
    assert all(abs(s[d] - steps[2][d]) < 1024 < steps[2][d] - out["freed"][d]["live_bytes"]
               for s in steps[3:] for d in DEVICES), steps
    assert out["one"]["device"] == "CPU:3" and out["one"]["source"] == "pjrt_wrap"
    assert out["unknown_device"] == ("expected a runtime device local to this process, one of "
                                     "CPU:0, CPU:1, CPU:2, CPU:3; found 'CPU:9'")
    assert out["call_us"] < 5000, "memory_info() for every device must be cheap enough for every step"
    assert out["manifest_memory"] == {"per_device": True, "source": "pjrt_wrap", "accounting": True, "devices": 4}


def test_jax_each_device_counts_its_shard_through_the_wrapper():
    out = run_job("jax", _env(XLAKIT_PJRT_PLUGIN=pjrt_job.lammps_plugin()))
    assert sorted(out["live"]) == DEVICES, out["jax_devices"]
    for d in DEVICES:
        before, live, freed = out["before"].get(d, {"live_bytes": 0, "live_buffers": 0}), out["live"][d], \
            out["freed"][d]
        assert live["live_bytes"] - before["live_bytes"] == SHARD
        assert live["live_buffers"] - before["live_buffers"] == 1
        assert freed["live_bytes"] == before["live_bytes"] and freed["peak_bytes"] >= before["live_bytes"] + SHARD
        assert live["plugin"] is None and live["plugin_unavailable"].startswith(UNIMPLEMENTED)
        assert out["reset"][d]["peak_bytes"] == freed["live_bytes"]  # reset_peaks(): the peak runs from now


def xlakit_cli(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlakit", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_xlakit_memory_answers_per_device_under_spmd_and_watches():
    env = torch_env()
    table = xlakit_cli("memory", env=env)
    assert table.returncode == 0, table.stderr[-3000:]
    rows = [line.split() for line in table.stdout.splitlines()]
    assert [r[0] for r in rows[1:5]] == DEVICES and all(r[-1] == "pjrt_wrap" for r in rows[1:5])
    assert "CPU:0: the plugin's own statistics are unavailable (PJRT_Device_MemoryStats: UNIMPLEMENTED" in \
        table.stdout

    watch = xlakit_cli("memory", "--watch", "0.1", "--count", "2", env=env)
    assert watch.returncode == 0, watch.stderr[-3000:]
    lines = watch.stdout.splitlines()
    assert [line.split()[1] for line in lines] == DEVICES * 2
    assert all(re.fullmatch(r"\S+Z CPU:\d used=- limit=- peak=- live=\d+ buffers=\d+ peak_live=\d+ "
                            r"source=pjrt_wrap", line) for line in lines), lines

    unknown = xlakit_cli("memory", "CPU:9", env=env)
    assert unknown.returncode == 2 and "one of CPU:0, CPU:1, CPU:2, CPU:3; found 'CPU:9'" in unknown.stderr
    bad = xlakit_cli("memory", "--watch", "0", env=env)
    assert bad.returncode == 2 and "expected an interval from 0.05 to 86400 seconds, found 0" in bad.stderr
    alone = xlakit_cli("memory", "--count", "2", env=env)
    assert alone.returncode == 2 and "add --watch SECONDS" in alone.stderr


def test_with_the_count_off_live_figures_are_unknown_never_zero():
    # Attack finding: under XLAKIT_PJRT_MEMORY_ACCOUNTING=0 every device read live=0, a confident figure for a
    # count never taken; the doctor's summary said "not counted" and its device lines "live 0 bytes".
    env = {**torch_env(), "XLAKIT_PJRT_MEMORY_ACCOUNTING": "0"}
    watch = xlakit_cli("memory", "--watch", "0.1", "--count", "1", env=env)
    assert watch.returncode == 0, watch.stderr[-3000:]
    assert all(" live=- buffers=- peak_live=- " in line for line in watch.stdout.splitlines()), watch.stdout
    table = xlakit_cli("memory", env=env)
    assert "CPU:0: LIVE is not counted: XLAKIT_PJRT_MEMORY_ACCOUNTING=0 turned the wrapper's count" in table.stdout
    doctor = xlakit_cli("doctor", "--profile", "cpu-dev", env=env)
    cpu0 = next(line for line in doctor.stdout.splitlines() if line.startswith("ok    memory CPU:0: "))
    assert "live buffers not counted (XLAKIT_PJRT_MEMORY_ACCOUNTING=0" in cpu0 and "live 0 bytes" not in cpu0
    for bad in ("abc", "nan"):
        run = xlakit_cli("memory", "--watch", bad, env=env)
        assert run.returncode == 2 and f"expected an interval from 0.05 to 86400 seconds, found {bad}" in run.stderr


def test_xlakit_memory_watch_stops_on_ctrl_c_with_130():
    with subprocess.Popen([sys.executable, "-m", "xlakit", "memory", "--watch", "0.2"], env=torch_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) as proc:
        try:
            first = proc.stdout.readline()
            assert " CPU:0 " in first
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]


def test_doctor_says_memory_per_device_comes_from_the_wrapper():
    run = xlakit_cli("doctor", "--profile", "cpu-dev", env=torch_env())
    lines = run.stdout.splitlines()
    assert "ok    per-device memory: from pjrt_wrap (4 devices, live buffers counted)" in lines, run.stdout
    cpu0 = next(line for line in lines if line.startswith("ok    memory CPU:0: "))
    assert "(via pjrt_wrap); the plugin's own statistics are unavailable: PJRT_Device_MemoryStats: " \
           "UNIMPLEMENTED" in cpu0


# The C API side, as a framework calls it: a client made through the wrapper's table, its devices, and
# PJRT_Device_MemoryStats with a larger and a smaller struct than the wrapper's header.
_DIRECT = textwrap.dedent(r"""
    import ctypes, json, re, sys
    header, wrapper = sys.argv[1], sys.argv[2]
    names = re.findall(r"_PJRT_API_STRUCT_FIELD\((PJRT_\w+)\)", open(header).read())
    lib = ctypes.CDLL(wrapper)
    lib.GetPjrtApi.restype = ctypes.c_void_p
    api = lib.GetPjrtApi()
    def fn(name):  # PJRT_Api: struct_size, extension_start, PJRT_Api_Version (24 bytes), then the functions
        ptr = ctypes.c_void_p.from_address(api + 40 + 8 * names.index(name)).value
        return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(ptr)
    def args(size, **at):
        buf = (ctypes.c_uint64 * (size // 8))()
        buf[0] = size
        for offset, value in at.items():
            buf[int(offset[1:]) // 8] = value
        return buf
    def code(error):
        if not error:
            return None
        a = args(32, o16=error)
        fn("PJRT_Error_GetCode")(ctypes.addressof(a))
        fn("PJRT_Error_Destroy")(ctypes.addressof(args(24, o16=error)))
        return a[3] & 0xffffffff
    create = args(88)
    assert code(fn("PJRT_Client_Create")(ctypes.addressof(create))) is None
    client = create[8]
    devs = args(40, o16=client)
    assert code(fn("PJRT_Client_AddressableDevices")(ctypes.addressof(devs))) is None
    first = ctypes.c_void_p.from_address(devs[3]).value
    out = {"devices": devs[4]}
    for size in (201, 40):
        buf = ctypes.create_string_buffer(b"\xab" * 256, 256)
        ctypes.c_uint64.from_address(ctypes.addressof(buf)).value = size
        ctypes.c_uint64.from_address(ctypes.addressof(buf) + 8).value = 0
        ctypes.c_uint64.from_address(ctypes.addressof(buf) + 16).value = first
        out[f"code_{size}"] = code(fn("PJRT_Device_MemoryStats")(ctypes.addressof(buf)))
        out[f"after_{size}"] = buf.raw[24:].hex()
    report = ctypes.create_string_buffer(1 << 16)
    lib.xlakit_pjrt_wrap_memory.restype = ctypes.c_size_t
    lib.xlakit_pjrt_wrap_memory(report, 1 << 16, 1)
    out["report"] = json.loads(report.value)
    assert code(fn("PJRT_Client_Destroy")(ctypes.addressof(args(24, o16=client)))) is None
    lib.xlakit_pjrt_wrap_memory(report, 1 << 16, 1)
    out["after_destroy"] = json.loads(report.value)
    print(json.dumps(out))
""")


@pytest.mark.parametrize("accounting,on", [("", True), ("0", False), ("ture", True)])
def test_memory_stats_zero_a_larger_callers_tail_and_every_client_device_is_reported(tmp_path, accounting, on):
    header = Path(pjrt_job.xla_cpu_plugin()).parent / "include" / "pjrt_c_api.h"
    script = tmp_path / "direct.py"
    script.write_text(_DIRECT)
    env = _env(XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(), XLAKIT_PJRT_MEMORY_ACCOUNTING=accounting)
    run = subprocess.run([sys.executable, str(script), str(header), str(pjrt_wrap.library_path())], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["code_201"] == 12  # UNIMPLEMENTED: the CPU plugin keeps no statistics
    assert out["code_40"] == 3  # INVALID_ARGUMENT: the plugin's own refusal of a struct older than its own stands
    # A caller newer than the plugin (TorchTPU passes 201 bytes): every out field of its struct is zero, so no
    # `_is_set` flag of its own garbage reads as set. A smaller struct: only what it holds is touched.
    assert out["after_201"] == "00" * (201 - 24) + "ab" * (256 - 201)
    assert out["after_40"] == "00" * (40 - 24) + "ab" * (256 - 40)
    report = out["report"]
    assert report["installed"] and report["accounting"] is on
    if accounting == "ture":  # a value the wrapper cannot read is said, naming the variable, and changes nothing
        assert "environment variable XLAKIT_PJRT_MEMORY_ACCOUNTING='ture': expected 1 or 0" in run.stderr
        assert "memory accounting stays on" in run.stderr
    assert [(d["platform"], d["id"], d["live_bytes"]) for d in report["devices"]] == [("cpu", i, 0) for i in range(4)]
    assert all(d["plugin_unavailable"].startswith(UNIMPLEMENTED) for d in report["devices"])
    assert out["after_destroy"]["devices"] == []  # a destroyed client's devices are never asked again


# -- memory that is not the device's own ---------------------------------------------------------------------

_PINNED = """
import json
import numpy as np
from tests.support import pjrt_job
from xlakit.runtime import wrap_memory
jax = pjrt_job.start_jax()
device = jax.devices()[0]
mem = lambda: wrap_memory.by_device(plugin_stats=False)["CPU:0"]
out = {"before": mem()}
pinned = jax.device_put(np.ones(1024, np.float32), jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
pinned.block_until_ready()
out["pinned"] = mem()
del pinned
out["freed"] = mem()
print(json.dumps(out))
"""

_VIEW = """
import json
import torch
import torch_xla.utils.dlpack as xla_dlpack
from tests.support import pjrt_job
from xlakit.runtime import wrap_memory
pjrt_job.start_torch_xla().device()
mem = lambda: wrap_memory.by_device(plugin_stats=False)["CPU:0"]
out = {"before": mem()}
host = torch.ones(1024)
view = xla_dlpack.from_dlpack(host)  # PJRT_Client_CreateViewOfDeviceBuffer over the CPU tensor's memory
out["view"] = mem()
print(json.dumps(out))
"""


def _memory_job(script: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_buffer_in_pinned_host_memory_counts_apart_from_the_devices_memory():
    # Regression (issue 32): buffers copied to pinned_host memory counted as device memory.
    out = _memory_job(_PINNED, {k: v for k, v in _env(XLAKIT_PJRT_PLUGIN=pjrt_job.lammps_plugin()).items()
                                if k != "XLA_FLAGS"})
    before, pinned, freed = out["before"], out["pinned"], out["freed"]
    assert pinned["live_bytes"] == before["live_bytes"] and pinned["live_buffers"] == before["live_buffers"]
    host = pinned["other_memories"]["pinned_host"]
    assert host["live_bytes"] - before["other_memories"]["pinned_host"]["live_bytes"] == 4096
    assert host["live_buffers"] == 1 and freed["other_memories"]["pinned_host"]["live_bytes"] == 0
    assert freed["other_memories"]["pinned_host"]["peak_bytes"] >= 4096


def test_a_view_of_the_frameworks_memory_counts_apart_from_the_devices_memory():
    # Regression (issue 32): views made with CreateViewOfDeviceBuffer counted as device memory.
    env = {k: v for k, v in _env(XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin()).items() if k != "XLA_FLAGS"}
    out = _memory_job(_VIEW, env)
    before, view = out["before"], out["view"]
    assert view["live_bytes"] == before["live_bytes"]
    assert view["views"]["live_bytes"] - before["views"]["live_bytes"] == 4096 and view["views"]["live_buffers"] == 1
