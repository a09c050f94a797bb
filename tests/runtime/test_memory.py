"""Memory telemetry: the real stock CPU path, and dispatch to the patched binding via a stand-in."""

from __future__ import annotations

import pytest

import xlakit
from tests.support.fakes import FakePatchedXLAC
from xlakit import cli
from xlakit.cli import runtime as cli_runtime
from xlakit.runtime import features, memory

pytestmark = pytest.mark.xla



@pytest.fixture
def local_devices():
    return list(features.xlac()._xla_get_runtime_devices())


def test_cpu_client_answers_not_supported_clearly(local_devices):
    # Regression: stock _xla_memory_info on the CPU client raised an opaque "Bad StatusOr access".
    infos = xlakit.memory_info()
    assert [i.device for i in infos] == local_devices
    for info in infos:
        assert not info.supported and info.source is None and info.bytes_used is None
        assert "no allocator statistics" in info.unsupported and "GetAllocatorStats" in info.unsupported
        assert "Bad StatusOr access" not in info.unsupported


def test_one_device_gives_one_result(local_devices):
    info = xlakit.memory_info(local_devices[0])
    assert isinstance(info, xlakit.MemoryInfo) and info.device == local_devices[0]


def test_unknown_device_lists_the_valid_ones(local_devices):
    with pytest.raises(ValueError, match=f"one of {local_devices[0]}.*found 'TPU:18'"):
        xlakit.memory_info("TPU:18")


def test_patched_binding_is_asked_by_raw_device(monkeypatch, local_devices):
    calls = []

    def runtime_memory_info(device):
        calls.append(device)
        return {"bytes_used": 1 << 30, "bytes_limit": 32 << 30, "peak_bytes_used": None}

    fake = FakePatchedXLAC(features.xlac(), _xla_runtime_memory_info=runtime_memory_info)
    monkeypatch.setattr(features, "xlac", lambda: fake)
    monkeypatch.setenv("XLA_USE_SPMD", "1")  # the patched binding answers under SPMD too
    info = xlakit.memory_info(local_devices[0])
    assert calls == [local_devices[0]]
    assert (info.bytes_used, info.bytes_limit, info.peak_bytes_used) == (1 << 30, 32 << 30, None)
    assert info.supported and info.source == "_xla_runtime_memory_info"


def test_patched_binding_unsupported_error_becomes_the_reason(monkeypatch, local_devices):
    def runtime_memory_info(device):
        raise RuntimeError(f"allocator statistics are not supported by the CPU client ({device})")

    fake = FakePatchedXLAC(features.xlac(), _xla_runtime_memory_info=runtime_memory_info)
    monkeypatch.setattr(features, "xlac", lambda: fake)
    info = xlakit.memory_info(local_devices[0])
    assert not info.supported and info.unsupported.startswith("allocator statistics are not supported")


def test_stock_fallback_maps_the_raw_device_to_its_torch_device(monkeypatch, local_devices):
    asked = []

    def stock_memory_info(torch_device):  # stands in for a stock TPU client, which can answer
        asked.append(torch_device)
        return {"bytes_used": 10, "bytes_limit": 100, "peak_bytes_used": 20}

    fake = FakePatchedXLAC(features.xlac(), _xla_memory_info=stock_memory_info)
    monkeypatch.setattr(features, "xlac", lambda: fake)
    info = xlakit.memory_info(local_devices[-1])
    assert asked == [f"xla:{len(local_devices) - 1}"]
    assert info.source == "_xla_memory_info" and info.bytes_used == 10


def test_stock_build_under_spmd_says_why_not(monkeypatch, local_devices):
    monkeypatch.setenv("XLA_USE_SPMD", "1")
    info = xlakit.memory_info(local_devices[0])
    assert not info.supported and "SPMD" in info.unsupported and "install" in info.unsupported


def test_cli_prints_a_table(capsys, local_devices):
    assert cli.main(["memory"]) == 1  # nothing could be measured here
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["DEVICE", "USED", "LIMIT", "PEAK", "LIVE", "BUFFERS", "LIVE-PEAK", "SOURCE"]
    assert out[1].split()[0] == local_devices[0] and out[1].endswith("not supported")
    assert out[-1].startswith(f"{local_devices[-1]}: not supported: ")


def test_table_formats_bytes():
    table = cli_runtime.format_table([memory.MemoryInfo("TPU:0", 3 << 30, 32 << 30, 512, "_xla_runtime_memory_info")])
    assert table.splitlines()[1].split() == ["TPU:0", "3.0", "GiB", "32.0", "GiB", "512", "B", "-", "-", "-",
                                             "_xla_runtime_memory_info"]
