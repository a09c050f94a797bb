"""The source build's steps: fetch, verify, place, stamp, wheels, checksums.

Each step is a function of (runner, config) that only issues commands
through the runner, so `--dry-run` prints the same pipeline a real build
runs. Steps that read a checkout (verify, stamp) say so in a dry run
instead of guessing. Inputs (pins, patch series, csrc/) are digested; a
build whose digest matches `wheels/build-info.json` and whose wheels still
match SHA256SUMS is not redone.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pins
import series
from runner import Runner

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
# csrc/ folder -> where it goes in the torch_xla tree. Files directly in
# csrc/ (module.cc, bind_*.cc) are xlakit._C only and are not placed.
PLACEMENT = {
    "core": "torch_xla/csrc/runtime/xlakit/core",
    "runtime": "torch_xla/csrc/runtime/xlakit",
    "torch_xla": "torch_xla/csrc/xlakit",
}
STAMP_TARGET = "torch_xla/csrc/runtime/xlakit/build_info_generated.h"
# The line the build patch adds; if it is gone the stamp's target moved.
STAMP_ANCHOR = ("torch_xla/csrc/runtime/BUILD", 'glob(["xlakit/*.cc"])')


class StepError(RuntimeError):
    """A build step found something wrong; the message says what and where."""


@dataclass
class Config:
    work: Path
    wheels: Path
    profile: str = "tpu"
    git_urls: dict[str, str] = field(default_factory=dict)  # overrides
    python: str = sys.executable

    @property
    def pytorch_dir(self) -> Path:
        return self.work / "pytorch"

    @property
    def torch_xla_dir(self) -> Path:
        # torch_xla builds from pytorch/xla, as upstream documents.
        return self.pytorch_dir / "xla"

    def sources(self) -> dict[str, pins.Source]:
        return pins.sources(self.profile)

    def url(self, name: str) -> str:
        return self.git_urls.get(name) or self.sources()[name].git

    def local_version(self) -> str:
        src = self.sources()["torch_xla"]
        return f"{src.version}+git{src.short}.xlakit{pins.patch_level()}"


def fetch(runner: Runner, url: str, commit: str, dest: Path, *, submodules: bool = False) -> None:
    """Exactly one commit, shallow: works for URLs and local mirrors alike."""
    runner.run(["git", "init", "-q", str(dest)])
    runner.run(["git", "fetch", "-q", "--depth", "1", url, commit], cwd=dest)
    runner.run(["git", "checkout", "-q", "--force", "--detach", "FETCH_HEAD"], cwd=dest)
    if submodules:
        runner.run(["git", "submodule", "update", "--init", "--recursive", "--depth", "1"], cwd=dest)


def verify(runner: Runner, cfg: Config, torch_xla_dir: Path, *, with_pytorch: bool = True) -> None:
    src = cfg.sources()
    if runner.dry_run:
        runner.note(f"verify: torch_xla HEAD == {src['torch_xla'].commit}, WORKSPACE xla_hash == "
                    f"{src['openxla'].commit}, .torch_commit == {src['pytorch'].commit}")
        return
    checks = [(torch_xla_dir, "torch_xla")] + ([(cfg.pytorch_dir, "pytorch")] if with_pytorch else [])
    for tree, name in checks:
        head = runner.capture(["git", "rev-parse", "HEAD"], cwd=tree).stdout.strip()
        if head != src[name].commit:
            raise StepError(f"{tree}: expected {name} at {src[name].commit}, found {head}")
    workspace = (torch_xla_dir / "WORKSPACE").read_text()
    m = re.search(r"^xla_hash\s*=\s*'([0-9a-f]{40})'", workspace, re.M)
    found = m.group(1) if m else "no xla_hash line"
    if found != src["openxla"].commit:
        raise StepError(f"torch_xla WORKSPACE pins openxla {found}, VERSIONS.toml says {src['openxla'].commit}; "
                        "bump [profiles.tpu.sources.openxla] with torch_xla")
    torch_commit = (torch_xla_dir / ".torch_commit").read_text().split()[-1]
    if torch_commit != src["pytorch"].commit:
        raise StepError(f"torch_xla .torch_commit names pytorch {torch_commit}, VERSIONS.toml says "
                        f"{src['pytorch'].commit}")
    runner.note("verify: commits, WORKSPACE xla_hash and .torch_commit match VERSIONS.toml")


def place(runner: Runner, torch_xla_dir: Path) -> None:
    for folder, target in PLACEMENT.items():
        dest = torch_xla_dir / target
        runner.run(["mkdir", "-p", str(dest)])
        runner.run(["cp", "-R", f"{CSRC / folder}/.", str(dest)])


def placed_files() -> list[Path]:
    """Every csrc/ file `place` copies into the tree, in a stable order."""
    return sorted(f for folder in PLACEMENT for f in (CSRC / folder).rglob("*") if f.is_file())


def sources_sha256(patches: list[series.Patch], src: dict[str, pins.Source]) -> str:
    """What the runtime's xlakit code is built from: the series, the placed
    csrc/ files and the upstream commits. It salts cache keys, so an entry is
    never reused across a change to any of them."""
    h = hashlib.sha256(b"xlakit-sources-v1\0")
    h.update(series.sha256(patches).encode() + b"\0")
    for name in ("torch_xla", "openxla"):
        h.update(f"{name}={src[name].commit}\0".encode())
    for f in placed_files():
        data = f.read_bytes()
        h.update(f"{f.relative_to(CSRC)}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def build_info(cfg: Config) -> dict:
    patches = series.read()
    src = cfg.sources()
    return {
        "patch_set": f"xlakit{pins.patch_level()}",
        "patches": [p.name for p in patches],
        "series_sha256": series.sha256(patches),
        "sources_sha256": sources_sha256(patches, src),
        "torch_xla_commit": src["torch_xla"].commit,
        "xla_commit": src["openxla"].commit,
        "pytorch_commit": src["pytorch"].commit,
        "torch_xla_version": cfg.local_version(),
    }


def _c_string(s: str) -> str:
    return json.dumps(s)  # JSON string escapes are valid C string escapes for ASCII


def stamp(runner: Runner, cfg: Config, torch_xla_dir: Path) -> Path:
    target = torch_xla_dir / STAMP_TARGET
    if not runner.dry_run:
        anchor_file, anchor = STAMP_ANCHOR
        if not target.parent.is_dir() or anchor not in (torch_xla_dir / anchor_file).read_text():
            raise StepError(f"stamp target moved: expected {target.parent} (placed csrc/runtime) and "
                            f"{anchor!r} in {anchor_file}; was the series applied and csrc placed?")
    return write_stamp(runner, cfg, torch_xla_dir)


def write_stamp(runner: Runner, cfg: Config, torch_xla_dir: Path) -> Path:
    """The provenance header alone, without checking the tree around it."""
    target = torch_xla_dir / STAMP_TARGET
    info = build_info(cfg)
    runner.note(f"stamp: write {target} ({info['patch_set']}, series {info['series_sha256'][:12]})")
    if runner.dry_run:
        return target
    lines = ["// Generated by xlakit's build/xlakit_build.py stamp; do not edit.",
             "#pragma once"]
    for key in ("patch_set", "series_sha256", "sources_sha256", "torch_xla_commit", "xla_commit"):
        lines.append(f"#define XLAKIT_{key.upper()} {_c_string(info[key])}")
    lines.append("#define XLAKIT_PATCHES " + ", ".join(_c_string(p) for p in info["patches"]))
    target.write_text("\n".join(lines) + "\n")
    return target


def inputs_digest() -> str:
    h = hashlib.sha256()
    files = [ROOT / "VERSIONS.toml", *sorted((ROOT / "patches").iterdir()), *sorted(CSRC.rglob("*"))]
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_sums(wheels: Path) -> dict[str, str]:
    sums = wheels / "SHA256SUMS"
    if not sums.exists():
        raise StepError(f"{sums} is missing; run `make build` or `make wheel` first")
    out = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        out[name] = digest
    return out


def verify_sums(wheels: Path) -> dict[str, str]:
    sums = read_sums(wheels)
    for name, digest in sums.items():
        path = wheels / name
        if not path.exists():
            raise StepError(f"{path} is listed in SHA256SUMS but missing")
        found = sha256_file(path)
        if found != digest:
            raise StepError(f"{path}: SHA256SUMS says {digest}, file hashes to {found}; rebuild it")
    return sums


def read_info(wheels: Path) -> dict:
    """build-info.json as the last build left it ({} if none)."""
    info = wheels / "build-info.json"
    return json.loads(info.read_text()) if info.exists() else {}


def write_sums(wheels: Path, extra: dict | None = None) -> None:
    # The wheels and the xlakit sdist: every release file.
    names = sorted(p.name for p in [*wheels.glob("*.whl"), *wheels.glob("xlakit-*.tar.gz")])
    (wheels / "SHA256SUMS").write_text("".join(f"{sha256_file(wheels / n)}  {n}\n" for n in names))
    if extra is not None:
        (wheels / "build-info.json").write_text(json.dumps({**extra, "wheels": names}, indent=2) + "\n")


def up_to_date(cfg: Config) -> bool:
    info = cfg.wheels / "build-info.json"
    if not info.exists():
        return False
    try:
        recorded = json.loads(info.read_text()).get("inputs_sha256")
        verify_sums(cfg.wheels)
    except (ValueError, StepError):
        return False
    return recorded == inputs_digest()
