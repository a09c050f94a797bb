"""Fakes for what cannot be real here: a device that hangs or is slow, a patched torch_xla, a
torch_xla whose runtime has not started.

The device fakes replace `xlakit.checkpoint.file.transfer.backend_for` (the one seam) and
otherwise behave like the CPU backend, so everything around the transfer is
the real code. `FakePatchedXLAC` wraps the real stock `_XLAC` and adds the
bindings only the patched build has.
"""

from __future__ import annotations

import threading
import time

from xlakit.checkpoint.file.transfer import HostTransfer


class FakeSlowDevice(HostTransfer):
    """Each batch takes `delay_s` to reach the host (a copy, as a device's: overlapped with the write)."""

    name = "fake-slow"
    copies = True

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def to_host(self, tensors, *, timeout_s):
        time.sleep(self.delay_s)
        return super().to_host(tensors, timeout_s=timeout_s)


class FakeHungDevice(HostTransfer):
    """A device whose sync or device-to-host copy never returns until `release()`."""

    name = "fake-hung"
    copies = True

    def __init__(self, *, hang_in: str = "transfer"):
        assert hang_in in ("sync", "transfer")
        self.hang_in = hang_in
        self.entered = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def _hang(self) -> None:
        self.entered.set()
        self._released.wait(600)  # releases the GIL, like a native call that drops it

    def prepare(self, tensors):
        if self.hang_in == "sync":
            self._hang()

    def to_host(self, tensors, *, timeout_s):
        if self.hang_in == "transfer":
            self._hang()
        return super().to_host(tensors, timeout_s=timeout_s)


class FakeFullDisk:
    """A full disk: every storage write (small records and chunked ones) fails with ENOSPC.

    `with FakeFullDisk() as disk:` installs it (in this process) and puts the real writer
    back; `disk.failed` is set once a write failed.
    """

    METHODS = ("write_storage", "write_small_storages")  # every way a storage reaches the file

    def __init__(self) -> None:
        self.failed = threading.Event()
        self._real: dict = {}

    def _full(self, *args, **kwargs):
        self.failed.set()
        raise OSError(28, "No space left on device")

    def __enter__(self) -> "FakeFullDisk":
        from xlakit.checkpoint.format import archive

        for name in self.METHODS:
            self._real[name] = getattr(archive.ArchiveWriter, name)
            setattr(archive.ArchiveWriter, name, lambda writer, *a, **k: self._full())
        return self

    def __exit__(self, *exc) -> None:
        from xlakit.checkpoint.format import archive

        for name, real in self._real.items():
            setattr(archive.ArchiveWriter, name, real)


def slow_disk(monkeypatch, delay_s: float) -> None:
    """A fake slow disk: every batch a save writes waits `delay_s` first (a stalled write, a disk slower
    than the copies)."""
    from xlakit.checkpoint.file import pipeline

    real = pipeline.write_batch

    def slow_write(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "write_batch", slow_write)


# Script text (for a child interpreter) of a fake: every operation reaches its commit just after its deadline, so
# the commit is refused. Needs `time` imported before it.
LATE_COMMIT = """
    from xlakit.checkpoint.core import operation
    original = operation.Operation.commit_point
    def late(self):
        time.sleep(max(self.deadline - time.monotonic(), 0.0) + 0.05)
        return original(self)
    operation.Operation.commit_point = late
"""


def install(monkeypatch, backend: HostTransfer) -> None:
    from xlakit.checkpoint.file import transfer

    monkeypatch.setattr(transfer, "backend_for", lambda device_type, sample, **_: backend)


class FakePatchedXLAC:
    """Stand-in for a patched torch_xla._XLAC: the real stock module plus the given bindings."""

    def __init__(self, real, **bindings):
        self._real = real
        self.__dict__.update(bindings)

    def __getattr__(self, name):
        return getattr(self._real, name)


class FakeXLAC:
    """Stand-in for torch_xla._XLAC whose computation cache is not yet created."""

    def __init__(self, real):
        self._real = real

    def _xla_computation_cache_is_initialized(self):
        return False

    def __getattr__(self, name):
        return getattr(self._real, name)
