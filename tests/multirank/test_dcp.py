"""xlakit.dcp_save / dcp_load: DCP folders committed atomically, verified, under one deadline.

The atomic and integrity behaviour is tested here in-process on CPU and plain
XLA tensors; SPMD sharding, resharding on load and compile counts run in
their own processes on a 4-device CPU mesh (see spmd_run.py).
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
import xxhash

import xlakit
from tests.support import fakes
from xlakit import cli
from tests.support.spmd_run import run_scenario
from xlakit.checkpoint.core import paths, workers
from xlakit.checkpoint.format import folders


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 8), value), "b": torch.arange(8)},
            "optim": {"step": int(value), "lr": 0.5}}


def _template() -> dict:
    return {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(8, dtype=torch.int64)},
            "optim": {"step": 0, "lr": 0.0}}


def _assert_loaded(state: dict, value: float) -> None:
    assert torch.equal(state["model"]["w"], torch.full((64, 8), value))
    assert torch.equal(state["model"]["b"], torch.arange(8))
    assert state["optim"] == {"step": int(value), "lr": 0.5}


def _temps(folder) -> list[str]:
    return [n for n in os.listdir(folder) if n.endswith(paths.TMP_SUFFIX)]


def test_round_trip_and_replace_committed_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    xlakit.dcp_save(_state(2.0), path)
    state = _template()
    xlakit.dcp_load(state, path)
    _assert_loaded(state, 2.0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert folders.COMMIT_RECORD in os.listdir(path)


@pytest.mark.xla
def test_plain_xla_tensors_round_trip(tmp_path):
    import torch_xla

    device = torch_xla.device()
    state = {"w": torch.arange(12.0).reshape(3, 4).to(device) * 3, "host": torch.ones(2),
             "scalar": torch.tensor(7, device=device)}
    xlakit.dcp_save(state, tmp_path / "ckpt")
    back = {"w": torch.zeros(3, 4), "host": torch.zeros(2), "scalar": torch.tensor(0)}
    xlakit.dcp_load(back, tmp_path / "ckpt")
    assert torch.equal(back["w"], torch.arange(12.0).reshape(3, 4) * 3)
    assert torch.equal(back["scalar"], torch.tensor(7))
    assert torch.equal(back["host"], torch.ones(2))


def test_folder_without_commit_record_is_refused_then_replaced(tmp_path):
    # Regression guard: a DCP folder whose save died before finishing must never load.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    os.unlink(path / folders.COMMIT_RECORD)
    with pytest.raises(xlakit.CheckpointIncompleteError, match="no commit record") as info:
        xlakit.dcp_load(_template(), path)
    assert ".metadata" in str(info.value)
    xlakit.dcp_save(_state(3.0), path)
    state = _template()
    xlakit.dcp_load(state, path)
    _assert_loaded(state, 3.0)


def test_damaged_file_is_named(tmp_path):
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(xlakit.CheckpointCorruptError, match=data.name):
        xlakit.dcp_load(_template(), path)


def test_a_damaged_item_is_found_before_any_of_it_reaches_the_state(tmp_path):
    # One pass (issue 35): each item is checked against its own hash in the commit record as it is read.
    path = tmp_path / "ckpt"
    state = {"a": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}
    xlakit.dcp_save(state, path)
    record = json.loads((path / folders.COMMIT_RECORD).read_text())
    name = next(n for n in record["files"] if n.endswith(".distcp"))
    offset, length, _ = max(record["files"][name]["items"], key=lambda item: item[0])  # the last item: "b"
    raw = bytearray((path / name).read_bytes())
    raw[offset + length - 100] ^= 0xFF  # inside "b"'s data
    (path / name).write_bytes(bytes(raw))
    target = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
    with pytest.raises(xlakit.CheckpointCorruptError, match=f"{name}.*at byte {offset}"):
        xlakit.dcp_load(target, path)
    assert torch.equal(target["a"], state["a"]) and not target["b"].any()  # the state is partly loaded, never damaged
    assert cli.main(["ckpt", "verify", str(path)]) == 1


def test_verify_checks_each_item_hash_of_the_record_in_the_one_read(tmp_path, capsys):
    # Regression: `ckpt verify` checked each file whole only, so an item list edited in the commit record passed
    # verify while dcp_load refused it. Both now blame the record; a damaged file is still blamed as such.
    path = tmp_path / "ckpt"
    xlakit.dcp_save({"a": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}, path)
    assert cli.main(["ckpt", "verify", "--json", str(path)]) == 0
    read = json.loads(capsys.readouterr().out)
    data_bytes = sum(p.stat().st_size for p in path.iterdir() if p.name != folders.COMMIT_RECORD)
    assert read["read_bytes"] <= data_bytes  # the items are checked in the read that hashes each file
    _edit_record(path, lambda files: files["__0_0.distcp"]["items"][-1].__setitem__(2, "0" * 16))
    assert cli.main(["ckpt", "verify", str(path)]) == 1
    out = capsys.readouterr()
    assert "item list was changed" in out.out + out.err and "__0_0.distcp" in out.out + out.err
    with pytest.raises(xlakit.CheckpointCorruptError, match="__0_0.distcp"):
        xlakit.dcp_load({"a": torch.zeros(4096), "b": torch.zeros(4096)}, path)
    _edit_record(path, lambda files: files["__0_0.distcp"].__setitem__("items", [[0, 10, "ab"], [5, 10, "cd"]]))
    assert cli.main(["ckpt", "verify", str(path)]) == 1
    assert "overlap" in "".join(capsys.readouterr())


def test_verify_refuses_an_item_list_that_lacks_an_item_the_metadata_names(tmp_path, capsys):
    # Regression: an item removed from the commit record's list passed `ckpt verify` (only listed items were
    # checked) while dcp_load refused it, its message saying verify would say the same.
    path = tmp_path / "ckpt"
    xlakit.dcp_save({"a": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}, path)
    (path / "__0_0.distcp").write_bytes(b"x" + (path / "__0_0.distcp").read_bytes()[1:])  # damaged as well
    _edit_record(path, lambda files: files["__0_0.distcp"]["items"].pop())
    assert cli.main(["ckpt", "verify", str(path)]) == 1
    out = "".join(capsys.readouterr())
    assert "__0_0.distcp is corrupt" in out and "item list" not in out, out  # the damaged file is blamed first
    xlakit.dcp_save({"a": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}, path)
    _edit_record(path, lambda files: files["__0_0.distcp"]["items"].pop())
    assert cli.main(["ckpt", "verify", str(path)]) == 1
    out = "".join(capsys.readouterr())
    assert "names an item" in out and "__0_0.distcp" in out, out
    with pytest.raises(xlakit.CheckpointCorruptError, match="names an item"):
        xlakit.dcp_load({"a": torch.zeros(4096), "b": torch.zeros(4096)}, path)


def test_a_replaced_metadata_file_is_refused_before_it_is_unpickled(tmp_path):
    # DCP's .metadata is a pickle: a folder on shared storage changed after the commit must not run code.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    with pytest.raises(xlakit.CheckpointCorruptError, match=r"\.metadata"):
        xlakit.dcp_load(_template(), path)
    assert not marker.exists()


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mknod, (self.marker,))


def test_a_metadata_file_naming_code_is_refused_unchecked_too(tmp_path):
    # With verify=False (or a commit record written with it) the library unpickled .metadata with
    # pickle.loads and ran what it named; the CLI already read it through the allowlist.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    marker = tmp_path / "ran"
    size = (path / ".metadata").stat().st_size
    payload = pickle.dumps(_RunsCode(str(marker)))
    (path / ".metadata").write_bytes(payload + b"." * (size - len(payload)))  # the record's size: read, not refused
    with pytest.raises(xlakit.CheckpointCorruptError, match=r"\.metadata is not DCP metadata .*names posix\.mknod"):
        xlakit.dcp_load(_template(), path, verify=False)
    assert not marker.exists()


@pytest.mark.parametrize("base", ["torch_xla's SPMDLoadPlanner", "DCP's DefaultLoadPlanner"])
def test_a_value_holding_pickled_code_is_refused_naming_it_and_never_run(tmp_path, monkeypatch, base):
    # DCP's own planner loads each non-tensor value with weights_only=False: without torch_xla (TorchTPU),
    # dcp_load ran the code a checkpoint's value held, from a bucket too; torch_xla's planner raised torch's
    # own error, which advises weights_only=False.
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from xlakit.checkpoint.torch_dcp import dcp_plan

    if base.startswith("DCP"):
        monkeypatch.setattr(dcp_plan, "load_planner_base", lambda: DefaultLoadPlanner)
    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    with monkeypatch.context() as m:  # written as an earlier xlakit wrote it (its save did not refuse the value)
        m.setattr(dcp_plan, "check_values", lambda state: None)
        xlakit.dcp_save({**_state(1.0), "extra": _RunsCode(str(marker))}, path)
    with pytest.raises(xlakit.CheckpointFormatError, match=r"'extra' holds pickled objects .*names posix.mknod"
                                                          r".*nothing of it was run") as caught:
        xlakit.dcp_load({**_template(), "extra": None}, path)
    assert not marker.exists()
    assert "weights_only=False" not in str(caught.value)  # torch's advice, for torch.load: not how to go on here


def test_a_value_a_weights_only_load_refuses_is_refused_by_the_save_before_anything_is_written(tmp_path):
    import numpy as np

    marker = tmp_path / "ran"
    for value, named in ((_RunsCode(str(marker)), "posix.mknod"), (np.arange(3), "numpy")):
        with pytest.raises(xlakit.CheckpointSerializationError, match=rf"'extra' .*could not be loaded back "
                                                                      rf"weights-only \(it names {named}.*nothing was "
                                                                      rf"written") as caught:
            xlakit.dcp_save({**_state(1.0), "extra": value}, tmp_path / "ckpt")
        assert "add_safe_globals" in "".join(caught.value.__notes__)
        assert not (tmp_path / "ckpt").exists() and not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary folder left either


def test_an_io_bytesio_value_loads_as_dcp_documents(tmp_path):
    import io

    path = tmp_path / "ckpt"
    xlakit.dcp_save({**_state(2.0), "blob": io.BytesIO(b"dataloader position 17")}, path)
    state = {**_template(), "blob": io.BytesIO()}
    xlakit.dcp_load(state, path)
    _assert_loaded(state, 2.0)
    assert state["blob"].getvalue() == b"dataloader position 17"


def test_save_and_load_keep_the_globals_the_user_allowed(tmp_path):
    # Bug: the values' weights-only check left torch's safe_globals context, which removes what it
    # added: a user's own add_safe_globals([io.BytesIO]) was gone after any dcp_save or dcp_load.
    import io

    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([io.BytesIO])
    try:
        xlakit.dcp_save({**_state(1.0), "cfg": (1, 2)}, tmp_path / "ckpt")  # a tuple: one value in every flattening
        assert io.BytesIO in torch.serialization.get_safe_globals()
        xlakit.dcp_load({**_template(), "cfg": None}, tmp_path / "ckpt")
        assert io.BytesIO in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    xlakit.dcp_load({**_template(), "cfg": None}, tmp_path / "ckpt")
    assert io.BytesIO not in torch.serialization.get_safe_globals()  # nor left allowed by xlakit


def test_a_subclass_of_a_number_is_checked_by_the_save_too(tmp_path):
    # Bug: check_values skipped any int/float instance, so numpy.float64 (a float) and IntEnum members
    # were written, and dcp_load then refused the checkpoint dcp_save had just committed.
    import numpy as np

    for value, named in ((np.float64(0.5), "numpy._core.multiarray.scalar"), (_Level.HIGH, "_Level")):
        with pytest.raises(xlakit.CheckpointSerializationError, match=rf"'extra' \({type(value).__name__}\) could "
                                                                      rf"not be loaded back .*it names .*{named}"):
            xlakit.dcp_save({**_state(1.0), "extra": value}, tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()


class _Level(enum.IntEnum):
    HIGH = 2


def test_a_value_pickle_cannot_write_is_named_before_anything_is_written(tmp_path):
    # Bug: the save's check let pickle's own error out, naming neither the value nor dcp_save.
    with pytest.raises(xlakit.CheckpointSerializationError, match=r"'extra' \(function\) cannot be pickled"):
        xlakit.dcp_save({**_state(1.0), "extra": lambda: 1}, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_a_class_torch_reports_as_built_is_named_too(tmp_path):
    # Bug: torch says "but got <class 'numpy.dtypes.UInt32DType'>" for the last class that
    # np.random.get_state() needs after the ones the note lists; the error named nothing.
    import numpy as np

    listed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype]
    with torch.serialization.safe_globals(listed):
        with pytest.raises(xlakit.CheckpointSerializationError, match=r"it names numpy\.dtypes\.UInt32DType"):
            xlakit.dcp_save({**_state(1.0), "rng": np.random.get_state()}, tmp_path / "ckpt")
    with torch.serialization.safe_globals([*listed, np.dtypes.UInt32DType]):
        xlakit.dcp_save({**_state(1.0), "rng": np.random.get_state()}, tmp_path / "ckpt")
        state = {**_template(), "rng": None}
        xlakit.dcp_load(state, tmp_path / "ckpt")
    assert state["rng"][0] == "MT19937"


@pytest.mark.xla
def test_device_tensors_inside_a_value_load_back_on_their_device(tmp_path):
    # Bug: values were loaded with map_location="cpu": a tuple of XLA (or TPU) tensors, which DCP
    # pickles as one value, came back on the host, where torch_xla's and DCP's planners restored it
    # on its device.
    import torch_xla

    device = torch_xla.device()
    xlakit.dcp_save({**_state(1.0), "pair": (torch.ones(2, device=device), torch.arange(3, device=device))},
                    tmp_path / "ckpt")
    state = {**_template(), "pair": None}
    xlakit.dcp_load(state, tmp_path / "ckpt")
    assert [t.device.type for t in state["pair"]] == ["xla", "xla"]
    assert torch.equal(state["pair"][1].cpu(), torch.arange(3))


def test_metadata_python_3_13_writes_loads(tmp_path, monkeypatch):
    # Bug: Python 3.13 pickles DCP's checkpoint_id path as pathlib._local.PosixPath, which the allowlist
    # lacked: every dcp_load there was CheckpointCorruptError. Faked here by pickling paths as 3.13 does.
    import pathlib

    monkeypatch.setitem(sys.modules, "pathlib._local", pathlib)
    monkeypatch.setattr(pathlib.PosixPath, "__module__", "pathlib._local")
    xlakit.dcp_save(_state(1.0), tmp_path / "ckpt")
    assert b"pathlib._local" in (tmp_path / "ckpt" / ".metadata").read_bytes()
    state = _template()
    xlakit.dcp_load(state, tmp_path / "ckpt")
    _assert_loaded(state, 1.0)


def test_metadata_naming_a_class_the_allowlist_lacks_is_not_called_corrupt(tmp_path, monkeypatch):
    # Bug: a .metadata that matches its commit record but names a class outside the allowlist (a newer
    # torch or Python) was CheckpointCorruptError, "the save that wrote it was faulty".
    from xlakit.checkpoint.format import dcp_metadata

    xlakit.dcp_save(_state(1.0), tmp_path / "ckpt")
    monkeypatch.setattr(dcp_metadata, "_ALLOWED", dcp_metadata._ALLOWED - dcp_metadata._PATHS)  # as if it were new
    with pytest.raises(xlakit.CheckpointFormatError, match=r"names pathlib\.PosixPath, which is not part of DCP's "
                                                           r"metadata") as caught:
        xlakit.dcp_load(_template(), tmp_path / "ckpt")
    assert not isinstance(caught.value, xlakit.CheckpointCorruptError)


@pytest.mark.parametrize("items", ["x", [[0, 5]], [["0", 5, "ab"]]])
def test_a_malformed_item_list_in_the_record_is_named(tmp_path, items):
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    record_path = path / folders.COMMIT_RECORD
    record = json.loads(record_path.read_text())
    name = next(n for n in record["files"] if n.endswith(".distcp"))
    record["files"][name]["items"] = items
    record_path.write_text(json.dumps(record))
    with pytest.raises(xlakit.CheckpointCorruptError, match="item list of __0_0.distcp is not a list"):
        xlakit.dcp_load(_template(), path)


def _drop_item_lists(path) -> None:
    """Make the commit record at `path` one written before items were listed."""
    record_path = path / folders.COMMIT_RECORD
    record = json.loads(record_path.read_text())
    for entry in record["files"].values():
        entry.pop("items", None)
    record_path.write_text(json.dumps(record))


def test_a_checkpoint_whose_record_lists_no_items_is_verified_whole_then_read(tmp_path):
    # Saved before items were hashed: each file is checked whole first, then DCP reads it.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    _drop_item_lists(path)
    state = _template()
    xlakit.dcp_load(state, path)
    _assert_loaded(state, 1.0)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    state = _template()
    with pytest.raises(xlakit.CheckpointCorruptError, match=data.name):
        xlakit.dcp_load(state, path)
    assert not state["model"]["w"].any()  # found before anything was read


def test_a_record_without_items_whose_metadata_is_refused_names_what_it_names(tmp_path, monkeypatch):
    # Bug: a folder saved before items were listed had .metadata read by DCP, which takes any failure of
    # read_metadata for a missing file: a class the allowlist refuses came out as a bare AssertionError.
    from xlakit.checkpoint.format import dcp_metadata

    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    _drop_item_lists(path)
    monkeypatch.setattr(dcp_metadata, "_ALLOWED", dcp_metadata._ALLOWED - dcp_metadata._PATHS)  # as if it were new
    with pytest.raises(xlakit.CheckpointFormatError, match=r"names pathlib\.PosixPath, which is not part of DCP's"):
        xlakit.dcp_load(_template(), path)


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_listed_file_that_is_gone_is_named_as_missing(tmp_path, name):
    # Regression: the one-pass reader let open()'s bare FileNotFoundError out, not the commit record's verdict.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    os.unlink(path / name)
    with pytest.raises(xlakit.CheckpointIncompleteError, match=f"{name} is listed in the commit record but missing"):
        xlakit.dcp_load(_template(), path)


@pytest.mark.parametrize("change", ["appended", "cut short"])
def test_a_data_file_of_another_size_than_committed_is_refused_before_it_is_read(tmp_path, change):
    # Regression: the one-pass reader read only the items, so bytes appended to a committed file went unseen.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    data = path / "__0_0.distcp"
    raw = data.read_bytes()
    data.write_bytes(raw + b"junk" if change == "appended" else raw[:-4])
    state = _template()
    with pytest.raises(xlakit.CheckpointCorruptError, match=f"{data.name}: expected {len(raw)} bytes"):
        xlakit.dcp_load(state, path)
    assert not state["model"]["w"].any()


def _edit_record(path, edit) -> None:
    record_path = path / folders.COMMIT_RECORD
    record = json.loads(record_path.read_text())
    edit(record["files"])
    record_path.write_text(json.dumps(record))


def test_a_commit_record_whose_items_disagree_with_the_checked_metadata_blames_the_record(tmp_path):
    # Regression: the metadata had just matched its hash in the record, yet the message said it was changed.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    _edit_record(path, lambda files: files["__0_0.distcp"]["items"][0].__setitem__(1, 1))
    with pytest.raises(xlakit.CheckpointCorruptError, match="commit record was changed") as info:
        xlakit.dcp_load(_template(), path)
    assert "ckpt verify" in str(info.value) and "verify=False" in str(info.value)


def test_a_commit_record_that_lists_items_but_no_metadata_is_refused(tmp_path):
    # Regression: a KeyError('.metadata') came out of the one-pass reader.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    _edit_record(path, lambda files: files.pop(".metadata"))
    with pytest.raises(xlakit.CheckpointCorruptError, match=r"but no \.metadata"):
        xlakit.dcp_load(_template(), path)


def test_unreadable_metadata_loaded_unverified_is_named(tmp_path):
    # Regression: verify=False handed pickle's own error (an OverflowError here) to the caller.
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    raw = bytearray((path / ".metadata").read_bytes())
    raw[10] ^= 0xFF
    (path / ".metadata").write_bytes(bytes(raw))
    with pytest.raises(xlakit.CheckpointCorruptError, match=r"\.metadata.*verify=True"):
        xlakit.dcp_load(_template(), path, verify=False)


def test_item_hashes_are_those_of_the_bytes_when_items_span_read_chunks(tmp_path, monkeypatch):
    import xxhash

    from xlakit.checkpoint.torch_dcp import one_pass

    monkeypatch.setattr(folders, "_CHUNK", 7)  # the read file_entry shares with file_digest
    data = bytes(range(256)) * 3
    (tmp_path / "f").write_bytes(data)
    ranges = [(0, 5), (5, 20), (25, 0), (25, 700), (725, 43)]
    entry = one_pass.file_entry(tmp_path / "f", ranges)
    assert entry["nbytes"] == len(data) and entry["xxh3_64"] == xxhash.xxh3_64(data).hexdigest()
    assert entry["items"] == [[o, n, xxhash.xxh3_64(data[o:o + n]).hexdigest()] for o, n in ranges]
    assert "items" not in one_pass.file_entry(tmp_path / "f", [(700, 100)])  # past the end: listed as none


def test_sharded_save_folder_is_told_apart_from_a_dcp_folder(tmp_path):
    # Both layouts name their commit record xlakit-commit.json; the format field decides.
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / folders.COMMIT_RECORD).write_text('{"format": "xlakit-sharded", "version": 1}')
    with pytest.raises(xlakit.CheckpointFormatError, match="load it with xlakit.load"):
        xlakit.dcp_load(_template(), path)


def test_foreign_folder_is_never_replaced(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(xlakit.CheckpointWriteError, match="notes.txt"):
        xlakit.dcp_save(_state(1.0), path)
    assert os.listdir(path) == ["notes.txt"] and _temps(tmp_path) == []


def test_missing_parent_folder_is_a_write_error(tmp_path):
    with pytest.raises(xlakit.CheckpointWriteError, match="does not exist"):
        xlakit.dcp_save(_state(1.0), tmp_path / "nope" / "ckpt")


def test_write_failure_inside_dcp_keeps_previous_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(folders, "write_commit_record", full)
    with pytest.raises(xlakit.CheckpointWriteError, match="no space") as info:
        xlakit.dcp_save(_state(2.0), path)
    assert info.value.errno == 28
    assert _temps(tmp_path) == []
    loaded = _template()
    xlakit.dcp_load(loaded, path)
    _assert_loaded(loaded, 1.0)


def test_next_save_removes_temporaries_of_dead_processes(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f".ckpt.{paths.host()}.{dead}.0badcafe{paths.TMP_SUFFIX}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    xlakit.dcp_save(_state(1.0), tmp_path / "ckpt")
    assert _temps(tmp_path) == []


def _dead_pid() -> str:
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_folders_moved_aside_by_dead_processes_are_cleaned_or_put_back(tmp_path, monkeypatch):
    # Regression: without an atomic exchange the previous folder is moved aside to
    # `.ckpt.<random>.xlakit-old`; a process killed before removing it left it forever (its name did
    # not say whose it was), and one killed between the two renames left no checkpoint at the name.
    monkeypatch.setattr(paths, "exchange", lambda a, b: False)  # a file system without RENAME_EXCHANGE
    final = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), final)
    kept = paths.replace_folder  # the aside a live save makes is named with its host and pid

    def killed_after_the_first_rename(tmp, final):
        aside = paths.temp_path(final, paths.ASIDE_SUFFIX)
        os.rename(final, aside)
        raise KeyboardInterrupt  # stands for the kill: nothing after the first rename runs

    monkeypatch.setattr(paths, "replace_folder", killed_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        xlakit.dcp_save(_state(2.0), final)
    monkeypatch.setattr(paths, "replace_folder", kept)
    (aside,) = [p for p in tmp_path.iterdir() if p.name.endswith(paths.ASIDE_SUFFIX)]
    assert not final.exists() and paths.parse_temp(aside.name, paths.ASIDE_SUFFIX)[1:] == (paths.host(), os.getpid())
    # As left by a dead process (its new folder too): the aside is the last committed checkpoint
    # and comes back.
    pid = _dead_pid()
    for left in tmp_path.iterdir():
        left.rename(left.with_name(left.name.replace(f".{os.getpid()}.", f".{pid}.")))
    dead = aside.with_name(aside.name.replace(f".{os.getpid()}.", f".{pid}."))
    assert paths.recover_asides(final) == [dead] and not dead.exists()
    state = _template()
    xlakit.dcp_load(state, final)
    _assert_loaded(state, 1.0)
    # An aside next to a newer checkpoint is removed by the next save; another host's is left alone.
    older = tmp_path / f".ckpt.{paths.host()}.{_dead_pid()}.0badcafe{paths.ASIDE_SUFFIX}"
    elsewhere = tmp_path / f".ckpt.otherhost.1.0badcafe{paths.ASIDE_SUFFIX}"
    for folder in (older, elsewhere):
        folder.mkdir()
        (folder / folders.COMMIT_RECORD).write_text("{}")
    xlakit.dcp_save(_state(3.0), final)
    assert not older.exists() and elsewhere.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", elsewhere.name])
    state = _template()
    xlakit.dcp_load(state, final)
    _assert_loaded(state, 3.0)


@pytest.mark.xla
def test_hung_transfer_times_out_and_keeps_previous(tmp_path, monkeypatch):
    import torch_xla

    path = tmp_path / "ckpt"
    xlakit.dcp_save(_state(1.0), path)
    hung = fakes.FakeHungDevice(hang_in="transfer")
    fakes.install(monkeypatch, hung)
    state = {"model": {"w": torch.full((64, 8), 2.0).to(torch_xla.device()), "b": torch.arange(8)},
             "optim": {"step": 2, "lr": 0.5}}
    start = time.monotonic()
    try:
        with pytest.raises(xlakit.CheckpointTimeoutError) as info:
            xlakit.dcp_save(state, path, timeout_s=0.5)
        elapsed = time.monotonic() - start
    finally:
        hung.release()
    assert 0.5 <= elapsed < 0.5 + workers.STOP_GRACE_S + 2.0  # its deadline, the wait for the worker, slack
    assert info.value.stage == "transfer" and info.value.tensor == "model.w"
    assert workers.wait_until_idle(10)
    assert _temps(tmp_path) == []
    loaded = _template()
    xlakit.dcp_load(loaded, path)
    _assert_loaded(loaded, 1.0)


@pytest.mark.xla
def test_runtime_deadline_error_stays_a_timeout(tmp_path, monkeypatch):
    # Regression guard: CheckpointTimeoutError is an OSError and was re-raised as a write error.
    import torch_xla

    class FakeDeadlineDevice(fakes.HostTransfer):
        def to_host(self, tensors, *, timeout_s):
            raise TimeoutError("tensor #0 (f32[4]): 0 of 16 bytes copied before the deadline")

    fakes.install(monkeypatch, FakeDeadlineDevice())
    with pytest.raises(xlakit.CheckpointTimeoutError, match="copy of 'w' passed its deadline"):
        xlakit.dcp_save({"w": torch.ones(4).to(torch_xla.device())}, tmp_path / "ckpt")
    assert _temps(tmp_path) == []


def test_irrelevant_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="compute_crc32"):
        xlakit.dcp_save(_state(1.0), tmp_path / "c", compute_crc32=True)
    with pytest.raises(ValueError, match="mmap"):
        xlakit.dcp_load(_template(), tmp_path / "c", mmap=True)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return run_scenario("dcp_sharded", tmp_path_factory.mktemp("dcp"))


@pytest.mark.xla
def test_sharded_save_compiles_no_replication_program(sharded):
    assert sharded["sharded"] == ["dim1", "even", "padded", "partial_bf16", "pending", "tiled_int"]
    assert sharded["save_compiles"] == [1, 0, 0]  # the one sync graph of the pending tensor
    assert sharded["small_batch_compiles"] == 0
    assert sharded["small_batch_shard_copies"] == len(sharded["sharded"])


@pytest.mark.xla
@pytest.mark.parametrize("load", ["same_sharding", "other_dim", "2x2_mesh", "host", "small_batch",
                                  "torch_xla_planner"])
def test_sharded_state_loads_bit_exactly(sharded, load):
    assert sharded[f"mismatch_{load}"] == []


@pytest.mark.xla
def test_sharded_save_times_out_in_transfer_and_keeps_previous(sharded):
    assert sharded["timeout"]["stage"] == "transfer"
    assert sharded["timeout"]["tensor"] == "model.even"
    # The deadline, the owner's wait for the worker (STOP_GRACE_S) and slack: under the 3 s of the first shard copy.
    assert sharded["timeout"]["elapsed_s"] < 0.5 + workers.STOP_GRACE_S + 1.5
    assert sharded["mismatch_after_timeout"] == []


@pytest.mark.xla
def test_xla_sharded_tensor_wrapper_is_saved_as_its_tensor(sharded):
    assert sharded["wrapper_type"] == "XLAShardedTensor" and sharded["wrapper_round_trip"]


@pytest.mark.xla
def test_load_on_another_device_count(sharded, tmp_path):
    result = run_scenario("dcp_two_devices", tmp_path, sharded["path"], devices=2)
    assert result == {"mismatch": [], "optim": {"step": 3, "lr": 0.5}}


def test_timeout_error_survives_pickling():
    # Regression guard: DCP pickles a rank's exception for the others, and unpickling
    # CheckpointTimeoutError failed on its keyword-only `stage`.
    import pickle

    err = xlakit.CheckpointTimeoutError("late", stage="write", tensor="w", rank=2)
    err.add_note("raise timeout_s")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is xlakit.CheckpointTimeoutError and str(back) == "late"
    assert (back.stage, back.tensor, back.rank, back.__notes__) == ("write", "w", 2, ["raise timeout_s"])


def test_an_item_of_no_bytes_at_the_end_of_a_file_is_not_called_past_the_end():
    # Regression (attack round): a 0-byte item at the file's end was reported "past its end" by verify.
    empty = xxhash.xxh3_64(b"").hexdigest()
    folders.ItemHashes("root", "f", [[0, 0, empty]]).check(0)
    items = folders.ItemHashes("root", "f", [[0, 3, xxhash.xxh3_64(b"abc").hexdigest()], [3, 0, empty]])
    items.update(0, b"abc")
    items.check(3)
    with pytest.raises(xlakit.CheckpointCorruptError, match="past its end"):
        folders.ItemHashes("root", "f", [[4, 0, empty]]).check(3)
