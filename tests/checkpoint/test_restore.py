"""xlakit.restore and xlakit's reader: one pass over the file, into the state where it lives."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import xlakit
from tests.support.spmd_run import run_scenario
from xlakit.checkpoint.file import loading
from xlakit.checkpoint.format import archive


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 16)).sum().backward()
        opt.step()
    return model, opt


def _equal_states(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_restore_fills_a_cpu_model_and_optimizer_bit_exactly(tmp_path):
    model, opt = _trained(0)
    xlakit.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 7}, tmp_path / "c.pt")
    model2, opt2 = _trained(1)
    params = [p.data_ptr() for p in model2.parameters()]
    state = xlakit.restore(tmp_path / "c.pt", {"model": model2.state_dict(), "opt": opt2.state_dict(), "step": 0})
    assert state["step"] == 7
    assert _equal_states(model.state_dict(), model2.state_dict())
    assert [p.data_ptr() for p in model2.parameters()] == params  # in place
    opt2.load_state_dict(state["opt"])
    for group, group2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(group[k], group2[k]) for k in group)
    assert opt2.param_groups[0]["lr"] == 0.01


def test_restore_into_tied_and_viewed_templates(tmp_path):
    base = torch.arange(20.0)
    xlakit.save({"base": base, "view": base[5:10], "tied_a": base, "other": torch.ones(3)}, tmp_path / "c.pt")
    t_base = torch.zeros(20)
    template = {"base": t_base, "view": torch.zeros(5), "tied_a": t_base, "other": torch.zeros(3)}
    xlakit.restore(tmp_path / "c.pt", template)
    assert torch.equal(template["base"], base) and torch.equal(template["view"], base[5:10])
    assert torch.equal(template["other"], torch.ones(3))


@pytest.mark.xla
def test_restore_onto_the_xla_device_in_one_transfer_per_batch_and_no_compile(tmp_path):
    import torch_xla
    import torch_xla.debug.metrics as met

    model, _ = _trained(0)
    xlakit.save({"model": model.state_dict()}, tmp_path / "c.pt")
    device = torch_xla.device()
    target = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(device)
    torch_xla.sync()
    met.clear_all()
    xlakit.restore(tmp_path / "c.pt", {"model": target.state_dict()})
    assert met.metric_data("CompileTime") is None
    assert met.metric_data("TransferToDeviceTime")[0] == 1  # six tensors, one batch, one transfer
    # The parameters themselves, not only state_dict()'s aliases, hold the values.
    assert all(torch.equal(p.cpu(), q) for p, q in zip(target.parameters(), model.parameters()))
    met.clear_all()
    xlakit.restore(tmp_path / "c.pt", {"model": target.state_dict()}, max_inflight_bytes=1)
    assert met.metric_data("TransferToDeviceTime")[0] == 6  # one storage per batch


@pytest.mark.xla
def test_restore_into_spmd_templates_of_another_sharding(tmp_path):
    result = run_scenario("restore_resharded", tmp_path)
    assert result["mismatch"] == [] and result["step"] == 11
    assert result["specs_kept"] and result["same_objects"]
    assert result["compiles"] == 0  # shards go to their devices: nothing is replicated or compiled
    assert result["made_here_mismatch"] == [] and result["made_here_specs_kept"]


def test_mismatches_are_reported_at_once_and_nothing_changes(tmp_path):
    model, opt = _trained(0)
    xlakit.save({"model": model.state_dict(), "step": 1}, tmp_path / "c.pt")
    wrong = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 5))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    template = {"model": wrong.state_dict(), "epoch": 0}
    with pytest.raises(xlakit.CheckpointMismatchError) as info:
        xlakit.restore(tmp_path / "c.pt", template)
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert any(p.startswith("model/2.weight: the checkpoint has torch.float32 [4, 16]") for p in problems)
    assert "epoch: missing from the checkpoint" in problems and "step: in the checkpoint, not in the template" in problems
    assert _equal_states(wrong.state_dict(), before)  # the matching tensors were not touched either


def test_a_damaged_record_is_named_by_restore_and_by_load(tmp_path, caplog):
    path = tmp_path / "c.pt"
    xlakit.save({"a": torch.ones(1000), "b": torch.full((1000,), 2.0)}, path)
    with open(path, "rb", buffering=0) as f:
        index = loading.open_index(f, path)
    cols = index["storages"]
    row = cols["path"].index("b")
    data = bytearray(path.read_bytes())
    data[cols["offset"][row] + 17] ^= 0x40
    path.write_bytes(bytes(data))
    for call in (lambda: xlakit.load(path), lambda: xlakit.restore(path, {"a": torch.zeros(1000), "b": torch.zeros(1000)})):
        with pytest.raises(xlakit.CheckpointCorruptError, match="tensor 'b' is corrupt") as info:
            call()
        assert info.value.tensor == "b"
    assert any("partly restored" in n for n in info.value.__notes__)  # restore says what it changed


def test_templates_that_cannot_hold_the_values_are_refused_before_anything_changes(tmp_path):
    xlakit.save({"a": torch.ones(4), "e": torch.ones(3), "m": torch.ones(2)}, tmp_path / "c.pt")
    a = torch.zeros(4)
    template = {"a": a, "e": torch.zeros(1).expand(3), "m": torch.zeros(2, device="meta")}
    with pytest.raises(xlakit.CheckpointMismatchError) as info:
        xlakit.restore(tmp_path / "c.pt", template)
    assert sorted(p.split(":")[0] for p in info.value.problems) == ["e", "m"], info.value.problems
    assert torch.equal(a, torch.zeros(4))


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.xla)])
def test_empty_and_math_bit_templates_restore_exactly(tmp_path, device):
    # Regression: an empty tensor crashed the restore (a read-only buffer) after others had
    # been filled; a conj or neg view as template received conjugated or negated values.
    if device == "xla":
        import torch_xla

        device = torch_xla.device()
    values = {"a": torch.arange(4.0), "empty": torch.empty(0), "c": torch.tensor([1 + 2j, 3 - 1j]),
              "n": torch.tensor([1.0, -2.0])}
    xlakit.save(values, tmp_path / "c.pt")
    template = {"a": torch.zeros(4, device=device), "empty": torch.zeros(0, device=device),
                "c": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(2)}
    if device == "cpu":
        template["c"], template["n"] = template["c"].conj(), template["n"]._neg_view()
    xlakit.restore(tmp_path / "c.pt", template)
    for k, v in values.items():
        assert torch.equal(template[k].cpu(), v), k


def test_a_wrong_index_offset_never_makes_a_good_file_corrupt(tmp_path, monkeypatch, caplog):
    real = archive.ArchiveWriter.finish

    def shifted(self):  # a fake writer bug: every storage's recorded offset is 64 bytes off
        self._offsets = [offset + 64 for offset in self._offsets]
        return real(self)

    monkeypatch.setattr(archive.ArchiveWriter, "finish", shifted)
    xlakit.save({"w": torch.arange(100000.0), "small": torch.ones(4)}, tmp_path / "c.pt")
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="xlakit"):
        loaded = xlakit.load(tmp_path / "c.pt")
    assert torch.equal(loaded["w"], torch.arange(100000.0)) and torch.equal(loaded["small"], torch.ones(4))
    assert any("points at another place" in r.getMessage() for r in caplog.records)


def test_load_reads_xlakit_files_in_one_pass(tmp_path, monkeypatch):
    xlakit.save({"w": torch.ones(1 << 16)}, tmp_path / "c.pt")
    calls = []
    monkeypatch.setattr(loading, "verify_file", lambda *a, **k: calls.append("second pass"))
    monkeypatch.setattr(loading, "torch_load", lambda *a, **k: calls.append("torch.load"))
    assert torch.equal(xlakit.load(tmp_path / "c.pt")["w"], torch.ones(1 << 16))
    assert calls == []  # neither the separate verify pass nor torch's reader ran


def test_restore_batches_stay_under_the_cap(tmp_path, monkeypatch):
    from xlakit.checkpoint.file import restoring

    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(10)}  # 4000 bytes each
    xlakit.save(state, tmp_path / "c.pt")
    held = []
    real = restoring.Arena.fit
    monkeypatch.setattr(restoring.Arena, "fit", lambda self, n, op: held.append(n) or real(self, n, op))
    template = {k: torch.zeros(2000)[::2] for k in state}  # strided: not read in place, through batches
    xlakit.restore(tmp_path / "c.pt", template, max_inflight_bytes=8192)
    assert len(held) == 5 and max(held) <= 8192, held
    assert all(torch.equal(template[k], state[k]) for k in state)


def test_restore_reads_plain_torch_files_too(tmp_path):
    # Regression (issue 19): restore's docstring said any torch.save file works, and its refusal of
    # one advised xlakit.load(path, verify=False); both now say restore needs verify=False for it.
    torch.save({"w": torch.arange(6.0).view(2, 3), "n": 3}, tmp_path / "t.pt")
    template = {"w": torch.zeros(2, 3), "n": 0}
    with pytest.raises(xlakit.CheckpointFormatError, match="no xlakit checksums") as info:
        xlakit.restore(tmp_path / "t.pt", template)
    assert any("xlakit.restore(path, template, verify=False)" in n for n in info.value.__notes__)
    assert "with ``verify=False`` any torch.save" in " ".join(xlakit.restore.__doc__.split())
    assert xlakit.restore(tmp_path / "t.pt", template, verify=False)["n"] == 3
    assert torch.equal(template["w"], torch.arange(6.0).view(2, 3))


def test_restore_only_the_model_with_strict_false_skips_and_reports_the_rest(tmp_path, caplog):
    # Regression (issue 19): restoring {"model": ...} from a {model, optimizer, step} file raised
    # CheckpointMismatchError; there was no documented way to restore part of a checkpoint.
    model, opt = _trained(0)
    xlakit.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}, tmp_path / "c.pt")
    fresh, _ = _trained(1)
    with pytest.raises(xlakit.CheckpointMismatchError) as info:  # strict stays the default
        xlakit.restore(tmp_path / "c.pt", {"model": fresh.state_dict()})
    assert sorted(info.value.problems) == ["optimizer: in the checkpoint, not in the template",
                                           "step: in the checkpoint, not in the template"]
    assert any("strict=False" in n for n in info.value.__notes__)
    reported = []
    with caplog.at_level(logging.INFO, logger="xlakit"):
        state = xlakit.restore(tmp_path / "c.pt", {"model": fresh.state_dict()}, strict=False,
                               extra_keys_callback=reported.append)
    assert reported == [["optimizer", "step"]]
    assert any("optimizer, step" in r.getMessage() and "strict=False" in r.getMessage() for r in caplog.records)
    assert list(state) == ["model"] and _equal_states(fresh.state_dict(), model.state_dict())
    # Keys the checkpoint lacks stay an error, strict or not; nested extra keys are skipped too.
    with pytest.raises(xlakit.CheckpointMismatchError, match="epoch: missing from the checkpoint"):
        xlakit.restore(tmp_path / "c.pt", {"model": fresh.state_dict(), "epoch": 0}, strict=False)
    partial = {k: v for k, v in fresh.state_dict().items() if k.startswith("0.")}
    state = xlakit.restore(tmp_path / "c.pt", {"model": partial, "step": 0}, strict=False,
                           extra_keys_callback=reported.append)
    assert reported[-1] == ["model/1.bias", "model/1.weight", "model/2.bias", "model/2.weight", "optimizer"]
    assert state["step"] == 7 and sorted(state["model"]) == ["0.bias", "0.weight"]


def test_strict_options_are_checked(tmp_path):
    xlakit.save({"w": torch.ones(2)}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="extra_keys_callback .* pass strict=False"):
        xlakit.LoadOptions(extra_keys_callback=print)
    with pytest.raises(TypeError, match="strict must be True or False"):
        xlakit.LoadOptions(strict="no")
    with pytest.raises(ValueError, match="strict=False applies to xlakit.restore"):
        xlakit.load(tmp_path / "c.pt", strict=False)


@pytest.mark.parametrize("plain", [False, True])
def test_tied_template_entries_the_checkpoint_holds_apart_are_reported_before_anything_changes(tmp_path, plain):
    # Regression (issue 19): a template whose two entries share memory, restored from a checkpoint
    # where they differ, came back with one entry holding the other's values, and no error.
    save = torch.save if plain else xlakit.save
    save({"embed": torch.ones(4, 3), "head": torch.full((4, 3), 2.0), "b": torch.ones(2)}, tmp_path / "c.pt")
    tied = torch.zeros(4, 3)
    b = torch.zeros(2)
    with pytest.raises(xlakit.CheckpointMismatchError) as info:
        xlakit.restore(tmp_path / "c.pt", {"embed": tied, "head": tied, "b": b}, verify=not plain)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("embed and head: the template's "
                                                                               "tensors share memory (tied)")
    assert torch.equal(tied, torch.zeros(4, 3)) and torch.equal(b, torch.zeros(2))  # nothing changed
    # Tied in the checkpoint too (one storage), or untied there with equal values: nothing to report.
    shared = torch.arange(12.0).view(4, 3)
    save({"embed": shared, "head": shared, "b": torch.ones(2)}, tmp_path / "tied.pt")
    save({"embed": shared, "head": shared.clone(), "b": torch.ones(2)}, tmp_path / "equal.pt")
    for name in ("tied.pt", "equal.pt"):
        tied.zero_()
        xlakit.restore(tmp_path / name, {"embed": tied, "head": tied, "b": b}, verify=not plain)
        assert torch.equal(tied, shared), name
    # Leaving one of them out of the template restores the other, with strict=False.
    xlakit.restore(tmp_path / "c.pt", {"head": tied, "b": b}, strict=False, verify=not plain)
    assert torch.equal(tied, torch.full((4, 3), 2.0))


def test_tied_views_are_judged_by_the_memory_they_share(tmp_path):
    base = torch.arange(10.0)
    xlakit.save({"all": base, "tail": base[6:], "apart": torch.full((4,), -1.0)}, tmp_path / "c.pt")
    t_base = torch.zeros(10)
    xlakit.restore(tmp_path / "c.pt", {"all": t_base, "tail": t_base[6:], "apart": torch.zeros(4)})
    assert torch.equal(t_base, base)  # the same view of the same storage: one value per element
    t_base.zero_()
    with pytest.raises(xlakit.CheckpointMismatchError, match="all and apart: the template's tensors share"):
        xlakit.restore(tmp_path / "c.pt", {"all": t_base, "tail": torch.zeros(4), "apart": t_base[6:]})
    assert torch.equal(t_base, torch.zeros(10))
    # Views of one buffer that do not overlap are no tie (a flat parameter buffer).
    flat = torch.zeros(14)
    xlakit.restore(tmp_path / "c.pt", {"all": flat[:10], "tail": flat[10:], "apart": torch.zeros(4)})
    assert torch.equal(flat[:10], base) and torch.equal(flat[10:], base[6:])


@pytest.mark.xla
def test_tied_xla_parameters_are_reported_when_the_checkpoint_holds_them_apart(tmp_path):
    import torch_xla

    model = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False)).to(torch_xla.device())
    model[1].weight = model[0].weight  # tied: state_dict() gives two aliases of one XLA tensor
    xlakit.save({"0.weight": torch.ones(4, 3), "1.weight": torch.full((4, 3), 2.0)}, tmp_path / "apart.pt")
    with pytest.raises(xlakit.CheckpointMismatchError, match="0.weight and 1.weight: the template's tensors share"):
        xlakit.restore(tmp_path / "apart.pt", model.state_dict())
    xlakit.save({"0.weight": torch.ones(4, 3), "1.weight": torch.ones(4, 3)}, tmp_path / "equal.pt")
    xlakit.restore(tmp_path / "equal.pt", model.state_dict())
    assert torch.equal(model[1].weight.cpu(), torch.ones(4, 3))


def _four_batches(tmp_path, device) -> tuple[dict, dict]:
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(4)}  # 1 MiB each: 4 batches of 1 MiB
    xlakit.save(state, tmp_path / "c.pt")
    # Strided CPU templates are filled through the arena (not read in place); device ones always are.
    template = {k: (torch.zeros(2 << 18)[::2] if device == "cpu" else torch.zeros(1 << 18, device=device))
                for k in state}
    return state, template


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.xla)])
def test_restore_of_many_batches_reuses_one_buffer_without_torchs_use_count(tmp_path, monkeypatch, device):
    # Regression (issue 32): the arena waited for torch._C._storage_Use_Count to reach 1, which torch
    # 2.13 never reports (a fresh tensor counts 2): a state of more than one batch hung to the deadline.
    from xlakit.checkpoint.file import restoring

    if device == "xla":
        import torch_xla

        device = torch_xla.device()
    monkeypatch.setattr(torch._C, "_storage_Use_Count", lambda cdata: 2, raising=False)  # torch 2.13's answer
    state, template = _four_batches(tmp_path, device)
    buffers = []
    real = restoring.Arena.fit

    def fit(self, n, op):
        lent = real(self, n, op)
        buffers.append((self.buffer.data_ptr(), self.buffer.numel()))
        return lent

    monkeypatch.setattr(restoring.Arena, "fit", fit)
    xlakit.restore(tmp_path / "c.pt", template, max_inflight_bytes=1 << 20, timeout_s=20)
    assert len(buffers) == 4 and len(set(buffers)) == 1 and buffers[0][1] <= 1 << 20, buffers  # one buffer, the cap
    assert all(torch.equal(template[k].cpu(), state[k]) for k in state)


def test_a_batch_is_not_overwritten_while_a_copy_still_reads_it(tmp_path, monkeypatch):
    # A copy that reads its source after the call returned, as torch_xla's host-to-device transfers do:
    # a fake (CPU tensors have no such copy), each batch's host tensors released 0.2 s later by a thread.
    import threading

    from xlakit.checkpoint.file import restoring

    state, template = _four_batches(tmp_path, "cpu")
    seen: dict[str, torch.Tensor] = {}
    real = restoring._apply

    def later(op, pairs):
        held = [(t.path, host) for t, host in pairs]

        def read():  # the copy that completes late: what it reads then is what it writes
            for name, host in held:
                seen[name] = host.clone()
            held.clear()

        threading.Timer(0.2, read).start()
        real(op, pairs)

    monkeypatch.setattr(restoring, "_apply", later)
    xlakit.restore(tmp_path / "c.pt", template, max_inflight_bytes=1 << 20, timeout_s=20)
    deadline = time.monotonic() + 5
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(seen) == sorted(state) and all(torch.equal(seen[k], state[k]) for k in state)


_OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
               "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)}


def _stepped(device, optimizer: str, seed: int, steps: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).to(device)
    opt = _OPTIMIZERS[optimizer](model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8).to(device)).square().sum().backward()
        opt.step()
    return model, opt


def _same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    x, y = a.state_dict(), b.state_dict()
    return (x["param_groups"] == y["param_groups"] and x["state"].keys() == y["state"].keys()
            and all(s.keys() == y["state"][i].keys() and all(torch.equal(v.cpu(), y["state"][i][k].cpu())
                                                              for k, v in s.items()) for i, s in x["state"].items()))


@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.xla)])
def test_restore_into_the_live_model_and_a_fresh_optimizer(tmp_path, device, optimizer):
    # Regression (issue 32): a fresh optimizer's state_dict() has no state, so a template built from
    # it could not receive a stateful optimizer's (CheckpointMismatchError "opt/state/0").
    if device == "xla":
        import torch_xla

        device = torch_xla.device()
    model, opt = _stepped(device, optimizer, 0, 3)
    xlakit.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}, tmp_path / "c.pt")
    fresh, fresh_opt = _stepped(device, optimizer, 1, 0)
    fresh_opt.param_groups[0]["lr"] = 5.0  # the saved hyper-parameters are loaded too
    params = [id(p) for p in fresh.parameters()]
    state = xlakit.restore(tmp_path / "c.pt", {"step": 0}, model=fresh, optimizer=fresh_opt)
    assert state["step"] == 3 and [id(p) for p in fresh.parameters()] == params
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert _same_optimizer_state(opt, fresh_opt)
    assert all(p.grad is None for p in fresh.parameters()), "the gradients are put back as they were"
    for s in fresh_opt.state.values():  # the optimizer's state lives where its parameters do
        assert all(v.device == (torch.device("cpu") if k == "step" else fresh.state_dict()["0.weight"].device)
                   for k, v in s.items() if isinstance(v, torch.Tensor))
    # Trained on, the restored pair follows the original step for step.
    for m, o in ((model, opt), (fresh, fresh_opt)):
        torch.manual_seed(5)
        o.zero_grad()
        m(torch.randn(4, 8).to(device)).square().sum().backward()
        o.step()
    assert _same_optimizer_state(opt, fresh_opt)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.parameters(), fresh.parameters()))


def test_the_manager_and_the_reader_restore_live_objects_and_templates_still_work(tmp_path):
    model, opt = _stepped("cpu", "adamw", 0, 2)
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(2, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        fresh, fresh_opt = _stepped("cpu", "adamw", 1, 0)
        mgr.restore(2, model=fresh, optimizer=fresh_opt)
        assert _same_optimizer_state(opt, fresh_opt)
        # The template API as before: an optimizer with state, its state dict in the template.
        again, again_opt = _stepped("cpu", "adamw", 2, 1)
        state = mgr.restore(2, template={"model": again.state_dict(), "optimizer": again_opt.state_dict()})
        again_opt.load_state_dict(state["optimizer"])
        assert _same_optimizer_state(opt, again_opt)
    reader = xlakit.ReadOnlyCheckpointManager(tmp_path / "run")
    evaluated, _ = _stepped("cpu", "adamw", 3, 0)
    reader.restore(model=evaluated, options=xlakit.LoadOptions(strict=False))  # the model alone
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), evaluated.state_dict().values()))


def test_live_objects_anywhere_in_a_template_and_the_refusals(tmp_path):
    model, opt = _stepped("cpu", "sgd-momentum", 0, 2)
    head = torch.optim.AdamW(model[2].parameters(), lr=0.5)
    model(torch.randn(4, 8)).sum().backward()
    head.step()
    xlakit.save({"nets": [model.state_dict()], "opts": {"body": opt.state_dict(), "head": head.state_dict()}},
                tmp_path / "c.pt")
    fresh, fresh_opt = _stepped("cpu", "sgd-momentum", 1, 0)
    fresh_head = torch.optim.AdamW(fresh[2].parameters(), lr=0.5)
    xlakit.restore(tmp_path / "c.pt", {"nets": [fresh], "opts": {"body": fresh_opt, "head": fresh_head}})
    assert _same_optimizer_state(opt, fresh_opt) and _same_optimizer_state(head, fresh_head)
    with pytest.raises(ValueError, match="'model' given both in the template and as a keyword"):
        xlakit.restore(tmp_path / "c.pt", {"model": fresh.state_dict()}, model=fresh)
    with pytest.raises(TypeError, match="a template, model= or optimizer="):
        xlakit.restore(tmp_path / "c.pt")
    with pytest.raises(TypeError, match="must then be a dict"):
        xlakit.restore(tmp_path / "c.pt", [fresh.state_dict()], model=fresh)


def test_a_module_gets_its_extra_state_back(tmp_path):
    class Counted(torch.nn.Linear):
        def __init__(self):
            super().__init__(2, 2)
            self.seen = 0

        def get_extra_state(self):
            return {"seen": self.seen}

        def set_extra_state(self, state):
            self.seen = state["seen"]

    saved = Counted()
    saved.seen = 41
    xlakit.save({"model": saved.state_dict()}, tmp_path / "c.pt")
    fresh = Counted()
    xlakit.restore(tmp_path / "c.pt", model=fresh)
    assert fresh.seen == 41 and torch.equal(fresh.weight, saved.weight)


class _WithUnused(torch.nn.Module):
    """A model whose `unused` layer never gets a gradient (a pooler outside the loss, an unrouted expert)."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        super().__init__()
        self.used, self.unused, self.frozen = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(self.frozen(x))


def _adamw_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=data)).square().sum().backward()
        opt.step()


@pytest.mark.parametrize("case", ["unused", "frozen-later", "before-first-step"])
def test_a_fresh_optimizer_takes_the_state_of_exactly_the_parameters_that_had_one(tmp_path, case):
    # Regression: restore(model=, optimizer=) created state for every trainable parameter and then
    # required it in the checkpoint (and none for frozen ones): a parameter without a gradient, one
    # frozen after stepping, or a checkpoint saved before the first step gave CheckpointMismatchError.
    model = _WithUnused(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if case != "frozen-later":
        model.frozen.requires_grad_(False)  # frozen from the start: never any state
    _adamw_steps(model, opt, 0 if case == "before-first-step" else 2, 1)
    if case == "frozen-later":
        model.used.requires_grad_(False)  # its moments stay in the optimizer's state
        _adamw_steps(model, opt, 1, 2)
    xlakit.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    fresh = _WithUnused(3)
    fresh.load_state_dict(model.state_dict())
    for a, b in zip(model.parameters(), fresh.parameters()):
        b.requires_grad_(a.requires_grad)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    xlakit.restore(tmp_path / "c.pt", model=fresh, optimizer=fresh_opt)
    assert _same_optimizer_state(opt, fresh_opt)
    model.frozen.requires_grad_(True)
    fresh.frozen.requires_grad_(True)
    for m, o in ((model, opt), (fresh, fresh_opt)):  # trained on alike, bit for bit
        _adamw_steps(m, o, 2, 4)
    assert _same_optimizer_state(opt, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_dcp_step_restores_a_fresh_optimizer_with_a_parameter_that_never_stepped(tmp_path):
    # Regression: the state created for a parameter without a gradient went to DCP as part of the
    # template: "RuntimeError: Missing key in checkpoint state_dict: optimizer.state.2.step".
    model = _WithUnused(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _adamw_steps(model, opt, 2, 1)
    with xlakit.CheckpointManager(tmp_path / "run", layout="dcp") as mgr:
        mgr.save(2, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        fresh = _WithUnused(3)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        mgr.restore(2, model=fresh, optimizer=fresh_opt)
    assert _same_optimizer_state(opt, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("failure", ["mismatch", "deadline", "interrupt"])
def test_a_failed_restore_leaves_a_fresh_optimizer_without_state(tmp_path, monkeypatch, failure):
    # Regression: restore(optimizer=opt) created the optimizer's state (step 1, zero moments) before
    # reading; when the restore then failed ("nothing was changed"), the optimizer kept that state
    # and a run that went on from scratch trained with it.
    model, opt = _stepped("cpu", "adamw", 0, 2)
    xlakit.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}, tmp_path / "c.pt")
    fresh, fresh_opt = _stepped("cpu", "adamw", 1, 0)
    if failure == "mismatch":
        with pytest.raises(xlakit.CheckpointMismatchError):
            xlakit.restore(tmp_path / "c.pt", model=fresh, optimizer=fresh_opt)  # "step" is not in it
    elif failure == "deadline":
        with pytest.raises(xlakit.CheckpointTimeoutError):
            xlakit.restore(tmp_path / "c.pt", {"step": 0}, model=fresh, optimizer=fresh_opt, timeout_s=1e-6)
    else:
        from xlakit.checkpoint.file import restoring

        def interrupted(*args):
            raise KeyboardInterrupt

        monkeypatch.setattr(restoring, "_restore_batch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            xlakit.restore(tmp_path / "c.pt", {"step": 0}, model=fresh, optimizer=fresh_opt)
    assert not fresh_opt.state and all(p.grad is None for p in fresh.parameters())
    assert fresh_opt.param_groups[0]["lr"] == 0.01


def test_model_and_optimizer_of_the_wrong_kind_are_named(tmp_path):
    # Regression: model=3 was taken as a template entry and reported as a checkpoint mismatch.
    model, opt = _stepped("cpu", "adamw", 0, 1)
    xlakit.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    with pytest.raises(TypeError, match=r"model= takes a torch.nn.Module or its state dict .*got int"):
        xlakit.restore(tmp_path / "c.pt", model=3, optimizer=opt)
    with pytest.raises(TypeError, match=r"optimizer= takes a torch.optim.Optimizer or its state dict .*got Linear"):
        xlakit.restore(tmp_path / "c.pt", model=model, optimizer=model[0])
    head = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)  # a list of optimizers stays an entry
    model(torch.randn(4, 8)).sum().backward()
    head.step()
    xlakit.save({"model": model.state_dict(), "optimizer": [opt.state_dict(), head.state_dict()]}, tmp_path / "c.pt")
    fresh, fresh_opt = _stepped("cpu", "adamw", 1, 0)
    fresh_head = torch.optim.SGD(fresh[2].parameters(), lr=0.1, momentum=0.9)
    xlakit.restore(tmp_path / "c.pt", model=fresh, optimizer=[fresh_opt, fresh_head])
    assert _same_optimizer_state(opt, fresh_opt) and _same_optimizer_state(head, fresh_head)


def test_a_template_written_during_the_restore_does_not_make_a_good_file_corrupt(tmp_path, monkeypatch):
    # Regression: a large record read straight into a CPU template tensor was hashed from that
    # tensor's memory; another thread writing the tensor meanwhile made restore call a good file
    # corrupt (CheckpointCorruptError). The other thread is a fake: a write right after each read.
    state = {"w": torch.randn(1 << 20), "b": torch.randn(4)}
    xlakit.save(state, tmp_path / "c.pt")
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    real = loading.RecordReader.read_into

    def read_then_written(self, offset, dst, what, tensor):
        real(self, offset, dst, what, tensor)
        if len(dst) == template["w"].nbytes:
            template["w"].add_(1)  # what the other thread does between the read and the hash

    monkeypatch.setattr(loading.RecordReader, "read_into", read_then_written)
    with pytest.raises(RuntimeError, match="'w' of the template changed while it was restored") as caught:
        xlakit.restore(tmp_path / "c.pt", template)
    assert not isinstance(caught.value, xlakit.CheckpointCorruptError)
    monkeypatch.setattr(loading.RecordReader, "read_into", real)
    xlakit.restore(tmp_path / "c.pt", template)  # the file itself is good
    assert torch.equal(template["w"], state["w"])


class _CastOnSave(torch.nn.Module):
    """Keeps float32 weights; its state dict holds bfloat16 copies of them (a state-dict hook), so the
    state dict's tensors are not the module's own."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self._register_state_dict_hook(lambda module, state, prefix, local: {k: v.to(torch.bfloat16)
                                                                             for k, v in state.items()})

    def forward(self, x):
        return self.lin(x)


def test_a_module_whose_state_dict_holds_copies_is_loaded_not_left_as_it_was(tmp_path):
    # Regression: restore(model=m) filled the tensors of m.state_dict() in place; where those were copies
    # (a state-dict hook that casts), the restore succeeded and the module kept its old weights.
    torch.manual_seed(0)
    saved = _CastOnSave()
    xlakit.save({"model": saved.state_dict()}, tmp_path / "c.pt")
    torch.manual_seed(1)
    fresh = _CastOnSave()
    weight = fresh.lin.weight
    xlakit.restore(tmp_path / "c.pt", model=fresh)
    assert fresh.lin.weight is weight and torch.equal(fresh.lin.weight, saved.lin.weight.to(torch.bfloat16).float())
