"""The pinned pjrt_c_api.h the PJRT wrapper builds against: fetched once, used only with the pinned sha256."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "build"))
import pjrt_header  # noqa: E402

PINS = ROOT / "VERSIONS.toml"


def test_the_cached_header_is_the_pinned_one():
    # `make setup` built the wrapper, so the header is in the cache, checked.
    pin = pjrt_header.pin(PINS)
    header = pjrt_header.include_dir(PINS) / pjrt_header.INCLUDE_PATH
    data = header.read_bytes()
    assert hashlib.sha256(data).hexdigest() == pin.sha256
    assert f"#define PJRT_API_MINOR {pin.api_version.split('.')[1]}".encode() in data


def test_an_offline_copy_is_taken_only_with_the_pinned_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    wrong = tmp_path / "pjrt_c_api.h"
    wrong.write_text("#define PJRT_API_MINOR 1\n")
    monkeypatch.setenv(pjrt_header.HEADER_ENV, str(wrong))
    with pytest.raises(pjrt_header.HeaderError, match="expected sha256"):
        pjrt_header.include_dir(PINS)
    monkeypatch.delenv("XDG_CACHE_HOME")
    good = pjrt_header.include_dir(PINS) / pjrt_header.INCLUDE_PATH  # the real cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(pjrt_header.HEADER_ENV, str(good))
    root = pjrt_header.include_dir(PINS)
    assert root.is_relative_to(tmp_path / "cache") and (root / pjrt_header.INCLUDE_PATH).read_bytes() == \
        good.read_bytes()
