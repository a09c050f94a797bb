"""A URL that is one plain object (another tool's torch.save file) is said to be that, and is read
with verify=False as a local torch.save file is read.

Regression (issue 25, item 4): `xlakit.load` and `xlakit ckpt inspect` of gs://b/pretrained.pt, a
torch.save file copied there, said "no committed checkpoint ... nothing is there".
"""

from __future__ import annotations

import io

import pytest
import torch

import xlakit
from tests.support.cli import ckpt
from xlakit.checkpoint.objstore.client import Location, store_for


def test_a_plain_torch_save_object_is_named_as_such_and_loads_with_verify_false(bucket, capsys):
    url = f"{bucket}/pretrained.pt"
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 5}
    buf = io.BytesIO()
    torch.save(state, buf)
    loc = Location.parse(url)
    store_for(loc).put(None, loc, buf.getvalue())

    with pytest.raises(xlakit.CheckpointFormatError, match="one object of .* not an xlakit checkpoint") as info:
        xlakit.load(url)
    assert "nothing is there" not in str(info.value)
    assert any("verify=False" in n for n in info.value.__notes__)
    loaded = xlakit.load(url, verify=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 5

    code, out, err = ckpt(capsys, "inspect", url)
    assert code != 0 and "not an xlakit checkpoint" in err and "nothing is there" not in err, (out, err)


def test_a_url_with_nothing_there_still_says_so(bucket):
    with pytest.raises(FileNotFoundError, match="nothing is there"):
        xlakit.load(f"{bucket}/missing.pt", verify=False)
