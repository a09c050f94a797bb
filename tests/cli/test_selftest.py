"""`xlakit selftest` end to end on the CPU plugins, each run a fresh `python -m xlakit` process.

Stock torch_xla 2.9 with `PJRT_DEVICE=TPU` and OpenXLA's xla-cpu-pjrt standing
in for libtpu (so the checks go through xlakit's PJRT wrapper), with its
built-in CPU client, under SPMD on four devices, and torch alone with jax on
lammps-jax-pjrt-cpu (the route torch on CUDA takes with jax's CUDA plugin);
then what breaks: a plugin that is no library, a torch_xla that cannot be
imported. Two ranks under torchrun check the multi-process part. Every check
must pass or skip with its reason, `--json` must validate against the
shipped schema, and no run may print a traceback or the cache key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tests.support import REPO, pjrt_job
from xlakit.selftest import report

pytestmark = [pytest.mark.slow, pytest.mark.pjrt]

SECRET = "selftest-key-" + "z" * 40
PYTHONPATH = os.pathsep.join([str(REPO / "python"), str(REPO)])


def _env(tmp_path: Path, **over: str) -> dict[str, str]:
    """The run's environment: its temporary folders under tmp_path/tmp (checked empty after), HOME apart
    (where the wrapper remembers plugin digests)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XLAKIT_", "PJRT_", "TPU_", "XLA_")) and k not in ("RANK", "WORLD_SIZE")}
    for name in ("home", "tmp"):
        (tmp_path / name).mkdir(exist_ok=True)
    env.update(PYTHONPATH=PYTHONPATH, HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"),
               XLAKIT_PROFILE="cpu-dev")
    return env | over


def selftest(tmp_path: Path, *args: str, code: int = 0, **env: str) -> tuple[dict, str]:
    """Run it with --json; the report (validated against the schema) and stderr."""
    run = subprocess.run([sys.executable, "-m", "xlakit", "selftest", "--quick", "--json", *args],
                         env=_env(tmp_path, **env), capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert "Traceback" not in run.stdout + run.stderr, run.stderr[-4000:]
    assert run.returncode == code, run.stdout[-4000:] + run.stderr[-4000:]
    found = json.loads(run.stdout)  # stdout holds the report alone, whatever a framework printed
    jsonschema.validate(found, report.schema(), cls=jsonschema.Draft202012Validator)
    return found, run.stderr


def statuses(found: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in found["checks"]}


def by_name(found: dict) -> dict[str, dict]:
    return {c["name"]: c for c in found["checks"]}


def test_on_the_wrapper_with_xla_cpu_pjrt_for_libtpu_everything_passes_and_no_secret_is_shown(tmp_path):
    file = tmp_path / "report.json"
    found, err = selftest(tmp_path, "--report", str(file), PJRT_DEVICE="TPU",
                          TPU_LIBRARY_PATH=pjrt_job.xla_cpu_plugin(), XLAKIT_CACHE_KEY=SECRET)
    assert statuses(found) == {"stack": "pass", "compile_cache": "pass", "memory": "pass", "checkpoint": "pass",
                               "ranks": "skip"}, found["checks"]
    checks = by_name(found)
    cache = checks["compile_cache"]
    assert cache["details"]["route"] == "pjrt-wrap" and cache["details"]["tampered"]
    second = cache["details"]["counts"][1]
    assert second["P"]["hits"] >= 1 and second["P"]["misses"] == 0 and second["Q"]["refused"] >= 1
    assert cache["timings_s"]["load_s_process2"] < cache["timings_s"]["compile_s_process1"]
    live = checks["memory"]["details"]["devices"]["CPU:0"]["live"]
    assert live["with"] - live["before"] == live["with"] - live["freed"] == 4 << 20
    assert "PJRT_Device_MemoryStats: UNIMPLEMENTED" in checks["memory"]["summary"]
    assert checks["checkpoint"]["details"]["state_bytes"] == 16 << 20
    timings = checks["checkpoint"]["timings_s"]
    assert timings["async_device_staged_blocked"] <= timings["async_device_staged_committed"]
    assert "with staging='device'" in checks["checkpoint"]["summary"]
    assert "torchrun" in checks["ranks"]["reason"]
    assert found["manifest"]["runtime"]["device_type"] == "TPU" and found["backend"]["cache_route"] == "pjrt-wrap"
    # The key: its id and length only, anywhere the report goes.
    assert found["env"]["XLAKIT_CACHE_KEY"].startswith(f"<set: {len(SECRET)} bytes, id ")
    assert SECRET not in json.dumps(found) + err + file.read_text()
    assert json.loads(file.read_text()) == found
    assert list((tmp_path / "tmp").iterdir()) == []  # its temporary folder removed


def test_on_the_built_in_cpu_client_what_cannot_be_checked_is_skipped_with_its_reason(tmp_path):
    found, _ = selftest(tmp_path, PJRT_DEVICE="CPU")
    assert statuses(found) == {"stack": "pass", "compile_cache": "skip", "memory": "skip", "checkpoint": "pass",
                               "ranks": "skip"}
    checks = by_name(found)
    assert "built-in CPU client (PJRT_DEVICE=CPU) is no PJRT plugin" in checks["compile_cache"]["reason"]
    assert "keeps no allocator statistics" in checks["memory"]["reason"]


def test_under_spmd_each_device_counts_its_share(tmp_path):
    found, _ = selftest(tmp_path, "--checks", "memory", PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=pjrt_job.xla_cpu_plugin(),
                        XLA_USE_SPMD="1", XLA_NO_SPECIAL_SCALARS="1")
    memory = by_name(found)["memory"]
    assert memory["status"] == "pass" and found["backend"]["spmd"], memory
    devices = memory["details"]["devices"]
    assert sorted(devices) == [f"CPU:{i}" for i in range(4)]
    share = (4 << 20) // 4
    # torch_xla keeps a scalar it made on the way (4 bytes per device): the share is what freeing gives back.
    assert all(d["live"]["with"] - d["live"]["freed"] == share <= d["live"]["with"] - d["live"]["before"] < share + 64
               for d in devices.values()), devices


def test_torch_on_the_cpu_checks_the_cache_and_memory_through_jax(tmp_path):
    found, _ = selftest(tmp_path, "--backend", "cpu")
    assert statuses(found) == {"stack": "pass", "compile_cache": "pass", "memory": "pass", "checkpoint": "pass",
                               "ranks": "skip"}, found["checks"]
    checks = by_name(found)
    assert found["backend"]["cache_route"] == "jax" and "lammps_jax_pjrt_cpu" in found["backend"]["plugin"]
    assert checks["compile_cache"]["details"]["counts"][1]["Q"]["refused"] >= 1
    assert "; no nominal figure: the CPU backend" in checks["checkpoint"]["summary"]


def test_a_backend_this_machine_lacks_is_skipped_naming_what_is_missing(tmp_path):
    found, _ = selftest(tmp_path, "--backend", "cuda", "--checks", "stack,checkpoint,memory", PJRT_DEVICE="CPU")
    assert statuses(found)["stack"] == "pass"
    for name in ("memory", "checkpoint"):
        assert by_name(found)[name]["reason"].startswith("not run: torch ") and "sees no CUDA device" in \
            by_name(found)[name]["reason"]


def test_a_plugin_that_is_no_library_fails_the_stack_and_the_rest_say_why_they_did_not_run(tmp_path):
    not_a_library = tmp_path / "libtpu.so"
    not_a_library.write_text("not a shared object")
    found, _ = selftest(tmp_path, code=1, PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=str(not_a_library))
    assert statuses(found) == {"stack": "fail", "compile_cache": "skip", "memory": "skip", "checkpoint": "skip",
                               "ranks": "skip"}
    failed = f"the runtime did not start: RuntimeError: Failed to open {not_a_library}"
    assert failed in by_name(found)["stack"]["reason"]
    assert all(c["reason"].startswith(f"not run: {failed}") for c in found["checks"][1:4]), found["checks"]


def test_a_torch_xla_that_cannot_be_imported_is_named(tmp_path):
    fake = tmp_path / "fake-site" / "torch_xla"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libtorch_xla.so: cannot open shared object file')\n")
    found, _ = selftest(tmp_path, code=1, PJRT_DEVICE="CPU",
                        PYTHONPATH=os.pathsep.join([str(fake.parent), PYTHONPATH]))
    said = "cannot import torch_xla: ImportError: libtorch_xla.so: cannot open shared object file"
    stack = by_name(found)["stack"]
    assert stack["status"] == "fail" and said in stack["reason"] and stack["fix"]
    assert all(c["status"] == "skip" and said in c["reason"] for c in found["checks"][1:4]), found["checks"]


@pytest.mark.multiproc
def test_two_ranks_under_torchrun_agree_save_sharded_and_restore_from_a_peer(tmp_path):
    # Regression (issue 34, found while building it): each rank's manager got its own deadline, which the
    # managers' start refused as a disagreement; rank 0's is every rank's now.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "xlakit",
                          "selftest", "--quick", "--checks", "ranks", "--report", str(tmp_path / "r.json")],
                         env=_env(tmp_path, PJRT_DEVICE="CPU"), capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr[-4000:]
    for rank in (0, 1):
        found = json.loads((tmp_path / f"r.rank{rank}.json").read_text())
        jsonschema.validate(found, report.schema(), cls=jsonschema.Draft202012Validator)
        ranks = by_name(found)["ranks"]
        assert found["job"]["rank"] == rank and found["job"]["world"] == 2
        assert ranks["status"] == "pass" and ranks["details"]["simulated_hosts"], ranks
        assert ranks["details"]["sources"] == {"0": "peer", "1": "local"}
        assert {"join", "agreement", "sharded_save", "local_save_with_peer_copy",
                "restore_after_host_loss"} <= set(ranks["timings_s"])
    assert not list((tmp_path / "tmp").glob("xlakit-selftest*"))  # nothing of the self-test's left behind
