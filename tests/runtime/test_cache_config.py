"""The compile cache's configuration: what a cache path may be, which folder it names, and who says it is off.

Issue 25, item 3. The runs go through stock torch_xla 2.9 and xlakit's PJRT
wrapper with `PJRT_DEVICE=TPU`, OpenXLA's xla-cpu-pjrt standing in for
libtpu (or registered in code as `XLACPU`, as tests/support/pjrt_job.py does); the
rest is checked in this process, before any runtime would start.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import xlakit
from xlakit import cli
from xlakit.runtime import features, cache_trust, contract, pjrt_wrap
from xlakit.errors import CompileCacheError, ConfigurationError

from tests.support import REPO, SUPPORT
from tests.support.fakes import FakeXLAC

ROOT = REPO
# The xlakit under test (a worktree's), then the repository for `tests`: a bare PYTHONPATH=ROOT would
# import whichever xlakit the environment has installed.
PYTHONPATH = os.pathsep.join([str(Path(xlakit.__file__).resolve().parents[1]), str(ROOT)])
HAS_PLUGIN = importlib.util.find_spec("xla_plugins") is not None


def xla_cpu_plugin() -> str:
    from tests.support import pjrt_job

    return pjrt_job.xla_cpu_plugin()


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLAKIT_", "TPU_", "PTXLA_", "XLA_PERSISTENT"))}
    env.update(PYTHONPATH=PYTHONPATH, **extra)
    return env


def xlakit_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xlakit", *args], env=env or child_env(), capture_output=True,
                          text=True, timeout=240, cwd=cwd)


def exports(text: str) -> dict[str, str]:
    """The variables `xlakit pjrt env` exports, as the shell would set them."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        out[name] = shlex.split(value)[0]
    return out


# A training step on the device; with an argument, enable_persistent_cache(argument) first.
STEP = textwrap.dedent("""
    import json, sys
    import xlakit
    where = str(xlakit.enable_persistent_cache(sys.argv[1])) if len(sys.argv) > 1 else None
    import torch, torch_xla
    from xlakit.runtime import pjrt_wrap
    x = torch.arange(16, dtype=torch.float32, device=torch_xla.device())
    (x * 3 + 1).sum().item()
    s = pjrt_wrap.status()
    print(json.dumps({"where": where, "cache": s.get("cache"), "counts": s.get("counts")}))
""")


def step(env: dict[str, str], *args: str, cwd: Path | None = None) -> dict:
    run = subprocess.run([sys.executable, "-c", STEP, *args], env=env, capture_output=True, text=True, timeout=240,
                         cwd=cwd)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture
def enable_here(monkeypatch):
    """The real enable_persistent_cache before any compilation; torch_xla's own switch is recorded, not flipped."""
    import torch_xla.runtime as xr

    asked: list[tuple[str, bool]] = []
    monkeypatch.setattr(features, "xlac", lambda: FakeXLAC(features._import_xlac()[0]))
    monkeypatch.setattr(xr, "initialize_cache", lambda path, readonly: asked.append((path, readonly)))
    for name in ("XLAKIT_CACHE_TRUST_SHARED", "XLAKIT_CACHE_KEY", "XLAKIT_PJRT_CACHE_READ_ONLY",
                 "XLA_PERSISTENT_CACHE_READ_ONLY"):
        monkeypatch.delenv(name, raising=False)

    def enable(*args, **kwargs):
        return xlakit.enable_persistent_cache(*args, **kwargs)

    enable.asked = asked  # what torch_xla's own cache was asked to do: (folder, readonly)
    return enable


# -- the run contract knows the plugin registry -------------------------------------------------------------

def test_the_contract_accepts_a_plugin_registered_in_code(monkeypatch):
    # Regression (issue 25): a plugin registered with register_plugin, which starts and runs, was "not a
    # device torch_xla can start".
    import torch_xla.experimental.plugins as plugins

    monkeypatch.setitem(plugins._plugin_registry, "XLAKITTEST", plugins.DevicePlugin())
    contract.check_run_contract(env={"PJRT_DEVICE": "XLAKITTEST"})
    accepted, source = contract.accepted_devices({})
    assert "XLAKITTEST" in accepted and "registered in code (XLAKITTEST)" in source
    with pytest.raises(xlakit.RunContractError, match="'NOSUCHDEV' is not a device torch_xla can start"):
        contract.check_run_contract(env={"PJRT_DEVICE": "NOSUCHDEV"})


@pytest.mark.pjrt
@pytest.mark.slow
def test_a_registered_plugin_through_the_wrapper_keeps_the_contract(tmp_path):
    # Regression (issue 25): the manifest of a job on a registered plugin logged CONTRACT BROKEN.
    run = subprocess.run([sys.executable, str(SUPPORT / "pjrt_job.py"), "torch_xla", "--enable",
                          str(tmp_path / "cache")], env=child_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["status"]["active"] and "XLACPU" in out["manifest_line"]
    assert "CONTRACT BROKEN" not in out["manifest_line"]


# -- what a cache path may be ------------------------------------------------------------------------------

def test_an_empty_path_and_a_url_are_refused_never_taken_for_a_folder(enable_here, monkeypatch, tmp_path):
    # Regression (issue 25): "" cached in the working directory; "gs://bucket/x" made a folder `gs:` there.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CompileCacheError, match="found an empty path"):
        enable_here("")
    # A gs:// or s3:// URL is the shared tier (tests/runtime/test_cache_tier.py), which needs the job's key;
    # any other scheme is refused as no folder.
    for url, says in (("gs://bucket/x", "expected XLAKIT_CACHE_KEY for the shared tier"),
                      ("s3://bucket/x", "expected XLAKIT_CACHE_KEY for the shared tier"),
                      ("file:///tmp/x", "which is never taken for a local path")):
        with pytest.raises(CompileCacheError, match=says):
            enable_here(url)
        bad = xlakit_cli("pjrt", "env", url, "--plugin", sys.executable, cwd=tmp_path)
        assert bad.returncode == 2 and says in bad.stderr, bad.stderr
    assert list(tmp_path.iterdir()) == [] and enable_here.asked == []


@pytest.mark.parametrize("what", ["/dev/null", "below a file"])
def test_a_path_that_is_no_folder_is_named_and_refused_without_chmod(enable_here, tmp_path, what):
    # Regression (issue 25): /dev/null was answered "fix: chmod 700 /dev/null"; a path below a regular file
    # was accepted by `xlakit pjrt env`, and the wrapper then turned its cache off.
    afile = tmp_path / "afile"
    afile.write_text("keep")
    path, kind = ("/dev/null", "a character device") if what == "/dev/null" else (str(afile / "cache"),
                                                                                  "a regular file")
    with pytest.raises(CompileCacheError) as refused:
        enable_here(path)
    assert not isinstance(refused.value, PermissionError)  # not a trust matter: nothing to chmod
    assert kind in str(refused.value) and "chmod" not in str(refused.value)
    verdict = cache_trust.judge(path)
    assert verdict.not_a_folder and not verdict.trusted and "chmod" not in verdict.fix
    bad = xlakit_cli("pjrt", "env", path, "--plugin", sys.executable)
    assert bad.returncode == 2 and kind in bad.stderr and "chmod" not in bad.stderr, bad.stderr
    assert afile.read_text() == "keep" and enable_here.asked == []


# -- read-only from the environment ------------------------------------------------------------------------

def test_readonly_defaults_to_its_variable(enable_here, monkeypatch, tmp_path):
    # Regression (issue 25): XLAKIT_PJRT_CACHE_READ_ONLY=1 was overridden by enable_persistent_cache(path).
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_READ_ONLY", "1")
    where = enable_here(tmp_path / "cache")
    assert enable_here.asked == [(str(where), True)] and not (tmp_path / "cache").exists()
    enable_here(tmp_path / "cache", readonly=False)  # an explicit argument beats the environment
    assert enable_here.asked[-1][1] is False
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_READ_ONLY", "ture")
    with pytest.raises(ConfigurationError, match="XLAKIT_PJRT_CACHE_READ_ONLY='ture'"):
        enable_here(tmp_path / "other")
    assert not (tmp_path / "other").exists()


@pytest.mark.pjrt
@pytest.mark.slow
@pytest.mark.skipif(not HAS_PLUGIN, reason="xla-cpu-pjrt is not installed (run `make setup`)")
def test_a_read_only_worker_through_the_wrapper_writes_nothing(tmp_path):
    root = tmp_path / "cache"
    env = child_env(PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=xla_cpu_plugin(), XLAKIT_PJRT_CACHE_READ_ONLY="1")
    out = step(env, str(root), cwd=tmp_path)
    assert out["cache"]["read_only"] and out["counts"]["compiles"] >= 1 and out["counts"]["writes"] == 0
    assert not root.exists()


# -- one path, one cache -----------------------------------------------------------------------------------

def test_pjrt_env_expands_home_as_enable_does(monkeypatch, tmp_path):
    # Regression (issue 25): `xlakit pjrt env "~/x"` exported $PWD/~/x.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("XLAKIT_CACHE_TRUST_SHARED", raising=False)
    lines = pjrt_wrap.env_lines("~/x", sys.executable)
    assert exports("\n".join(lines))["XLAKIT_PJRT_CACHE_DIR"] == str(tmp_path / "home" / "x" / "pjrt-tpu")
    assert not (tmp_path / "~").exists()


@pytest.mark.pjrt
@pytest.mark.slow
@pytest.mark.skipif(not HAS_PLUGIN, reason="xla-cpu-pjrt is not installed (run `make setup`)")
def test_one_path_is_one_cache_whichever_route(tmp_path):
    # Regression (issue 25): enable_persistent_cache(P) cached in P/pjrt-tpu, `xlakit pjrt env P` in P, so a
    # job through one route never hit what the other wrote.
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    base = child_env(HOME=str(home), PJRT_DEVICE="TPU")
    printed = xlakit_cli("pjrt", "env", "~/xla-cache", "--plugin", xla_cpu_plugin(), env=base, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    exported = exports(printed.stdout)
    folder = home / "xla-cache" / "pjrt-tpu"
    assert exported["XLAKIT_PJRT_CACHE_DIR"] == str(folder)
    # Environment only: the entries are written...
    first = step({**base, **exported}, cwd=tmp_path)
    assert first["cache"]["on"] and first["counts"]["writes"] == first["counts"]["compiles"] >= 1
    # ... and enable_persistent_cache of the same path finds every one of them.
    second = step({**base, "TPU_LIBRARY_PATH": xla_cpu_plugin()}, "~/xla-cache", cwd=tmp_path)
    assert second["where"] == str(folder) and second["cache"]["dir"] == str(folder)
    assert second["counts"]["hits"] == second["counts"]["compiles"] == first["counts"]["compiles"]
    assert second["counts"]["misses"] == 0


def test_pjrt_env_points_at_entries_an_earlier_xlakit_wrote_in_the_path_itself(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("XLAKIT_CACHE_TRUST_SHARED", raising=False)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / ("ab" * 32)).write_bytes(b"an entry of the wrapper")
    (root / "README").write_text("not an entry")
    assert cli.main(["pjrt", "env", str(root), "--plugin", sys.executable]) == 0
    err = capsys.readouterr().err
    assert f"{root} holds 1 entries an earlier xlakit wrote there directly" in err and "mv -t" in err
    assert sorted(p.name for p in root.iterdir()) == ["README", "ab" * 32]  # told, nothing moved
    # The path given as its own subfolder (what matched enable_persistent_cache before): its parent is named.
    sub = root / "pjrt-tpu"
    sub.mkdir(mode=0o700)
    (sub / ("cd" * 32)).write_bytes(b"an entry of the wrapper")
    assert cli.main(["pjrt", "env", str(sub), "--plugin", sys.executable]) == 0
    assert f"pass {root} instead" in capsys.readouterr().err


# -- manifest --check: a cache the environment asks for that is off ----------------------------------------

def test_check_fails_when_the_wrapper_never_loads(monkeypatch, tmp_path, capsys):
    # Regression (issue 25): XLAKIT_PJRT_CACHE_DIR with PJRT_DEVICE=CPU passed the check; nothing cached.
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("XLA_PERSISTENT_CACHE_PATH", "XLAKIT_CACHE_KEY", "XLAKIT_PJRT_CACHE_READ_ONLY"):
        monkeypatch.delenv(name, raising=False)
    assert os.environ["PJRT_DEVICE"] == "CPU"  # this process's runtime: the built-in client (conftest)
    assert cli.main(["manifest", "--check", "--profile", "cpu-dev"]) == 1
    err = capsys.readouterr().err
    assert "xlakit manifest --check: cache: XLAKIT_PJRT_CACHE_DIR=" in err
    assert "started without xlakit's PJRT wrapper (PJRT_DEVICE=CPU starts torch_xla's built-in CPU client" in err
    assert "fix: start the job with the wrapper" in err
    from xlakit.runtime import doctor

    probe = doctor.probe_cache_folder()  # doctor says the same
    assert probe.verdict == "fail" and "started without xlakit's PJRT wrapper" in probe.detail, probe


@pytest.mark.pjrt
@pytest.mark.slow
@pytest.mark.skipif(not HAS_PLUGIN, reason="xla-cpu-pjrt is not installed (run `make setup`)")
@pytest.mark.parametrize("case", ["on", "a file", "uncreatable", "mistyped read-only", "/dev/null", "a URL"])
def test_check_fails_when_the_cache_the_environment_asks_for_is_off(tmp_path, case):
    # Regression (issue 25): each of these exited 0 while the wrapper ran with its cache off.
    afile = tmp_path / "afile"
    afile.write_text("")
    cache, extra, says = {
        "on": (tmp_path / "cache", {}, None),
        "a file": (afile, {}, "is a regular file, not a folder"),
        # /proc takes no new folder, even from root.
        "uncreatable": (Path("/proc/xlakit-no-such-folder/cache"), {}, "cannot create /proc/xlakit-no-such-folder"),
        "mistyped read-only": (tmp_path / "cache", {"XLAKIT_PJRT_CACHE_READ_ONLY": "ture"},
                               "XLAKIT_PJRT_CACHE_READ_ONLY='ture'"),
        "/dev/null": (Path("/dev/null"), {}, "is a character device, not a folder"),
        "a URL": ("gs://bucket/x", {}, "XLAKIT_PJRT_CACHE_DIR='gs://bucket/x' is a URL: a shared compile cache tier"),
    }[case]
    env = child_env(PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=str(pjrt_wrap.library_path()),
                    XLAKIT_PJRT_PLUGIN=xla_cpu_plugin(), XLAKIT_PJRT_CACHE_DIR=str(cache), **extra)
    run = xlakit_cli("manifest", "--check", "--profile", "cpu-dev", env=env, cwd=tmp_path)
    assert "pjrt-wrap 0.81 cache" in run.stdout, run.stderr[-4000:]
    if says is None:
        assert run.returncode == 0 and "cache 0 hits 0 misses" in run.stdout, run.stderr[-4000:]
        return
    assert run.returncode == 1 and "| pjrt-wrap 0.81 cache off" in run.stdout, run.stderr[-4000:]
    found = [ln for ln in run.stderr.splitlines() if ln.startswith("xlakit manifest --check: cache: ")]
    assert len(found) == 1 and says in found[0] and "; fix: " in found[0] and "chmod" not in found[0], run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing made where the job started


@pytest.mark.pjrt
@pytest.mark.slow
@pytest.mark.skipif(not HAS_PLUGIN, reason="xla-cpu-pjrt is not installed (run `make setup`)")
def test_the_wrapper_reads_its_folder_variable_as_enable_reads_a_path(tmp_path):
    # A job that sets XLAKIT_PJRT_CACHE_DIR itself: ~ is $HOME, as in enable_persistent_cache("~/x"), not
    # a folder `~` where the job started.
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    env = child_env(HOME=str(home), PJRT_DEVICE="TPU", TPU_LIBRARY_PATH=str(pjrt_wrap.library_path()),
                    XLAKIT_PJRT_PLUGIN=xla_cpu_plugin(), XLAKIT_PJRT_CACHE_DIR="~/xla-cache/pjrt-tpu")
    out = step(env, cwd=tmp_path)
    assert out["cache"]["on"] and out["cache"]["dir"] == str(home / "xla-cache" / "pjrt-tpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_before_the_runtime_starts_the_check_says_what_the_wrapper_will_do(monkeypatch, tmp_path):
    # A manifest taken before the runtime starts (or where it cannot) predicts the wrapper's verdict.
    class NotStarted:
        def _xla_runtime_is_initialized(self):
            return False

    monkeypatch.setattr(features, "xlac", lambda: NotStarted())
    idle = {"loaded": False}  # status() of a process whose runtime has not called the wrapper
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(pjrt_wrap.library_path()))
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("XLAKIT_PJRT_CACHE_READ_ONLY", raising=False)
    assert pjrt_wrap.requested_cache_off(idle) is None
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_READ_ONLY", "ture")
    assert "XLAKIT_PJRT_CACHE_READ_ONLY='ture'" in pjrt_wrap.requested_cache_off(idle)[0]
    monkeypatch.delenv("XLAKIT_PJRT_CACHE_READ_ONLY")
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_DIR", "s3://bucket/cache")
    assert "a gs:// or s3:// URL is the shared tier" in pjrt_wrap.requested_cache_off(idle)[0]
    monkeypatch.setenv("XLAKIT_PJRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TPU_LIBRARY_PATH", "/opt/libtpu.so")
    why, fix = pjrt_wrap.requested_cache_off(idle)
    assert "PJRT_DEVICE=TPU loads TPU_LIBRARY_PATH=/opt/libtpu.so, not the wrapper" in why and "pjrt env" in fix
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert "torch_xla's built-in CPU client" in pjrt_wrap.requested_cache_off(idle)[0]
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(pjrt_wrap.library_path()))
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)  # a folder above that you cannot write
    assert f"cannot create {tmp_path / 'cache'}: you cannot write {tmp_path}" in \
        pjrt_wrap.requested_cache_off(idle)[0]
