"""build/cxx_check.py, cxx_compile.py, cxx_deps.py: what is compiled, how verdicts are reached, what must fail."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "build"))

import cxx_check  # noqa: E402
import cxx_compile  # noqa: E402
import cxx_deps  # noqa: E402
import pins  # noqa: E402
import pipeline  # noqa: E402
import series  # noqa: E402
from runner import Runner  # noqa: E402

PLACED_RUNTIME = "torch_xla/csrc/runtime/xlakit"


def _quiet() -> Runner:
    return Runner(out=io.StringIO())


def test_upstream_units_are_the_files_the_series_touches():
    units = {u.path: u for u in cxx_check.upstream_units(series.read(), None)}
    assert set(units) == {"torch_xla/csrc/runtime/pjrt_computation_client.cpp",
                          "torch_xla/csrc/xla_graph_executor.cpp",  # instantiates cache.h
                          "torch_xla/csrc/init_python_bindings.cpp"}
    assert all(u.kind == "upstream" and u.needs_tree for u in units.values())


def test_a_touched_header_without_a_consumer_is_an_error(tmp_path):
    patch = tmp_path / "0001-x.patch"
    patch.write_text("diff --git a/torch_xla/csrc/lonely.h b/torch_xla/csrc/lonely.h\n")
    (tmp_path / "tree").mkdir()
    with pytest.raises(series.SeriesError, match="HEADER_CONSUMERS"):
        cxx_check.upstream_units([series.Patch("0001-x.patch", "r", patch)], tmp_path / "tree")


def test_every_placed_file_is_checked_and_tree_needs_are_derived():
    units = {u.path: u for u in cxx_check.xlakit_units()}
    placed = {cxx_check.tree_path(f) for f in pipeline.placed_files()}
    sources = {p for p in placed if p.endswith(".cc")}
    # Each .cc is a unit; each header is one, or is included by its own .cc.
    assert sources <= set(units)
    assert all(p in units or p[:-2] + ".cc" in sources for p in placed)
    assert f"{PLACED_RUNTIME}/cache_io.h" in units
    tree = {p for p, u in units.items() if u.needs_tree}
    assert tree == {f"{PLACED_RUNTIME}/pjrt_access.cc", "torch_xla/csrc/xlakit/host_transfer.cc",
                    "torch_xla/csrc/xlakit/xlakit_bindings.cc"}


def test_the_cxx_test_links_only_xla_only_sources(tmp_path):
    srcs = {p.name for p in cxx_check.xla_only_sources(cxx_check.xlakit_units(), tmp_path)}
    assert {"cache_entry.cc", "shard_layout.cc", "memory_stats.cc", "envelope.cc", "atomic_file.cc"} <= srcs
    assert not srcs & {"pjrt_access.cc", "host_transfer.cc", "xlakit_bindings.cc"}


def _r(rc: int, *errors: str) -> cxx_compile.Result:
    return cxx_compile.Result(rc, 1.0, list(errors))


@pytest.mark.parametrize(
    ("control", "patched", "verdict"),
    [
        (_r(0), _r(0), "ok"),
        (_r(0), _r(1, "no member named 'x'"), "error"),
        (_r(1, "'PjRtFuture' was not declared"), _r(1, "'PjRtFuture' was not declared"), "drift"),
        # The bracket drifted, and the patches add a failure of their own.
        (_r(1, "'PjRtFuture' was not declared"), _r(1, "'PjRtFuture' was not declared", "private within this context"),
         "error"),
        (None, _r(1, "anything"), "error"),
        (None, _r(0), "ok"),
    ],
)
def test_verdicts(control, patched, verdict):
    assert cxx_check.classify(control, patched) == verdict


def test_errors_are_read_from_gcc_output():
    out = ("a.cc:3:1: error: 'x' was not declared in this scope\n"
           "b.h:1:10: fatal error: y.h: No such file or directory\n"
           "a.cc:9:2: warning: unused\n")
    assert cxx_compile.errors_of(out) == ["'x' was not declared in this scope", "y.h: No such file or directory"]


def test_every_deliberate_break_still_finds_its_text():
    patched_header = "".join(p.path.read_text() for p in series.read())
    for brk in cxx_check.BREAKS:
        if brk.needs_tree:  # the friend line exists only in the patched tree
            assert "\n+" + brk.old.rstrip("\n") + "\n" in patched_header, brk.name
        else:
            rel = Path(brk.edit_path).relative_to(PLACED_RUNTIME)
            assert brk.old in (pipeline.CSRC / "runtime" / rel).read_text(), brk.name


def test_dry_run_prints_downloads_compiles_and_skips(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_XLA_GIT", "XLAKIT_TORCH_XLA_GIT")}
    r = subprocess.run([sys.executable, str(ROOT / "build" / "xlakit_build.py"), "cxx-check", "--dry-run",
                        "--cache", str(tmp_path / "cache"), "--work", str(tmp_path / "work"), "--python",
                        sys.executable], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for pin in pins.cxx_brackets():
        assert f"{pin.package}=={pin.version} --hash=sha256:{pin.sha256}" in out
    assert "--require-hashes" in out and "apt-get download" in out
    assert "-fsyntax-only" in out
    assert "pjrt_computation_client.cpp" in out and "skip  no torch_xla source" in out
    assert out.count(f"XLAKIT_CACHE_KEY={cxx_check.TEST_CACHE_KEY}") == 3  # units, write, load: keyed jobs
    assert not (tmp_path / "cache" / "downloads").exists()  # a dry run fetches nothing


def test_the_codegen_gets_an_absolute_interpreter_when_given_a_relative_one(tmp_path):
    # Regression: `make cxx-check TORCH_XLA_GIT=...` on a fresh cache failed after 9 s with
    # FileNotFoundError '.venv/bin/python': the Makefile passed the venv's interpreter relative to the
    # checkout and torch_xla's codegen runs it from the cache's folder.
    relative = os.path.relpath(sys.executable, ROOT)
    assert not os.path.isabs(relative)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_XLA_GIT", "XLAKIT_TORCH_XLA_GIT")}
    r = subprocess.run([sys.executable, "build/xlakit_build.py", "cxx-check", "--dry-run", "--cache",
                        str(tmp_path / "cache"), "--work", str(tmp_path / "work"), "--torch-xla-git",
                        str(tmp_path / "torch_xla.git"), "--python", relative], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (codegen,) = [line for line in r.stdout.splitlines() if "lazy_tensor_generator.py" in line]
    assert f"&& {os.path.abspath(os.path.join(ROOT, relative))} " in codegen, codegen
    make = subprocess.run(["make", "-n", "cxx-check", "TORCH_XLA_GIT=x"], capture_output=True, text=True, cwd=ROOT)
    assert f'--python "{ROOT / ".venv" / "bin" / "python"}"' in make.stdout, make.stdout


def test_a_cached_download_with_another_sha256_is_refused(tmp_path):
    pin = pins.cxx_brackets()[0]
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / pin.file).write_bytes(b"not the wheel")
    with pytest.raises(cxx_deps.DepsError, match=f"expected sha256 {pin.sha256}.*delete the file"):
        cxx_deps.fetch_wheel(_quiet(), tmp_path, pin)


@pytest.mark.parametrize(
    ("brackets", "match"),
    [
        ([{"package": "p", "version": "1", "file": "f.whl", "sha256": "ab", "link": True}], "64 hex digits"),
        ([{"package": "p", "version": "1", "file": "f.whl", "sha256": "a" * 64}], "exactly one with link"),
        ([{"package": "p", "file": "f.whl", "sha256": "a" * 64, "link": True}], r"brackets\[0\].version"),
    ],
)
def test_bracket_pins_are_validated(brackets, match):
    with pytest.raises(pins.PinError, match=match):
        pins.cxx_brackets({"schema": 1, "cxx_check": {"brackets": brackets}})


def _cached_toolchain() -> tuple[cxx_compile.Toolchain, cxx_deps.Bracket]:
    """The headers `make cxx-check` already unpacked, or a skip: tests never download 300 MB."""
    cache = cxx_deps.cache_root()
    pin = next(p for p in pins.cxx_brackets() if p.link)
    llvm = pins.cxx_llvm()
    needed = [cache / f"{pin.package}-{pin.version}", cache / f"{llvm.package}-{llvm.version.replace(':', '_')}"]
    if not all((d / ".xlakit-unpacked").exists() for d in needed):
        pytest.skip(f"XLA/LLVM headers are not unpacked in {cache}: run `make cxx-check` once")
    runner = _quiet()
    bracket = cxx_deps.unpack_wheel(runner, cache / "downloads" / pin.file, pin, cache)
    tc = cxx_compile.Toolchain(cxx=cxx_compile.which_cxx(None), torch=cxx_deps.torch(runner, sys.executable),
                             llvm=cxx_deps.llvm(runner, cache), gen=None)
    return tc, bracket


def test_the_entry_mac_is_compiled_against_boringssl_not_the_system_openssl(tmp_path):
    # The runtime links @boringssl//:crypto; the system's OpenSSL headers (libssl-dev) must not stand in.
    tc, bracket = _cached_toolchain()
    probe = tmp_path / "probe.cc"
    probe.write_text("#include <openssl/hmac.h>\n")
    r = _quiet().capture([tc.cxx, *tc.flags(tmp_path, bracket), "-E", "-dM", str(probe)], check=False)
    assert r.returncode == 0, r.stderr[-600:]
    assert "#define OPENSSL_IS_BORINGSSL" in r.stdout


@pytest.mark.slow
@pytest.mark.build
def test_removing_the_friend_declaration_fails_pjrt_access(tmp_path):
    tc, bracket = _cached_toolchain()
    runner = _quiet()
    cfg = pipeline.Config(work=tmp_path, wheels=tmp_path / "wheels")
    commit = cfg.sources()["torch_xla"].commit
    pristine = cxx_deps.torch_xla_tree(runner, tmp_path / "cache", os.environ["XLAKIT_TORCH_XLA_GIT"], commit)
    gen = cxx_deps.codegen(runner, tmp_path / "cache", pristine, commit, tc.torch)
    tc = cxx_compile.Toolchain(cxx=tc.cxx, torch=tc.torch, llvm=tc.llvm, gen=gen)
    patched = cxx_check.patched_tree(runner, cfg, pristine, tmp_path / "patched")
    brk = next(b for b in cxx_check.BREAKS if b.needs_tree)
    broken = cxx_check.broken_copy(runner, patched, brk, tmp_path / "broken")
    bad = cxx_compile.compile_one(runner, tc.syntax_cmd(broken, bracket, brk.victim))
    assert not bad.ok and any(brk.expect in e for e in bad.errors), bad.errors[:3]
