"""The xlakit release: an sdist, the one manylinux wheel built from it, and their checks.

The wheel is built from the sdist, not the checkout, so it holds what a
release holds and the sdist is proven to build. The compiler is zig's clang
(`ziglang` from PyPI) targeting the glibc floor in VERSIONS.toml `[wheel]`:
it links against that glibc's symbol versions and its own C++ runtime,
statically and kept private, so the wheel loads on any host from the floor
up with no container and no old sysroot. `xlakit._C` uses only the limited
API, so one `cp3N-abi3` wheel serves every Python (docs/building.md says why
this and not the alternatives). `auditwheel show` is the judge of the tag:
`check` fails on any wheel it finds consistent only with a newer glibc.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
import shlex
import sys
import zipfile
from pathlib import Path

import pins
from pipeline import ROOT, StepError, sha256_file
from runner import Runner

ARCH = "x86_64"
_CONSISTENT = re.compile(r'consistent with the following platform tag:\s*"([^"]+)"')
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_" + ARCH + "$")


def floor(data: dict | None = None) -> str:
    """The glibc the wheel targets, e.g. "2.28"."""
    data = data if data is not None else pins.load()
    value = str(data.get("wheel", {}).get("glibc", ""))
    if not re.fullmatch(r"2\.\d+", value):
        raise pins.PinError(f"wheel.glibc must be a glibc version such as \"2.28\", found {value!r}")
    return value


def platform_tag(glibc: str) -> str:
    return f"manylinux_{glibc.replace('.', '_')}_{ARCH}"


def zig(python: str | None = None) -> Path:
    """The zig binary of the pinned `ziglang` installed beside this build CLI."""
    pin = pins.wheel_tools().get("ziglang")
    try:
        found = importlib.metadata.version("ziglang")
        import ziglang
    except (importlib.metadata.PackageNotFoundError, ImportError) as e:
        raise StepError(f"the wheel's compiler is zig from PyPI (ziglang=={pin}), not installed for "
                        f"{python or sys.executable} ({e}); run `make setup` (VERSIONS.toml [wheel.tools])") from e
    if found != pin:
        raise StepError(f"expected ziglang=={pin} (VERSIONS.toml [wheel.tools]), found {found}; run `make setup`")
    return Path(ziglang.__file__).resolve().parent / "zig"


def toolchain_env(zig_bin: Path, glibc: str) -> dict[str, str]:
    """CXX and friends for setup.py: zig's clang for `x86_64-linux-gnu.<glibc>`."""
    return {
        "CXX": shlex.join([str(zig_bin), "c++", "-target", f"{ARCH}-linux-gnu.{glibc}"]),
        # -O2 at the link too: zig builds its C++ runtime in the link's mode (debug otherwise, 10x larger);
        # -s: no symbol table (the dynamic exports stay).
        "LDFLAGS": "-O2 -s",
    }


def build(runner: Runner, work: Path, python: str) -> tuple[Path, Path]:
    """sdist from the checkout, then the wheel from the unpacked sdist; returns (sdist, wheel)."""
    glibc = floor()
    dist = work / "dist"
    runner.run(["rm", "-rf", str(work)])
    runner.run(["mkdir", "-p", str(dist)])
    # No build isolation: the build requirements are this environment's (`make setup`), and CI may be offline.
    runner.run([python, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist), str(ROOT)])
    version = pins.xlakit_version()
    sdist = dist / f"xlakit-{version}.tar.gz"
    runner.run(["tar", "-xzf", str(sdist), "-C", str(work)])
    env = toolchain_env(zig(python), glibc) if not runner.dry_run else toolchain_env(Path("zig"), glibc)
    runner.run([python, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
                f"-C--build-option=--plat-name={platform_tag(glibc)}", str(work / f"xlakit-{version}")], env=env)
    wheels = sorted(dist.glob("xlakit-*.whl"))
    if runner.dry_run:
        return sdist, dist / f"xlakit-{version}-<tag>.whl"
    if len(wheels) != 1:
        raise StepError(f"expected one xlakit wheel in {dist}, found {[w.name for w in wheels] or 'none'}")
    return sdist, wheels[0]


def audit(runner: Runner, wheel: Path, glibc: str) -> str:
    """The platform tag `auditwheel show` finds `wheel` consistent with; StepError if newer than `glibc`."""
    out = runner.capture([sys.executable, "-m", "auditwheel", "show", str(wheel)], check=False)
    text = " ".join((out.stdout + out.stderr).split())
    m = _CONSISTENT.search(text)
    if out.returncode != 0 or not m:
        raise StepError(f"auditwheel show {wheel.name}: expected a platform tag, found: {text or out.returncode}")
    tag = m.group(1)
    limit = tuple(int(x) for x in glibc.split("."))
    found = _MANYLINUX.match(tag)
    if not found or (int(found.group(1)), int(found.group(2))) > limit:
        raise StepError(f"{wheel.name}: auditwheel finds it consistent only with {tag}, newer than "
                        f"{platform_tag(glibc)} (VERSIONS.toml [wheel] glibc); it needs a newer glibc or "
                        "libstdc++ than the floor: build it with `make wheel` (zig for that glibc), not the "
                        "host compiler")
    return tag


def check(runner: Runner, wheels: Path) -> dict[str, str]:
    """`auditwheel show` on every wheel in `wheels`; one line each; StepError on the first too new."""
    glibc = floor()
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise StepError(f"no wheels in {wheels}; run `make wheel` first")
    tags = {}
    for wheel in found:
        tags[wheel.name] = audit(runner, wheel, glibc)
        print(f"wheel-check: {wheel.name}: consistent with {tags[wheel.name]} "
              f"(floor {platform_tag(glibc)}), {wheel.stat().st_size / 2**20:.1f} MiB", file=runner.out, flush=True)
    return tags


def stamp_of(wheel: Path) -> dict:
    """The provenance setup.py stamped into the wheel (xlakit/_build.json)."""
    with zipfile.ZipFile(wheel) as z:
        return json.loads(z.read("xlakit/_build.json"))


def record(sdist: Path, wheel: Path, tag: str, python: str) -> dict:
    """build-info.json's `xlakit` part: sources, commit, toolchain, glibc floor."""
    stamp = stamp_of(wheel)
    header = pins.load()["pjrt_wrap"]["header"]
    return {
        "version": stamp["version"],
        "commit": stamp.get("commit"),
        "commit_date": stamp.get("commit_date"),
        "dirty": stamp.get("dirty"),
        "sources": {
            "sdist": sdist.name,
            "sdist_sha256": sha256_file(sdist),
            "pjrt_c_api_h": {k: header[k] for k in ("package", "version", "member", "sha256", "api_version")},
        },
        "toolchain": {
            "compiler": stamp["compiler"],
            "compiler_version": stamp["compiler_version"],
            "tools": {name: importlib.metadata.version(name) for name in pins.wheel_tools()},
            "python": f"{platform.python_implementation()} {platform.python_version()} ({python})",
        },
        "glibc_floor": stamp["glibc_floor"],
        "python_abi": stamp["python_abi"],
        "auditwheel": tag,
        "wheel": wheel.name,
    }
