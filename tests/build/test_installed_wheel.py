"""The released wheel, installed as a user installs it, proven outside the checkout (issue 33).

`make test-installed` runs this after `make wheel` (wheels/) and `make wheelhouse` (torch, torch_xla
2.9 and the rest downloaded once into XLAKIT_WHEELHOUSE). A fresh venv outside the checkout gets
them with `--no-index`, then the xlakit wheel with no network (a network namespace of its own where
the host allows one) and no compiler on PATH. Everything then runs from a folder that is not the
checkout, with no PYTHONPATH: the compile cache through the PJRT wrapper on torch_xla's TPU route
(xla-cpu-pjrt standing in for libtpu) restarted with every compile a hit and bit-exact results, a
save and restore, `xlakit doctor` and `xlakit manifest`. Every other Python the wheel is proven on
(VERSIONS.toml [wheel] pythons) installs it the same way and runs its native parts.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import REPO, SUPPORT

sys.path.insert(0, str(REPO / "build"))

import pins  # noqa: E402

WHEELHOUSE = os.environ.get("XLAKIT_WHEELHOUSE", "")
VERSION = pins.xlakit_version()
FLOOR = pins.load()["wheel"]["glibc"]
WHEELS = sorted((REPO / "wheels").glob(f"xlakit-{VERSION}-*.whl"))
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not WHEELHOUSE, reason="XLAKIT_WHEELHOUSE is unset: run `make test-installed`"),
    pytest.mark.skipif(len(WHEELS) != 1, reason=f"expected one xlakit-{VERSION}-*.whl in wheels/, found "
                                                f"{[w.name for w in WHEELS] or 'none'}: run `make wheel`"),
]


def _no_network() -> list[str]:
    """A prefix that runs a command with no network at all, where the host lets us make one."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn"]
    return []


NO_NET = _no_network()


def _env(venv: Path, home: Path, **extra: str) -> dict[str, str]:
    """Only the venv on PATH (no compiler), no PYTHONPATH, a HOME of the test's, proxies that lead nowhere."""
    closed = "http://127.0.0.1:9"
    return {"PATH": str(venv / "bin"), "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8",
            "http_proxy": closed, "https_proxy": closed, "PIP_CONFIG_FILE": os.devnull, **extra}


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _install(python: str, where: Path, *requirements: str, compile_py: bool = True
             ) -> tuple[Path, dict[str, str], Path]:
    """A fresh venv of `python` under `where`, `requirements` installed into it offline; (venv, env, run folder)."""
    venv, home, run = where / "venv", where / "home", where / "run"
    home.mkdir(mode=0o700, parents=True)
    run.mkdir()
    # ensurepip installs the pip the interpreter bundles: nothing is fetched.
    _ok(subprocess.run([python, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300))
    env = _env(venv, home)
    assert not any(shutil.which(c, path=env["PATH"]) for c in COMPILERS), env["PATH"]
    pip = [*NO_NET, str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--find-links", WHEELHOUSE]
    _ok(_run([*pip, *([] if compile_py else ["--no-compile"]), *requirements], env, run, timeout_s=1200))
    return venv, env, run


PROBE = textwrap.dedent("""
    import json, sys
    import xlakit, xlakit._C as c
    from xlakit.runtime import pjrt_wrap
    entry = c.encode_entry(b"p", kind="executable", platform_name="a", platform_version="b",
                           torch_xla_revision="c", patch_series_id="d")
    print(json.dumps({
        "modules": sorted(getattr(m, "__file__", None) or "" for n, m in sys.modules.items()
                          if n == "xlakit" or n.startswith("xlakit.")),
        "path": sys.path, "c": c.__file__, "entry": c.verify_entry(entry)["status"],
        "trust": c.judge_cache_folder(sys.argv[1])["state"],
        "wrapper": pjrt_wrap.status(), "library": str(pjrt_wrap.library_path()),
    }))
""")


def _probe(venv: Path, env: dict[str, str], run: Path) -> dict:
    """The installed xlakit imports from the venv, nothing of the checkout, and its native parts run."""
    found = json.loads(_ok(_run([str(venv / "bin" / "python"), "-c", PROBE, env["HOME"]], env, run)))
    site = str(venv.resolve())
    assert found["modules"] and all(f.startswith(site) for f in found["modules"] if f), found["modules"]
    assert not [p for p in found["path"] if p and Path(p).resolve().is_relative_to(REPO)], found["path"]
    assert found["c"].startswith(site) and found["c"].endswith("_C.abi3.so")
    assert found["entry"] == "ok" and found["trust"] == "owner-only"
    assert found["library"].startswith(site) and found["wrapper"]["built"], found["wrapper"]
    version = _ok(_run([str(venv / "bin" / "xlakit"), "--version"], env, run))
    assert version.startswith(f"xlakit {VERSION} (commit ") and f"glibc {FLOOR}+" in version, version
    return found


SAVE_RESTORE = textwrap.dedent("""
    import sys, torch, torch_xla, xlakit
    dev = torch_xla.device()
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32).to(dev), "opt": {"m": torch.arange(10.0).to(dev), "step": 7}}
    xlakit.save(state, sys.argv[1])
    template = {"w": torch.zeros(64, 32).to(dev), "opt": {"m": torch.zeros(10).to(dev), "step": 0}}
    back = xlakit.restore(sys.argv[1], template)
    loaded = xlakit.load(sys.argv[1])
    for got in (back, loaded):
        assert torch.equal(got["w"].cpu(), state["w"].cpu()) and torch.equal(got["opt"]["m"].cpu(), state["opt"]["m"].cpu())
        assert got["opt"]["step"] == 7
    print("restored")
""")


# Installing torch with its CUDA libraries (7 GB) alone takes minutes; doctor's cache probe starts two runtimes.
@pytest.mark.timeout(1500)
def test_the_wheel_installed_offline_runs_outside_the_checkout(tmp_path):
    assert not tmp_path.resolve().is_relative_to(REPO)
    (wheel,) = WHEELS
    started = time.monotonic()
    stack = [*pins.requirements("cpu-dev"), *[r for r in pins.test_tool_requirements() if r.startswith("xla-cpu")]]
    # --no-compile: torch's thousands of modules are byte-compiled when first imported instead; what is
    # installed is the same (and this step is most of the test's time).
    venv, env, run = _install(sys.executable, tmp_path, *stack, compile_py=False)
    installed = time.monotonic()
    # The wheel alone, as a user on a host with no compiler and no network installs it.
    pip = [*NO_NET, str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--find-links", WHEELHOUSE]
    _ok(_run([*pip, str(wheel)], env, run))
    _probe(venv, env, run)
    py = str(venv / "bin" / "python")
    plugin = _ok(_run([py, "-c", "import xla_plugins.xla_cpu_pjrt as p, pathlib; "
                                 "print(pathlib.Path(p.__file__).parent / 'xla_cpu_pjrt.so')"], env, run)).strip()

    # The restart, through enable_persistent_cache on the TPU route: a copy of the job (nothing of the
    # checkout is on the path), twice.
    shutil.copy(SUPPORT / "pjrt_job.py", run / "job.py")
    cache = Path(env["HOME"]) / "xla-cache"
    tpu = {**env, "TPU_LIBRARY_PATH": plugin}

    def job() -> dict:
        out = _ok(_run([py, "job.py", "torch_xla", "--tpu", "--enable", str(cache)], tpu, run))
        return json.loads(out.strip().splitlines()[-1])

    first, second = job(), job()
    c1, c2 = first["status"]["counts"], second["status"]["counts"]
    assert first["status"]["active"] and first["status"]["plugin"] == plugin, first["status"]
    assert c1["misses"] == c1["compiles"] == c1["writes"] >= 2 and c1["hits"] == 0, c1
    assert c2["hits"] == c2["compiles"] == c1["compiles"] and c2["misses"] == 0, c2
    assert second["results"] == first["results"]  # bit-exact
    assert f"| pjrt-wrap {first['status']['plugin_api']} cache {c2['hits']} hits 0 misses" in second["manifest_line"]

    # A save and a restore.
    assert _ok(_run([py, "-c", SAVE_RESTORE, str(tmp_path / "ckpt.pt")], {**env, "PJRT_DEVICE": "CPU"}, run)) \
        .strip().splitlines()[-1] == "restored"

    # The CLI on the wrapper route, set up as `xlakit pjrt env` tells a job to.
    exports = _ok(_run([str(venv / "bin" / "xlakit"), "pjrt", "env", str(cache), "--plugin", plugin],
                       {**env, "PJRT_DEVICE": "TPU"}, run))
    wrapped = {**env, "PJRT_DEVICE": "TPU"}
    for line in exports.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        wrapped[name] = value
    assert wrapped["TPU_LIBRARY_PATH"].startswith(str(venv.resolve()))
    doctor = _run([str(venv / "bin" / "xlakit"), "doctor", "--profile", "cpu-dev"], wrapped, run)
    report = _ok(doctor)
    assert "ok    cache: works: the second process loaded the first one's entry" in report, report
    assert f"ok    pjrt wrapper: wrapping {plugin}" in report and "ok    stack: " in report, report
    manifest = _run([str(venv / "bin" / "xlakit"), "manifest", "--json", "--check", "--profile", "cpu-dev"],
                    wrapped, run)
    m = json.loads(_ok(manifest))
    info = json.loads((REPO / "wheels" / "build-info.json").read_text())["xlakit"]
    assert m["xlakit"] == VERSION and m["xlakit_build"]["commit"] == info["commit"], m["xlakit_build"]
    assert m["xlakit_build"]["glibc_floor"] == info["glibc_floor"] == FLOOR
    assert m["pjrt_wrap"]["active"] and m["drift"] == [] and m["contract"] == [], m
    print(f"\ninstalled-wheel test: install {installed - started:.0f} s, runs {time.monotonic() - installed:.0f} s, "
          f"network namespace: {'yes' if NO_NET else 'no (host refuses one; --no-index and dead proxies only)'}")
    # 7 GB that pytest would keep for three sessions; a failure keeps it to look at.
    shutil.rmtree(venv)


def _interpreter(version: str) -> str | None:
    """A working `python<version>`: on PATH, or one pyenv installed."""
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates = [shutil.which(f"python{version}"), *sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))]
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                               text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return exe
    return None


OTHER_PYTHONS = [v for v in pins.wheel_pythons() if v != "%d.%d" % sys.version_info[:2]]


@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_every_other_supported_python_installs_the_one_wheel(tmp_path, version):
    exe = _interpreter(version)
    if exe is None:
        pytest.skip(f"no Python {version} here (on PATH or under pyenv)")
    (wheel,) = WHEELS
    venv, env, run = _install(exe, tmp_path, str(wheel))
    _probe(venv, env, run)
