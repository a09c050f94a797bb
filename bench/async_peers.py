"""The asynchronous saves `bench_async.py` compares: each peer's own documented path, and its state.

Every peer is `start(state, path) -> (returned_s, wait)` for an empty folder `path`: `start` returns when the caller may
change the state again (what the training loop waits for), `wait()` when the
peer says the checkpoint is written. The states hold the same bytes for every
peer: `--total-mib` of fp32 tensors of `--tensor-mib` each.

* `xlakit`: `xlakit.save(state, path, asynchronous=True)`, then `handle.result()`.
* `xlakit-copy` (XLA state only): the same with `transfer_backend="stock"`, the copy a TPU's
  buffers take to the host (this machine's CPU client exports them zero-copy instead).
* `xlakit-device` (XLA state only): the copy route with `staging="device"`: the caller waits for a copy
  on the device, the background moves it to the host (docs/checkpoints.md, "Staging on the device").
* `dcp`: `torch.distributed.checkpoint.async_save` with its `DefaultStager`
  (shared memory, staging on its own thread: torchtitan's "zero-overhead"
  setting; pinned memory and non-blocking copies need CUDA, which this machine
  lacks, so DCP turns pinning off and non-blocking copies are not asked for),
  one stager reused by every save, in a single-process gloo group. The caller
  may change the state once `staging_completion` is done: that is its blocked
  time; `async_save` itself returns earlier (`returned_s`). Its stager refuses
  XLA tensors (they have no storage: "Attempted to call copy_() on an invalid
  python storage"), so an XLA state is moved with `.cpu()` first, inside the
  blocked time, as a user of DCP on torch_xla must.
* `orbax`: `ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())` of jax
  arrays on jax's CPU device (the XLA state) or of numpy arrays (the CPU state);
  `save` returns once the arrays are on the host, `wait_until_finished()`.
* `lightning`: `AsyncCheckpointIO(TorchCheckpointIO())`: clones every tensor on
  its device on the caller's thread, then `torch.save` on a worker thread;
  `teardown()` waits for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20
Wait = Callable[[], None]


def _values(total_mib: int, tensor_mib: int):
    """(name, fp32 CPU tensor of random values): random, so that no peer's compression shrinks them."""
    import torch

    g = torch.Generator().manual_seed(0)
    for i in range(total_mib // tensor_mib):
        yield f"layer{i}.weight", torch.randn(tensor_mib * MiB // 4, generator=g)


def torch_state(kind: str, total_mib: int, tensor_mib: int) -> dict:
    """{"model": {name: fp32 tensor}}: synced on the XLA device (`xla`) or on the CPU (`cpu`)."""
    if kind != "xla":
        return {"model": dict(_values(total_mib, tensor_mib))}
    import torch_xla

    device = torch_xla.device()
    model = {k: v.to(device) for k, v in _values(total_mib, tensor_mib)}
    torch_xla._XLAC._xla_sync_multi(list(model.values()), devices=[], wait=True)
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    return {"model": model}


def jax_state(kind: str, total_mib: int, tensor_mib: int) -> dict:
    """The same bytes for Orbax: jax arrays on jax's CPU device (`xla`) or numpy arrays (`cpu`)."""
    if kind != "xla":
        return {"model": {k: v.numpy() for k, v in _values(total_mib, tensor_mib)}}
    import jax

    model = {k: jax.device_put(v.numpy()) for k, v in _values(total_mib, tensor_mib)}
    jax.block_until_ready(model)
    return {"model": model}


class Xlakit:
    options: dict = {}  # the save's options beside asynchronous=True

    def __init__(self, kind: str):
        import xlakit

        self.xlakit = xlakit

    def start(self, state: dict, path: Path) -> tuple[float | None, Wait]:
        handle = self.xlakit.save(state, path / "ckpt.pt", asynchronous=True, **self.options)
        return None, handle.result

    def close(self) -> None:
        pass


class XlakitCopy(Xlakit):
    """xlakit on the route a TPU takes (XLA state only): the stock device-to-host copy, in place of the CPU
    client's zero-copy DLPack export that `xlakit` takes here."""

    options = {"transfer_backend": "stock"}


class XlakitDevice(Xlakit):
    """xlakit on the copy route, staged on the device (XLA state only): the caller waits for a device copy."""

    options = {"transfer_backend": "stock", "staging": "device"}


class Dcp:
    def __init__(self, kind: str):
        import socket
        import warnings

        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
        self.kind = kind
        with warnings.catch_warnings():  # "Ignoring pin_memory flag ... CUDA is not available"
            warnings.simplefilter("ignore")
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                                                       use_async_staging=True, use_non_blocking_copy=False))

    def start(self, state: dict, path: Path) -> tuple[float | None, Wait]:
        import time

        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        if self.kind == "xla":
            state = {"model": {k: v.cpu() for k, v in state["model"].items()}}
        response = dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)
        returned = time.perf_counter() - t
        response.staging_completion.result()  # only now may the training loop change the state
        return returned, response.upload_completion.result

    def close(self) -> None:
        import torch.distributed as dist

        self.stager.close()
        dist.destroy_process_group()


class Orbax:
    def __init__(self, kind: str):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.checkpointer = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())

    def start(self, state: dict, path: Path) -> tuple[float | None, Wait]:
        self.checkpointer.save(path.resolve() / "ckpt", args=self.ocp.args.StandardSave(state))
        return None, self.checkpointer.wait_until_finished

    def close(self) -> None:
        self.checkpointer.close()


class Lightning:
    def __init__(self, kind: str):
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def start(self, state: dict, path: Path) -> tuple[float | None, Wait]:
        self.io.save_checkpoint({"state_dict": state}, path / "ckpt.ckpt")
        return None, self.io.teardown  # waits for the worker (a later save makes a new one)

    def close(self) -> None:
        self.io.teardown()


PEERS = {"xlakit": Xlakit, "xlakit-copy": XlakitCopy, "xlakit-device": XlakitDevice, "dcp": Dcp, "orbax": Orbax,
         "lightning": Lightning}
XLA_ONLY = {"xlakit-copy", "xlakit-device"}
LABELS = {"xlakit": "xlakit async save", "xlakit-copy": "xlakit async, copy route (TPU)",
          "xlakit-device": "xlakit async, device staging",
          "dcp": "DCP async_save+DefaultStager",
          "orbax": "Orbax AsyncCheckpointer", "lightning": "Lightning AsyncCheckpointIO"}


def state_for(peer: str, kind: str, total_mib: int, tensor_mib: int) -> dict:
    return (jax_state if peer == "orbax" else torch_state)(kind, total_mib, tensor_mib)


def fsync_tree(path: Path) -> None:
    """fsync every file and folder under `path`, and `path`'s folder: what a peer that does not
    fsync (torch.save, Orbax's tensorstore) leaves to be made durable; for one that did, a no-op."""
    for root, dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
