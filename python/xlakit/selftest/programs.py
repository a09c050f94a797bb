"""The two small programs the compile-cache check compiles, in torch (torch_xla, TorchTPU) and in jax.

`P` is a few dense layers, `Q` a different program (softmax and a
reduction), so that each compiles to entries of its own: the check tampers
with `Q`'s and expects `P`'s to load. Each returns the SHA-256 of its
result's bytes, which must be the same in every process (bit-exact).
"""

from __future__ import annotations

import hashlib

PROGRAMS = ("P", "Q")


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def torch_program(which: str, dev) -> str:
    import torch

    x = (torch.arange(4096, dtype=torch.float32).reshape(64, 64) / 4096).to(dev.device)
    if which == "P":
        for i in range(6):
            x = torch.tanh(x @ x.T * 0.5 + i)
        out = x
    else:
        out = (torch.softmax(x * 3, dim=1) * 2 - 1).sum(dim=0)
    return _digest(out.cpu().numpy().tobytes())


def jax_program(which: str, jax) -> str:
    import jax.numpy as jnp

    x = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) / 4096
    if which == "P":
        def body(a):
            for i in range(6):
                a = jnp.tanh(a @ a.T * 0.5 + i)
            return a
    else:
        def body(a):
            return (jax.nn.softmax(a * 3, axis=1) * 2 - 1).sum(axis=0)
    out = jax.jit(body)(x)
    return _digest(bytes(jax.device_get(out).tobytes()))
