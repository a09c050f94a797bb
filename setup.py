"""Build hooks for the xlakit package (metadata lives in pyproject.toml).

VERSIONS.toml is baked into the package as `xlakit/_pins.toml` on every build
(wheel, sdist, editable), so an installed xlakit knows the profile it was
built for without a checkout.

`xlakit._C` (csrc/: the dependency-free core the torch_xla patches also
compile in, plus its pybind11 bindings) is compiled through a generated
ninja file rather than distutils' one-file-at-a-time compiler: ninja builds
the sources in parallel and rebuilds only what changed, which keeps
`pip install -e .` and `build_ext --inplace` quick during C++ work.

The same step builds `xlakit/_lib/libxlakit_pjrt_wrap.so`, the PJRT plugin
that wraps the real one (csrc/pjrt_wrap): a plain shared library, no Python,
compiled against the pinned `pjrt_c_api.h` (build/pjrt_header.py fetches it
once into ~/.cache), exporting only its entry points.
"""

import os
import shlex
import sys
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
PJRT_WRAP_LIB = Path("_lib") / "libxlakit_pjrt_wrap.so"  # inside the xlakit package

if PINS_SOURCE.exists():  # absent only when building from an sdist, which carries the baked copy
    shutil.copyfile(PINS_SOURCE, PINS_BAKED)


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
        import pybind11

        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        includes = [ROOT / CSRC, pybind11.get_include(), sysconfig.get_paths()["include"]]
        self._ninja(ext.name.replace(".", "_"), ext.sources, out, includes, link_flags=[])
        if ext.name == "xlakit._C":
            self._ninja("pjrt_wrap", _pjrt_wrap_sources(), out.parent / PJRT_WRAP_LIB,
                        [ROOT / CSRC, _pjrt_header_dir()],
                        # Only GetPjrtApi and the status function leave the library; libstdc++
                        # stays dynamic (GLIBCXX_3.4.21 suffices), so it loads on older hosts.
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

    def _ninja(self, name: str, sources: list[str], out: Path, includes: list, *, link_flags: list[str]) -> None:
        import ninja  # build-system requirement

        work = Path(self.build_temp).resolve() / name
        work.mkdir(parents=True, exist_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
        cflags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra"]
        cflags += [f"-I{shlex.quote(str(i))}" for i in includes]
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {cxx}",
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
    package_data={"xlakit": ["_pins.toml", "*.pyi", "data/*.toml"]},
    ext_modules=[Extension("xlakit._C", sources=_ext_sources(), language="c++")],
    cmdclass={"build_ext": NinjaBuildExt},
    # setuptools' default "build/" is our build CLI's folder; keep its
    # intermediates under the ignored build/_out instead.
    options={"build": {"build_base": "build/_out/setuptools"}},
)
