"""TorchTPU's tests: torch_tpu on xla-cpu-pjrt, in the `torchtpu-cpu` profile's environment.

Every module here sets `pytestmark = pytest.mark.torchtpu`, which tests/conftest.py turns
into a skip, with its reason, where torch-tpu or xla-cpu-pjrt is missing (the
torch_xla environment): run them with
`make test PROFILE=torchtpu-cpu VENV=.venv-torchtpu`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tpu():
    """The `tpu` device, TorchTPU started once per test process over xla-cpu-pjrt."""
    from xlakit.runtime import torchtpu

    return torchtpu.start_on_cpu_plugin()
