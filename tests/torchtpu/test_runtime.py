"""The runtime side on TorchTPU: manifest, run contract, doctor, the compile cache, no torch_xla anywhere."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import xlakit
from tests.support import REPO
from xlakit import _knobs
from xlakit.runtime import torchtpu

pytestmark = pytest.mark.torchtpu

TIER3 = _knobs.TORCH_TPU_TIER3_CACHE_ROOT

# Every entry point, in a process where a fake torch_xla records being imported.
_EVERY_PATH = """
import sys, tempfile, torch
from pathlib import Path
import xlakit, xlakit.checkpoint, xlakit.runtime.manifest, xlakit.cli
from xlakit.runtime import torchtpu, torchtpu_doctor
xlakit.enable_persistent_cache(tempfile.mkdtemp())
tpu = torchtpu.start_on_cpu_plugin()
d = Path(tempfile.mkdtemp())
s = {"w": torch.ones(4, device=tpu)}
xlakit.save(s, d / "a.pt"); xlakit.load(d / "a.pt"); xlakit.restore(d / "a.pt", s)
xlakit.save(s, d / "b.pt", asynchronous=True).result()
xlakit.dcp_save(s, d / "dcp"); xlakit.dcp_load(s, d / "dcp")
m = xlakit.CheckpointManager(d / "run"); m.save(1, s); m.restore(1, template=s); m.close()
xlakit.check_run_contract(); xlakit.manifest_line(); torchtpu_doctor.probes(profile=None, pins=None, timeout_s=60)
print("torch_xla" in sys.modules)
"""


def test_nothing_imports_torch_xla(tpu, tmp_path):
    fake = tmp_path / "fake" / "torch_xla"
    fake.mkdir(parents=True)
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('fake')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(REPO)]))
    env.pop(TIER3, None)
    done = subprocess.run([sys.executable, "-c", _EVERY_PATH], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists(), "something imported torch_xla on TorchTPU"
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_manifest_names_torch_tpu_libtpu_and_torch(tpu):
    m = xlakit.manifest()
    assert m["torch_tpu"]["version"] == "0.2.0" and m["torch_tpu"]["plugin"].endswith("xla_cpu_pjrt.so")
    assert m["torch"]["version"].startswith("2.13.0") and m["libtpu"]["version"] is None
    assert "not installed" in m["libtpu"]["why_not"]
    assert m["torch_xla"]["why_not"] == "TorchTPU stack: torch_xla is not used"
    assert m["profile"]["name"] == "torchtpu-cpu" and m["drift"] == []
    assert m["runtime"]["device_type"] == "tpu"
    line = xlakit.manifest_line(m)
    assert "torch_tpu 0.2.0" in line and "libtpu none" in line and "torchtpu-cpu ok" in line


def test_contract_reads_libtpu_init_args_against_torchtpus_libtpu(tpu):
    # No libtpu here: the newest the torchtpu profile allows (0.0.52) removed this flag (in 0.0.37).
    env = {"LIBTPU_INIT_ARGS": "--xla_disable_hlo_passes=foo"}
    with pytest.raises(xlakit.RunContractError, match=r"libtpu 0\.0\.37 removed .*pinned torchtpu profile"):
        xlakit.check_run_contract(env=env)
    assert xlakit.check_run_contract(env={"PJRT_DEVICE": "GPU"}) is None, "PJRT_DEVICE is torch_xla's"


_ENABLE = """
import json, os, sys, xlakit
from xlakit.runtime import torchtpu
tpu = torchtpu.start_on_cpu_plugin()
out = {}

def refused(path, **kw):
    try:
        xlakit.enable_persistent_cache(path, **kw)
    except (xlakit.CompileCacheError, xlakit.RuntimeFeatureError) as e:
        return f"{type(e).__name__}: {e}"

out["empty"] = refused("")
where = xlakit.enable_persistent_cache(os.path.join(sys.argv[1], "cache"))
out.update(where=str(where), env=os.environ[sys.argv[2]], mode=oct(os.stat(where).st_mode & 0o777))
from xlakit.runtime import torchtpu_doctor
out["probe"] = list(torchtpu_doctor.probe_cache()[0][:2])
out["other"] = refused(os.path.join(sys.argv[1], "other"))
out["readonly"] = refused(os.path.join(sys.argv[1], "cache"), readonly=True)
import torch
(torch.ones(4, device=tpu) * 2).cpu()
del os.environ[sys.argv[2]]  # as if never set: TorchTPU has compiled, so a new root would be ignored
out["late"] = refused(os.path.join(sys.argv[1], "late"))
print(json.dumps(out))
"""


def test_enable_persistent_cache_configures_torchtpus_own(tpu, tmp_path):
    # In a fresh process: the call must come before TorchTPU's first use of its device.
    env = {k: v for k, v in os.environ.items() if k != TIER3}
    run = subprocess.run([sys.executable, "-c", _ENABLE, str(tmp_path), TIER3], capture_output=True, text=True,
                         env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    where = tmp_path / "cache" / "torch_tpu-0.2.0"
    assert out["where"] == out["env"] == str(where) and out["mode"] == "0o700"
    assert out["probe"] == ["torchtpu cache (tier 3)", "ok"]
    assert out["empty"].startswith("CompileCacheError: expected a cache folder, found an empty path")
    assert "already names" in out["other"] and "no read-only mode" in out["readonly"]
    assert out["late"].startswith("CompileCacheError: expected to run before TorchTPU's first use"), out["late"]
    assert not (tmp_path / "late").exists()


def test_cache_folder_others_can_write_is_refused(tpu, tmp_path, monkeypatch):
    monkeypatch.delenv(TIER3, raising=False)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(xlakit.CacheFolderTrustError, match="chmod"):
        xlakit.enable_persistent_cache(open_folder)
    assert TIER3 not in os.environ, "nothing set for a refused folder"
    monkeypatch.setenv(TIER3, str(open_folder))
    from xlakit.runtime import torchtpu_doctor

    assert torchtpu_doctor.probe_cache()[0][1] == "fail"


_COMPILE = """
import sys, xlakit
from xlakit.runtime import torchtpu
xlakit.enable_persistent_cache(sys.argv[1])
tpu = torchtpu.start_on_cpu_plugin()
import torch
x = torch.arange(64.0).reshape(8, 8).to(tpu)
print(((x @ x.T).relu().sum(dim=0) * 3 + 1).cpu().tolist())
"""


def test_tier3_cache_serves_a_restart(tpu, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != TIER3}
    # Each run gets its own, new tier-2 cache (node-local, /dev/shm): only tier 3 can serve the second.
    names = [f"xlakit-test-{uuid.uuid4().hex}" for _ in range(2)]
    try:
        runs = [subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path)], capture_output=True, text=True,
                               env=env | {_knobs.TORCH_TPU_TIER2_CACHE: name}, timeout=240) for name in names]
    finally:
        for name in names:
            shutil.rmtree(Path(torchtpu.TIER2_ROOT) / name, ignore_errors=True)
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    compiles = [int(re.findall(r"num_compilations=(\d+)", r.stderr)[-1]) for r in runs]
    # Measured: 5 compiles, then 0 or 1 (TorchTPU may lose its last tier-3 write at the first run's exit).
    assert compiles[0] > 0 and compiles[1] < compiles[0], compiles
    assert runs[0].stdout == runs[1].stdout


def test_doctor_reports_memory_from_torch_accelerator(tpu):
    from xlakit.runtime import torchtpu_doctor

    (name, verdict, detail, _), = torchtpu_doctor.probe_memory(timeout_s=60)
    assert name == "torchtpu memory" and "torch.accelerator.memory_stats" in detail
    assert verdict == "n/a" and "HBM figures need a TPU" in detail  # the CPU plugin reports no statistics


def test_memory_info_answers_from_torch_accelerator(tpu):
    infos = xlakit.memory_info()
    assert [i.device for i in infos][:1] == ["tpu:0"]
    assert not infos[0].supported and "HBM figures need a TPU" in infos[0].unsupported
    assert xlakit.memory_info("tpu:0").device == "tpu:0"
    with pytest.raises(ValueError, match="expected a TorchTPU device"):
        xlakit.memory_info("TPU:0")


def test_manifest_without_a_plugin_says_torch_cannot_be_imported_not_that_it_drifted():
    # Attack finding: without TPU_LIBRARY_PATH (import torch would abort) the row read `torch none` and
    # --check called it drift from the pin, as if the wrong torch were installed.
    env = {k: v for k, v in os.environ.items() if k not in (_knobs.TPU_LIBRARY_PATH, "PYTHONSTARTUP")}
    row = subprocess.run([sys.executable, "-m", "xlakit", "manifest"], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    assert row.returncode == 0 and "torch 2.13.0+cpu NOT IMPORTABLE (xlakit doctor)" in row.stdout, row
    check = subprocess.run([sys.executable, "-m", "xlakit", "manifest", "--check"], capture_output=True, text=True,
                           env=env, timeout=120, cwd=REPO)
    assert check.returncode == 1, check
    assert "2.13.0+cpu installed, which cannot be imported here: torch-tpu is installed" in check.stdout + check.stderr


@pytest.mark.parametrize("plugin", ["missing", "not a library"])
def test_a_tpu_library_path_that_names_no_plugin_is_reported_not_an_abort(tmp_path, plugin):
    # Regression: only an unset TPU_LIBRARY_PATH was caught before `import torch`; one naming a missing
    # file or a text file let torch_tpu's registration check abort manifest, doctor and memory (exit 1,
    # no report, `--json` empty).
    path = tmp_path / "libtpu.so"
    if plugin == "not a library":
        path.write_text("not a library")
    env = {**os.environ, _knobs.TPU_LIBRARY_PATH: str(path)}
    env.pop("PYTHONSTARTUP", None)
    found = _xlakit("manifest", "--json", env=env)
    assert found.returncode == 0, found.stderr[-2000:]
    why = json.loads(found.stdout)["torch"]["why_not"]
    assert f"TPU_LIBRARY_PATH={path}" in why and "aborts the process" in why, why
    for command in ("doctor", "memory"):
        done = _xlakit(command, env=env)
        assert "Check failed" not in done.stderr and f"TPU_LIBRARY_PATH={path}" in done.stdout + done.stderr, done


def _xlakit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # This checkout's xlakit, whatever the environment installed (its own python/ first on the path).
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "xlakit", *args], capture_output=True, text=True, env=env,
                          timeout=240, cwd=REPO)


def _checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    import torch

    xlakit.save({"w": torch.arange(6.0), "step": 3}, tmp_path / "c.pt")
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    return tmp_path / "c.pt", tmp_path / "run"


def test_json_reports_stay_json_where_torch_tpu_prints_at_its_import(tmp_path):
    # Regression (issue 32): with TPU_LIBRARY_PATH set, `xlakit manifest --json`, `ckpt inspect --json` and
    # `ckpt ls --json` began with torch_tpu's "libtpu not found." (its import prints to stdout).
    assert os.environ.get(_knobs.TPU_LIBRARY_PATH), "tests/conftest.py points it at the CPU plugin"
    path, run = _checkpoints(tmp_path)
    for args in (["manifest", "--json"], ["ckpt", "inspect", "--json", str(path)], ["ckpt", "ls", "--json", str(run)]):
        done = _xlakit(*args)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        json.loads(done.stdout)  # the whole of stdout, nothing before it


_CKPT_IN_PROCESS = """
import sys
from xlakit.cli import main
code = main(sys.argv[1:])
print("torch_tpu imported:", "torch_tpu" in sys.modules)
sys.exit(code)
"""


def test_ckpt_needs_no_device_and_works_without_tpu_library_path(tmp_path):
    # Regression (issue 32): without TPU_LIBRARY_PATH, torch's device-backend autoload ran torch_tpu's native
    # check: every `xlakit ckpt` subcommand exited 1, and `ckpt verify` called a good file damaged.
    path, run = _checkpoints(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != _knobs.TPU_LIBRARY_PATH}
    for args in (["ls", str(run)], ["inspect", str(path)], ["verify", str(path)], ["verify", str(run)],
                 ["diff", str(path), str(path)], ["convert", str(path), "--to", "xlakit", str(tmp_path / "x.pt")]):
        done = _xlakit("ckpt", *args, env=env)
        assert done.returncode == 0, (args, done.stdout[-1000:], done.stderr[-2000:])
    assert _xlakit("ckpt", "verify", str(path), env=env).stdout.startswith("OK: ")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p)
    inside = subprocess.run([sys.executable, "-c", _CKPT_IN_PROCESS, "ckpt", "verify", str(path)], env=env,
                            capture_output=True, text=True, timeout=240)
    assert inside.returncode == 0 and inside.stdout.splitlines()[-1] == "torch_tpu imported: False", inside


def test_no_command_imports_an_installed_torch_xla(tmp_path):
    # Regression (issue 32): where a torch_xla package is importable beside torch-tpu, `xlakit manifest`,
    # `doctor` and `memory` imported it (runtime/features.py) and reported the runtime broken.
    fake = tmp_path / "fake" / "torch_xla"
    fake.mkdir(parents=True)
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")  # importable, and says so
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    manifest = _xlakit("manifest", "--json", env=env)
    assert manifest.returncode == 0, manifest.stderr[-2000:]
    m = json.loads(manifest.stdout)
    assert m["torch_xla"]["why_not"] == "TorchTPU stack: torch_xla is not used" and "fix" not in m["runtime"]
    assert not marker.exists(), "xlakit manifest imported torch_xla in the TorchTPU environment"
    for args in (["doctor", "--timeout-s", "120"], ["memory"]):
        done = _xlakit(*args, env=env)
        assert "cannot import torch_xla" not in done.stdout + done.stderr, (args, done.stdout[-2000:])
        assert not marker.exists(), f"xlakit {args[0]} imported torch_xla in the TorchTPU environment"
