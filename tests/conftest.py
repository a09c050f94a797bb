"""Test configuration: run XLA on the CPU PJRT client, skip hardware we lack.

Markers (declared in pyproject.toml): `xla` needs torch_xla, `cuda` a CUDA
device, `build` an upstream torch_xla source in XLAKIT_TORCH_XLA_GIT, `pjrt`
jax and the PJRT CPU plugins from PyPI, `torchtpu` TorchTPU (torch-tpu with
xla-cpu-pjrt, the `torchtpu-cpu` profile's environment).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.support.objstore_servers import CLOSED_METADATA

# Before any torch import: where torch-tpu is installed, torch imports it, which aborts without a
# PJRT plugin; its test bed is xla-cpu-pjrt (tests/torchtpu; children inherit the variables).
if importlib.util.find_spec("torch_tpu") is not None and not os.environ.get("TPU_LIBRARY_PATH"):
    from xlakit.runtime import torchtpu as _torchtpu

    if _torchtpu.cpu_plugin_path() is not None:
        os.environ["TPU_LIBRARY_PATH"] = str(_torchtpu.cpu_plugin_path())
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# Before any torch_xla import: the test bed is the CPU PJRT client.
os.environ.setdefault("PJRT_DEVICE", "CPU")
# Before any client library is imported (google-auth reads these at import): every cloud metadata
# endpoint points at a closed port here, so no credential lookup can leave the machine.
os.environ.update(CLOSED_METADATA)


def pytest_configure(config):
    from tests.support.ranks import let_children_take_ctrl_c

    let_children_take_ctrl_c()
    # torch's autograd engine sizes its per-device queues on the first backward;
    # the XLA runtime must be up before any test runs one on the CPU.
    if importlib.util.find_spec("torch_xla") is not None:
        import torch_xla

        torch_xla.device()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    reasons = {}
    if importlib.util.find_spec("torch_xla") is None:
        reasons["xla"] = "torch_xla is not installed (run `make setup`)"
    if any(item.get_closest_marker("cuda") for item in items) and not _has_cuda():
        reasons["cuda"] = "no CUDA device on this machine"
    missing = [m for m in ("jax", "lammps_jax_pjrt_cpu", "xla_plugins") if importlib.util.find_spec(m) is None]
    if missing:
        reasons["pjrt"] = f"{', '.join(missing)} not installed (run `make setup`)"
    if not os.environ.get("XLAKIT_TORCH_XLA_GIT"):
        reasons["build"] = "set XLAKIT_TORCH_XLA_GIT to a torch_xla git URL or local mirror"
    for item in items:
        for marker, reason in reasons.items():
            # By marker, not keyword: a folder's name (tests/build) is a keyword of every test in it.
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))
    if importlib.util.find_spec("torch_tpu") is None or importlib.util.find_spec("xla_plugins") is None:
        # By marker, not keyword: every item's keywords hold its checkout's folder name (which may be torchtpu).
        skip = pytest.mark.skip(reason="torch-tpu or xla-cpu-pjrt is not installed (its own environment: "
                                       "`make setup PROFILE=torchtpu-cpu VENV=.venv-torchtpu`)")
        for item in items:
            if item.get_closest_marker("torchtpu"):
                item.add_marker(skip)


@pytest.fixture
def no_pending_save():
    """Let an asynchronous save a test left running finish, so the next test starts idle."""
    yield
    from xlakit.checkpoint.file import background

    pending = background._pending
    if pending is not None:
        pending._finished.wait(30)
        background._pending = None


@pytest.fixture
def one_rank():
    """torch.distributed with one rank (gloo on loopback): a coordinated save of one rank, in this process."""
    import torch.distributed as dist

    from tests.support.ranks import private_port

    # Not a port the kernel hands out (free_port): one it handed out may be taken before the store binds it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{private_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- object storage: real servers on 127.0.0.1, shared by the session -----------------------------

@pytest.fixture(scope="session")
def objstore_servers(tmp_path_factory):
    """Started on first use, one per scheme, stopped at the end of the session."""
    from tests.support import objstore_servers as servers

    started: dict = {}

    def get(scheme: str):
        why = servers.installed()[scheme]
        if why is not None:
            pytest.skip(f"no {scheme}:// test server: {why}")
        if scheme not in started:
            started[scheme] = servers.Server(scheme, tmp_path_factory.mktemp(f"{scheme}-server"))
        return started[scheme]

    yield get
    for server in started.values():
        server.stop()


@pytest.fixture
def loopback_only():
    """No connection and no name lookup off this machine during the test (and it fails if one was
    tried, even where the client library swallowed the refusal)."""
    from tests.support import objstore_servers as servers

    before = len(servers.refused)
    servers.loopback_only(True)
    try:
        yield
    finally:
        servers.loopback_only(False)
    assert servers.refused[before:] == [], "a client tried to reach a host off this machine"


@pytest.fixture(params=["gs", "s3"])
def bucket(request, objstore_servers, monkeypatch, loopback_only):
    """A fresh bucket's URL on each server, the clients pointed at it by their standard variables."""
    server = objstore_servers(request.param)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return server.bucket()
