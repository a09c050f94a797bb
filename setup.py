"""Build hooks for the xlakit package (metadata lives in pyproject.toml).

VERSIONS.toml is baked into the package as `xlakit/_pins.toml` on every build
(wheel, sdist, editable), so an installed xlakit knows the profile it was
built for without a checkout; the version is its `[xlakit] version`. Beside it
goes `xlakit/_build.json`, the build's provenance: the source commit (from git,
or from the sdist's copy when building from one), the compiler and the glibc
floor it targets. `xlakit --version` and the manifest read that, never a
checkout.

`xlakit._C` (csrc/: the dependency-free core the torch_xla patches also
compile in, plus its bindings) is built against the CPython limited API from
the floor in pyproject's requires-python, so one `_C.abi3.so` and one wheel
serve every Python from there up. It is compiled through a generated ninja
file rather than distutils' one-file-at-a-time compiler: ninja builds the
sources in parallel and rebuilds only what changed, which keeps
`pip install -e .` and `build_ext --inplace` quick during C++ work.

The same step builds `xlakit/_lib/libxlakit_pjrt_wrap.so`, the PJRT plugin
that wraps the real one (csrc/pjrt_wrap): a plain shared library, no Python,
compiled against the pinned `pjrt_c_api.h` (build/pjrt_header.py fetches it
once into ~/.cache), exporting only its entry points.

The compiler is `$CXX` (else Python's, else c++), with `$CXXFLAGS` and
`$LDFLAGS` added; `make wheel` (build/wheel.py) sets them to a toolchain that
targets an old glibc, which is what lets the wheel carry a manylinux tag.
"""

import json
import os
import platform
import re
import shlex
import sys
import shutil
import subprocess
import sysconfig
import tomllib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PINS_SOURCE = ROOT / "VERSIONS.toml"
PACKAGE = ROOT / "python" / "xlakit"
PINS_BAKED = PACKAGE / "_pins.toml"
BUILD_STAMP = PACKAGE / "_build.json"
CSRC = "csrc"
PJRT_WRAP_LIB = Path("_lib") / "libxlakit_pjrt_wrap.so"  # inside the xlakit package

if PINS_SOURCE.exists():  # absent only when building from an sdist, which carries the baked copy
    shutil.copyfile(PINS_SOURCE, PINS_BAKED)


def _min_python() -> int:
    """The lowest Python 3 minor version, from requires-python: the limited API's floor."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        spec = tomllib.load(f)["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    if not m:
        raise SystemExit(f"pyproject.toml requires-python: expected '>=3.N' (the limited API's floor), found {spec!r}")
    return int(m.group(1))


MIN_PYTHON = _min_python()


def _cxx() -> str:
    return os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"


def _source() -> dict:
    """The commit built: git's in a checkout, else the one the sdist's stamp recorded."""
    if (ROOT / ".git").exists():
        try:
            git = ["git", "-C", str(ROOT)]
            commit, date = subprocess.run([*git, "log", "-1", "--format=%H %cs"], capture_output=True, text=True,
                                          check=True).stdout.split()
            changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                     text=True, check=True).stdout
            return {"commit": commit, "commit_date": date, "dirty": bool(changed.strip())}
        except (OSError, ValueError, subprocess.CalledProcessError) as e:
            return {"commit": None, "why_not": f"git could not name the commit: {e}"}
    if BUILD_STAMP.exists():
        old = json.loads(BUILD_STAMP.read_text())
        return {k: old[k] for k in ("commit", "commit_date", "dirty", "why_not") if k in old}
    return {"commit": None, "why_not": "built from a tree with neither git nor an sdist's stamp"}


def _toolchain() -> dict:
    argv = shlex.split(_cxx())
    try:
        probe = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=120)
        version = (probe.stdout.splitlines() or ["?"])[0]
    except (OSError, subprocess.SubprocessError) as e:
        version = f"unknown ({e})"
    target = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-target"), None)
    floor = re.search(r"-gnu\.(\d+\.\d+)$", target or "")
    return {
        "compiler": " ".join([Path(argv[0]).name, *argv[1:]]),
        "compiler_version": version,
        "target": target or "host",
        # A build for the host needs the host's glibc; a cross target names its own.
        "glibc_floor": floor.group(1) if floor else platform.libc_ver()[1],
        "python_abi": f"abi3 (CPython 3.{MIN_PYTHON} and newer)",
    }


def _stamp() -> str:
    """Write xlakit/_build.json; the version (VERSIONS.toml [xlakit] version)."""
    if not PACKAGE.is_dir():
        raise SystemExit(f"stamp target moved: expected the package at {PACKAGE}")
    with open(PINS_BAKED, "rb") as f:
        version = tomllib.load(f)["xlakit"]["version"]
    stamp = {"version": version, **_source(), **_toolchain()}
    BUILD_STAMP.write_text(json.dumps(stamp, indent=2) + "\n")
    return version


def _pjrt_wrap_sources() -> list[str]:
    # The plugin and the parts of the core it writes entries with; no bindings, no Python.
    wrap = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC / "pjrt_wrap").glob("*.cc"))
    return wrap + [f"{CSRC}/core/{name}.cc"
                   for name in ("envelope", "envelope_mac", "envelope_read", "atomic_file", "folder_trust")]


def _pjrt_header_dir() -> Path:
    sys.path.insert(0, str(ROOT / "build"))
    try:
        import pjrt_header
    finally:
        sys.path.pop(0)
    pins = PINS_SOURCE if PINS_SOURCE.exists() else PINS_BAKED
    return pjrt_header.include_dir(pins)


def _ext_sources() -> list[str]:
    # The bindings and the core; csrc/runtime and csrc/torch_xla need torch_xla
    # headers and are only compiled inside the patched torch_xla tree.
    top = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC).glob("*.cc"))
    core = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC / "core").glob("*.cc"))
    return top + core


class NinjaBuildExt(build_ext):
    """Compile each Extension, and the PJRT wrapping plugin beside them, with a generated build.ninja."""

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        includes = [ROOT / CSRC, sysconfig.get_paths()["include"]]
        name = ext.name.replace(".", "_")
        # Only the module's init function leaves it (a C++ runtime linked in statically stays private).
        exports = Path(self.build_temp).resolve() / f"{name}.map"
        exports.parent.mkdir(parents=True, exist_ok=True)
        exports.write_text(f"{{ global: PyInit_{ext.name.rpartition('.')[2]}; local: *; }};\n")
        self._ninja(name, ext.sources, out, includes, defines=[f"Py_LIMITED_API=0x03{MIN_PYTHON:02X}0000"],
                    link_flags=[f"-Wl,--version-script={exports}"])
        if ext.name == "xlakit._C":
            self._ninja("pjrt_wrap", _pjrt_wrap_sources(), out.parent / PJRT_WRAP_LIB,
                        [ROOT / CSRC, _pjrt_header_dir()],
                        # Only GetPjrtApi and the status functions leave the library (exports.map).
                        link_flags=["-ldl", f"-Wl,--version-script={ROOT / CSRC / 'pjrt_wrap' / 'exports.map'}"])

    # setuptools builds extensions in build_lib and copies them into the tree for `--inplace` and
    # editable installs, knowing only the extensions: the plugin is added to each step.
    def _pjrt_wrap_paths(self) -> tuple[str, str]:
        """(where the plugin is built, where an in-place build puts it)."""
        ext = next(e for e in self.extensions if e.name == "xlakit._C")
        inplace, regular = self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)
        return str(Path(regular).parent / PJRT_WRAP_LIB), str(Path(inplace).parent / PJRT_WRAP_LIB)

    def copy_extensions_to_source(self) -> None:
        super().copy_extensions_to_source()
        # A per-version module an earlier (pybind11) build left in the tree would shadow the new
        # _C.abi3.so: Python tries `.cpython-3XY-*.so` first. Only that build's own file is removed.
        ext = next(e for e in self.extensions if e.name == "xlakit._C")
        inplace_c = Path(self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)[0])
        for stale in inplace_c.parent.glob("_C.cpython-*.so"):
            print(f"removing {stale}: built for one Python before _C moved to the limited API")
            stale.unlink()
        regular, inplace = self._pjrt_wrap_paths()
        os.makedirs(os.path.dirname(inplace), exist_ok=True)
        self.copy_file(regular, inplace, level=self.verbose)

    def get_outputs(self) -> list[str]:
        outputs = super().get_outputs()
        return outputs if self.inplace else [*outputs, self._pjrt_wrap_paths()[0]]

    def get_output_mapping(self) -> dict[str, str]:
        mapping = super().get_output_mapping()
        if self.inplace:
            regular, inplace = self._pjrt_wrap_paths()
            mapping[regular] = inplace
        return mapping

    def _ninja(self, name: str, sources: list[str], out: Path, includes: list, *, link_flags: list[str],
               defines: tuple[str, ...] = ()) -> None:
        import ninja  # build-system requirement

        work = Path(self.build_temp).resolve() / name
        work.mkdir(parents=True, exist_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        cflags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra"]
        cflags += [f"-D{d}" for d in defines] + shlex.split(os.environ.get("CXXFLAGS", ""))
        cflags = [shlex.quote(f) for f in cflags] + [f"-I{shlex.quote(str(i))}" for i in includes]
        link_flags = [*link_flags, *shlex.split(os.environ.get("LDFLAGS", ""))]
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {_cxx()}",
            f"cflags = {' '.join(cflags)}",
            f"ldflags = {' '.join(shlex.quote(f) for f in link_flags)}",
            "rule cxx",
            "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "rule link",
            "  command = $cxx -shared $in -o $out $ldflags",
        ]
        objects = []
        for src in sources:
            obj = work / (src.replace("/", "_") + ".o")
            objects.append(str(obj))
            lines.append(f"build {_esc(obj)}: cxx {_esc(ROOT / src)}")
        lines.append(f"build {_esc(out)}: link {' '.join(_esc(o) for o in objects)}")
        (work / "build.ninja").write_text("\n".join(lines) + "\n")
        ninja_bin = os.path.join(ninja.BIN_DIR, "ninja")
        subprocess.run([ninja_bin, "-C", str(work)], check=True)


def _esc(path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


setup(
    version=_stamp(),
    package_data={"xlakit": ["_pins.toml", "_build.json", "*.pyi", "data/*.toml", "selftest/*.json"]},
    ext_modules=[Extension("xlakit._C", sources=_ext_sources(), language="c++", py_limited_api=True)],
    cmdclass={"build_ext": NinjaBuildExt},
    options={
        # setuptools' default "build/" is our build CLI's folder; keep its
        # intermediates under the ignored build/_out instead.
        "build": {"build_base": "build/_out/setuptools"},
        # One wheel for every Python from the floor up (the limited API; _C.abi3.so).
        "bdist_wheel": {"py_limited_api": f"cp3{MIN_PYTHON}"},
    },
)
