"""A reader overtaken by two saves is told to load again (CheckpointIncompleteError).

Regression (issue 25, item 4): the data object vanished under the read (two newer saves committed,
the second removing the generation being read) and the reader raised a bare FileNotFoundError
naming an internal object.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import xlakit
from xlakit.checkpoint.objstore import reader

SAVE_TWICE = """
    import sys, torch, xlakit
    for v in (2.0, 3.0):
        xlakit.save({"w": torch.full((1 << 20,), v)}, sys.argv[1])
"""


def test_a_load_overtaken_by_two_saves_raises_incomplete_saying_to_load_again(bucket, monkeypatch):
    url = f"{bucket}/x.pt"
    xlakit.save({"w": torch.full((1 << 20,), 1.0)}, url)
    original = reader.ObjectFile.readinto
    overtaken: list[int] = []

    def readinto(self, buffer):
        if not overtaken:  # the read has begun: two saves by another process commit meanwhile
            overtaken.append(1)
            proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SAVE_TWICE), url],
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
        return original(self, buffer)

    monkeypatch.setattr(reader.ObjectFile, "readinto", readinto)
    with pytest.raises(xlakit.CheckpointIncompleteError, match="gone") as info:
        xlakit.load(url)
    assert any("load it again" in n for n in info.value.__notes__)
    monkeypatch.setattr(reader.ObjectFile, "readinto", original)
    assert torch.equal(xlakit.load(url)["w"], torch.full((1 << 20,), 3.0))
