"""A small training loop on TorchTPU's `tpu` device, checkpointed by a CheckpointManager.

Run as a script (`FOLDER STEPS [--kill-at STEP] [--out FILE]`) it resumes from
the manager's latest step, trains to STEPS, and with --kill-at SIGKILLs itself
right after asking for the save of that step (which may or may not have
committed); --out saves the final weights. `train()` is the same loop in-process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def model_and_opt(device):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def batch(step: int, device):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).to(device)


def train(device, steps: int, folder: str | None = None, kill_at: int | None = None):
    """Train to `steps` (resuming from `folder`'s latest step); the model."""
    import xlakit

    model, opt = model_and_opt(device)
    mgr = xlakit.CheckpointManager(folder, save_interval_steps=2, max_to_keep=2) if folder else None
    start = mgr.latest_step() if mgr else None
    if start is not None:
        state = mgr.restore(start)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    for step in range((start or 0) + 1, steps + 1):
        x, y = batch(step, device)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if mgr and mgr.should_save(step):
            mgr.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    if mgr:
        mgr.close()
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("steps", type=int)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--out")
    args = p.parse_args()
    from xlakit.runtime import torchtpu

    device = torchtpu.start_on_cpu_plugin()
    model = train(device, args.steps, args.folder, args.kill_at)
    if args.out:
        import xlakit

        xlakit.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
