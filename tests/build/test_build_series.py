"""patches/: the series file, export from a branch, strict apply, and the real torch_xla."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "build"))

import series  # noqa: E402
from runner import Runner  # noqa: E402

BASE_TEXT = "".join(f"line {i}\n" for i in range(20))


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def branch(tmp_path):
    repo = tmp_path / "upstream"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f.txt").write_text(BASE_TEXT)
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    for i, (old, new) in enumerate([("line 3", "line three"), ("line 12", "line twelve")]):
        (repo / "f.txt").write_text((repo / "f.txt").read_text().replace(f"{old}\n", f"{new}\n"))
        _git(repo, "commit", "-qam", f"Change {old}\n\nWhy.\n\nSeries-Reason: reason {i}")
    return repo, base


def test_checked_in_series_is_well_formed():
    patches = series.read()
    assert patches, "patches/series lists no patch"
    for p in patches:
        text = p.path.read_text()
        assert "Upstream status:" in text, f"{p.name} does not say its upstream status"
        assert not re.search(r"/(work|tmp|home|root)/", text), f"{p.name} carries a machine path"
        assert text.startswith("From 0000000000000000000000000000000000000000 "), "export with --zero-commit"


def test_series_hash_changes_with_any_patch(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "0001-A.patch").write_text("a")
    (d / "0002-B.patch").write_text("b")
    (d / "series").write_text("0001-A.patch # why a\n0002-B.patch # why b\n")
    before = series.sha256(series.read(d))
    (d / "0002-B.patch").write_text("b2")
    assert series.sha256(series.read(d)) != before


@pytest.mark.parametrize(
    ("series_text", "match"),
    [
        ("0001-A.patch\n", "expected 'NNNN-subject.patch # reason'"),
        ("0001-A.patch # a\n0002-Gone.patch # g\n", "0002-Gone.patch is listed but not in"),
        ("", "does not list 0001-A.patch"),
    ],
)
def test_series_file_errors_name_the_problem(tmp_path, series_text, match):
    (tmp_path / "0001-A.patch").write_text("a")
    (tmp_path / "series").write_text(series_text)
    with pytest.raises(series.SeriesError, match=match):
        series.read(tmp_path)


def test_export_writes_patches_and_series_from_trailers(branch, tmp_path):
    repo, base = branch
    out = tmp_path / "patches"
    out.mkdir()
    (out / "0009-Stale.patch").write_text("old")
    patches = series.export(Runner(out=io.StringIO()), repo, base, out)
    assert [p.name for p in patches] == ["0001-Change-line-3.patch", "0002-Change-line-12.patch"]
    assert [p.reason for p in patches] == ["reason 0", "reason 1"]
    assert not (out / "0009-Stale.patch").exists()


def test_export_requires_a_reason_trailer(branch, tmp_path):
    repo, base = branch
    (repo / "f.txt").write_text("x\n")
    _git(repo, "commit", "-qam", "No trailer")
    with pytest.raises(series.SeriesError, match="needs exactly one 'Series-Reason:"):
        series.export(Runner(out=io.StringIO()), repo, base, tmp_path)


def _fresh_tree(tmp_path: Path, text: str) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    _git(tree, "init", "-q")
    (tree / "f.txt").write_text(text)
    return tree


def test_apply_applies_the_whole_series(branch, tmp_path):
    repo, base = branch
    patches = series.export(Runner(out=io.StringIO()), repo, base, tmp_path)
    tree = _fresh_tree(tmp_path, BASE_TEXT)
    series.check_and_apply(Runner(out=io.StringIO()), tree, patches, "abc123")
    assert (tree / "f.txt").read_text() == (repo / "f.txt").read_text()


def test_apply_names_the_failing_patch_and_applies_nothing(branch, tmp_path):
    repo, base = branch
    patches = series.export(Runner(out=io.StringIO()), repo, base, tmp_path)
    # A context line of the second patch differs: fuzz would accept it, we must not.
    drifted = BASE_TEXT.replace("line 11\n", "line eleven\n")
    tree = _fresh_tree(tmp_path, drifted)
    with pytest.raises(series.SeriesError, match=r"patch 0002-Change-line-12.patch does not apply to torch_xla abc123"):
        series.check_and_apply(Runner(out=io.StringIO()), tree, patches, "abc123")
    assert (tree / "f.txt").read_text() == drifted, "the check must run before anything is applied"


@pytest.mark.build
def test_patches_check_against_the_pinned_torch_xla(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "build" / "xlakit_build.py"), "patches-check",
         "--torch-xla-git", os.environ["XLAKIT_TORCH_XLA_GIT"], "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"patches-check: \d+ patches apply with zero fuzz to torch_xla c04e61c", proc.stdout)
    assert "verify: commits, WORKSPACE xla_hash and .torch_commit match VERSIONS.toml" in proc.stdout


@pytest.fixture
def pinned_tree(tmp_path):
    import pipeline

    cfg = pipeline.Config(work=tmp_path, wheels=tmp_path / "wheels",
                          git_urls={"torch_xla": os.environ["XLAKIT_TORCH_XLA_GIT"]})
    tree = tmp_path / "torch_xla"
    pipeline.fetch(Runner(out=io.StringIO()), cfg.url("torch_xla"), cfg.sources()["torch_xla"].commit, tree)
    return cfg, tree


@pytest.mark.build
def test_verify_catches_a_workspace_that_pins_another_openxla(pinned_tree):
    import pipeline

    cfg, tree = pinned_tree
    pipeline.verify(Runner(out=io.StringIO()), cfg, tree, with_pytorch=False)
    ws = tree / "WORKSPACE"
    ws.write_text(re.sub(r"^xla_hash = '[0-9a-f]{40}'", "xla_hash = '" + "1" * 40 + "'", ws.read_text(), flags=re.M))
    with pytest.raises(pipeline.StepError, match="WORKSPACE pins openxla 1111111111111111111111111111111111111111"):
        pipeline.verify(Runner(out=io.StringIO()), cfg, tree, with_pytorch=False)


@pytest.mark.build
def test_real_series_names_the_patch_that_stops_applying(pinned_tree):
    cfg, tree = pinned_tree
    cache_h = tree / "torch_xla/csrc/runtime/cache.h"
    cache_h.write_text(cache_h.read_text().replace("std::ofstream out(path, std::ios::binary);",
                                                   "std::ofstream out(path, std::ios::binary);  // drift"))
    before = cache_h.read_text()
    patches = series.read()
    (failing,) = [p for p in patches if "cache.h" in p.path.read_text() and "WriteCacheEntry" in p.path.read_text()]
    commit = cfg.sources()["torch_xla"].commit
    with pytest.raises(series.SeriesError, match=rf"patch {re.escape(failing.name)} does not apply to torch_xla {commit}"):
        series.check_and_apply(Runner(out=io.StringIO()), tree, patches, commit)
    assert cache_h.read_text() == before
    assert "xlakit" not in (tree / "torch_xla/csrc/runtime/BUILD").read_text(), "nothing may be applied"
