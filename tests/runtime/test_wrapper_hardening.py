"""The wrapper's C ABI under pressure (issue 32 item 5), on real plugins in fresh processes.

* No memory inside the wrapper: a preloaded fake (tests/support/pjrt_shims.py) makes operator new fail for
  the wrapper's own allocations, from the N-th on or only the N-th, at points spread over a whole job. Each
  run either completes with the clean run's numbers (a lookup that failed is a miss or a pass-through) or
  ends with the framework's error saying the wrapper is out of memory; never an abort.
* Flag files named in the environment: bounded, never blocking, and keyed by content down nested ones.
* Log lines: bidi and other format controls (Unicode Cf, U+2028/9) escaped like control bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from tests.support import REPO, pjrt_job, pjrt_shims
from xlakit.runtime import pjrt_wrap

PYTHONPATH = os.pathsep.join([str(Path(pjrt_wrap.__file__).resolve().parents[2]), str(REPO)])

pytestmark = [pytest.mark.pjrt, pytest.mark.slow]

# pjrt_job's programs, printing only their results (the status report is not asked for: under no memory the
# wrapper answers it with an error object).
_JAX = """
import json
from tests.support import pjrt_job
print(json.dumps({"results": [r.hex() for r in pjrt_job.run_jax(0)]}))
"""
_TORCH_XLA = _JAX.replace("run_jax(0)", "run_torch_xla(0, None)")


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`script` (source, or a file's path with `args`) in a fresh process, with only `env` set of ours."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("XLAKIT_", "XLA_", "TPU_", "LIBTPU_", "FAIL_"))}
    base.update(PYTHONPATH=PYTHONPATH, **env)
    command = [script, *args] if args else ["-c", script]
    return subprocess.run([sys.executable, *command], env=base, capture_output=True, text=True, timeout=240)


def _results(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


def _allocations(done: subprocess.CompletedProcess) -> int:
    line = next(ln for ln in done.stderr.splitlines() if ln.startswith("fail_new:"))
    return int(line.split()[1])


def _survives_every_failure_point(tmp_path: Path, script: str, plugin: str, **extra: str) -> None:
    preload = pjrt_shims.fail_new_preload(tmp_path)
    env = dict(LD_PRELOAD=str(preload), XLAKIT_PJRT_PLUGIN=plugin, **extra)
    cold = _run(script, FAIL_NEW_FROM="0", FAIL_NEW_REPORT="1", XLAKIT_PJRT_CACHE_DIR=str(tmp_path / "counted"), **env)
    expected, n = _results(cold), _allocations(cold)
    warm = _run(script, FAIL_NEW_FROM="0", FAIL_NEW_REPORT="1", XLAKIT_PJRT_CACHE_DIR=str(tmp_path / "counted"), **env)
    assert _results(warm) == expected
    points = [("cold", "1+"), ("cold", f"{n // 3}+"), ("cold", f"{2 * n // 3}+"), ("cold", str(n // 2)),
              ("cold", str(n - 1)), ("warm", f"{_allocations(warm) // 2}+")]
    completed = 0
    for i, (cache, point) in enumerate(points):
        folder = tmp_path / "counted" if cache == "warm" else tmp_path / f"cache{i}"
        done = _run(script, FAIL_NEW_FROM=point, XLAKIT_PJRT_CACHE_DIR=str(folder), **env)
        where = f"{cache} cache, allocations {point} of {n} fail"
        assert done.returncode in (0, 1), f"{where}: exit {done.returncode}\n{done.stderr[-3000:]}"
        if done.returncode == 0:
            completed += 1
            assert _results(done) == expected, where
        else:  # the framework's own error, naming the wrapper's refusal
            assert "xlakit PJRT wrapper: out of memory" in done.stderr, f"{where}\n{done.stderr[-3000:]}"
    assert completed >= len(points) - 2  # only failures while starting refuse the runtime


def test_no_memory_in_the_wrapper_under_jax_is_a_miss_or_an_error_never_an_abort(tmp_path):
    # Regression (issue 32): bad_alloc escaped through the C ABI (WrappedCompile, the in-flight map,
    # memory accounting's try_emplace, Activate) and aborted the process.
    _survives_every_failure_point(tmp_path, _JAX, pjrt_job.lammps_plugin())


def test_no_memory_in_the_wrapper_under_torch_xla_is_a_miss_or_an_error_never_an_abort(tmp_path):
    # Regression (issue 32): as above, through torch_xla's execute bridge and buffer accounting too.
    _survives_every_failure_point(tmp_path, _TORCH_XLA, pjrt_job.xla_cpu_plugin(),
                                  XLAKIT_TEST_REAL_PLUGIN=str(pjrt_wrap.library_path()))  # pjrt_job loads it


# -- flag files ---------------------------------------------------------------------------------------------

def _job(folder: Path, **env: str) -> dict:
    done = _run(pjrt_job.__file__, "jax", XLAKIT_PJRT_CACHE_DIR=str(folder), **env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr
    return out


def _jax(folder: Path, flags: str) -> dict:
    # LIBTPU_INIT_ARGS: keyed, and ignored by the CPU plugin (which would read XLA_FLAGS' files itself).
    return _job(folder, LIBTPU_INIT_ARGS=flags, XLAKIT_PJRT_PLUGIN=pjrt_job.lammps_plugin())


def test_a_flag_file_that_cannot_be_keyed_turns_the_cache_off_and_never_blocks(tmp_path):
    # Regression (issue 32): a flag file was read without a bound (/dev/zero hung the start), and a FIFO
    # blocked it.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"--x=1\n" * 300_000)
    for flags, says in ((f"--flagfile={fifo}", "not a regular file"), ("--flagfile=/dev/zero", "not a regular file"),
                        (f"-flagfile {big}", "holds more than")):
        out = _jax(tmp_path / "cache", flags)
        cache = out["status"]["cache"]
        assert not cache["on"] and says in cache["why_off"] and "LIBTPU_INIT_ARGS" in cache["why_off"], cache
        assert out["status"]["counts"]["bypassed"] == out["status"]["counts"]["compiles"] > 0


def test_nested_flag_files_are_keyed_by_content(tmp_path):
    # Regression (issue 32): a flag file's own --flagfile was not followed, so changing it kept the key.
    folder = tmp_path / "cache"
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    outer.write_text(f"--xla_tpu_x=1\n--flagfile={inner}\n")
    for flags in (f"--flagfile={outer}", f"-flagfile {outer}"):  # absl's spellings, each its own key
        inner.write_text("--xla_tpu_enable_latency_hiding_scheduler=true\n")
        assert _jax(folder, flags)["status"]["counts"]["writes"] > 0
        inner.write_text("--xla_tpu_enable_latency_hiding_scheduler=false\n")
        assert _jax(folder, flags)["status"]["counts"]["hits"] == 0
    inner.write_text(f"--flagfile={outer}\n")  # a circle
    out = _jax(folder, f"--flagfile={outer}")
    assert not out["status"]["cache"]["on"] and "nest deeper" in out["status"]["cache"]["why_off"]


# -- log lines ----------------------------------------------------------------------------------------------

def test_format_controls_in_log_lines_are_escaped(tmp_path):
    # Regression (issue 32): bidi controls (U+202E) and other format characters reached log lines as they were.
    controls = [chr(c) for c in range(0x80, 0x110000) if unicodedata.category(chr(c)) in ("Cf", "Zl", "Zp")]
    # The plugin path is quoted in the refusal the wrapper logs; cut into path components of < 255 bytes.
    path = "/nonexistent/" + "/".join("".join(controls[i:i + 40]) for i in range(0, len(controls), 40)) + "/p.so"
    load = "import ctypes, sys; ctypes.CDLL(sys.argv[1]).GetPjrtApi()"
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLAKIT_")}
    done = subprocess.run([sys.executable, "-c", load, str(pjrt_wrap.library_path())], capture_output=True,
                          env={**base, "XLAKIT_PJRT_PLUGIN": path}, timeout=60)
    line = next(ln for ln in done.stderr.decode("utf-8").splitlines() if "cannot load the real plugin" in ln)
    assert not [c for c in line if unicodedata.category(c) in ("Cf", "Zl", "Zp", "Cc")], line
    assert "\\u{202e}" in line and "\\u{feff}" in line and "\\u{e007f}" in line
