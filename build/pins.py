"""Read VERSIONS.toml, the one place pins live.

Every part of the build asks this module for versions; nothing copies them.
Validation is strict so a half-edited pin (a short commit, a missing date)
fails here, naming the key, instead of deep inside a fetch.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

VERSIONS_FILE = Path(__file__).resolve().parent.parent / "VERSIONS.toml"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class PinError(ValueError):
    """VERSIONS.toml is missing a key or holds a malformed value."""


@dataclass(frozen=True)
class Source:
    name: str
    commit: str
    date: str
    git: str | None = None
    archive: str | None = None
    version: str | None = None
    sha256: str | None = None

    @property
    def short(self) -> str:
        return self.commit[:7]


def load(path: Path = VERSIONS_FILE) -> dict:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    if data.get("schema") != 1:
        raise PinError(f"{path}: expected schema = 1, found {data.get('schema')!r}")
    return data


def profile(name: str, data: dict | None = None) -> dict:
    data = data if data is not None else load()
    profiles = data.get("profiles", {})
    if name not in profiles:
        raise PinError(f"no profile {name!r} in VERSIONS.toml; known: {', '.join(sorted(profiles))}")
    return profiles[name]


def sources(name: str = "tpu", data: dict | None = None) -> dict[str, Source]:
    out = {}
    for key, raw in profile(name, data).get("sources", {}).items():
        commit = raw.get("commit", "")
        if not _COMMIT.match(commit):
            raise PinError(f"profiles.{name}.sources.{key}.commit must be 40 hex digits, found {commit!r}")
        if not raw.get("date"):
            raise PinError(f"profiles.{name}.sources.{key}.date is missing (bump commit and date together)")
        out[key] = Source(name=key, **raw)
    return out


def requirements(name: str, data: dict | None = None, *, no_deps: bool = False) -> list[str]:
    """pip requirement lines for a profile's wheel packages (exact pins; `">=X"` kept as a floor).

    A profile's `no_deps` packages are left out, or with `no_deps=True` are the only ones listed:
    they are installed by a second `pip install --no-deps` (torch-tpu, whose libtpu dependency
    aborts a process without a TPU).
    """
    prof = profile(name, data)
    skip = set(prof.get("no_deps", []))
    lines = []
    for pkg, spec in prof.get("packages", {}).items():
        if (pkg in skip) != no_deps:
            continue
        if isinstance(spec, dict):
            lines.append(f"{pkg}>={spec['floor']}")
        elif spec.startswith(">="):
            lines.append(f"{pkg}{spec}")
        else:
            lines.append(f"{pkg}=={spec}")
    return lines


def test_tool_requirements(data: dict | None = None) -> list[str]:
    """pip requirement lines (exact pins) for the PJRT wrapper's test plugins and the framework driving them."""
    data = data if data is not None else load()
    return [f"{pkg}=={version}" for pkg, version in data.get("pjrt_wrap", {}).get("test_packages", {}).items()]


def wheel_tools(data: dict | None = None) -> dict[str, str]:
    """The release build's tools (`make wheel`): package -> exact version."""
    data = data if data is not None else load()
    return dict(data.get("wheel", {}).get("tools", {}))


def wheel_tool_requirements(data: dict | None = None) -> list[str]:
    return [f"{pkg}=={version}" for pkg, version in wheel_tools(data).items()]


def wheel_pythons(data: dict | None = None) -> list[str]:
    """The Python versions the wheel is proven on ("3.11", ...), lowest first."""
    data = data if data is not None else load()
    found = data.get("wheel", {}).get("pythons", [])
    if not found or any(not re.fullmatch(r"3\.\d+", v) for v in found):
        raise PinError(f"wheel.pythons must list versions such as \"3.11\", found {found!r}")
    return sorted(found, key=lambda v: int(v.split(".")[1]))


def xlakit_version(data: dict | None = None) -> str:
    data = data if data is not None else load()
    version = data.get("xlakit", {}).get("version")
    if not version:
        raise PinError("xlakit.version is missing (the package's version lives there)")
    return str(version)


def patch_level(data: dict | None = None) -> int:
    data = data if data is not None else load()
    return int(data["xlakit"]["patch_level"])


@dataclass(frozen=True)
class Download:
    """A pinned file from a package registry: what `make cxx-check` fetches."""

    name: str
    package: str
    version: str
    file: str
    sha256: str
    date: str | None = None
    link: bool = False


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _download(where: str, raw: dict) -> Download:
    for key in ("package", "version", "file", "sha256"):
        if not raw.get(key):
            raise PinError(f"{where}.{key} is missing")
    if not _SHA256.match(raw["sha256"]):
        raise PinError(f"{where}.sha256 must be 64 hex digits, found {raw['sha256']!r}")
    return Download(name=raw.get("name", raw["package"]), package=raw["package"], version=raw["version"],
                    file=raw["file"], sha256=raw["sha256"], date=raw.get("date"), link=bool(raw.get("link")))


def cxx_brackets(data: dict | None = None) -> list[Download]:
    """The TensorFlow wheels whose XLA brackets the openxla pin, in order."""
    data = data if data is not None else load()
    raw = data.get("cxx_check", {}).get("brackets", [])
    out = [_download(f"cxx_check.brackets[{i}]", b) for i, b in enumerate(raw)]
    if not out or sum(b.link for b in out) != 1:
        raise PinError("cxx_check.brackets needs at least one wheel and exactly one with link = true")
    return out


def cxx_llvm(data: dict | None = None) -> Download:
    data = data if data is not None else load()
    return _download("cxx_check.llvm", data.get("cxx_check", {}).get("llvm", {}))
