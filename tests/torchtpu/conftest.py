"""TorchTPU's tests: torch_tpu on xla-cpu-pjrt, in the `torchtpu-cpu` profile's environment.

Every module here sets `pytestmark = pytest.mark.torchtpu`, which tests/conftest.py turns
into a skip, with its reason, where torch-tpu or xla-cpu-pjrt is missing (the
torch_xla environment): run them with
`make test PROFILE=torchtpu-cpu VENV=.venv-torchtpu`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tpu():
    """The `tpu` device, TorchTPU started once per test process over xla-cpu-pjrt.

    TorchTPU keeps a node-local tier-2 compile cache in /dev/shm; the tests (and
    the processes they start) use one of their own, removed at the end.
    """
    from xlakit import _knobs
    from xlakit.runtime import torchtpu

    name = f"xlakit-tests-{os.getpid()}"
    os.environ.setdefault(_knobs.TORCH_TPU_TIER2_CACHE, name)
    yield torchtpu.start_on_cpu_plugin()
    shutil.rmtree(Path(torchtpu.TIER2_ROOT) / name, ignore_errors=True)
