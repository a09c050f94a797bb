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
