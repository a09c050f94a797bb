"""xlakit.save on real torch_xla (CPU PJRT): one sync for the whole pending state, exact values."""

from __future__ import annotations

import pytest
import torch

import xlakit
from xlakit.checkpoint.file import transfer
from xlakit.checkpoint.format import archive

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def xla():
    import torch_xla
    import torch_xla.debug.metrics as met

    return torch_xla, met


def _count(met, name: str) -> int:
    data = met.metric_data(name)
    return data[0] if data else 0


def _pending_state(torch_xla, layers: int, width: int) -> dict:
    """A model + AdamW whose last step is still pending (not yet executed)."""
    device = torch_xla.device()
    torch.manual_seed(layers * 1000 + width)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, width, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()
        if _ == 0:
            torch_xla.sync()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}


def _host_copy(state):
    """Reference values: every tensor moved to host by the stock path."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _host_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_host_copy(v) for v in state)
    return state


def _assert_bit_exact(expected, actual):
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape
        assert bytes(archive.tensor_bytes(expected.contiguous())) == bytes(
            archive.tensor_bytes(actual.contiguous()))
    elif isinstance(expected, dict):
        assert list(expected) == list(actual)
        for k in expected:
            _assert_bit_exact(expected[k], actual[k])
    elif isinstance(expected, (list, tuple)):
        for a, b in zip(expected, actual):
            _assert_bit_exact(a, b)
    else:
        assert expected == actual


@pytest.mark.parametrize("layers,width", [(3, 24), (12, 40)])
def test_pending_state_compiles_exactly_one_graph(xla, tmp_path, layers, width):
    torch_xla, met = xla
    state = _pending_state(torch_xla, layers, width)
    n_tensors = len(state["model"]) + 2 * len(state["model"]) + 1
    before = _count(met, "CompileTime")
    xlakit.save(state, tmp_path / "c.pt")
    assert _count(met, "CompileTime") - before == 1, f"{n_tensors} tensors"


def test_plain_torch_save_compiles_per_tensor(xla, tmp_path):
    # Regression guard for the defect xlakit.save exists for: torch.save compiles one graph per tensor.
    torch_xla, met = xla
    state = _pending_state(torch_xla, 2, 28)
    before = _count(met, "CompileTime")
    torch.save(state, tmp_path / "plain.pt")
    assert _count(met, "CompileTime") - before > 4


@pytest.mark.parametrize("mode", ["dlpack", "stock"])
def test_xla_state_round_trips_bit_exactly(xla, tmp_path, monkeypatch, mode):
    torch_xla, _ = xla
    monkeypatch.setenv("XLAKIT_TRANSFER_BACKEND", mode)
    state = _pending_state(torch_xla, 2, 36)
    state["host_tensor"] = torch.arange(5)
    xlakit.save(state, tmp_path / "c.pt")
    expected = _host_copy(state)
    _assert_bit_exact(expected, xlakit.load(tmp_path / "c.pt"))
    _assert_bit_exact(expected, torch.load(tmp_path / "c.pt", map_location="cpu", weights_only=True))


def test_cpu_pjrt_uses_zero_copy_dlpack(xla):
    torch_xla, _ = xla
    t = torch.ones(8, device=torch_xla.device())
    backend = transfer.backend_for("xla", t)
    assert backend.name == "xla-dlpack"
    backend.prepare([t])
    host = backend.to_host([t], timeout_s=10)[0]
    assert host.device.type == "cpu" and torch.equal(host, torch.ones(8))


def test_transfer_batches_respect_max_inflight_bytes(xla, tmp_path, monkeypatch):
    torch_xla, _ = xla
    seen = []
    real = transfer.backend_for

    class Spy(transfer.HostTransfer):
        def __init__(self, inner):
            self.inner = inner

        def prepare(self, tensors):
            self.inner.prepare(tensors)

        def to_host(self, tensors, *, timeout_s):
            seen.append(sum(t.numel() * t.element_size() for t in tensors))
            return self.inner.to_host(tensors, timeout_s=timeout_s)

    monkeypatch.setattr(transfer, "backend_for", lambda d, s, **kw: Spy(real(d, s, **kw)))
    state = _pending_state(torch_xla, 4, 44)
    cap = 3 * 44 * 44 * 4
    xlakit.save(state, tmp_path / "c.pt", max_inflight_bytes=cap)
    assert len(seen) > 3 and max(seen) <= cap
    _assert_bit_exact(_host_copy(state), xlakit.load(tmp_path / "c.pt"))


def test_state_synced_asynchronously_just_before_the_save_is_exported_safely(xla, tmp_path):
    # Buffers of an asynchronous torch_xla.sync() may still be in flight; exporting such a buffer
    # through DLPack aborted a process here (dl_convertor "Could not get a valid pjrt_buffer").
    torch_xla, _ = xla
    device = torch_xla.device()
    for i in range(20):
        state = {"w": torch.full((512, 512), float(i), device=device) * 2}
        torch_xla.sync()  # asynchronous: the buffers may not be ready yet
        xlakit.save(state, tmp_path / "c.pt")
        assert torch.equal(xlakit.load(tmp_path / "c.pt")["w"], torch.full((512, 512), 2.0 * i))


TWO_DEVICES = """
import json, sys, tempfile, torch, torch_xla, xlakit
from pathlib import Path
d0, d1 = torch_xla.device(0), torch_xla.device(1)
state = {"a": torch.ones(4, device=d0), "b": torch.full((4,), 2.0, device=d1)}
state["c"] = state["b"] * 3  # pending on xla:1: the save's sync runs it
want = {"a": torch.ones(4), "b": torch.full((4,), 2.0), "c": torch.full((4,), 6.0)}
folder, out = Path(tempfile.mkdtemp()), {}
def same(got):
    return all(torch.equal(got[k].cpu(), v) for k, v in want.items())
for name, kw in [("stock", dict(transfer_backend="stock")), ("dlpack", dict(transfer_backend="dlpack")),
                 ("async", dict(asynchronous=True)),
                 ("device staging", dict(asynchronous=True, staging="device", transfer_backend="stock"))]:
    try:
        handle = xlakit.save(state, folder / "c.pt", **kw)
        handle and handle.result(60)
        out[name] = same(xlakit.load(folder / "c.pt"))
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
template = {"a": torch.zeros(4, device=d0), "b": torch.zeros(4, device=d1), "c": torch.zeros(4, device=d1)}
restored = xlakit.restore(folder / "c.pt", template)
out["restore"] = same(restored) and [str(t.device) for t in restored.values()] == ["xla:0", "xla:1", "xla:1"]
print(json.dumps(out))
"""


def test_a_state_on_two_devices_of_one_process_saves_on_every_route(tmp_path):
    # Every save failed with torch_xla's "'CPU:0' vs 'CPU:1'": its syncs and copies take one device at a time.
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2", TMPDIR=str(tmp_path))
    env.pop("XLA_USE_SPMD", None)
    run = subprocess.run([sys.executable, "-c", TWO_DEVICES], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "stock": True, "dlpack": True, "async": True, "device staging": True, "restore": True}
