"""Nothing xlakit does keeps the caller's state, or a loaded one, alive after it returns.

Regression: recursive closures in the structure codec formed reference cycles holding every
tensor a load made (and every tensor a save planned) until Python's cyclic garbage collector
happened to run; a resume that loaded 2 GiB kept the previous 2 GiB alive, and
`xlakit.load` + `load_state_dict` peaked at three times the state.
"""
from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

import xlakit


@pytest.fixture(autouse=True)
def no_cyclic_gc():
    """Only reference counting frees objects: a cycle shows up as a tensor that stays alive."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _state() -> dict:
    w = torch.ones(1000)
    return {"w": w, "tied": w, "list": [torch.zeros(10), 3], "opt": {"step": torch.tensor(2.0)}}


def _released(make, *names) -> bool:
    """Whether the tensors `make()` returns (reached through `names`) are freed once dropped."""
    value = make()
    refs = [weakref.ref(value[n]) for n in names]  # tensors (a dict cannot be weakly referenced)
    del value
    return all(r() is None for r in refs)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_saved_state_is_released_after_the_save(tmp_path, asynchronous):
    state = _state()
    refs = [weakref.ref(state["w"]), weakref.ref(state["list"][0])]
    result = xlakit.save(state, tmp_path / "c.pt", asynchronous=asynchronous)
    if asynchronous:
        result.result()
    del state, result
    # result() returns when the write is done; the background thread's frames go a moment later.
    deadline = time.monotonic() + 5
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_loaded_state_is_released_when_dropped(tmp_path, mmap):
    xlakit.save(_state(), tmp_path / "c.pt")
    assert _released(lambda: xlakit.load(tmp_path / "c.pt", mmap=mmap), "w")


def test_a_restored_template_is_released_when_dropped(tmp_path):
    xlakit.save(_state(), tmp_path / "c.pt")
    w = torch.empty(1000)
    template = {"w": w, "tied": w, "list": [torch.empty(10), 0], "opt": {"step": torch.tensor(0.0)}}
    refs = [weakref.ref(w), weakref.ref(template["opt"]["step"])]
    del w
    restored = xlakit.restore(tmp_path / "c.pt", template)
    del template, restored
    assert all(r() is None for r in refs)


def test_the_manager_releases_saved_and_restored_states(tmp_path):
    with xlakit.CheckpointManager(tmp_path / "run") as manager:
        state = _state()
        ref = weakref.ref(state["w"])
        manager.save(1, state)
        del state
        assert ref() is None
        assert _released(lambda: manager.restore(1), "w")
