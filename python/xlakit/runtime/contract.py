"""The run contract: environment a run must (not) carry, checked before the runtime starts.

A broken contract either kills the run at start-up (libtpu rejects a flag it
removed with "unknown flag", after the job was scheduled) or, worse, lets it
run wrong (SPMD without `XLA_NO_SPECIAL_SCALARS=1` gave silently wrong
losses). Both are checked from the environment alone, so the check can run
before torch_xla starts the runtime. Which libtpu flags were removed is data
(`data/libtpu_flags.toml`), not code: a libtpu bump adds a row.

The device must be one torch_xla can start (`PJRT_DEVICE`: CPU, built in, an
installed plugin or one registered in code with `register_plugin`; unset lets
torch_xla choose), and a persistent cache path
must not be a file: both otherwise fail only later, inside the runtime.

The libtpu version a flag is judged against is, in order: the one given, the
installed one, else the newest the pinned `tpu` profile allows (a run script
checked on a laptop is meant for the pinned hosts).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shlex
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from xlakit import _knobs
from xlakit.runtime import pins as _pins, torchtpu
from xlakit.errors import RunContractError


@dataclass(frozen=True)
class RemovedFlag:
    """One row of the libtpu flag table."""

    name: str
    removed_in: str
    replacement: str


@functools.cache
def removed_flags() -> tuple[RemovedFlag, ...]:
    """The libtpu flag table shipped with xlakit (`xlakit/data/libtpu_flags.toml`)."""
    text = resources.files("xlakit").joinpath("data/libtpu_flags.toml").read_text()
    data = tomllib.loads(text)
    return tuple(RemovedFlag(**row) for row in data.get("flag", []))


def _flag_names(args: str) -> list[tuple[str, str]]:
    """(name, as written) for each `--flag[=value]` in an args string."""
    out = []
    for token in shlex.split(args):
        if token.startswith("-"):
            out.append((token.lstrip("-").split("=", 1)[0], token))
    return out


def target_libtpu(libtpu_version: str | None = None, *, pins: str | os.PathLike | None = None) -> tuple[str | None, str]:
    """The libtpu version flags are judged against, and where it came from."""
    if libtpu_version:
        return libtpu_version, "given"
    installed = _pins.installed_version("libtpu")
    if installed:
        return installed, "installed"
    # TorchTPU reads LIBTPU_INIT_ARGS too, with its own libtpu range (profile torchtpu).
    profile = _pins.TORCHTPU_PROFILE if torchtpu.in_use() else _pins.TPU_PROFILE
    newest = _pins.newest_pinned("libtpu", profile, pins)
    if newest is None:
        return None, "libtpu is neither installed nor pinned"
    return newest, f"not installed; the newest the pinned {profile} profile allows"


# torch_xla registers every device but CPU from these entry points at import (torch_xla/__init__.py).
PLUGIN_GROUP = "torch_xla.plugins"
# With dynamic plugins off, torch_xla 2.9's C++ starts only these (InitializePjRt in pjrt_registry.cpp).
_STATIC_DEVICES = ("CPU", "NEURON", "TPU", "XPU")


def accepted_devices(env: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], str]:
    """The `PJRT_DEVICE` values this torch_xla can start, and where that list comes from."""
    env = os.environ if env is None else env
    dynamic = (env.get(_knobs.XLA_REGISTER_INSTALLED_PLUGINS, "1") == "1"
               or _knobs.is_true(env.get(_knobs.PJRT_DYNAMIC_PLUGINS)))
    if not dynamic:
        return _STATIC_DEVICES, f"torch_xla's built-in clients ({_knobs.XLA_REGISTER_INSTALLED_PLUGINS}=0)"
    plugins = {ep.name.upper() for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}
    registered = registered_devices() - plugins - {"CPU"}
    plugins |= registered
    source = f"CPU is built in, the others are the installed {PLUGIN_GROUP} entry points"
    if registered:
        source += f" and the plugins registered in code ({', '.join(sorted(registered))})"
    return ("CPU", *sorted(plugins)), source


def registered_devices() -> set[str]:
    """The devices registered in this process with `torch_xla.experimental.plugins.register_plugin` (the
    registry `enable_persistent_cache` routes through too). Never imports torch_xla: nobody registered a
    plugin in a module nobody imported, and its import fills in torch_xla's environment defaults."""
    plugins = sys.modules.get("torch_xla.experimental.plugins")
    registry = getattr(plugins, "_plugin_registry", None)
    return {str(name).upper() for name in registry} if isinstance(registry, Mapping) else set()


def _device_violation(env: Mapping[str, str]) -> str | None:
    if _knobs.PJRT_DEVICE not in env:
        return None  # torch_xla chooses TPU, NEURON or CPU itself
    value = env[_knobs.PJRT_DEVICE]
    accepted, source = accepted_devices(env)
    expected = f"expected one of {', '.join(accepted)} ({source})"
    if not value.strip():
        return (f"{_knobs.PJRT_DEVICE} is set but empty, {expected}; torch_xla refuses to start with it "
                f"(\"$PJRT_DEVICE is not set\"); export {_knobs.PJRT_DEVICE}=<one of them>, or unset it to let "
                "torch_xla choose")
    if value in accepted:
        return None
    if value.upper() in accepted:
        return (f"{_knobs.PJRT_DEVICE}={value!r} is not a device torch_xla can start, {expected}; names are "
                f"case-sensitive: export {_knobs.PJRT_DEVICE}={value.upper()}")
    return (f"{_knobs.PJRT_DEVICE}={value!r} is not a device torch_xla can start, {expected}; export "
            f"{_knobs.PJRT_DEVICE}=<one of them>, or install the plugin for {value} (a package with a "
            f"{value.lower()!r} entry point in {PLUGIN_GROUP})")


def _cache_path_violation(env: Mapping[str, str]) -> str | None:
    raw = env.get(_knobs.XLA_PERSISTENT_CACHE_PATH)
    if not raw:
        return None
    path = Path(raw)
    for where in (path, *path.parents):
        try:
            if not where.exists():
                continue
            if where.is_dir():
                return None
        except OSError:  # cannot look: the runtime will say what it finds
            return None
        what = "is a file" if where == path else f"lies under {where}, which is a file"
        return (f"{_knobs.XLA_PERSISTENT_CACHE_PATH}={raw} {what}, expected a folder (torch_xla fails the first "
                "compilation: \"filesystem error: cannot create directories\"); point it at a folder, or call "
                "xlakit.enable_persistent_cache(folder), which sets it")
    return None


def contract_violations(*, env: Mapping[str, str] | None = None, libtpu_version: str | None = None,
                        spmd: bool | None = None, pins: str | os.PathLike | None = None) -> list[str]:
    """Each way the environment breaks the run contract, as a message; [] when it holds.

    Same arguments as `check_run_contract`, which raises instead.
    """
    env = os.environ if env is None else env
    # PJRT_DEVICE and XLA_PERSISTENT_CACHE_PATH are torch_xla's; TorchTPU reads neither.
    problems = [] if torchtpu.in_use() else [p for p in (_device_violation(env), _cache_path_violation(env)) if p]
    args = env.get(_knobs.LIBTPU_INIT_ARGS) or ""
    if args:
        table = {f.name: f for f in removed_flags()}
        version, origin = target_libtpu(libtpu_version, pins=pins)
        for name, written in _flag_names(args):
            # absl spells a false boolean `--noname`; it is the same flag.
            row = table.get(name) or (table.get(name[2:]) if name.startswith("no") else None)
            if row is None or version is None or _pins.release(version) < _pins.release(row.removed_in):
                continue
            fix = f"pass {row.replacement} instead" if row.replacement else "drop it (it has no replacement)"
            problems.append(
                f"{_knobs.LIBTPU_INIT_ARGS} passes {written}, but libtpu {row.removed_in} removed "
                f"--{row.name} (this run targets libtpu {version}: {origin}); {fix}"
            )
    in_spmd = spmd if spmd is not None else _knobs.is_true(env.get(_knobs.XLA_USE_SPMD))
    special = env.get(_knobs.XLA_NO_SPECIAL_SCALARS)
    if in_spmd and (special or "").strip() != "1":
        problems.append(
            f"SPMD is in use but {_knobs.XLA_NO_SPECIAL_SCALARS} is "
            f"{'unset' if special is None else repr(special)}, expected 1 (SPMD runs without it gave "
            f"silently wrong losses); export {_knobs.XLA_NO_SPECIAL_SCALARS}=1 before the run starts"
        )
    return problems


def check_run_contract(*, env: Mapping[str, str] | None = None, libtpu_version: str | None = None,
                       spmd: bool | None = None, pins: str | os.PathLike | None = None) -> None:
    """Refuse a run whose environment breaks the contract, before the runtime starts.

    Call it first thing in a training script, before anything touches an XLA
    device: a removed libtpu flag otherwise kills the run inside libtpu.

    Args:
        env: Variables to check; `os.environ` when None.
        libtpu_version: The libtpu the run targets; default the installed one,
            else the newest the pinned `tpu` profile allows.
        spmd: Whether the run uses SPMD; default `XLA_USE_SPMD` from `env`
            (pass True when `torch_xla.runtime.use_spmd()` is called later).
        pins: A pins file other than the one baked into xlakit.

    Raises:
        RunContractError: naming each violation (flag, the libtpu version that
            removed it, its replacement; the missing SPMD setting; a
            `PJRT_DEVICE` torch_xla cannot start, with the accepted values;
            a persistent cache path that is a file).

    Example:
        >>> import xlakit
        >>> xlakit.check_run_contract(env={"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=true"})
    """
    problems = contract_violations(env=env, libtpu_version=libtpu_version, spmd=spmd, pins=pins)
    if problems:
        raise RunContractError(
            "the run contract is broken:\n  - " + "\n  - ".join(problems), violations=problems)
