"""The states the benchmark saves, built on the XLA device named by PJRT_DEVICE.

`pending`: a 16-layer Linear(1024, 1024) model with AdamW whose last step has
not run yet (every tensor is lazy IR: the state a training loop checkpoints).
`synced`: ~2 GiB of materialised device tensors (32 x 64 MiB).
`many`: 100,000 CPU tensors of 64 floats (26 MiB): optimizer states and per-parameter buffers of a
large model, where the per-tensor work of a save is what it costs.
"""

from __future__ import annotations

import torch

MiB = 1 << 20


def pending(layers: int = 16, width: int = 1024) -> dict:
    import torch_xla

    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        model(torch.randn(8, width, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            torch_xla.sync()  # the second step stays pending
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}


def synced(total_mib: int = 2048, tensor_mib: int = 64) -> dict:
    import torch_xla

    device = torch_xla.device()
    n = tensor_mib * MiB // 4
    state = {f"layer{i}.weight": torch.full((n,), float(i), device=device)
             for i in range(total_mib // tensor_mib)}
    torch_xla._XLAC._xla_sync_multi(list(state.values()), devices=[], wait=True)
    return {"model": state}


def many(count: int = 100_000, numel: int = 64) -> dict:
    torch.manual_seed(0)
    return {f"block{i // 100}.t{i % 100}": torch.randn(numel) for i in range(count)}


def nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return 0


BUILDERS = {"pending": pending, "synced": synced, "many": many}
