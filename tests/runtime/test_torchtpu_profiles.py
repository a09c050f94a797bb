"""The TorchTPU profiles' requirement lines (issue 28): build/pins.py, tested here because every
test under tests/build is skipped without XLAKIT_TORCH_XLA_GIT ("build" is a keyword of each)."""

from __future__ import annotations

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
