"""Options for save and load: frozen dataclasses, units in the names, validated when built.

Defaults come from the environment (`_knobs`) when a field is not given, so a
job can raise every save's timeout with one variable; an explicit argument
always wins. Every field is checked for its type, range and combination with
the others when the options are built, before any work starts: a wrong option
is a `TypeError` or `ValueError` naming the option, what it got and what it
accepts, never a save that does something else than asked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xlakit import _knobs


@dataclass(frozen=True)
class Progress:
    """A snapshot of a running save or load, passed to `progress_callback`.

    A save also reports its parts: `transfer_s` (copying storages to the host), `write_s`
    (hashing and writing them) and `overlap_s` (both at once: an overlapped save copies the next
    batch while it writes this one), each counting the batches done so far.
    """

    path: str
    stage: str
    tensor: str | None
    bytes_done: int
    bytes_total: int
    elapsed_s: float
    transfer_s: float = 0.0
    write_s: float = 0.0
    overlap_s: float = 0.0

    @property
    def rate_bytes_per_s(self) -> float:
        return self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.rate_bytes_per_s
        if rate <= 0:
            return None
        return max(self.bytes_total - self.bytes_done, 0) / rate


ProgressCallback = Callable[[Progress], None]
ExtraKeysCallback = Callable[[list[str]], None]
SAVE_LAYOUTS = ("single", "replicated", "sharded")
SAVE_STAGINGS = ("host", "device")
LOAD_LAYOUTS = ("auto", "single", "replicated")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _callback(value: object, name: str = "progress_callback") -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")


@dataclass(frozen=True)
class SaveOptions:
    """How `xlakit.save` runs.

    Attributes:
        timeout_s: one deadline for the whole save (sync, transfer, write, commit).
        max_inflight_bytes: cap on tensor bytes held on the host at once.
        stall_warning_s: warn when no progress was made for this long.
        progress_interval_s: log progress of long saves at this interval.
        progress_callback: called with a `Progress` while the save runs and at the end;
            an exception it raises cancels the save.
        asynchronous: return once the state is staged in host memory; the write and
            commit run in the background under the same deadline (see `SaveHandle`).
            Works with every layout.
        layout: "single" (this process writes `path`), "replicated" (every rank of a
            torch.distributed job passes the same state; `writer_rank` writes it) or
            "sharded" (every rank writes its own state as a shard of folder `path`).
        writer_rank: the rank that writes a replicated checkpoint (layout "replicated" only).
        replica_parallel: (layout "replicated" only) every rank writes a share of about 1/R
            of the bytes into a folder at `path`, `writer_rank` its commit record; a load
            in the job reads each share once and broadcasts it (docs/multi-rank.md).
        compute_crc32: also fill in the zip CRC32 fields. Off by default: torch.load
            never checks them, xlakit's xxh3 checksums cover every byte, and they
            cost ~0.4 s per GB; turn on for generic zip tools (`unzip -t`).
        transfer_backend: how XLA tensors reach the host: "auto" (the best this build
            has), "patched" (xlakit's deadline-bounded binding; needs the patched
            torch_xla), "dlpack" (zero-copy export, CPU PJRT client) or "stock"
            (`_xla_get_cpu_tensors`). Default `XLAKIT_TRANSFER_BACKEND`, else "auto".
        staging: (asynchronous saves) where the state is held while the caller waits:
            "host" (the default: the caller waits for the device-to-host copy) or "device"
            (the caller waits for a copy on the device, made at device-memory speed; the
            background copies it to the host batch by batch and frees each batch's device
            copy once it is on the host). "device" needs free device memory for a copy
            of the state's device tensors (docs/checkpoints.md, "Staging on the device").
            `xlakit.save` refuses "device" without ``asynchronous=True``; a
            `CheckpointManager`'s synchronous saves (on preemption) stage on the host.
    """

    timeout_s: float = field(default_factory=lambda: _knobs.get_float(_knobs.SAVE_TIMEOUT_S))
    max_inflight_bytes: int = field(default_factory=lambda: _knobs.get_int(_knobs.MAX_INFLIGHT_BYTES))
    stall_warning_s: float = field(default_factory=lambda: _knobs.get_float(_knobs.STALL_WARNING_S))
    progress_interval_s: float = field(
        default_factory=lambda: _knobs.get_float(_knobs.PROGRESS_INTERVAL_S))
    progress_callback: ProgressCallback | None = None
    compute_crc32: bool = False
    asynchronous: bool = False
    layout: str = "single"
    writer_rank: int = 0
    replica_parallel: bool = False
    transfer_backend: str = field(default_factory=_knobs.get_transfer_backend)
    staging: str = "host"

    def __post_init__(self) -> None:
        _seconds("timeout_s", self.timeout_s)
        _count("max_inflight_bytes", self.max_inflight_bytes, minimum=1)
        _seconds("stall_warning_s", self.stall_warning_s)
        _seconds("progress_interval_s", self.progress_interval_s)
        _callback(self.progress_callback)
        _bool("compute_crc32", self.compute_crc32)
        _bool("asynchronous", self.asynchronous)
        _choice("layout", self.layout, SAVE_LAYOUTS)
        _count("writer_rank", self.writer_rank, minimum=0)
        _bool("replica_parallel", self.replica_parallel)
        _choice("transfer_backend", self.transfer_backend, _knobs.TRANSFER_BACKENDS)
        _choice("staging", self.staging, SAVE_STAGINGS)
        if self.writer_rank != 0 and self.layout != "replicated":
            raise ValueError(f"writer_rank={self.writer_rank} applies to layout='replicated' only "
                             f"(layout is {self.layout!r}); drop it or use layout='replicated'")
        if self.replica_parallel and self.layout != "replicated":
            raise ValueError(f"replica_parallel=True applies to layout='replicated' only (layout is "
                             f"{self.layout!r}); drop it or use layout='replicated'")


@dataclass(frozen=True)
class LoadOptions:
    """How `xlakit.load` runs.

    Attributes:
        verify: check every checksum (refuses files without them).
        timeout_s: deadline for the whole load.
        mmap: map tensor data from the file instead of reading it into memory.
        stall_warning_s, progress_interval_s, progress_callback: as for saving.
        layout: "auto" (a folder is a sharded checkpoint, a file is read by this process
            alone), "single" (this process alone) or "replicated" (every rank of the job
            reads the file; all succeed or all raise).
        shard: read this one shard of a sharded checkpoint folder, without coordination.
        max_inflight_bytes: (`xlakit.restore`) cap on checkpoint bytes held on the host at once.
        strict: (`xlakit.restore`) every entry of the checkpoint must be in the template. False
            allows entries the template lacks (restore part of a state, e.g. only the model):
            they are not read, not in the result, and their names are logged (logger `xlakit`,
            INFO) and passed to `extra_keys_callback`. A template entry missing from the
            checkpoint is an error either way.
        extra_keys_callback: (`xlakit.restore`, with ``strict=False``) called once, before
            anything is read, with the sorted names of the checkpoint's entries the template
            lacks (``["optimizer", "step"]``); not called when there are none.
    """

    verify: bool = True
    timeout_s: float = field(default_factory=lambda: _knobs.get_float(_knobs.SAVE_TIMEOUT_S))
    mmap: bool = False
    max_inflight_bytes: int = field(default_factory=lambda: _knobs.get_int(_knobs.MAX_INFLIGHT_BYTES))
    stall_warning_s: float = field(default_factory=lambda: _knobs.get_float(_knobs.STALL_WARNING_S))
    progress_interval_s: float = field(
        default_factory=lambda: _knobs.get_float(_knobs.PROGRESS_INTERVAL_S))
    progress_callback: ProgressCallback | None = None
    layout: str = "auto"
    shard: int | None = None
    strict: bool = True
    extra_keys_callback: ExtraKeysCallback | None = None

    def __post_init__(self) -> None:
        _bool("verify", self.verify)
        _seconds("timeout_s", self.timeout_s)
        _bool("mmap", self.mmap)
        _count("max_inflight_bytes", self.max_inflight_bytes, minimum=1)
        _seconds("stall_warning_s", self.stall_warning_s)
        _seconds("progress_interval_s", self.progress_interval_s)
        _callback(self.progress_callback)
        _choice("layout", self.layout, LOAD_LAYOUTS)
        if self.shard is not None:
            _count("shard", self.shard, minimum=0)
            if self.layout == "replicated":
                raise ValueError("shard=N reads one shard without coordination; it cannot be combined "
                                 "with layout='replicated'")
        _bool("strict", self.strict)
        _callback(self.extra_keys_callback, "extra_keys_callback")
        if self.strict and self.extra_keys_callback is not None:
            raise ValueError("extra_keys_callback reports the entries a restore with strict=False skips; "
                             "with strict=True such entries are an error: pass strict=False too, or drop it")


def resolve(cls: type, options: Any, overrides: dict[str, Any]) -> Any:
    """`options` (or the defaults) with keyword overrides; unknown names are a TypeError."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)} for {cls.__name__}; "
                        f"valid: {', '.join(sorted(names))}")
    if options is None:
        return cls(**overrides)
    if not isinstance(options, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
    return dataclasses.replace(options, **overrides) if overrides else options


def check_staging(opts: SaveOptions) -> None:
    """Refuse `staging` other than "host" for a synchronous `xlakit.save`."""
    if opts.staging != "host" and not opts.asynchronous:
        raise ValueError(f"staging={opts.staging!r} applies to asynchronous saves only (a synchronous save "
                         f"copies its batches to the host while it writes them); pass asynchronous=True "
                         f"or drop staging")


def manager_options(options: SaveOptions | None, layout: str, asynchronous: bool,
                    replica_parallel: bool = False) -> SaveOptions:
    """The `SaveOptions` of a `CheckpointManager`'s saves: the caller's, with the manager's layout,
    and `replica_parallel` (checked as `SaveOptions` checks it: layout "replicated" only)."""
    opts: SaveOptions = resolve(SaveOptions, options, {})
    for name, given in (("layout", opts.layout != "single"), ("asynchronous", opts.asynchronous),
                        ("replica_parallel", opts.replica_parallel)):
        if given:
            raise ValueError(f"options.{name} is the manager's to set: pass CheckpointManager({name}=...) "
                             f"and leave it out of options")
    _bool("replica_parallel", replica_parallel)
    if layout == "dcp" and (asynchronous or opts.compute_crc32):
        raise ValueError("layout='dcp' saves with xlakit.dcp_save, which is synchronous and has no "
                         "zip CRC32; drop asynchronous/compute_crc32 or use another layout")
    if opts.staging != "host" and not asynchronous:
        raise ValueError(f"options.staging={opts.staging!r} applies to asynchronous saves: pass "
                         f"CheckpointManager(asynchronous=True) or drop staging")
    if layout not in ("replicated", "sharded"):
        if replica_parallel:
            raise ValueError(f"replica_parallel=True applies to layout='replicated' only (layout is "
                             f"{layout!r}); drop it or use layout='replicated'")
        return opts
    return dataclasses.replace(opts, layout=layout, replica_parallel=replica_parallel)
