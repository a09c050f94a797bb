"""xlakit's checkpoints on TorchTPU's `tpu` tensors, run over xla-cpu-pjrt (no TPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import xlakit
from tests.support import REPO

pytestmark = pytest.mark.torchtpu

TRAIN = REPO / "tests" / "support" / "torchtpu_train.py"


def _tpu_state(device, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(7)
    return {"model": {"w": (torch.randn(64, 32, generator=g) * scale).to(device),
                      "b": torch.arange(32, dtype=torch.float32).to(device)},
            "half": torch.ones(5, dtype=torch.bfloat16).to(device), "step": 3}


def _on_cpu(state: dict) -> dict:
    return {k: v.cpu() for k, v in state.items()}


def test_save_load_restore_in_place_on_tpu(tpu, tmp_path):
    state = _tpu_state(tpu)
    xlakit.save(state, tmp_path / "a.pt")
    loaded = xlakit.load(tmp_path / "a.pt")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"].cpu()) and loaded["step"] == 3
    assert torch.load(tmp_path / "a.pt", weights_only=True)["half"].dtype == torch.bfloat16
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                "half": torch.zeros(5, dtype=torch.bfloat16, device=tpu), "step": 0}
    before = {k: id(v) for k, v in template["model"].items()}
    out = xlakit.restore(tmp_path / "a.pt", template)
    for k, v in out["model"].items():
        assert v.device.type == "tpu" and id(v) == before[k], "restored in place, on its device"
        assert torch.equal(v.cpu(), state["model"][k].cpu())
    assert out["step"] == 3


def test_training_loop_killed_and_resumed_is_bit_exact(tpu, tmp_path):
    from tests.support.torchtpu_train import train

    reference = {k: v.cpu() for k, v in train(tpu, 12).state_dict().items()}
    folder, out = tmp_path / "ckpt", tmp_path / "final.pt"
    killed = subprocess.run([sys.executable, str(TRAIN), str(folder), "12", "--kill-at", "7"],
                            capture_output=True, text=True, timeout=240)
    assert killed.returncode == -9, killed.stderr[-2000:]
    mgr = xlakit.CheckpointManager(folder)
    steps = mgr.all_steps()
    mgr.close()
    assert steps and max(steps) <= 7, steps
    resumed = subprocess.run([sys.executable, str(TRAIN), str(folder), "12", "--out", str(out)],
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = xlakit.load(out)
    for k, v in reference.items():
        assert torch.equal(final[k], v), f"{k} differs after the kill and resume"


@pytest.mark.parametrize("staging", ["host", "device"])
def test_asynchronous_save_while_the_loop_mutates(tpu, tmp_path, staging, monkeypatch):
    from xlakit.checkpoint.file import device_staging

    copies = []
    real_copy = device_staging._copy
    monkeypatch.setattr(device_staging, "_copy", lambda t: copies.append(t.device.type) or real_copy(t))
    w = torch.randn(4 << 20, generator=torch.Generator().manual_seed(1)).to(tpu)  # 16 MiB
    expected = w.cpu()
    handle = xlakit.save({"w": w}, tmp_path / "async.pt", asynchronous=True, staging=staging)
    assert copies == ([] if staging == "host" else ["tpu"])  # staged on the device: one copy there
    after = expected.clone()
    for _ in range(20):  # the loop goes on, changing the saved tensor in place
        w.add_(1.0)
        after.add_(1.0)
    handle.result(timeout=120)
    assert torch.equal(xlakit.load(tmp_path / "async.pt")["w"], expected), "the values at the save's call"
    assert torch.equal(w.cpu(), after)


def test_manager_keeps_the_newest_and_restores_onto_tpu(tpu, tmp_path):
    mgr = xlakit.CheckpointManager(tmp_path / "run", save_interval_steps=1, max_to_keep=2)
    w = torch.zeros(1000, device=tpu)
    for step in range(1, 6):
        w.fill_(float(step))
        mgr.save(step, {"w": w})
    mgr.wait()
    assert mgr.all_steps() == [4, 5]
    target = torch.zeros(1000, device=tpu)
    out = mgr.restore(4, template={"w": target})
    assert out["w"] is target and torch.equal(target.cpu(), torch.full((1000,), 4.0))
    mgr.close()


def test_dcp_save_and_load_in_place(tpu, tmp_path):
    state = _tpu_state(tpu)
    xlakit.dcp_save({"model": state["model"]}, tmp_path / "dcp")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    xlakit.dcp_load(target, tmp_path / "dcp")
    for k, v in target["model"].items():
        assert v.device.type == "tpu" and torch.equal(v.cpu(), state["model"][k].cpu())


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (self.marker,))


def test_dcp_load_never_runs_the_pickled_code_a_value_holds(tpu, tmp_path):
    # Without torch_xla, DCP's own planner loads values with weights_only=False: dcp_load ran this code.
    marker = tmp_path / "ran"
    state = _tpu_state(tpu)
    from xlakit.checkpoint.torch_dcp import dcp_plan

    real, dcp_plan.check_values = dcp_plan.check_values, lambda state: None  # as an earlier xlakit wrote it
    try:
        xlakit.dcp_save({"model": state["model"], "extra": _RunsCode(str(marker))}, tmp_path / "dcp")
    finally:
        dcp_plan.check_values = real
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra": None}
    with pytest.raises(xlakit.CheckpointFormatError, match="'extra' holds pickled objects .*nothing of it was run"):
        xlakit.dcp_load(target, tmp_path / "dcp")
    assert not marker.exists()


def test_dcp_tpu_tensors_inside_a_value_load_back_on_the_tpu(tpu, tmp_path):
    # Bug: values were loaded with map_location="cpu": a tuple of TPU tensors (DCP pickles it as one
    # value) came back on the host, where DCP's own planner restored it on the TPU.
    pair = (torch.ones(2).to(tpu), torch.arange(3).to(tpu))
    xlakit.dcp_save({"w": torch.ones(4).to(tpu), "pair": pair}, tmp_path / "dcp")
    target = {"w": torch.zeros(4, device=tpu), "pair": None}
    xlakit.dcp_load(target, tmp_path / "dcp")
    assert [t.device.type for t in target["pair"]] == ["tpu", "tpu"]
    assert torch.equal(target["pair"][1].cpu(), torch.arange(3))


def test_deadline_expiring_mid_transfer_names_the_stage_and_commits_nothing(tpu, tmp_path, monkeypatch):
    from xlakit.checkpoint.file import transfer

    previous = tmp_path / "ckpt.pt"
    xlakit.save({"w": torch.ones(4)}, previous)
    real = transfer.TpuTransfer._copy

    def slow(self, t):  # each device-to-host copy takes 0.3 s
        time.sleep(0.3)
        return real(self, t)

    monkeypatch.setattr(transfer.TpuTransfer, "_copy", slow)
    state = {f"t{i}": torch.full((256,), float(i), device=tpu) for i in range(10)}
    with pytest.raises(xlakit.CheckpointTimeoutError) as info:
        xlakit.save(state, previous, timeout_s=1.0, max_inflight_bytes=4096)
    assert info.value.stage == "transfer", info.value
    assert "transfer" in str(info.value)
    assert torch.equal(xlakit.load(previous)["w"], torch.ones(4)), "the previous checkpoint is kept"
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"], "no temporary file left behind"


def test_an_overlapped_save_of_tpu_tensors_is_exact_and_reports_its_parts(tpu, tmp_path, monkeypatch):
    from xlakit.checkpoint.file import transfer

    real = transfer.TpuTransfer._copy

    def slow(self, t):  # each device-to-host copy takes 20 ms: the writes overlap them
        time.sleep(0.02)
        return real(self, t)

    monkeypatch.setattr(transfer.TpuTransfer, "_copy", slow)
    state = {f"t{i}": torch.full((1 << 16,), float(i), device=tpu) for i in range(16)}
    seen = []
    xlakit.save(state, tmp_path / "o.pt", max_inflight_bytes=1 << 20, progress_callback=seen.append)
    loaded = xlakit.load(tmp_path / "o.pt")
    assert all(torch.equal(loaded[k], v.cpu()) for k, v in state.items())
    assert seen[-1].transfer_s >= 16 * 0.02 and seen[-1].write_s > 0 and seen[-1].overlap_s > 0, seen[-1]


def test_manager_on_a_bucket_from_tpu(tpu, bucket):
    url = f"{bucket}/run"
    w = torch.zeros(4096, device=tpu)
    with xlakit.CheckpointManager(url, max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            w.fill_(float(step))
            mgr.save(step, {"w": w})
        assert mgr.all_steps() == [2, 3]
        target = torch.zeros(4096, device=tpu)
        assert mgr.restore(3, template={"w": target})["w"] is target
    assert torch.equal(target.cpu(), torch.full((4096,), 3.0))



@pytest.mark.parametrize("into", ["tpu", "cpu", "strided cpu"])
def test_restore_of_four_batches_in_place_and_into_cpu(tpu, tmp_path, monkeypatch, into):
    # Regression (issue 32): the arena waited for torch._C._storage_Use_Count to reach 1, which torch 2.13
    # never reports (a fresh tensor counts 2): a restore of more than one batch timed out at stage 'copy'
    # (tpu) or 'verify' (cpu).
    from xlakit.checkpoint.file import restoring

    state = {f"t{i}": torch.full((1 << 18,), float(i)).to(tpu) for i in range(4)}  # 1 MiB each
    xlakit.save(state, tmp_path / "c.pt")
    make = {"tpu": lambda: torch.zeros(1 << 18, device=tpu), "cpu": lambda: torch.zeros(1 << 18),
            "strided cpu": lambda: torch.zeros(2 << 18)[::2]}[into]
    template = {k: make() for k in state}
    before = {k: id(v) for k, v in template.items()}
    sizes = []
    real = restoring.Arena.fit
    monkeypatch.setattr(restoring.Arena, "fit",
                        lambda self, n, op: sizes.append(n) or real(self, n, op))
    out = xlakit.restore(tmp_path / "c.pt", template, max_inflight_bytes=1 << 20, timeout_s=20)
    assert {k: id(v) for k, v in out.items()} == before, "in place"
    assert all(torch.equal(template[k].cpu(), state[k].cpu()) for k in state)
    assert len(sizes) == 4 and max(sizes) <= 1 << 20, sizes  # four batches, each within the bound


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
                                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)], ids=["adamw", "sgd-momentum"])
def test_manager_restores_the_live_model_and_a_fresh_optimizer_on_tpu(tpu, tmp_path, make_opt):
    # Regression (issue 32): the README's resume (a template from a fresh optimizer's state_dict(),
    # which has no state) raised CheckpointMismatchError for AdamW and SGD with momentum, on TorchTPU too.
    def built(seed: int, steps: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(tpu)
        opt = make_opt(model.parameters())
        for _ in range(steps):
            opt.zero_grad()
            model(torch.ones(4, 8, device=tpu)).square().sum().backward()
            opt.step()
        return model, opt

    model, opt = built(0, 2)
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(2, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        fresh, fresh_opt = built(1, 0)
        params = [id(p) for p in fresh.parameters()]
        mgr.restore(2, model=fresh, optimizer=fresh_opt)
    assert [id(p) for p in fresh.parameters()] == params
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.parameters(), fresh.parameters()))
    saved, restored = opt.state_dict(), fresh_opt.state_dict()
    assert saved["param_groups"] == restored["param_groups"] and saved["state"].keys() == restored["state"].keys()
    for i, s in saved["state"].items():
        for k, v in s.items():
            assert torch.equal(v.cpu(), restored["state"][i][k].cpu()), (i, k)
            assert restored["state"][i][k].device.type == ("cpu" if k == "step" else "tpu"), (i, k)
