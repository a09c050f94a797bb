"""What a PJRT wrapper cache key covers (issue 24, "one entry per program across a pod's hosts", "normalised keys").

Keys leave out what is host-specific (process index, device ids and description strings) and key the plugin's
topology description instead, so the hosts of a pod share one entry per program; they key the TPU variables
that change code generation and the contents of flag files; flags are sorted and dump/logging flags dropped; an
HLO module's source locations are out of its hash. Real plugins, fresh processes: jax 0.10 on
lammps-jax-pjrt-cpu and stock torch_xla 2.9 on xla-cpu-pjrt through the wrapper.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, pjrt_job, pjrt_shims
from xlakit import _C
from xlakit.runtime import cache_explain, cache_files, pjrt_wrap

JOB = Path(pjrt_job.__file__)
# The xlakit under test first (a worktree's), then the repository for `tests`.
PYTHONPATH = os.pathsep.join([str(Path(pjrt_wrap.__file__).resolve().parents[2]), str(REPO)])

pytestmark = [pytest.mark.pjrt, pytest.mark.slow]


def run(args: list[str], folder: Path, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("XLAKIT_", "XLA_", "TPU_", "LIBTPU_"))}
    base.update(PYTHONPATH=PYTHONPATH, XLAKIT_PJRT_CACHE_DIR=str(folder), **env)
    done = subprocess.run([sys.executable, *args], env=base, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr
    return out


def job(framework: str, folder: Path, **env: str) -> dict:
    return run([str(JOB), framework], folder, **env)


def counts(out: dict) -> dict:
    return out["status"]["counts"]


def all_hits(out: dict) -> bool:
    c = counts(out)
    return c["hits"] == c["compiles"] > 0 and c["misses"] == 0


# -- one entry per program across a pod's hosts -------------------------------------------------------------

_HOST_SHIM = r"""
/* A real plugin as another host of a pod sees it: the same plugin, each device described with this host's
   string (on a TPU, ToString names the device's id, process and coordinates). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "xla/pjrt/c/pjrt_c_api.h"
static _Alignas(16) char table[16384];  /* the real table is newer (larger) than this header's */
static const PJRT_Api* real;
static char text[256];
static PJRT_Error* ToString(PJRT_DeviceDescription_ToString_Args* args) {
  PJRT_Error* e = real->PJRT_DeviceDescription_ToString(args);
  if (e) return e;
  snprintf(text, sizeof text, "host %s: %.*s", getenv("SHIM_HOST"), (int)args->to_string_size, args->to_string);
  args->to_string = text;
  args->to_string_size = strlen(text);
  return NULL;
}
const PJRT_Api* GetPjrtApi(void) {
  void* h = dlopen(getenv("SHIM_REAL"), RTLD_NOW | RTLD_LOCAL);
  real = ((const PJRT_Api* (*)(void))dlsym(h, "GetPjrtApi"))();
  if (real->struct_size > sizeof table) return NULL;
  memcpy(table, real, real->struct_size);
  ((PJRT_Api*)table)->PJRT_DeviceDescription_ToString = ToString;
  return (const PJRT_Api*)table;
}
"""


def _host_shim(tmp_path: Path) -> Path:
    return pjrt_shims.compile_plugin(_HOST_SHIM, tmp_path, "host_shim")


def test_a_read_only_worker_on_another_host_hits_what_the_writer_published(tmp_path):
    # Regression (issue 24): keys held the process index and device strings, so a pod wrote one copy per host
    # and read-only workers on other hosts always missed, silently.
    shim = _host_shim(tmp_path)
    folder = tmp_path / "cache"
    env = dict(XLAKIT_PJRT_PLUGIN=str(shim), SHIM_REAL=pjrt_job.lammps_plugin())
    writer = job("jax", folder, SHIM_HOST="0", **env)
    assert counts(writer)["writes"] == counts(writer)["compiles"] > 0
    assert "plugin's topology description" in writer["stderr"]
    reader = job("jax", folder, SHIM_HOST="1", XLAKIT_PJRT_CACHE_READ_ONLY="1", **env)
    assert all_hits(reader) and reader["results"] == writer["results"]


def test_the_tpu_variables_that_change_code_generation_are_keyed(tmp_path):
    folder = tmp_path / "cache"
    first = job("jax", folder)
    assert all_hits(job("jax", folder, TPU_VISIBLE_CHIPS="3", CLOUD_TPU_TASK_ID="7"))  # host-specific: out
    megacore = job("jax", folder, TPU_MEGACORE="megacore_dense")
    assert counts(megacore)["hits"] == 0 and megacore["results"] == first["results"]
    bounds = job("jax", folder, TPU_PROCESS_BOUNDS="2,2,1")
    assert counts(bounds)["hits"] == 0


def test_a_flag_file_is_keyed_by_its_contents(tmp_path):
    # LIBTPU_INIT_ARGS, which the CPU plugin ignores and the key covers: an absl --flagfile is read by libtpu.
    folder = tmp_path / "cache"
    flags = tmp_path / "flags"
    flags.write_text("--xla_tpu_enable_latency_hiding_scheduler=true\n")
    job("jax", folder, LIBTPU_INIT_ARGS=f"--flagfile={flags}")
    assert all_hits(job("jax", folder, LIBTPU_INIT_ARGS=f"--flagfile={flags}"))
    moved = tmp_path / "same-flags"
    moved.write_bytes(flags.read_bytes())
    assert all_hits(job("jax", folder, LIBTPU_INIT_ARGS=f"--flagfile={moved}"))  # where it lies does not count
    flags.write_text("--xla_tpu_enable_latency_hiding_scheduler=false\n")
    assert counts(job("jax", folder, LIBTPU_INIT_ARGS=f"--flagfile={flags}"))["hits"] == 0


# -- normalised keys ----------------------------------------------------------------------------------------

def test_flag_order_and_dump_flags_do_not_change_the_key_but_a_flag_does(tmp_path):
    folder = tmp_path / "cache"
    first = job("torch_xla", folder, XLAKIT_TEST_REAL_PLUGIN=str(pjrt_wrap.library_path()),
                XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(),
                XLA_FLAGS="--xla_cpu_enable_fast_math=false --xla_cpu_fast_math_honor_nans=true")
    dumps = tmp_path / "dumps"
    again = job("torch_xla", folder, XLAKIT_TEST_REAL_PLUGIN=str(pjrt_wrap.library_path()),
                XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(),
                XLA_FLAGS=f"--xla_dump_to={dumps} --xla_cpu_fast_math_honor_nans=true "
                          "--xla_dump_hlo_as_text --xla_cpu_enable_fast_math=false")
    assert all_hits(again) and again["results"] == first["results"]
    # Another value of a flag is another key.
    other = job("torch_xla", folder, XLAKIT_TEST_REAL_PLUGIN=str(pjrt_wrap.library_path()),
                XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(),
                XLA_FLAGS="--xla_cpu_enable_fast_math=false --xla_cpu_fast_math_honor_nans=false")
    assert counts(other)["hits"] == 0


_TORCH_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
from tests.support import pjrt_job
import torch, torch_xla
import torch_xla.experimental.plugins as plugins
from xlakit.runtime import pjrt_wrap


class XlaCpuPlugin(plugins.DevicePlugin):
    def library_path(self):
        return os.environ["XLAKIT_TEST_REAL_PLUGIN"]


os.environ["PJRT_DEVICE"] = "XLACPU"
plugins.use_dynamic_plugins()
plugins.register_plugin("XLACPU", XlaCpuPlugin())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
device = torch_xla.device()
model = model.to(device)
{blank}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = (torch.arange(64, dtype=torch.float32).reshape(4, 16) / 64).to(device)
for _ in range(2):
    opt.zero_grad()
{blank}
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    torch_xla.sync()
print(json.dumps({{"results": [p.detach().cpu().numpy().tobytes().hex() for p in model.parameters()],
                  "status": pjrt_wrap.status()}}))
"""


def test_torch_xla_with_hlo_debug_hits_after_blank_lines_are_added(tmp_path):
    # Regression (issue 24): with XLA_HLO_DEBUG=1 every op carries its source line, so blank lines missed.
    folder = tmp_path / "cache"
    script = tmp_path / "train.py"
    env = dict(XLA_HLO_DEBUG="1", XLAKIT_TEST_REAL_PLUGIN=str(pjrt_wrap.library_path()),
               XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin())
    script.write_text(_TORCH_SCRIPT.format(tests=str(REPO), blank=""))
    first = run([str(script)], folder, **env)
    assert counts(first)["writes"] == counts(first)["compiles"] > 0
    script.write_text(_TORCH_SCRIPT.format(tests=str(REPO), blank="\n\n\n"))
    moved = run([str(script)], folder, **env)
    assert all_hits(moved) and moved["results"] == first["results"]


_JAX_SCRIPT = """
import json, os
import numpy as np
import lammps_jax_pjrt_cpu
from xlakit.runtime import pjrt_wrap
os.environ["XLAKIT_PJRT_PLUGIN"] = str(lammps_jax_pjrt_cpu.PLUGIN_PATH)
os.environ["JAX_PLATFORMS"] = "xlakitcpu"
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)
from jax._src import xla_bridge
xla_bridge.register_plugin("xlakitcpu", library_path=str(pjrt_wrap.library_path()))
{blank}
@jax.jit
def step(w, x):
    h = jnp.tanh(x @ w * {scale})
    return w - 0.1 * (h.T @ x).T

x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
w = np.eye(8, dtype=np.float32)
for _ in range(3):
    w = step(w, x)
print(json.dumps({{"results": [np.asarray(w).tobytes().hex()], "status": pjrt_wrap.status()}}))
"""


def test_a_jax_function_moved_down_or_run_from_another_path_hits(tmp_path):
    # Issue 24 item 4: jax sends MLIR bytecode whose locations carry the script's path, lines and columns;
    # the key drops them (csrc/pjrt_wrap/mlir_bytecode.h), as JAX's own cache strips debug info.
    folder = tmp_path / "cache"
    script = tmp_path / "a" / "train.py"
    script.parent.mkdir()
    script.write_text(_JAX_SCRIPT.format(blank="", scale="0.5"))
    first = run([str(script)], folder)
    assert counts(first)["writes"] == counts(first)["compiles"] > 0
    script.write_text(_JAX_SCRIPT.format(blank="\n\n\n", scale="0.5"))  # three lines down
    moved = run([str(script)], folder)
    assert all_hits(moved) and moved["results"] == first["results"], counts(moved)
    elsewhere = tmp_path / "another" / "checkout" / "train.py"  # another host's path to the same code
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_text(script.read_text())
    other = run([str(elsewhere)], folder)
    assert all_hits(other) and other["results"] == first["results"], counts(other)
    script.write_text(_JAX_SCRIPT.format(blank="\n\n\n", scale="0.25"))  # another constant: another program
    changed = run([str(script)], folder)
    assert counts(changed)["misses"] > 0 and changed["results"] != first["results"]


# -- single flight ------------------------------------------------------------------------------------------

_THREADS = """
import json, os, threading
import numpy as np
import lammps_jax_pjrt_cpu
from xlakit.runtime import pjrt_wrap
os.environ["XLAKIT_PJRT_PLUGIN"] = str(lammps_jax_pjrt_cpu.PLUGIN_PATH)
os.environ["JAX_PLATFORMS"] = "xlakitcpu"
import jax, jax.numpy as jnp
jax.config.update("jax_enable_compilation_cache", False)
from jax._src import xla_bridge
xla_bridge.register_plugin("xlakitcpu", library_path=str(pjrt_wrap.library_path()))
jax.devices()
x = np.arange(64, dtype=np.float32).reshape(8, 8) / 64
results, start = [None] * 16, threading.Barrier(16)

def work(i):
    def step(a):  # one program, a new function object per thread: jax compiles it in each
        for k in range(6):
            a = jnp.tanh(a @ a.T * 0.1 + k * 0.01)
        return a + i % 2
    start.wait()
    results[i] = jax.device_get(jax.jit(step)(x)).tobytes().hex()

threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"results": results, "status": pjrt_wrap.status()}))
"""


def test_threads_compiling_the_same_programs_compile_each_once(tmp_path):
    # Regression (issue 24): 48 threads compiling 25 distinct programs made 33 real compiles.
    folder = tmp_path / "cache"
    out = run(["-c", _THREADS], folder)
    c = counts(out)
    assert c["compiles"] == 16 and c["misses"] == c["writes"] == 2 and c["hits"] == 14, c
    assert c["flight_waits"] >= 1  # the threads did ask at once
    assert len(set(out["results"][0::2])) == len(set(out["results"][1::2])) == 1
    assert out["results"][0] != out["results"][1]


# -- cheap starts -------------------------------------------------------------------------------------------

def test_the_plugins_digest_is_remembered_per_host_until_the_file_changes(tmp_path):
    # Regression (issue 24): every process start hashed the whole real plugin (libtpu is hundreds of MB).
    folder = tmp_path / "cache"
    plugin = tmp_path / "plugin.so"
    plugin.write_bytes(Path(pjrt_job.lammps_plugin()).read_bytes())
    env = dict(HOME=str(tmp_path / "home"), XLAKIT_PJRT_PLUGIN=str(plugin))
    job("jax", folder, **env)
    (memo,) = (tmp_path / "home" / ".cache" / "xlakit" / "pjrt-digests").iterdir()
    stamp, digest = memo.read_text().rsplit(" ", 1)
    assert len(digest) == 65 and oct(memo.stat().st_mode & 0o777) == "0o600"
    assert all_hits(job("jax", folder, **env))
    # The memo is what the next start uses: a digest put in it is another plugin build, so every program misses.
    memo.write_text(f"{stamp} {'0' * 64}\n")
    assert counts(job("jax", folder, **env))["hits"] == 0
    # A changed file (here only touched: its mtime and ctime) is hashed again, and hits what it wrote before.
    os.utime(plugin)
    assert all_hits(job("jax", folder, **env))
    assert memo.read_text().endswith(digest)


# -- bounded size -------------------------------------------------------------------------------------------

def test_prune_max_bytes_evicts_the_least_recently_used_and_a_hit_is_a_use(tmp_path):
    folder = tmp_path / "cache"
    job("jax", folder)
    first = {p.name: p for p in _entries(folder)}
    old = time.time() - 3600
    for p in first.values():
        os.utime(p, (old, old))
    other = run([str(JOB), "jax", "--variant", "1"], folder)  # hits the programs both variants compile
    assert 0 < counts(other)["hits"] < counts(other)["compiles"]
    unused = {name for name, p in first.items() if p.stat().st_mtime < old + 1}
    assert unused and len(unused) < len(first)  # a hit touched its entry
    sizes = {p.name: p.stat().st_size for p in _entries(folder)}
    budget = sum(sizes.values()) - sum(sizes[n] for n in unused)
    prune = subprocess.run([sys.executable, "-m", "xlakit", "cache", "prune", str(folder), "--max-bytes",
                            str(budget)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert prune.returncode == 0, prune.stderr
    assert {p.name for p in _entries(folder)} == set(sizes) - unused, prune.stdout
    assert _with_records(set(sizes) - unused) == {p.name for p in folder.iterdir()}  # records went with entries
    assert all_hits(run([str(JOB), "jax", "--variant", "1"], folder))


def test_the_wrapper_keeps_its_folder_under_max_bytes(tmp_path):
    sizes = {p.name: p.stat().st_size for p in _written(tmp_path / "unbounded")}
    folder = tmp_path / "cache"
    budget = sum(sizes.values()) - 1  # one byte short of every entry
    folder.mkdir(mode=0o700)
    killed, live = (folder / f"{_C.TEMP_PREFIX}{'a' * 64}.host.{pid}.1.{'0' * 16}" for pid in (11, 12))
    for temp in (killed, live):
        temp.write_bytes(b"half an entry")
    assert _C.temp_file_target(killed.name) == "a" * 64
    old = time.time() - 3600
    os.utime(killed, (old, old))  # a writer killed an hour ago; `live` may still be written
    first = run([str(JOB), "jax"], folder, XLAKIT_PJRT_CACHE_MAX_BYTES=str(budget))
    assert not killed.exists() and live.exists()
    live.unlink()
    c = counts(first)
    kept = _entries(folder)
    assert c["writes"] == c["compiles"] and c["evictions"] == c["writes"] - len(kept) >= 1
    assert {p.name for p in folder.iterdir()} == _with_records({p.name for p in kept})  # evicted with its entry
    assert sum(p.stat().st_size for p in kept) <= budget
    assert counts(job("jax", folder))["hits"] == len(kept)  # what is left is loadable, and hit
    bad = run([str(JOB), "jax"], folder, XLAKIT_PJRT_CACHE_MAX_BYTES="lots")
    assert not bad["status"]["cache"]["on"] and "XLAKIT_PJRT_CACHE_MAX_BYTES='lots'" in bad["stderr"]


def _written(folder: Path) -> list[Path]:
    job("jax", folder)
    return _entries(folder)


def _entries(folder: Path) -> list[Path]:
    """The wrapper's entries, without the key records beside them (cache_explain)."""
    return [p for p in folder.iterdir() if cache_files.is_entry_name(p.name)]


def _with_records(names: set[str]) -> set[str]:
    return names | {n + cache_explain.PARTS_SUFFIX for n in names}


def test_programs_compiled_faster_than_the_minimum_are_not_written(tmp_path):
    folder = tmp_path / "cache"
    out = job("jax", folder, XLAKIT_PJRT_CACHE_MIN_COMPILE_S="1000")
    c = counts(out)
    assert c["writes"] == 0 and c["skipped_fast"] == c["misses"] == c["compiles"] > 0 and not any(folder.iterdir())
    assert counts(job("jax", folder, XLAKIT_PJRT_CACHE_MIN_COMPILE_S="0"))["writes"] == c["compiles"]
    bad = job("jax", folder, XLAKIT_PJRT_CACHE_MIN_COMPILE_S="1s")
    assert not bad["status"]["cache"]["on"] and "XLAKIT_PJRT_CACHE_MIN_COMPILE_S='1s'" in bad["stderr"]
