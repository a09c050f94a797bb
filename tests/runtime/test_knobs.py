"""Environment knobs: every `XLAKIT_*` variable is read by `_knobs`, and a value it cannot use is
refused naming the variable and the value, never only the option it feeds."""

from __future__ import annotations

import pytest
import torch

import xlakit
from xlakit import _knobs
from xlakit.checkpoint.file import transfer
from xlakit.checkpoint.objstore import upload
from xlakit.runtime import host_heap

# How each knob is read where xlakit reads it, and values that must be refused.
_READERS = {
    _knobs.SAVE_TIMEOUT_S: (lambda: xlakit.SaveOptions(), ["nan", "abc", "-1", "0", "NaN", "inf", "1e999", "1_0",
                                                           "\u0663"]),
    _knobs.MAX_INFLIGHT_BYTES: (lambda: xlakit.LoadOptions(), ["abc", "1.5", "0", "-3", "1e9", "1_0", "\u0663"]),
    _knobs.STALL_WARNING_S: (lambda: xlakit.SaveOptions(), ["nan", "ten"]),
    _knobs.PROGRESS_INTERVAL_S: (lambda: xlakit.LoadOptions(), ["nan", "-0"]),
    _knobs.TRANSFER_BACKEND: (lambda: xlakit.SaveOptions(), ["fast", "PATCHED"]),
    _knobs.PREEMPTION_GRACE_S: (lambda: _knobs.get_float(_knobs.PREEMPTION_GRACE_S), ["nan", "x"]),
    _knobs.DOCTOR_TIMEOUT_S: (lambda: _knobs.get_float(_knobs.DOCTOR_TIMEOUT_S), ["nan", "0"]),
    _knobs.CACHE_TRUST_SHARED: (lambda: _knobs.get_flag(_knobs.CACHE_TRUST_SHARED), ["ture", "2"]),
    _knobs.KEEP_HOST_HEAP: (host_heap.keep_if_asked, ["ture", "2"]),
    _knobs.CACHE_KEY: (_knobs.get_cache_key, ["short"]),
    _knobs.PROFILE: (lambda: xlakit.manifest(), ["no-such-profile"]),
    _knobs.OBJECT_PART_BYTES: (upload.part_bytes, ["16M", "0", "nan"]),
    _knobs.OBJECT_PARTS_IN_FLIGHT: (upload.parts_in_flight, ["four", "0", "-1"]),
    _knobs.OBJECT_CHUNK_BYTES: (upload.chunk_bytes, ["100MiB", "0", "-1"]),
    _knobs.OBJECT_REQUEST_TIMEOUT_S: (lambda: _knobs.get_float(_knobs.OBJECT_REQUEST_TIMEOUT_S), ["nan", "0"]),
    _knobs.MANAGER_LEASE_S: (lambda: _knobs.get_float(_knobs.MANAGER_LEASE_S), ["nan", "-5"]),
    _knobs.HOST_ID: (_knobs.get_host_id, ["../x", ".hidden", "a b", "x" * 129]),  # the local tier's host
    **{name: (lambda name=name: _knobs.get_float(name), ["nan", "0", "-1", "fast"])  # the shared tier (cache_tier/)
       for name in (_knobs.CACHE_TIER_PULL_TIMEOUT_S, _knobs.CACHE_TIER_PUBLISH_INTERVAL_S,
                    _knobs.CACHE_TIER_EXIT_TIMEOUT_S, _knobs.CACHE_TIER_REQUESTS_PER_S)},
}
# Set by xlakit itself for the processes of a job (what its manifest reports), any value.
_SET_BY_XLAKIT = {_knobs.CACHE_TIER_URL}


# Read by the PJRT wrapping plugin (C++) alone: a value it cannot use turns its cache off, saying so
# (tests/runtime/test_pjrt_wrap.py, tests/runtime/test_cache_integrity.py), or leaves its memory accounting
# on, saying so (tests/runtime/test_memory_wrapper.py), or leaves misses unexplained, saying so
# (tests/runtime/test_cache_explain.py).
_READ_BY_THE_WRAPPER = {_knobs.PJRT_PLUGIN, _knobs.PJRT_CACHE_DIR, _knobs.PJRT_CACHE_READ_ONLY,
                        _knobs.PJRT_CACHE_MAX_ENTRY_BYTES, _knobs.PJRT_MEMORY_ACCOUNTING,
                        _knobs.PJRT_CACHE_MAX_BYTES, _knobs.PJRT_CACHE_EXPLAIN}


def test_every_xlakit_knob_has_a_reader_here():
    names = {v for k, v in vars(_knobs).items() if k.isupper() and isinstance(v, str) and v.startswith("XLAKIT_")}
    assert names == set(_READERS) | _READ_BY_THE_WRAPPER | _SET_BY_XLAKIT


@pytest.mark.parametrize("name,value", [(n, v) for n, (_, values) in _READERS.items() for v in values])
def test_an_unusable_environment_value_names_the_variable_and_its_value(monkeypatch, name, value):
    # Regression: XLAKIT_SAVE_TIMEOUT_S=nan was reported as "timeout_s must be a positive number of
    # seconds, got nan" (the option, not the variable), an unknown XLAKIT_TRANSFER_BACKEND only when
    # an XLA tensor was saved, a mistyped XLAKIT_CACHE_TRUST_SHARED silently read as off.
    monkeypatch.setenv(name, value)
    read, _ = _READERS[name]
    with pytest.raises(ValueError) as info:
        read()
    assert isinstance(info.value, xlakit.ConfigurationError), repr(info.value)
    message = str(info.value)
    assert name in message
    if name != _knobs.CACHE_KEY:  # a key is a secret: its length is shown, never its value
        assert repr(value) in message
    else:
        assert value not in message


def test_usable_environment_values_are_taken(monkeypatch):
    monkeypatch.setenv(_knobs.SAVE_TIMEOUT_S, "12.5")
    monkeypatch.setenv(_knobs.MAX_INFLIGHT_BYTES, "4096")
    monkeypatch.setenv(_knobs.TRANSFER_BACKEND, "stock")
    monkeypatch.setenv(_knobs.CACHE_TRUST_SHARED, " Yes ")
    opts = xlakit.SaveOptions()
    assert (opts.timeout_s, opts.max_inflight_bytes, opts.transfer_backend) == (12.5, 4096, "stock")
    assert _knobs.get_flag(_knobs.CACHE_TRUST_SHARED) is True
    monkeypatch.setenv(_knobs.CACHE_TRUST_SHARED, "off")
    assert _knobs.get_flag(_knobs.CACHE_TRUST_SHARED) is False
    # An explicit argument beats the environment, even a broken one.
    monkeypatch.setenv(_knobs.SAVE_TIMEOUT_S, "nan")
    assert xlakit.SaveOptions(timeout_s=3).timeout_s == 3


def test_the_doctor_reports_a_broken_knob_in_one_line_and_its_fix_in_another(monkeypatch, capsys):
    # The fix (the error's note) was dropped: commands printed str(error) only.
    monkeypatch.setenv(_knobs.DOCTOR_TIMEOUT_S, "abc")
    from xlakit import cli

    assert cli.main(["doctor"]) == 2
    first, fix = capsys.readouterr().err.splitlines()
    assert "XLAKIT_DOCTOR_TIMEOUT_S='abc'" in first and fix == (
        "  Fix or unset XLAKIT_DOCTOR_TIMEOUT_S (unset, the default is 120.0); an explicit argument overrides it.")


@pytest.mark.xla
@pytest.mark.parametrize("from_env", [True, False])
def test_patched_transfer_on_a_stock_build_is_refused_before_anything_is_written(
        monkeypatch, tmp_path, from_env):
    # Regression: XLAKIT_TRANSFER_BACKEND=patched on stock torch_xla raised a raw
    # AttributeError ("module '_XLAC' has no attribute '_xla_transfer_to_host'") from inside the save.
    import torch_xla

    from xlakit.runtime import features

    if features.has_binding(features.TRANSFER_TO_HOST):
        pytest.skip("this torch_xla is xlakit's patched build")
    state = {"w": torch.ones(4, device=torch_xla.device()), "cpu": torch.zeros(2)}
    if from_env:
        monkeypatch.setenv(_knobs.TRANSFER_BACKEND, "patched")
        kwargs = {}
    else:
        kwargs = {"transfer_backend": "patched"}
    for save in (lambda: xlakit.save(state, tmp_path / "c.pt", **kwargs),
                 lambda: xlakit.save(state, tmp_path / "a.pt", asynchronous=True, **kwargs),
                 lambda: xlakit.dcp_save(state, tmp_path / "d", **kwargs)):
        with pytest.raises(Exception) as info:
            save()
        assert isinstance(info.value, xlakit.RuntimeFeatureError), repr(info.value)
        message = str(info.value)
        assert ("set by XLAKIT_TRANSFER_BACKEND" if from_env else "passed as an option") in message
        assert "patched torch_xla build" in message and "nothing was written" in message
        assert "this build has: auto, dlpack, stock" in message
    assert list(tmp_path.iterdir()) == []
    assert transfer.available_backends() == ["auto", "dlpack", "stock"]


@pytest.mark.xla
@pytest.mark.parametrize("mode", ["dlpack", "stock"])
def test_the_transfer_backend_option_chooses_the_xla_backend(mode, monkeypatch, tmp_path):
    import torch_xla

    monkeypatch.delenv(_knobs.TRANSFER_BACKEND, raising=False)
    chosen = []
    real = transfer.backend_for

    def spy(device_type, sample, **kw):
        backend = real(device_type, sample, **kw)
        chosen.append(backend.name)
        return backend

    monkeypatch.setattr(transfer, "backend_for", spy)
    w = torch.arange(6.0, device=torch_xla.device())
    xlakit.save({"w": w}, tmp_path / "c.pt", transfer_backend=mode)
    assert chosen == [f"xla-{mode}"]
    assert torch.equal(xlakit.load(tmp_path / "c.pt")["w"], torch.arange(6.0))
