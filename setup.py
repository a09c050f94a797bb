"""Build hooks for the xlakit package (metadata lives in pyproject.toml).

VERSIONS.toml is baked into the package as `xlakit/_pins.toml` on every build
(wheel, sdist, editable), so an installed xlakit knows the profile it was
built for without a checkout.

`xlakit._C` (csrc/: the dependency-free core the torch_xla patches also
compile in, plus its pybind11 bindings) is compiled through a generated
ninja file rather than distutils' one-file-at-a-time compiler: ninja builds
the sources in parallel and rebuilds only what changed, which keeps
`pip install -e .` and `build_ext --inplace` quick during C++ work.
"""

import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
PINS_SOURCE = ROOT / "VERSIONS.toml"
PINS_BAKED = ROOT / "python" / "xlakit" / "_pins.toml"
CSRC = "csrc"

if PINS_SOURCE.exists():  # absent only when building from an sdist, which carries the baked copy
    shutil.copyfile(PINS_SOURCE, PINS_BAKED)


def _ext_sources() -> list[str]:
    # The bindings and the core; csrc/runtime and csrc/torch_xla need torch_xla
    # headers and are only compiled inside the patched torch_xla tree.
    top = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC).glob("*.cc"))
    core = sorted(str(p.relative_to(ROOT)) for p in (ROOT / CSRC / "core").glob("*.cc"))
    return top + core


class NinjaBuildExt(build_ext):
    """Compile each Extension with a generated build.ninja."""

    def build_extension(self, ext: Extension) -> None:
        import ninja  # build-system requirement
        import pybind11

        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        work = Path(self.build_temp).resolve() / ext.name.replace(".", "_")
        work.mkdir(parents=True, exist_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
        includes = [ROOT / CSRC, pybind11.get_include(), sysconfig.get_paths()["include"]]
        cflags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra"]
        cflags += [f"-I{shlex.quote(str(i))}" for i in includes]
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {cxx}",
            f"cflags = {' '.join(cflags)}",
            "rule cxx",
            "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "rule link",
            "  command = $cxx -shared $in -o $out",
        ]
        objects = []
        for src in ext.sources:
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
    package_data={"xlakit": ["_pins.toml", "*.pyi", "data/*.toml"]},
    ext_modules=[Extension("xlakit._C", sources=_ext_sources(), language="c++")],
    cmdclass={"build_ext": NinjaBuildExt},
    # setuptools' default "build/" is our build CLI's folder; keep its
    # intermediates under the ignored build/_out instead.
    options={"build": {"build_base": "build/_out/setuptools"}},
)
