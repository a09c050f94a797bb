"""The pinned stack as the installed package knows it: the baked `_pins.toml`.

`setup.py` copies VERSIONS.toml into the package on every build, so a wheel
(or an editable install) carries the pins it was built with and never reads a
checkout, which may have moved on since. Another file can be named explicitly
(that is how a drift check is pointed at a different profile). Profile choice:
an explicit name, else `XLAKIT_PROFILE`, else `torchtpu` (`torchtpu-cpu`
without libtpu) where torch-tpu is installed, else `tpu` when the process
targets a TPU (`PJRT_DEVICE=TPU` or libtpu installed), else `cpu-dev`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import tomllib
from importlib import resources
from pathlib import Path

from xlakit import _knobs
from xlakit.errors import ConfigurationError, PinsError

BAKED_NAME = "_pins.toml"
TPU_PROFILE = "tpu"
DEV_PROFILE = "cpu-dev"
TORCHTPU_PROFILE = "torchtpu"  # TorchTPU on a TPU host; `torchtpu-cpu` on its CPU plugin


def baked_path() -> Path:
    return Path(str(resources.files("xlakit").joinpath(BAKED_NAME)))


@functools.cache
def _load_cached(path: str) -> dict:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise PinsError(
            f"expected the pins file at {p}, found nothing; reinstall xlakit "
            "(the build copies VERSIONS.toml into the package) or pass another pins file"
        ) from None
    except IsADirectoryError:
        raise PinsError(f"{p}: expected a TOML pins file, found a folder; pass the file (such as "
                        "VERSIONS.toml)") from None
    except UnicodeDecodeError as e:
        raise PinsError(f"{p}: expected a TOML pins file, found binary data ({e.reason} at byte {e.start}); pass "
                        "the text file (such as VERSIONS.toml)") from None
    except tomllib.TOMLDecodeError as e:
        raise PinsError(f"{p}: expected TOML, found a syntax error: {e}") from e
    if data.get("schema") != 1:
        raise PinsError(f"{p}: expected schema = 1, found {data.get('schema')!r}")
    return data


def load(path: str | os.PathLike | None = None) -> dict:
    """The whole pins document (the baked copy unless `path` names another)."""
    return _load_cached(str(Path(path) if path is not None else baked_path()))


def profile(name: str, path: str | os.PathLike | None = None) -> dict:
    profiles = load(path).get("profiles", {})
    if name not in profiles:
        raise PinsError(
            f"expected a profile named {name!r} in {path or baked_path()}, "
            f"found only: {', '.join(sorted(profiles)) or 'none'}"
        )
    return profiles[name]


def patch_level(path: str | os.PathLike | None = None) -> int:
    return int(load(path)["xlakit"]["patch_level"])


def expected_patch_set(path: str | os.PathLike | None = None) -> str:
    """The patch set a source-built profile's binary must carry (`xlakit<patch_level>`)."""
    return f"xlakit{patch_level(path)}"


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def newest_pinned(dist: str, profile_name: str, path: str | os.PathLike | None = None) -> str | None:
    """The newest version of `dist` that `profile_name` allows (its floor when it lists none), or None."""
    spec = profile(profile_name, path).get("packages", {}).get(dist)
    if spec is None:
        return None
    if isinstance(spec, dict):
        versions = spec.get("allowed") or [spec["floor"]]
    else:
        versions = [spec.removeprefix(">=")]
    return max(versions, key=release)


def choose_profile(name: str | None = None, path: str | os.PathLike | None = None) -> tuple[str, str]:
    """The profile to check against and why it was chosen; a profile named by the environment must exist."""
    if name:
        return name, "given explicitly"
    env = os.environ.get(_knobs.PROFILE)
    if env:
        known = sorted(load(path).get("profiles", {}))
        if env not in known:
            raise ConfigurationError(f"environment variable {_knobs.PROFILE}={env!r}: expected a profile of "
                                     f"{path or baked_path()}: {', '.join(known) or 'none'} (fix or unset it)")
        return env, f"from {_knobs.PROFILE}"
    if installed_version("torch-tpu") is not None:
        if installed_version("libtpu") is not None:
            return TORCHTPU_PROFILE, "torch-tpu and libtpu are installed"
        return f"{TORCHTPU_PROFILE}-cpu", "torch-tpu is installed without libtpu (its CPU plugin stack)"
    device = (os.environ.get(_knobs.PJRT_DEVICE) or "").upper()
    if device.startswith("TPU"):
        return TPU_PROFILE, f"{_knobs.PJRT_DEVICE}={os.environ[_knobs.PJRT_DEVICE]}"
    if installed_version("libtpu") is not None:
        return TPU_PROFILE, "libtpu is installed"
    return DEV_PROFILE, "no TPU in sight (PJRT_DEVICE is not TPU, libtpu not installed)"


_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """`2.9.0+cu128` -> (2, 9, 0): the public release, without local labels."""
    m = _RELEASE.match(version)
    if not m:
        raise PinsError(f"expected a version like 1.2.3, found {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def _pad(v: tuple[int, ...], n: int) -> tuple[int, ...]:
    return v + (0,) * (n - len(v))


def satisfies(found: str, spec: str | dict) -> bool:
    """Does `found` meet a pin? Pins are `"X"` (same release), `">=X"`, or `{floor, allowed}`."""
    have = release(found)
    if isinstance(spec, dict):
        allowed = spec.get("allowed")
        if allowed is not None:
            return any(_pad(have, 4) == _pad(release(a), 4) for a in allowed)
        return _pad(have, 4) >= _pad(release(spec["floor"]), 4)
    if spec.startswith(">="):
        return _pad(have, 4) >= _pad(release(spec[2:]), 4)
    want = release(spec)
    # A pin of "3.13" accepts any 3.13.x; "2.9.0" accepts 2.9.0+cu128 but not 2.9.1.
    return have[: len(want)] == want


def describe(spec: str | dict) -> str:
    if isinstance(spec, dict):
        if spec.get("allowed") is not None:
            return "one of " + ", ".join(spec["allowed"])
        return f">={spec['floor']}"
    return spec
