"""The xlakit wheel builds from a clean copy of the tree and imports in a fresh venv.

Built here by the host compiler, as `pip install .` builds it: the release build (`make wheel`, zig for
the glibc floor) is proven by tests/build/test_installed_wheel.py; this one also shows that the tag
check fails on what the host compiler makes.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "build"))

import pipeline  # noqa: E402
import wheel as release  # noqa: E402
from runner import Runner  # noqa: E402


def _clean_copy(dest: Path) -> Path:
    # What a clone would hold: tracked files plus new, not-ignored ones.
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.mark.slow
@pytest.mark.timeout(600)  # two builds of the C++ with the host compiler
def test_the_sdist_builds_a_wheel_that_installs_into_a_fresh_venv_and_imports(tmp_path):
    tree = _clean_copy(tmp_path / "src")
    assert not list(tree.rglob("*.so")), "the copy must not carry a prebuilt extension"
    wheels = tmp_path / "wheels"
    # No build isolation: this interpreter already has setuptools, wheel and
    # ninja (the build-system requires), and CI may have no index.
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(wheels), str(tree)],
                   check=True, capture_output=True, timeout=240)
    (sdist,) = wheels.glob("xlakit-*.tar.gz")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(sdist)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("xlakit-*.whl")
    # One wheel for every Python from the floor up: the limited API.
    assert wheel.name.endswith("-abi3-linux_x86_64.whl"), wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "xlakit/_C.abi3.so" in names, names
    assert "xlakit/_C.pyi" in names and "xlakit/_pins.toml" in names and "xlakit/_build.json" in names
    stamp = release.stamp_of(wheel)
    assert stamp["target"] == "host" and stamp["commit"] is None and "neither git nor" in stamp["why_not"], stamp
    assert "xlakit/selftest/report.schema.json" in names  # `xlakit selftest --json`'s schema ships with it
    assert "xlakit/_lib/libxlakit_pjrt_wrap.so" in names  # the PJRT wrapper, prebuilt: no compiler on the user's host

    # The fresh venv must see only what the wheel installed: a PYTHONPATH
    # pointing at a source tree (how developers run the suite) would make pip
    # think xlakit is already installed and the import succeed from the tree.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    # The outer pip installs into the venv; --no-deps keeps it offline.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=120, env=env)
    probe = (
        "import xlakit, xlakit._C as c, xlakit.cli;"
        "assert xlakit.__file__.startswith(%r), xlakit.__file__;"
        "e = c.encode_entry(b'p', kind='executable', platform_name='a', platform_version='b',"
        " torch_xla_revision='c', patch_series_id='d');"
        "print(c.verify_entry(e)['status']);"
        "import xlakit.runtime.pjrt_wrap as w; s = w.status(); assert s['built'] and s['built_api'], s;"
        "from xlakit.selftest import report; assert report.schema()['properties']['schema']['const'];"
        "assert w.library_path().is_relative_to(%r)" % (str(venv), str(venv))
    )
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

    # The host's glibc is newer than the floor here, so the tag check refuses this wheel, naming what it found.
    floor = release.floor()
    host = tuple(int(x) for x in stamp["glibc_floor"].split("."))
    if host <= tuple(int(x) for x in floor.split(".")):
        pytest.skip(f"this host's glibc {stamp['glibc_floor']} is not newer than the floor {floor}")
    with pytest.raises(pipeline.StepError, match=r"consistent only with manylinux_2_\d+_x86_64, newer than "
                                                 rf"manylinux_{floor.replace('.', '_')}_x86_64"):
        release.audit(Runner(out=io.StringIO()), wheel, floor)
