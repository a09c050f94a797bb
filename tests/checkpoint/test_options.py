"""Strict options and clear edges: what is wrong is refused before any work, naming itself."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import xlakit


@pytest.mark.parametrize("cls,kwargs,exc,message", [
    (xlakit.SaveOptions, {"asynchronous": "no"}, TypeError, "asynchronous must be True or False, got 'no'"),
    (xlakit.SaveOptions, {"compute_crc32": 1}, TypeError, "compute_crc32 must be True or False"),
    (xlakit.SaveOptions, {"timeout_s": True}, TypeError, "timeout_s must be a number of seconds, got True"),
    (xlakit.SaveOptions, {"timeout_s": "abc"}, TypeError, "timeout_s must be a number of seconds, got 'abc'"),
    (xlakit.SaveOptions, {"timeout_s": float("nan")}, ValueError, "timeout_s must be a positive number"),
    (xlakit.SaveOptions, {"max_inflight_bytes": 1.5}, TypeError, "max_inflight_bytes must be a whole number"),
    (xlakit.SaveOptions, {"max_inflight_bytes": 0}, ValueError, "max_inflight_bytes must be at least 1"),
    (xlakit.SaveOptions, {"layout": "shared"}, ValueError, "layout must be one of 'single', 'replicated'"),
    (xlakit.SaveOptions, {"writer_rank": 5}, ValueError, "writer_rank=5 applies to layout='replicated' only"),
    (xlakit.SaveOptions, {"writer_rank": -1, "layout": "replicated"}, ValueError, "writer_rank must be at least 0"),
    (xlakit.SaveOptions, {"progress_callback": 3}, TypeError, "progress_callback must be callable"),
    (xlakit.LoadOptions, {"verify": "no"}, TypeError, "verify must be True or False, got 'no'"),
    (xlakit.LoadOptions, {"mmap": None}, TypeError, "mmap must be True or False"),
    (xlakit.LoadOptions, {"shard": "1"}, TypeError, "shard must be a whole number"),
    (xlakit.LoadOptions, {"shard": 1, "layout": "replicated"}, ValueError, "cannot be combined"),
])
def test_options_refuse_wrong_types_ranges_and_combinations(cls, kwargs, exc, message):
    # Regression: asynchronous='no' ran asynchronously; verify='no', timeout_s=True,
    # max_inflight_bytes=1.5 and writer_rank=5 with layout single were accepted.
    with pytest.raises(exc, match=message.replace("(", r"\(").replace("[", r"\[")):
        cls(**kwargs)


def test_options_accept_what_they_document():
    assert xlakit.SaveOptions(timeout_s=5, max_inflight_bytes=1 << 20, layout="replicated",
                              writer_rank=2, asynchronous=True).writer_rank == 2
    assert xlakit.SaveOptions(timeout_s=float("inf")).timeout_s == float("inf")
    assert xlakit.LoadOptions(shard=3, verify=False).shard == 3


def test_shard_of_a_single_file_is_refused(tmp_path):
    xlakit.save({"w": torch.ones(2)}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match=r"shard=3 reads one shard of a sharded checkpoint folder; .* is a file"):
        xlakit.load(tmp_path / "c.pt", shard=3)


def test_a_folder_target_is_refused_before_any_work(tmp_path):
    # Regression: a folder as the target was refused only after the whole state was written.
    seen = []
    with pytest.raises(xlakit.CheckpointWriteError, match="it is a folder") as info:
        xlakit.save({"w": torch.ones(1 << 20)}, tmp_path, progress_callback=seen.append)
    assert info.value.errno == errno.EISDIR and seen == []
    assert os.listdir(tmp_path) == []


def test_long_names_work_as_far_as_the_file_system_allows(tmp_path):
    # Regression: names over ~225 characters failed (the temporary name passed 255 bytes).
    name = "x" * 250 + ".pt"
    xlakit.save({"w": torch.arange(3.0)}, tmp_path / name)
    assert torch.equal(xlakit.load(tmp_path / name)["w"], torch.arange(3.0))
    assert os.listdir(tmp_path) == [name]
    with pytest.raises(xlakit.CheckpointWriteError, match="too long"):
        xlakit.save({"w": torch.ones(1)}, tmp_path / ("y" * 256))


def test_loading_a_folder_says_what_the_folder_is(tmp_path):
    # Regression: load(folder) called a DCP or a plain folder "a sharded checkpoint" and raised
    # a bare XlakitError.
    xlakit.dcp_save({"w": torch.ones(2)}, tmp_path / "dcp")
    with pytest.raises(xlakit.CheckpointFormatError, match=r"written by xlakit.dcp_save; load it with xlakit.dcp_load"):
        xlakit.load(tmp_path / "dcp")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hi")
    with pytest.raises(xlakit.CheckpointIncompleteError, match=r"no commit record .*it holds notes.txt"):
        xlakit.load(plain)
    (tmp_path / "empty").mkdir()
    with pytest.raises(xlakit.CheckpointIncompleteError, match="it is empty"):
        xlakit.load(tmp_path / "empty")


def test_dcp_refuses_the_options_it_cannot_honour(tmp_path):
    for kwargs in ({"asynchronous": True}, {"layout": "sharded"}, {"compute_crc32": True}):
        with pytest.raises(ValueError, match="applies to xlakit.save, not to dcp_save"):
            xlakit.dcp_save({"w": torch.ones(2)}, tmp_path / "d", **kwargs)
    with pytest.raises(ValueError, match="not to DCP folders"):
        xlakit.dcp_load({"w": torch.ones(2)}, tmp_path / "d", shard=1)
