"""build/xlakit_build.py: the dry-run pipeline, preflight, checksums, stamping."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "build"))

import pipeline  # noqa: E402
import pins  # noqa: E402
import series  # noqa: E402
import xlakit_build  # noqa: E402


def _run(tmp_path, *argv) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, str(ROOT / "build" / "xlakit_build.py"), *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


def _ordered(text: str, *needles: str) -> None:
    pos = 0
    for n in needles:
        found = text.find(n, pos)
        assert found >= 0, f"{n!r} missing (or out of order) in:\n{text}"
        pos = found + len(n)


def test_dry_run_lists_the_full_pipeline_in_order(tmp_path):
    src = pins.sources("tpu")
    rc, out = _run(tmp_path, "build", "--dry-run", "--work", str(tmp_path / "w"), "--wheels", str(tmp_path / "wh"),
                   "--torch-xla-git", "/mirror/xla")
    assert rc == 0, out
    patches = series.read()
    _ordered(
        out,
        "xlakit_build.py preflight",
        f"git fetch -q --depth 1 https://github.com/pytorch/pytorch.git {src['pytorch'].commit}",
        "git submodule update --init --recursive",
        f"git fetch -q --depth 1 /mirror/xla {src['torch_xla'].commit}",
        f"# verify: torch_xla HEAD == {src['torch_xla'].commit}, WORKSPACE xla_hash == {src['openxla'].commit}",
        "git apply --check --whitespace=error",
        *[f"git apply --whitespace=error {p.path}" for p in patches],
        "csrc/core/.", "csrc/runtime/.", "csrc/torch_xla/.",
        "# stamp: write",
        "setup.py bdist_wheel",
        "pip install --no-deps --force-reinstall --no-index",
        f"TORCH_XLA_VERSION=2.9.0+git{src['torch_xla'].short}.xlakit{pins.patch_level()}",
        "-m build --sdist --no-isolation",
        "-m build --wheel --no-isolation",
        "SHA256SUMS and build-info.json",
    )
    assert not (tmp_path / "w").exists() and not (tmp_path / "wh").exists(), "a dry run must not write"


def test_wheel_dry_run_builds_the_sdist_then_the_wheel_from_it_with_zig_for_the_floor(tmp_path):
    rc, out = _run(tmp_path, "wheel", "--dry-run", "--work", str(tmp_path / "w"), "--wheels", str(tmp_path / "wh"))
    assert rc == 0, out
    floor = pins.load()["wheel"]["glibc"]
    version = pins.xlakit_version()
    _ordered(
        out,
        f"-m build --sdist --no-isolation --outdir {tmp_path / 'w'}",
        f"tar -xzf {tmp_path / 'w' / 'xlakit-wheel' / 'dist' / f'xlakit-{version}.tar.gz'}",
        f"c++ -target x86_64-linux-gnu.{floor}",
        f"-m build --wheel --no-isolation",
        f"--plat-name=manylinux_{floor.replace('.', '_')}_x86_64",
        f"{tmp_path / 'w' / 'xlakit-wheel' / f'xlakit-{version}'}",
        f"cp {tmp_path / 'w' / 'xlakit-wheel' / 'dist' / f'xlakit-{version}.tar.gz'}",
        "SHA256SUMS and build-info.json",
    )
    assert not (tmp_path / "w").exists() and not (tmp_path / "wh").exists(), "a dry run must not write"


def test_make_n_release_targets_run_their_subcommands_in_the_venv():
    out = subprocess.run(["make", "-n", "test-installed", "wheel-check", "VENV=/v",
                          "WHEELHOUSE=/wh"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    _ordered(out, "/v/bin/python build/xlakit_build.py wheel", '/v/bin/python build/xlakit_build.py wheelhouse --dest "/wh"',
             'XLAKIT_WHEELHOUSE="/wh" /v/bin/python -m pytest', "tests/build/test_installed_wheel.py",
             "/v/bin/python build/xlakit_build.py wheel-check")


def test_wheelhouse_downloads_the_stack_and_xlakits_dependencies_for_every_python(tmp_path):
    rc, out = _run(tmp_path, "wheelhouse", "--dry-run", "--dest", str(tmp_path / "wh"))
    assert rc == 0, out
    lines = [ln for ln in out.splitlines() if " pip download " in ln]
    assert all("--only-binary=:all:" in ln and str(tmp_path / "wh") in ln for ln in lines), lines
    assert "torch==2.9.0" in lines[0] and "torch_xla==2.9.0" in lines[0] and "xla-cpu-pjrt==" in lines[0]
    assert [ln.split("--python-version ")[1].split()[0] for ln in lines[1:]] == pins.wheel_pythons()
    assert not (tmp_path / "wh").exists()


def test_the_release_tools_are_installed_by_setup(tmp_path):
    rc, out = _run(tmp_path, "requirements", "--profile", "cpu-dev", "--test-tools")
    assert rc == 0 and set(pins.wheel_tool_requirements()) <= set(out.split()), out


def test_make_n_build_passes_the_sources_and_args():
    out = subprocess.run(["make", "-n", "build", "TORCH_XLA_GIT=/m/xla", "BUILD_ARGS=--dry-run"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "build/xlakit_build.py build" in out
    assert '--torch-xla-git="/m/xla"' in out and "--dry-run" in out


def test_preflight_fails_clearly_and_names_every_gap(tmp_path):
    # PATH without bazel; sources that cannot be reached.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("git", "cc", "c++"):
        real = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        if real:
            (bin_dir / tool).symlink_to(real)
    env = {**os.environ, "PATH": str(bin_dir)}
    proc = subprocess.run([sys.executable, str(ROOT / "build" / "xlakit_build.py"), "preflight",
                           "--work", str(tmp_path / "w"), "--torch-xla-git", str(tmp_path / "no-xla"),
                           "--pytorch-git", str(tmp_path / "no-pytorch")],
                          capture_output=True, text=True, env=env, timeout=120)
    out = proc.stdout
    assert proc.returncode == 1, out
    assert f"FAIL bazel: expected bazel {pipeline_bazel()} (or bazelisk) on PATH, found none" in out
    assert f"FAIL torch_xla source: {tmp_path / 'no-xla'}: not reachable" in out
    assert "preflight failed: this host lacks bazel" in out


def pipeline_bazel() -> str:
    import preflight
    return preflight.FALLBACK_BAZEL_VERSION


def test_stamp_fails_when_its_target_moved(tmp_path):
    cfg = pipeline.Config(work=tmp_path, wheels=tmp_path / "wheels")
    tree = tmp_path / "torch_xla"
    (tree / "torch_xla/csrc/runtime").mkdir(parents=True)
    (tree / "torch_xla/csrc/runtime/BUILD").write_text("cc_library(name = 'x')\n")
    with pytest.raises(pipeline.StepError, match="stamp target moved"):
        pipeline.stamp(xlakit_build.Runner(), cfg, tree)


def test_stamp_writes_provenance_from_the_series(tmp_path):
    cfg = pipeline.Config(work=tmp_path, wheels=tmp_path / "wheels")
    tree = tmp_path / "torch_xla"
    (tree / "torch_xla/csrc/runtime/xlakit").mkdir(parents=True)
    (tree / "torch_xla/csrc/runtime/BUILD").write_text('srcs = glob(["xlakit/*.cc"])\n')
    header = pipeline.stamp(xlakit_build.Runner(), cfg, tree).read_text()
    patches = series.read()
    assert f'#define XLAKIT_SERIES_SHA256 "{series.sha256(patches)}"' in header
    assert f'#define XLAKIT_PATCH_SET "xlakit{pins.patch_level()}"' in header
    assert "#define XLAKIT_PATCHES " + ", ".join(f'"{p.name}"' for p in patches) in header


def test_stamp_carries_the_sources_digest(tmp_path):
    cfg = pipeline.Config(work=tmp_path, wheels=tmp_path / "wheels")
    (tmp_path / pipeline.STAMP_TARGET).parent.mkdir(parents=True)
    header = pipeline.write_stamp(xlakit_build.Runner(), cfg, tmp_path).read_text()
    digest = pipeline.sources_sha256(series.read(), cfg.sources())
    assert f'#define XLAKIT_SOURCES_SHA256 "{digest}"' in header


def test_sources_digest_covers_placed_csrc_not_only_patches(tmp_path, monkeypatch):
    # Regression: the id that salts cache keys covered patches/ only, so a
    # change to xlakit's placed C++ reused entries written by the old code.
    csrc = tmp_path / "csrc"
    for folder in pipeline.PLACEMENT:
        (csrc / folder).mkdir(parents=True)
        (csrc / folder / "a.cc").write_text("int a;\n")
    (csrc / "module.cc").write_text("// xlakit._C only\n")
    monkeypatch.setattr(pipeline, "CSRC", csrc)
    patches, src = series.read(), pins.sources()
    before = pipeline.sources_sha256(patches, src)
    (csrc / "module.cc").write_text("// changed, but never placed\n")
    assert pipeline.sources_sha256(patches, src) == before
    (csrc / "runtime" / "a.cc").write_text("int b;\n")
    changed = pipeline.sources_sha256(patches, src)
    assert changed != before
    other = {**src, "torch_xla": dataclasses.replace(src["torch_xla"], commit="0" * 40)}
    assert pipeline.sources_sha256(patches, other) != changed


def test_sums_detect_a_changed_wheel_and_install_refuses(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1-py3-none-any.whl").write_bytes(b"one")
    (wheels / "b-1-py3-none-any.whl").write_bytes(b"two")
    pipeline.write_sums(wheels, {"inputs_sha256": "x"})
    assert set(pipeline.verify_sums(wheels)) == {"a-1-py3-none-any.whl", "b-1-py3-none-any.whl"}
    assert json.loads((wheels / "build-info.json").read_text())["wheels"] == sorted(pipeline.read_sums(wheels))
    (wheels / "b-1-py3-none-any.whl").write_bytes(b"tampered")
    rc, out = _run(tmp_path, "install", "--wheels", str(wheels), "--work", str(tmp_path / "w"), "--dry-run")
    assert rc == 2
    assert "b-1-py3-none-any.whl: SHA256SUMS says" in out and "rebuild it" in out


def test_install_uses_require_hashes(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1-py3-none-any.whl").write_bytes(b"one")
    pipeline.write_sums(wheels)
    rc, out = _run(tmp_path, "install", "--wheels", str(wheels), "--work", str(tmp_path / "w"), "--dry-run")
    assert rc == 0, out
    assert "--require-hashes -r" in out
    reqs = (tmp_path / "w" / "install-requirements.txt").read_text()
    assert reqs.startswith((wheels / "a-1-py3-none-any.whl").as_uri() + " --hash=sha256:")


def test_unchanged_inputs_skip_the_build(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.9.0-x.whl").write_bytes(b"w")
    pipeline.write_sums(wheels, {"inputs_sha256": pipeline.inputs_digest()})
    rc, out = _run(tmp_path, "build", "--wheels", str(wheels), "--work", str(tmp_path / "w"))
    assert rc == 0 and "inputs unchanged" in out
    pipeline.write_sums(wheels, {"inputs_sha256": "stale"})
    cfg = pipeline.Config(work=tmp_path / "w", wheels=wheels)
    assert not pipeline.up_to_date(cfg)


def test_requirements_subcommand_still_works(tmp_path):
    rc, out = _run(tmp_path, "requirements", "--profile", "cpu-dev")
    assert rc == 0 and "torch==2.9.0" in out.split()


def test_build_stops_at_the_preflight_before_anything_long(tmp_path):
    rc, out = _run(tmp_path, "build", "--work", str(tmp_path / "w"), "--wheels", str(tmp_path / "wh"),
                   "--torch-xla-git", str(tmp_path / "no-xla"), "--pytorch-git", str(tmp_path / "no-pytorch"))
    assert rc == 2, out
    assert "preflight failed: this host lacks" in out and "torch_xla source" in out
    assert "git fetch" not in out, "nothing may be fetched when the preflight fails"
    assert not (tmp_path / "w" / "pytorch").exists()
