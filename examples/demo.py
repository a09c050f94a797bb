"""`make demo`: train on the XLA device, checkpoint mid-training with xlakit, reload, compare.

Runs wherever PJRT_DEVICE points (CPU here, TPU or Neuron elsewhere). The
checkpoint is taken while the last optimizer step is still pending (lazy), the
moment where plain `torch.save` compiles one graph per tensor.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch_xla
import torch_xla.debug.metrics as met

import xlakit

LAYERS, WIDTH, STEPS, SAVE_AT = 4, 512, 6, 3


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def snapshot(state):
    """Reference values straight from the device (for the equality check)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    return state


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def train_step(model, opt, device):
    loss = model(torch.randn(16, WIDTH, device=device)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def main() -> int:
    device = torch_xla.device()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    print(f"xlakit {xlakit.__version__} | device {device} "
          f"({os.environ.get('PJRT_DEVICE', 'default')}) | {LAYERS} x Linear({WIDTH}) + AdamW")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "step.pt")
        for step in range(1, STEPS + 1):
            loss = train_step(model, opt, device)
            if step != SAVE_AT:
                torch_xla.sync()
                print(f"step {step}: loss {loss.item():.5f}")
                continue
            # Checkpoint now, with the step still pending on the device.
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            c0, t0 = compiles(), time.perf_counter()
            xlakit.save(state, path, timeout_s=600)
            save_s, save_compiles = time.perf_counter() - t0, compiles() - c0
            size = os.path.getsize(path)
            print(f"step {step}: loss {loss.item():.5f}  -> xlakit.save: {save_compiles} compile(s), "
                  f"{size / 2**20:.1f} MiB in {save_s:.2f} s (one sync: the pending step is the "
                  f"training step's own graph)")
            expected = snapshot(state)
            loaded = xlakit.load(path)
            ok = same(expected, loaded) and same(expected, torch.load(path, weights_only=True))
            print(f"         reload: checksums verified, bit-exact = {ok}, also via plain torch.load")
            if not ok:
                raise SystemExit("demo failed: the reloaded checkpoint differs")
        # What plain torch.save costs on the same kind of state: one more pending step.
        train_step(model, opt, device)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": STEPS + 1}
        c0, t0 = compiles(), time.perf_counter()
        torch.save(state, os.path.join(folder, "plain.pt"))
        plain_s, plain_compiles = time.perf_counter() - t0, compiles() - c0
    print(f"plain torch.save on the same pending state: {plain_compiles} compiles, {plain_s:.2f} s "
          f"(xlakit: {save_compiles} compile(s), {save_s:.2f} s, {plain_s / save_s:.1f}x faster, "
          f"atomic and checksummed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
