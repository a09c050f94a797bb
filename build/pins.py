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


def requirements(name: str, data: dict | None = None) -> list[str]:
    """pip requirement lines for a profile's wheel packages (exact pins)."""
    lines = []
    for pkg, spec in profile(name, data).get("packages", {}).items():
        version = spec["floor"] if isinstance(spec, dict) else spec
        op = ">=" if isinstance(spec, dict) else "=="
        lines.append(f"{pkg}{op}{version}")
    return lines


def patch_level(data: dict | None = None) -> int:
    data = data if data is not None else load()
    return int(data["xlakit"]["patch_level"])
