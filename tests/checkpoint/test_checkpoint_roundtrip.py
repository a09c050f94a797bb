"""Round trips of CPU state through xlakit.save: bit-exact, readable by plain torch.load."""

from __future__ import annotations

import logging
from collections import OrderedDict

import pytest
import torch

import xlakit
from xlakit.checkpoint.format.archive import tensor_bytes

from tests.support import fakes


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    base = torch.arange(40.0)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7, "lr": 1e-3, "name": "run-1", "flags": [True, None, (1, 2.5)],
        "dtypes": {str(dt): torch.randn(5).to(dt) for dt in
                   (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
                    torch.int64, torch.bool, torch.float8_e4m3fn, torch.uint16)},
        "views": {"slice": base[10:20], "transposed": base.reshape(5, 8).t(), "empty": base[:0]},
        "scalar": torch.tensor(3.5),
        "param": torch.nn.Parameter(torch.ones(3)),
    }


def _assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert bytes(tensor_bytes(a.contiguous())) == bytes(tensor_bytes(b.contiguous())), where
        assert type(a) is type(b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_round_trip_is_bit_exact_through_xlakit_and_plain_torch_load(tmp_path):
    state = _state()
    path = tmp_path / "ckpt.pt"
    xlakit.save(state, path)
    _assert_same(state, xlakit.load(path))
    _assert_same(state, torch.load(path, map_location="cpu", weights_only=True))


def test_loaded_state_dict_restores_a_model(tmp_path):
    state = _state()
    xlakit.save(state, tmp_path / "c.pt")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(xlakit.load(tmp_path / "c.pt")["model"])
    assert torch.equal(model[0].weight, state["model"]["0.weight"])


def test_same_tensor_twice_is_stored_once_and_stays_shared(tmp_path):
    t = torch.randn(4)
    xlakit.save({"a": t, "b": t}, tmp_path / "c.pt")
    loaded = xlakit.load(tmp_path / "c.pt")
    assert loaded["a"] is loaded["b"]


def test_ordered_dict_and_metadata_survive(tmp_path):
    sd = torch.nn.Linear(2, 2).state_dict()
    assert isinstance(sd, OrderedDict)
    xlakit.save(sd, tmp_path / "c.pt")
    loaded = xlakit.load(tmp_path / "c.pt")
    assert isinstance(loaded, OrderedDict)
    assert loaded._metadata == sd._metadata


def test_overwrite_replaces_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "c.pt"
    xlakit.save({"v": torch.zeros(3)}, path)
    xlakit.save({"v": torch.ones(3)}, path)
    assert torch.equal(xlakit.load(path)["v"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_unsaveable_object_is_refused_by_path_before_anything_is_written(tmp_path):
    path = tmp_path / "c.pt"
    xlakit.save({"v": torch.zeros(1)}, path)
    before = path.read_bytes()
    with pytest.raises(xlakit.CheckpointSerializationError, match=r"opt/scheduler.*LambdaLR"):
        sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1), lambda s: 1)
        xlakit.save({"opt": {"scheduler": sched}}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_a_state_that_holds_itself_is_refused_saying_so(tmp_path):
    # Regression (a helper's audit): a bare RecursionError from deep inside the planner.
    state = {"w": torch.ones(2), "children": []}
    state["children"].append(state)
    with pytest.raises(xlakit.CheckpointSerializationError, match="a container inside itself"):
        xlakit.save(state, tmp_path / "c.pt")
    assert list(tmp_path.iterdir()) == []


def test_what_torch_load_weights_only_cannot_read_back_is_refused(tmp_path):
    # Regression: a frozenset was saved, and then torch.load(weights_only=True) (and Lightning's
    # load_from_checkpoint) could not read the file.
    with pytest.raises(xlakit.CheckpointSerializationError, match=r"hp/tags.*frozenset"):
        xlakit.save({"w": torch.ones(2), "hp": {"tags": frozenset({"a"})}}, tmp_path / "c.pt")
    assert not (tmp_path / "c.pt").exists()
    state = {"w": torch.ones(2), "hp": {"tags": {"a"}, "pair": (1, 2)}}
    xlakit.save(state, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["hp"] == state["hp"]


def test_tensor_subclasses_and_meta_tensors_are_refused(tmp_path):
    with pytest.raises(xlakit.CheckpointSerializationError, match="meta device"):
        xlakit.save({"m": torch.empty(2, device="meta")}, tmp_path / "c.pt")


def test_options_are_validated_and_unknown_names_listed(tmp_path):
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        xlakit.SaveOptions(timeout_s=0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) timeout\b.*valid: .*timeout_s"):
        xlakit.save({}, tmp_path / "c.pt", timeout=3)


def test_environment_default_is_beaten_by_explicit_argument(monkeypatch):
    monkeypatch.setenv("XLAKIT_SAVE_TIMEOUT_S", "12")
    assert xlakit.SaveOptions().timeout_s == 12
    assert xlakit.SaveOptions(timeout_s=3).timeout_s == 3
    monkeypatch.setenv("XLAKIT_SAVE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="XLAKIT_SAVE_TIMEOUT_S='soon'"):
        xlakit.SaveOptions()


def test_small_save_prints_nothing_and_reports_progress_to_the_callback(tmp_path, caplog):
    seen = []
    with caplog.at_level(logging.DEBUG, logger="xlakit"):
        xlakit.save({"w": torch.ones(1000)}, tmp_path / "c.pt", progress_callback=seen.append)
    assert caplog.records == []
    assert seen and seen[-1].bytes_done == seen[-1].bytes_total == 4000


def test_long_save_logs_bytes_rate_and_eta(tmp_path, caplog, monkeypatch):
    fakes.install(monkeypatch, fakes.FakeSlowDevice(delay_s=0.15))
    state = {f"t{i}": torch.ones(256 * 1024) for i in range(6)}
    with caplog.at_level(logging.INFO, logger="xlakit"):
        xlakit.save(state, tmp_path / "c.pt", progress_interval_s=0.2, max_inflight_bytes=1 << 20)
    lines = [r.getMessage() for r in caplog.records]
    assert any("MiB of 6.0 MiB at" in m and "ETA" in m for m in lines), lines

