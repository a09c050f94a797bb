"""`xlakit ckpt verify` checks each object against the xxh3-64 its commit record names.

Regression (issue 25, item 4): a record whose object hash was edited (the data intact) verified OK:
nothing ever read the hash. `xlakit.load` checks every record's own checksum, not the whole object's
hash (that would be a second pass over the object), so a good object still loads.
"""

from __future__ import annotations

import json

import pytest
import torch

import xlakit
from tests.support.cli import ckpt
from xlakit.checkpoint.objstore.client import Location, store_for


def edit_record_hash(url: str) -> None:
    loc = Location.parse(url)
    store = store_for(loc)
    (name,) = [n for n in store.list(None, loc) if n.startswith("xlakit-commit.")]
    record = json.loads(store.get(None, loc.child(name)))
    for entry in record["objects"].values():
        entry["xxh3_64"] = format(int(entry["xxh3_64"], 16) ^ 1, "016x")
    store.put(None, loc.child(name), json.dumps(record).encode())


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_record_whose_object_hash_was_edited_fails_verify_and_still_loads(bucket, capsys, request, layout):
    if layout == "sharded":
        request.getfixturevalue("one_rank")
    url = f"{bucket}/x.pt"
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    xlakit.save(state, url, layout=layout)
    assert ckpt(capsys, "verify", url)[0] == 0
    edit_record_hash(url)
    code, out, _ = ckpt(capsys, "verify", url)
    assert code != 0 and "DAMAGED" in out and "xxh3_64" in out, out
    loaded = xlakit.load(url, shard=0) if layout == "sharded" else xlakit.load(url)
    assert torch.equal(loaded["w"], state["w"])  # the data is intact: a load never calls it corrupt
