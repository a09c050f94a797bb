"""The TorchTPU profiles' requirement lines (issue 28): build/pins.py, tested here because every
test under tests/build is skipped without XLAKIT_TORCH_XLA_GIT ("build" is a keyword of each)."""

from __future__ import annotations

import os
import sys

from tests.support import REPO

sys.path.insert(0, str(REPO / "build"))

import pins  # noqa: E402


def test_torchtpu_cpu_installs_torch_tpu_alone_and_no_libtpu():
    first = pins.requirements("torchtpu-cpu")
    assert "torch==2.13.0+cpu" in first and "xla-cpu-pjrt==0.0.1" in first and "numpy>=2" in first
    assert not [r for r in first if r.startswith(("torch-tpu", "libtpu"))]
    assert pins.requirements("torchtpu-cpu", no_deps=True) == ["torch-tpu==0.2.0"]


def test_torchtpu_pins_libtpu_for_the_tpu_host():
    assert "libtpu>=0.0.50" in pins.requirements("torchtpu")
    assert pins.requirements("torchtpu", no_deps=True) == ["torch-tpu==0.2.0"]


def test_profiles_without_no_deps_are_unchanged():
    assert pins.requirements("cpu-dev") == ["torch==2.9.0", "torch_xla==2.9.0"]
    assert pins.requirements("cpu-dev", no_deps=True) == []


def test_make_setup_of_a_torchtpu_profile_ends_by_saying_how_to_start_torchtpu(tmp_path):
    # Regression (issue 32): `import torch` in the new environment dies on "TPU_LIBRARY_PATH is not set"
    # and `make setup PROFILE=torchtpu-cpu` said nothing about it.
    import subprocess

    from xlakit.runtime import torchtpu

    venv = tmp_path / "venv"
    # Run as a top-level make: under `make test` (CI) a nested make prints "Leaving directory" last.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    plan = subprocess.run(["make", "--no-print-directory", "-n", "setup", "PROFILE=torchtpu-cpu", f"VENV={venv}"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert plan.returncode == 0, plan.stderr
    last = plan.stdout.strip().splitlines()[-1]
    assert last == f"""{venv}/bin/python -c 'from xlakit.runtime.torchtpu import setup_hint; print(setup_hint("{venv}"))'"""
    cpu_dev = subprocess.run(["make", "--no-print-directory", "-n", "setup", f"VENV={venv}"], capture_output=True,
                             text=True, cwd=REPO, timeout=60, env=env)
    assert "setup_hint" not in cpu_dev.stdout
    hint = torchtpu.setup_hint(".venv-torchtpu")
    assert "TPU_LIBRARY_PATH is not set" in hint and "torchtpu.start_on_cpu_plugin()" in hint
    assert ("export TPU_LIBRARY_PATH=" in hint) == (torchtpu.cpu_plugin_path() is not None)
