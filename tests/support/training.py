"""What the checkpoint tests train and kill: a small model's steps, and savers killed by SIGKILL mid-save."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import xlakit

TENSORS, NUMEL = 8, 1 << 20  # a killed saver's state: TENSORS tensors of NUMEL elements, each its version


def linear_model(device, width: int = 64):
    """A Linear model with AdamW on `device`, and one training step of it (in-place updates)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(4, width, device=device)).sum().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


def kill_9_trials(path: Path, saver: str, *, seed: int, trials: int = 4) -> list[int]:
    """Run `saver` (a script saving versions to `path` in a loop, printing each) and SIGKILL it at a
    random time, `trials` times; after each, `path` must load whole with every tensor of one version.
    Returns the versions found; a later save then removes what the killed ones left behind."""
    xlakit.save({"version": 0, **{f"w{i}": torch.full((NUMEL,), 0.0) for i in range(TENSORS)}}, path)
    rng = random.Random(seed)
    versions = []
    for trial in range(trials):
        proc = subprocess.Popen([sys.executable, "-c", saver, str(path), str(1 + trial * 1000)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline(), proc.communicate()[1]  # it is saving in a loop now
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        state = xlakit.load(path)  # whole, every checksum verified, each tensor of its own version
        assert all(torch.equal(state[f"w{i}"], torch.full((NUMEL,), float(state["version"])))
                   for i in range(TENSORS))
        versions.append(state["version"])
    xlakit.save({"version": -1}, path)
    return versions
