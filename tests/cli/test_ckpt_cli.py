"""`xlakit ckpt`: ls, inspect, verify, diff and convert on xlakit files, plain torch.save files,
sharded and DCP folders, manager folders and damaged checkpoints; exit codes as documented."""

from __future__ import annotations

import json
import math
import os
import pty
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import xlakit
from tests.support import ranks
from xlakit import cli
from xlakit.checkpoint.format import archive, folders
from xlakit.checkpoint.stepstore import steps
from tests.support import REPO, SUPPORT

ROOT = REPO
DIST_WORKER = SUPPORT / "dist_worker.py"


def ckpt(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["ckpt", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def ckpt_json(capsys, *args: str) -> tuple[int, dict]:
    code, out, err = ckpt(capsys, *args, "--json")
    return code, json.loads(out)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def xlakit_state() -> dict:
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    return {"model": {"w": w, "w_t": w.t(), "b": torch.arange(5, dtype=torch.bfloat16)},
            "ids": [torch.tensor([1, -2**40])], "step": 7, "name": "run"}


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    state = xlakit_state()
    xlakit.save(state, tmp_path / "a.pt")
    torch.save({"model": {"w": state["model"]["w"] + 1, "b": state["model"]["b"]}, "step": 8}, tmp_path / "plain.pt")
    xlakit.dcp_save({"model": {"w": state["model"]["w"], "b": torch.ones(3)}, "step": 3}, tmp_path / "dcp")
    return {"xlakit": tmp_path / "a.pt", "plain": tmp_path / "plain.pt", "dcp": tmp_path / "dcp"}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    results = ranks.run(DIST_WORKER, "sharded-roundtrip", folder, 2)
    assert all(code == 0 for code, _, _ in results), results
    return folder / "ckpt"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which are not JSON."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def pickle_offset(path: Path) -> int:
    """Where the pickle (`<name>/data.pkl`) of a torch zip file starts."""
    import zipfile

    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("/data.pkl"))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len


def storage_offset(path: Path, tensor: str) -> int:
    """Where the storage whose first tensor is `tensor` starts in the file."""
    meta, _ = archive.read_index(str(path))
    return next(c.offset for c in archive.iter_checks(meta) if c.path == tensor)


# -- ls ----------------------------------------------------------------------------------------

def test_ls_lists_steps_commit_state_sizes_and_the_best(tmp_path, capsys):
    with xlakit.CheckpointManager(tmp_path, best_metric="loss", max_to_keep=3) as mgr:
        for step, loss in ((10, 0.5), (20, 0.2), (30, 0.4)):
            mgr.save(step, {"w": torch.ones(256) * step}, metrics={"loss": loss})
    os.remove(tmp_path / "30" / steps.CHECKPOINT_FILE)  # an interrupted save
    (tmp_path / "notes.txt").write_text("mine")
    code, data = ckpt_json(capsys, "ls", tmp_path)
    assert code == 0 and data["latest"] == 20 and data["best"] == 20 and data["best_metric"] == "loss"
    assert [(s["step"], s["state"], s["best"]) for s in data["steps"]] == [
        (10, "committed", False), (20, "committed", True), (30, "interrupted", False)]
    assert data["steps"][0]["bytes"] > 1024 and data["steps"][0]["metrics"] == {"loss": 0.5}
    assert "notes.txt" in data["other"]
    code, out, _ = ckpt(capsys, "ls", tmp_path)
    assert code == 0 and "best 20 by loss (min)" in out and "interrupted" in out and "(best)" in out


# Regression (issue 19): `ls` on a DCP, sharded or step folder exited 0 listing "0 committed step(s)".
def test_ls_refuses_what_is_not_a_manager_folder_saying_what_it_is(files, sharded, tmp_path, capsys):
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    (tmp_path / "empty").mkdir()
    for path, what in ((files["dcp"], "a torch.distributed.checkpoint folder"), (sharded, "a sharded checkpoint folder"),
                       (tmp_path / "run" / "1", "one step of a manager folder"),
                       (files["xlakit"], "an xlakit checkpoint file"), (tmp_path / "empty", "it is empty")):
        code, out, err = ckpt(capsys, "ls", path)
        assert code == 2 and out == "" and what in err and "not a CheckpointManager folder" in err, (path, err)


# Regression (issue 19): a truncated step record made `verify <dir>` say OK while `verify <dir>/20` said
# damaged, and `ls` left the step out; a manager folder that never saved made `verify` exit 2, not 3.
def test_a_damaged_step_record_is_a_finding_in_ls_and_verify(tmp_path, capsys):
    run = tmp_path / "run"
    with xlakit.CheckpointManager(run) as mgr:
        code, data = ckpt_json(capsys, "verify", run)  # only the manager's lock file: nothing saved yet
        assert code == 3 and data["status"] == "no-committed-step"
        code, data = ckpt_json(capsys, "ls", run)
        assert code == 0 and data["steps"] == []
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((64,), float(step))})
    record = run / "20" / steps.STEP_RECORD
    record.write_text(record.read_text()[:40])
    for path in (run, run / "20"):
        code, out, _ = ckpt(capsys, "verify", path)
        assert code == 1 and out.startswith("DAMAGED:") and "20/xlakit-step.json is damaged" in out, out
    code, data = ckpt_json(capsys, "ls", run)
    assert code == 0 and [(r["step"], r["state"]) for r in data["steps"]] == [(10, "committed"), (20, "damaged")]
    assert "not whole JSON" in data["steps"][1]["problem"] and data["latest"] == 10
    code, out, _ = ckpt(capsys, "ls", run)
    assert "DAMAGED: step(s) 20" in out and "damaged" in out.splitlines()[-1]
    shutil.copytree(run / "10", run / "30")  # a step folder copied under another number
    record.write_text(json.dumps({**json.loads((run / "10" / steps.STEP_RECORD).read_text()), "step": 20}))
    code, out, _ = ckpt(capsys, "verify", run)
    assert code == 1 and "step 30" in out and "records step 10 in folder '30'" in out, out


# -- inspect -----------------------------------------------------------------------------------

def test_inspect_an_xlakit_file_lists_tensors_storages_and_checksums(files, capsys):
    code, data = ckpt_json(capsys, "inspect", files["xlakit"])
    assert code == 0 and data["kind"] == "xlakit-file" and data["format_version"] == 2 and data["checksums"]
    assert data["checksum_count"] == 5  # the pickle, the structure record and three storages
    by = {t["name"]: t for t in data["tensors"]}
    assert by["model/w"]["dtype"] == "float32" and by["model/w"]["shape"] == [4, 3] and by["model/w"]["bytes"] == 48
    assert by["model/w"]["shared_with"] == ["model/w_t"] and by["model/b"]["dtype"] == "bfloat16"
    assert by["ids/0"]["dtype"] == "int64" and by["model/b"]["shared_with"] == []
    assert data["values"] == {"step": 7, "name": "run"}


def test_names_and_values_of_a_checkpoint_are_printed_escaped(tmp_path, capsys):
    # Regression (a helper's audit): inspect and diff printed a checkpoint's names and values raw: a newline
    # forged a line of the listing and an escape sequence rewrote the user's terminal.
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    xlakit.save({"\x1b[31mred": torch.ones(2), "a\nFAKE LINE": torch.zeros(1), "s": "x\x1b[2Jy"}, a)
    xlakit.save({"\x1b[31mred": torch.ones(2), "a\nFAKE LINE": torch.ones(1), "s": "x\x1b[2Jz"}, b)
    for args in (("inspect", str(a)), ("diff", str(a), str(b))):
        _, out, _ = ckpt(capsys, *args)
        assert "\x1b" not in out and not any(line.startswith("FAKE LINE") for line in out.splitlines()), out
        assert "a\\nFAKE LINE" in out and "x\\x1b[2J" in out, out


class _RunsAShellCommand:  # what an attacker's pickle holds: os.system at load time
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_is_never_offered_nor_allowed_through_allow_global(tmp_path, capsys):
    # Regression (a helper's audit): the refusal of a pickle calling os.system said "if you trust it, pass
    # --allow-global posix.system", and that flag was accepted: the tool told the user how to run the payload.
    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _RunsAShellCommand(marker)}, path)
    code, _, err = ckpt(capsys, "inspect", str(path))
    assert code == 2 and "runs code or reaches the system" in err and "--allow-global posix" not in err, err
    code, _, err = ckpt(capsys, "inspect", str(path), "--allow-global", f"{os.system.__module__}.system")
    assert code == 2 and "never allows it" in err, err
    assert not marker.exists()


def test_inspect_a_plain_torch_file_says_it_has_no_checksums(files, capsys):
    code, data = ckpt_json(capsys, "inspect", files["plain"])
    assert code == 0 and data["kind"] == "torch-file" and data["checksums"] is False
    assert {t["name"] for t in data["tensors"]} == {"model/w", "model/b"}


@pytest.mark.multiproc  # the sharded folder comes from a 2-rank job
def test_inspect_folders_shows_their_commit_record(files, sharded, capsys):
    code, data = ckpt_json(capsys, "inspect", files["dcp"])
    assert code == 0 and data["kind"] == "dcp" and data["commit"]["format"] == folders.DCP_FORMAT
    assert {t["name"]: t["shape"] for t in data["tensors"]} == {"model.w": [4, 3], "model.b": [3]}
    code, data = ckpt_json(capsys, "inspect", sharded)
    assert code == 0 and data["kind"] == "sharded" and data["commit"]["world"] == 2
    assert [s["tensors"][0]["name"] for s in data["shards"]] == ["w", "w"]


def test_inspect_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "junk.bin").write_bytes(b"garbage!")
    code, out, err = ckpt(capsys, "inspect", tmp_path / "junk.bin")
    assert code == 2 and "is not a checkpoint" in err and "Traceback" not in err and out == ""
    code, _, err = ckpt(capsys, "inspect", tmp_path / "missing.pt")
    assert code == 2 and "no such file or folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = ckpt(capsys, "inspect", tmp_path / "empty")
    assert code == 2 and "not a committed checkpoint: it is empty" in err


# Regression: a plain torch.save file damaged in its pickle made inspect/diff die with a traceback
# (IndexError, AssertionError, struct.error from torch's unpickler) and exit 1, "they differ" for diff.
@pytest.mark.parametrize("offset, bit", [(0, 0), (120, 0), (192, 0)])
def test_a_damaged_plain_torch_file_is_one_line_naming_it_and_exit_2(tmp_path, capsys, offset, bit):
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save({"model": {"w": torch.arange(24.0).reshape(4, 6)}, "step": 3}, good)
    data = bytearray(good.read_bytes())
    data[pickle_offset(good) + offset] ^= 1 << bit
    bad.write_bytes(bytes(data))
    for command in (["inspect", bad], ["diff", good, bad], ["convert", bad, "--to", "xlakit", tmp_path / "o.pt"]):
        code, out, err = ckpt(capsys, *command)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (command, err)
        assert f"{bad} cannot be read" in err and "damaged" in err


# Regression: a safetensors file starting with byte 0x80 was taken for a legacy torch pickle, and
# inspect relayed torch's advice to retry with weights_only=False (running pickled code).
def test_safetensors_is_told_by_its_header_and_pickled_code_is_never_advised(tmp_path, capsys):
    from safetensors.torch import save_file

    st = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.zeros(1) for i in range(77)}, st)  # 77 tensors: a header length of 0x...80
    assert st.read_bytes()[:1] == b"\x80"
    for command in (["inspect", st], ["diff", st, st], ["verify", st]):
        code, _, err = ckpt(capsys, *command)
        assert code == 2 and f"{st} is a safetensors file" in err and "weights_only" not in err, err
    torch.save({"w": torch.ones(2), "opts": argparse_namespace()}, tmp_path / "code.pt")
    code, _, err = ckpt(capsys, "inspect", tmp_path / "code.pt")
    assert code == 2 and "never runs pickled code" in err and "weights_only" not in err, err


def test_a_dcp_value_holding_pickled_code_is_one_line_naming_it_never_run(tmp_path, capsys, monkeypatch):
    from xlakit.checkpoint.torch_dcp import dcp_plan

    with monkeypatch.context() as m:  # written as an earlier xlakit wrote it (dcp_save now refuses the value)
        m.setattr(dcp_plan, "check_values", lambda state: None)
        xlakit.dcp_save({"w": torch.ones(2), "opts": argparse_namespace()}, tmp_path / "dcp")
    for command in (["diff", tmp_path / "dcp", tmp_path / "dcp"], ["convert", tmp_path / "dcp", "--to", "xlakit",
                                                                   tmp_path / "out.pt"]):
        code, out, err = ckpt(capsys, *command)
        assert code == 2 and "'opts' holds pickled objects" in err and "argparse.Namespace" in err, err
        assert "Traceback" not in err and "safe_globals" not in err and "\x1b" not in err
    assert not (tmp_path / "out.pt").exists()


class _RunsCode:
    """Unpickling this calls os.system: what a tampered DCP .metadata could hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_dcp_metadata_naming_code_is_refused_never_run(tmp_path, capsys):
    import pickle

    folder = tmp_path / "dcp"
    xlakit.dcp_save({"w": torch.ones(2)}, folder)
    import xxhash

    marker = tmp_path / "ran"
    body = pickle.dumps(_RunsCode(marker))
    (folder / ".metadata").write_bytes(body)
    record = json.loads((folder / "xlakit-commit.json").read_text())  # the tamperer fixes the record too
    record["files"][".metadata"] = {"nbytes": len(body), "xxh3_64": xxhash.xxh3_64(body).hexdigest()}
    (folder / "xlakit-commit.json").write_text(json.dumps(record))
    for command in (["inspect", folder], ["diff", folder, folder], ["convert", folder, "--to", "xlakit",
                                                                     tmp_path / "out.pt"]):
        code, _, err = ckpt(capsys, *command)
        assert code == 2 and "names posix.system" in err and "never runs pickled code" in err, err
    assert not marker.exists()


def test_a_url_of_a_scheme_xlakit_does_not_commit_to_is_refused_by_its_scheme(tmp_path, capsys):
    for command in (["inspect", "az://b/x"], ["verify", "http://host/x"], ["ls", "az://b/run"],
                    ["diff", tmp_path / "a.pt", "az://b/x"], ["convert", tmp_path / "a.pt", "--to", "xlakit",
                                                              "az://b/out.pt"]):
        code, _, err = ckpt(capsys, *command)
        assert code == 2 and "are not supported" in err and "gs:// and s3://" in err, err


def argparse_namespace():
    import argparse

    return argparse.Namespace(lr=0.1)


# -- verify ------------------------------------------------------------------------------------

@pytest.mark.multiproc  # the sharded folder comes from a 2-rank job
def test_verify_passes_intact_checkpoints_of_every_kind(files, sharded, tmp_path, capsys):
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(8)})
    for path, kind in ((files["xlakit"], "xlakit-file"), (files["dcp"], "dcp"), (sharded, "sharded"),
                       (tmp_path / "run", "manager"), (tmp_path / "run" / "1", "xlakit-file")):
        code, data = ckpt_json(capsys, "verify", path)
        assert code == 0 and data["status"] == "ok" and data["checksums"] >= 2, (path, data)
        assert data["kind"] == ("step" if path.name == "1" else kind)


def test_verify_json_says_what_it_read_each_byte_once(tmp_path, capsys):
    state = {f"big{i}": torch.full((1 << 18,), float(i)) for i in range(3)}
    state.update({f"small{i}": torch.full((256,), float(i)) for i in range(3)})
    xlakit.save(state, tmp_path / "f.pt")
    code, data = ckpt_json(capsys, "verify", tmp_path / "f.pt")
    size = (tmp_path / "f.pt").stat().st_size
    assert code == 0 and 0 < data["read_requests"], data
    assert sum(t.numel() * 4 for t in state.values()) <= data["read_bytes"] <= size, (data, size)


def test_verify_names_the_first_bad_tensor_and_exits_1(files, capsys):
    flip_byte(files["xlakit"], storage_offset(files["xlakit"], "model/b") + 3)
    code, data = ckpt_json(capsys, "verify", files["xlakit"])
    assert code == 1 and data["status"] == "damaged" and data["tensor"] == "model/b"
    code, out, _ = ckpt(capsys, "verify", files["xlakit"])
    assert code == 1 and "DAMAGED" in out and "tensor 'model/b' is corrupt" in out


def test_verify_checks_the_structure_record_too(files, capsys):
    meta, _ = archive.read_index(str(files["xlakit"]))
    flip_byte(files["xlakit"], meta["structure"]["offset"] + 5)
    code, data = ckpt_json(capsys, "verify", files["xlakit"])
    assert code == 1 and "the structure record is corrupt" in data["message"] and data["tensor"] is None


@pytest.mark.multiproc  # the sharded folder comes from a 2-rank job
def test_verify_finds_truncation_damaged_folders_and_missing_commits(files, sharded, tmp_path, capsys):
    data = files["xlakit"].read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:storage_offset(files["xlakit"], "model/b") + 4])
    code, out, _ = ckpt(capsys, "verify", tmp_path / "cut.pt")
    assert code == 1 and "DAMAGED" in out
    dcp_file = next(n for n in os.listdir(files["dcp"]) if n.endswith(".distcp"))
    flip_byte(files["dcp"] / dcp_file, 10)
    code, data = ckpt_json(capsys, "verify", files["dcp"])
    assert code == 1 and f"file {dcp_file} is corrupt" in data["message"]
    os.remove(files["dcp"] / folders.COMMIT_RECORD)
    code, data = ckpt_json(capsys, "verify", files["dcp"])
    assert code == 1 and "not a committed checkpoint" in data["message"]
    copy = tmp_path / "sharded"
    copy.mkdir()
    for name in os.listdir(sharded):
        (copy / name).write_bytes((sharded / name).read_bytes())
    shard1 = json.loads((copy / folders.COMMIT_RECORD).read_text())["shards"][1]["file"]
    flip_byte(copy / shard1, storage_offset(copy / shard1, "w") + 100)
    code, data = ckpt_json(capsys, "verify", copy)
    assert code == 1 and data["tensor"] == "w" and "shard 1: tensor 'w'" in data["message"]


def _loads_with_torch(path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - torch's reader meets damage with any error
        return False
    return True


@pytest.mark.slow  # a few thousand damaged copies, each read by torch and verified
def test_verify_never_says_ok_of_a_file_torch_load_refuses(tmp_path, capsys):
    # Regression: verify hashed the checksummed records only; a flipped byte in a local header's
    # signature, a central directory entry's method or name, the end records or the byte-order record
    # made torch.load refuse a file that verify called OK.
    from xlakit.checkpoint.inspect import integrity

    good_path = tmp_path / "c.pt"
    xlakit.save({"a": torch.arange(10.0), "b": [torch.ones(3), 7]}, good_path)
    good = good_path.read_bytes()
    checksummed = {i for r in integrity.plan(good_path)[1] for i in range(r.offset, r.offset + r.nbytes)}
    bad, refused = tmp_path / "bad.pt", []
    for pos in sorted(set(range(len(good))) - checksummed):
        for flip in (0xA5,):  # low and high bits: a digit becomes a non-digit, ASCII non-ASCII
            data = bytearray(good)
            data[pos] ^= flip
            bad.write_bytes(bytes(data))
            if _loads_with_torch(bad):
                continue
            refused.append(pos)
            code, out, err = ckpt(capsys, "verify", bad)
            assert code in (1, 2) and "OK" not in out, (pos, flip, out, err)  # damaged, or no checkpoint
    assert len(refused) > 100  # the damage covered headers, the directory, the end records


def test_verify_names_the_damaged_zip_structure(files, capsys):
    path = files["xlakit"]
    data = path.read_bytes()
    local = data.index(b"PK\x03\x04", data.index(b"PK\x03\x04") + 1)  # the second record's local header
    flip_byte(path, local + 1)
    code, out, _ = ckpt(capsys, "verify", path)
    assert code == 1 and "DAMAGED" in out and "the zip structure is damaged" in out
    assert "lacks its signature" in out and not _loads_with_torch(path)
    flip_byte(path, local + 1)
    central = data.index(b"PK\x01\x02")
    flip_byte(path, central + 10)  # the first entry's compression method
    code, data_ = ckpt_json(capsys, "verify", path)
    assert code == 1 and "expected a stored, unencrypted record" in data_["message"]
    flip_byte(path, central + 10)
    assert ckpt(capsys, "verify", path)[0] == 0


@pytest.mark.parametrize("field, at", [("signature", 0), ("name", 30 + len("archive/"))])
def test_a_damaged_local_header_of_the_checksums_record_is_damage_like_any_other(files, tmp_path, capsys, field, at):
    # Regression: verify read the checksums record through torch's reader before checking the zip structure,
    # so damage to its local header was "RuntimeError: PytorchStreamReader failed reading file
    # xlakit/checksums.json: invalid header or archive is corrupted", exit 2, where the same damage to any other
    # record's header is DAMAGED naming it, exit 1.
    import zipfile

    path = files["xlakit"]
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/xlakit/checksums.json")]
        header = z.getinfo(name).header_offset
    flip_byte(path, header + at)
    code, out, err = ckpt(capsys, "verify", path)
    assert code == 1 and out.startswith("DAMAGED: ") and "the zip structure is damaged" in out, (out, err)
    assert f"the local header of entry" in out and repr(name) in out and "RuntimeError" not in out + err, out
    code, data = ckpt_json(capsys, "verify", path)
    assert code == 1 and data["status"] == "damaged" and repr(name) in data["message"]
    for command in (["inspect", path], ["diff", path, path], ["convert", path, "--to", "xlakit", tmp_path / "o.pt"]):
        code, _, err = ckpt(capsys, *command)
        assert "RuntimeError" not in err, (command, err)
        if field == "signature":  # torch's reader cannot read the record: each stops, naming the damage
            assert code == 2 and repr(name) in err, (command, err)
    assert torch.equal(xlakit.load(path)["model"]["w"], xlakit_state()["model"]["w"])  # as before: it loads


def test_verify_of_a_plain_torch_file_exits_3_saying_there_is_nothing_to_verify(files, capsys):
    code, out, _ = ckpt(capsys, "verify", files["plain"])
    assert code == 3 and "no xlakit checksums" in out and "nothing to verify" in out


# Regression: a folder holding no checkpoint was "DAMAGED" (exit 1), and a manager folder whose only
# step was interrupted was "OK ... 0 checksum(s)" (exit 0) although nothing was verified.
def test_verify_exit_codes_for_what_is_no_checkpoint_and_for_nothing_committed(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine")
    code, out, err = ckpt(capsys, "verify", tmp_path / "notes")
    assert code == 2 and out == "" and "is not a checkpoint: it holds notes.txt" in err
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    os.remove(tmp_path / "run" / "1" / steps.CHECKPOINT_FILE)  # its only step: an interrupted save
    code, out, _ = ckpt(capsys, "verify", tmp_path / "run")
    assert code == 3 and "OK" not in out and "no committed step" in out and "step(s) 1 never committed" in out
    code, data = ckpt_json(capsys, "verify", tmp_path / "run")
    assert code == 3 and data["status"] == "no-committed-step" and data["interrupted"] == [1]


def _verify_in_a_subprocess(path: Path, stderr) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    return subprocess.run([sys.executable, "-m", "xlakit", "ckpt", "verify", str(path)], env=env,
                          stdout=subprocess.PIPE, stderr=stderr, timeout=300)


def test_the_progress_bar_is_drawn_on_a_terminal_only(files):
    plain = _verify_in_a_subprocess(files["xlakit"], subprocess.PIPE)
    assert plain.returncode == 0 and plain.stderr == b""
    leader, follower = pty.openpty()
    try:
        tty = _verify_in_a_subprocess(files["xlakit"], follower)
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
    assert tty.returncode == 0 and b"\r  [" in drawn and b"100%" in drawn


@pytest.mark.slow
def test_verify_streams_in_bounded_memory(tmp_path):
    big = tmp_path / "big.pt"
    xlakit.save({"w": torch.ones(48 << 20)}, big)  # 192 MiB
    probe = ("import resource, sys; from pathlib import Path; from xlakit.checkpoint.inspect import integrity;"
             "_, r = integrity.plan(Path(sys.argv[1]));"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;"
             "done = integrity.check(r);"
             "print(done, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)")
    out = subprocess.run([sys.executable, "-c", probe, str(big)], env={**os.environ, "PYTHONPATH": str(ROOT / "python")},
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    assert int(out[0]) >= 192 << 20  # the tensor and the pickle
    assert int(out[1]) < 24 << 10, out  # KiB: one 4 MiB buffer, not the file


# -- diff --------------------------------------------------------------------------------------

def test_diff_names_what_differs_and_by_how_much(files, tmp_path, capsys):
    code, data = ckpt_json(capsys, "diff", files["xlakit"], files["xlakit"])
    assert code == 0 and data["identical"] and data["same"] == 4  # tensors
    state = xlakit_state()
    state["model"]["w"] = state["model"]["w"].clone()
    state["model"]["w"][1, 2] += 0.5
    state["model"]["b"] = state["model"]["b"].float()
    del state["ids"]
    xlakit.save(state, tmp_path / "b.pt")
    code, data = ckpt_json(capsys, "diff", files["xlakit"], tmp_path / "b.pt")
    assert code == 1 and not data["identical"]
    assert data["only_in_a"] == ["ids/0"] and data["only_in_b"] == []
    assert data["mismatched"] == [{"name": "model/b", "a": "bfloat16[5]", "b": "float32[5]"}]
    assert [(d["name"], d["differing"]) for d in data["different"]] == [("model/w", 1)]
    assert data["different"][0]["max_abs_diff"] == pytest.approx(0.5, abs=1e-6)
    code, data = ckpt_json(capsys, "diff", files["xlakit"], files["plain"])  # a plain torch file reads too
    assert code == 1 and data["different"][0]["max_abs_diff"] == pytest.approx(1.0, abs=1e-6)
    assert {"name": "step", "a": 7, "b": 8} in data["values_different"]


# Regression: {"a/b": x, "a": {"b": y}} flattened both tensors to "a/b": diff said "identical" for
# different files and convert wrote one of the two tensors.
def test_names_that_collide_are_refused_not_merged(tmp_path, capsys):
    a, b = tmp_path / "A.pt", tmp_path / "B.pt"
    xlakit.save({"a/b": torch.zeros(3), "a": {"b": torch.ones(3)}}, a)
    xlakit.save({"a/b": torch.full((3,), 7.0), "a": {"b": torch.ones(3)}}, b)
    code, out, err = ckpt(capsys, "diff", a, b)
    assert code == 2 and out == "" and "the same name 'a/b' (['a/b'] and ['a']['b'])" in err
    code, _, err = ckpt(capsys, "convert", a, "--to", "safetensors", tmp_path / "A.st")
    assert code == 2 and "same name 'a/b'" in err and not (tmp_path / "A.st").exists()
    code, data = ckpt_json(capsys, "convert", a, "--to", "xlakit", tmp_path / "A2.pt")  # keeps the structure
    assert code == 0 and data["tensors"] == 2


# Regression: a list and a dict keyed "0" gave the same names, and diff called them identical.
def test_diff_tells_apart_containers_that_give_the_same_names(tmp_path, capsys):
    states = {"list": {"layers": [torch.zeros(2)]}, "dict": {"layers": {"0": torch.zeros(2)}},
              "int_keys": {"layers": {0: torch.zeros(2)}}, "tuple": {"layers": (torch.zeros(2),)},
              "empty_list": {"w": torch.zeros(2), "e": []}, "empty_dict": {"w": torch.zeros(2), "e": {}}}
    for name, state in states.items():
        xlakit.save(state, tmp_path / f"{name}.pt")
    for a, b in (("list", "dict"), ("dict", "int_keys"), ("list", "tuple"), ("empty_list", "empty_dict")):
        code, data = ckpt_json(capsys, "diff", tmp_path / f"{a}.pt", tmp_path / f"{b}.pt")
        assert code == 1 and not data["identical"], (a, b, data)
    code, data = ckpt_json(capsys, "diff", tmp_path / "list.pt", tmp_path / "dict.pt")
    assert data["structure_different"] == [{"name": "layers/0", "a": "['layers'][0]", "b": "['layers']['0']"}]
    code, out, _ = ckpt(capsys, "diff", tmp_path / "list.pt", tmp_path / "list.pt")
    assert code == 0 and out.strip() == "identical"


# Regression: a file holding a NaN value differed from itself, NaN against 5.0 had "max abs
# difference 0", and --json printed NaN, which is not JSON.
def test_diff_nan_equals_nan_and_differs_from_a_number(tmp_path, capsys):
    nan, inf = math.nan, math.inf
    xlakit.save({"w": torch.tensor([nan, 1.0, inf, 2.0]), "best": nan}, tmp_path / "a.pt")
    xlakit.save({"w": torch.tensor([-nan, 1.0, inf, 2.0]), "best": nan}, tmp_path / "other_nan.pt")
    xlakit.save({"w": torch.tensor([nan, 1.0, 5.0, nan]), "best": nan}, tmp_path / "b.pt")
    xlakit.save({"w": torch.tensor([nan, 1.0, 5.0, 2.0]), "best": nan}, tmp_path / "c.pt")
    for other in ("a", "other_nan"):  # NaNs with other bits are NaNs all the same
        code, out, _ = ckpt(capsys, "diff", tmp_path / "a.pt", tmp_path / f"{other}.pt")
        assert code == 0 and out.strip() == "identical", out
    code, out, _ = ckpt(capsys, "diff", tmp_path / "a.pt", tmp_path / "b.pt")
    assert code == 1 and ("w: 2 of 4 element(s), max abs difference nan (1 where a NaN stands against a "
                          "number)") in out
    code, out, _ = ckpt(capsys, "diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    assert strict_json(out)["different"] == [{"name": "w", "differing": 2, "elements": 4, "nan_vs_number": 1,
                                              "max_abs_diff": "NaN"}]
    code, out, _ = ckpt(capsys, "diff", tmp_path / "a.pt", tmp_path / "c.pt", "--json")
    assert code == 1 and strict_json(out)["different"][0]["max_abs_diff"] == "Infinity"


def test_diff_compares_dcp_bytesio_values_by_their_bytes(tmp_path, capsys):
    # Bug: since dcp_load reads DCP's io.BytesIO values, diff compared them by identity: a checkpoint
    # against itself "differed" (exit 1), shown as object addresses.
    import io

    for name, blob in (("a", b"position 17"), ("b", b"position 17"), ("c", b"position 18")):
        xlakit.dcp_save({"w": torch.ones(2), "blob": io.BytesIO(blob)}, tmp_path / name)
    code, out, _ = ckpt(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert code == 0 and out.strip() == "identical", out
    code, out, _ = ckpt(capsys, "diff", tmp_path / "a", tmp_path / "c")
    assert code == 1 and "blob: \"io.BytesIO(b'position 17')\" vs \"io.BytesIO(b'position 18')\"" in out, out


# Regression: --json printed the bare constants NaN and Infinity (not JSON) for NaN metrics and values.
def test_json_output_is_strict_json_when_floats_are_not_finite(tmp_path, capsys):
    with xlakit.CheckpointManager(tmp_path / "run", best_metric="loss") as mgr:
        mgr.save(1, {"w": torch.ones(2), "score": -math.inf}, metrics={"loss": math.nan})
    code, out, _ = ckpt(capsys, "ls", tmp_path / "run", "--json")
    assert code == 0 and strict_json(out)["steps"][0]["metrics"] == {"loss": "NaN"}
    code, out, _ = ckpt(capsys, "inspect", tmp_path / "run" / "1", "--json")
    data = strict_json(out)
    assert code == 0 and data["values"] == {"score": "-Infinity"} and data["step"]["metrics"] == {"loss": "NaN"}


# Regression: diff of float8 tensors that differ died with NotImplementedError (index_cpu), exit 2.
def test_diff_compares_float8_tensors(tmp_path, capsys):
    for name, values in (("a", [1.0, 2.0]), ("b", [1.0, 3.0])):
        xlakit.save({"w": torch.tensor(values).to(torch.float8_e4m3fn),
                     "v": torch.tensor(values).to(torch.float8_e5m2)}, tmp_path / f"{name}.pt")
    code, data = ckpt_json(capsys, "diff", tmp_path / "a.pt", tmp_path / "b.pt")
    assert code == 1 and [(d["name"], d["differing"], d["max_abs_diff"]) for d in data["different"]] == [
        ("v", 1, 1.0), ("w", 1, 1.0)]
    code, _ = ckpt_json(capsys, "diff", tmp_path / "a.pt", tmp_path / "a.pt")
    assert code == 0


# Regression: "Permission denied" errors never said which file (diff has two).
@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("capsh") is None,
                    reason="as root, file permissions bind only with capsh dropping cap_dac_override")
def test_permission_errors_name_the_file(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    for path in (a, b):
        xlakit.save({"w": torch.ones(2)}, path)
    b.chmod(0)
    command = f"{sys.executable} -m xlakit ckpt diff {a} {b}"
    if os.geteuid() == 0:
        if os.stat(tmp_path).st_uid == 0:
            os.chown(b, 4242, -1)  # root's files stay readable to root even without the capability
        argv = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", command]
    else:
        argv = ["sh", "-c", command]
    run = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(ROOT / "python")}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and f"{b}: Permission denied" in run.stderr, run.stderr


def test_diff_refuses_a_damaged_source(files, capsys):
    flip_byte(files["xlakit"], storage_offset(files["xlakit"], "model/w") + 1)
    code, _, err = ckpt(capsys, "diff", files["xlakit"], files["plain"])
    assert code == 2 and "tensor 'model/w' is corrupt" in err


# -- convert -----------------------------------------------------------------------------------

def test_convert_to_safetensors_loads_bit_exactly(files, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "a.safetensors"
    code, data = ckpt_json(capsys, "convert", files["xlakit"], "--to", "safetensors", out)
    assert code == 0 and data["tensors"] == 4
    loaded, want = load_file(out), xlakit.load(files["xlakit"])
    assert set(loaded) == {"model/w", "model/w_t", "model/b", "ids/0"}
    for name, t in (("model/w", want["model"]["w"]), ("model/w_t", want["model"]["w_t"]),
                    ("model/b", want["model"]["b"]), ("ids/0", want["ids"][0])):
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(bits(loaded[name]), bits(t)), name
    with safe_open(out, "pt") as f:
        assert json.loads(f.metadata()["xlakit.values"]) == {"step": 7, "name": "run"}


def test_convert_writes_strict_json_values_when_floats_are_not_finite(tmp_path, capsys):
    # Regression (issue 19): NaN and Infinity went into the safetensors metadata, which is not JSON.
    from safetensors import safe_open

    xlakit.save({"w": torch.ones(2), "loss": math.nan, "best": math.inf, "worst": [-math.inf, 1.5]}, tmp_path / "a.pt")
    code, _ = ckpt_json(capsys, "convert", tmp_path / "a.pt", "--to", "safetensors", tmp_path / "a.safetensors")
    assert code == 0
    with safe_open(tmp_path / "a.safetensors", "pt") as f:
        values = strict_json(f.metadata()["xlakit.values"])
    assert values == {"loss": "NaN", "best": "Infinity", "worst/0": "-Infinity", "worst/1": 1.5}


def test_convert_a_plain_torch_file_and_a_dcp_folder(files, tmp_path, capsys):
    from safetensors.torch import load_file

    code, _ = ckpt_json(capsys, "convert", files["plain"], "--to", "safetensors", tmp_path / "p.st")
    assert code == 0 and torch.equal(load_file(tmp_path / "p.st")["model/w"], torch.load(files["plain"])["model"]["w"])
    code, _ = ckpt_json(capsys, "convert", files["dcp"], "--to", "safetensors", tmp_path / "d.st")
    loaded = load_file(tmp_path / "d.st")
    assert code == 0 and torch.equal(bits(loaded["model.w"]), bits(xlakit_state()["model"]["w"]))
    assert torch.equal(loaded["model.b"], torch.ones(3))
    code, _ = ckpt_json(capsys, "convert", files["dcp"], "--to", "xlakit", tmp_path / "d.pt")
    one = xlakit.load(tmp_path / "d.pt")
    assert code == 0 and one["step"] == 3 and torch.equal(one["model.w"], xlakit_state()["model"]["w"])


@pytest.mark.multiproc  # the sharded folder comes from a 2-rank job
def test_convert_a_sharded_folder_into_one_file(sharded, tmp_path, capsys):
    code, data = ckpt_json(capsys, "convert", sharded, "--to", "xlakit", tmp_path / "one.pt")
    assert code == 0 and data["source_kind"] == "sharded"
    one = xlakit.load(tmp_path / "one.pt")
    for rank in (0, 1):
        shard = one[f"shard{rank}"]
        assert shard["rank"] == rank and torch.equal(shard["w"], torch.full((1000,), 10.0 + rank))


def test_convert_never_replaces_silently_nor_writes_from_a_damaged_source(files, tmp_path, capsys):
    out = tmp_path / "out.st"
    out.write_text("keep me")
    code, _, err = ckpt(capsys, "convert", files["xlakit"], "--to", "safetensors", out)
    assert code == 2 and "--force" in err and out.read_text() == "keep me"
    flip_byte(files["xlakit"], storage_offset(files["xlakit"], "model/w") + 1)
    code, _, err = ckpt(capsys, "convert", files["xlakit"], "--to", "safetensors", out, "--force")
    assert code == 2 and "corrupt" in err and out.read_text() == "keep me"
    assert [n for n in os.listdir(tmp_path) if n.endswith(".xlakit-tmp")] == []


@pytest.mark.parametrize("to", ["safetensors", "xlakit"])
def test_convert_never_replaces_a_dangling_link_without_force(files, tmp_path, capsys, to):
    # Regression: OUT.exists() follows the link, so a link to a file not made yet was replaced by the output
    # without --force ("an existing output is replaced only with --force").
    out = tmp_path / "link.out"
    out.symlink_to(tmp_path / "not-yet" / "target")
    code, _, err = ckpt(capsys, "convert", files["xlakit"], "--to", to, out)
    assert code == 2 and f"{out} exists; pass --force" in err, err
    assert out.is_symlink() and os.readlink(out) == str(tmp_path / "not-yet" / "target")


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ckpt", "verify", "--help"])
    assert "exit codes: 0 success; 1 verify found damage" in capsys.readouterr().out


def test_verify_calls_a_file_damaged_only_from_its_checksums_never_from_a_failed_import(tmp_path):
    # Regression (issue 32): where importing torch failed (TorchTPU's native check), `ckpt verify`
    # exited 1, its "damaged" status, on a good file. A failed import is an error (2), named.
    xlakit.save({"w": torch.ones(4)}, tmp_path / "c.pt")
    broken = tmp_path / "broken" / "torch"  # a fake: a torch whose import fails
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this torch cannot be imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "broken"), str(REPO / "python")]))
    done = subprocess.run([sys.executable, "-m", "xlakit", "ckpt", "verify", str(tmp_path / "c.pt")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "this torch cannot be imported" in done.stderr, done
    assert "DAMAGED" not in done.stdout


def test_allow_global_reads_values_of_classes_the_user_trusts_and_the_error_says_how(tmp_path, capsys, monkeypatch):
    # The CLI could not read a checkpoint whose values need a class allowed (numpy's RNG state, a Namespace).
    from xlakit.checkpoint.torch_dcp import dcp_plan

    with monkeypatch.context() as m:  # a value the user's own process allowed when it saved
        m.setattr(dcp_plan, "check_values", lambda state: None)
        xlakit.dcp_save({"w": torch.ones(2), "opts": argparse_namespace()}, tmp_path / "dcp")
    code, _, err = ckpt(capsys, "diff", tmp_path / "dcp", tmp_path / "dcp")
    assert code == 2 and err.rstrip().endswith("if you trust it, pass --allow-global argparse.Namespace"), err
    code, out, err = ckpt(capsys, "diff", tmp_path / "dcp", tmp_path / "dcp", "--allow-global", "argparse.Namespace")
    assert code == 0 and "identical" in out, err
    code, _, err = ckpt(capsys, "inspect", tmp_path / "dcp", "--allow-global", "argparse.Namespace")
    assert code == 0, err
    import argparse

    assert argparse.Namespace not in torch.serialization.get_safe_globals()  # allowed for that command only
    code, _, err = ckpt(capsys, "diff", tmp_path / "dcp", tmp_path / "dcp", "--allow-global", "argparse.Nope")
    assert code == 2 and "--allow-global argparse.Nope: no such class" in err and "Traceback" not in err, err
    code, _, err = ckpt(capsys, "diff", tmp_path / "dcp", tmp_path / "dcp", "--allow-global", "nosuchmodule.X")
    assert code == 2 and "--allow-global nosuchmodule.X: no such class" in err, err


def numpy_rng_allowed():
    """numpy, the classes its RNG state (`get_state()`) pickles, and the `--allow-global` arguments naming them."""
    np = pytest.importorskip("numpy")
    allowed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    return np, allowed, [arg for g in allowed for arg in ("--allow-global", f"{g.__module__}.{g.__qualname__}")]


def test_diff_compares_numpy_values_the_user_allowed_element_by_element(tmp_path, capsys):
    # With numpy's classes allowed, diff raised "The truth value of an array ... is ambiguous" (exit 2).
    np, allowed, allow = numpy_rng_allowed()
    rng = np.random.RandomState(0)
    with torch.serialization.safe_globals(allowed):
        xlakit.dcp_save({"w": torch.ones(2), "rng": rng.get_state()}, tmp_path / "a")
        rng.rand()
        xlakit.dcp_save({"w": torch.ones(2), "rng": rng.get_state()}, tmp_path / "b")
    code, out, err = ckpt(capsys, "diff", tmp_path / "a", tmp_path / "a", *allow)
    assert code == 0 and "identical" in out, err
    code, out, err = ckpt(capsys, "diff", tmp_path / "a", tmp_path / "b", *allow)
    assert code == 1 and "value differs: rng/1: 'array([" in out and "characters)" in out, (out, err)
    assert all(len(line) < 400 for line in out.splitlines())


def test_a_command_error_prints_how_to_fix_it_under_its_one_line(tmp_path, capsys):
    # The errors' hints (add_note: how to mend a damaged step, what convert can do instead) were dropped.
    with xlakit.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    (tmp_path / "run" / "1" / "xlakit-step.json").write_text("{not json")
    code, out, err = ckpt(capsys, "inspect", tmp_path / "run" / "1")
    first, hint = err.splitlines()
    assert code == 2 and "xlakit-step.json is damaged" in first and "Traceback" not in err, err
    assert hint.startswith("  xlakit never deletes or reuses") and "xlakit ckpt inspect" in hint, hint
    np, allowed, allow = numpy_rng_allowed()
    with torch.serialization.safe_globals(allowed):
        xlakit.dcp_save({"w": torch.ones(2), "rng": np.random.RandomState(0).get_state()}, tmp_path / "dcp")
    code, out, err = ckpt(capsys, "convert", tmp_path / "dcp", "--to", "xlakit", tmp_path / "o.pt", *allow)
    assert code == 2 and "cannot save rng/1: it is a numpy.ndarray" in err.splitlines()[0], err
    assert "`--to safetensors` keeps such a value as text" in err and not (tmp_path / "o.pt").exists(), err
    # An OSError of xlakit's (CheckpointWriteError) too: its line is its strerror, its hint still follows.
    code, out, err = ckpt(capsys, "convert", tmp_path / "run" / "1" / "ckpt.pt", "--to", "xlakit",
                          tmp_path / "nowhere" / "o.pt")
    first, hint = err.splitlines()
    assert code == 2 and first.endswith(f"the folder {tmp_path / 'nowhere'} does not exist"), err
    assert hint.startswith("  How to fix: create it first"), err


def test_allow_global_hint_for_a_plain_torch_save_file(tmp_path, capsys):
    # A torch.save file's refused value named no class, so no --allow-global hint (only DCP values had one).
    torch.save({"w": torch.ones(2), "opts": argparse_namespace()}, tmp_path / "t.pt")
    for command in ("inspect", "diff"):
        code, _, err = ckpt(capsys, command, *[tmp_path / "t.pt"] * (2 if command == "diff" else 1))
        assert code == 2 and err.rstrip().endswith("if you trust it, pass --allow-global argparse.Namespace"), err
    code, out, err = ckpt(capsys, "inspect", tmp_path / "t.pt", "--allow-global", "argparse.Namespace")
    assert code == 0 and "Namespace(lr=0.1)" in out, err


def test_allow_global_takes_the_name_the_error_gave_and_refuses_what_is_no_class_or_function(tmp_path, capsys):
    # A numpy-1 pickle's numpy.core.multiarray._reconstruct stayed refused with that very name allowed; a
    # nested name (Outer.Inner) was "no such class"; a module (os.path) made a good file "damaged".
    np = pytest.importorskip("numpy")
    import pickle

    class Numpy1(pickle._Pickler):  # writes the global as numpy 1.x named it
        def save_global(self, obj, name=None):
            if obj is np._core.multiarray._reconstruct:
                self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
                self.memoize(obj)
                return
            super().save_global(obj, name)

    class Module:
        Pickler, Unpickler, __name__ = Numpy1, pickle.Unpickler, "numpy1_pickle"

    torch.save({"w": torch.ones(2), "arr": np.arange(3.0)}, tmp_path / "np1.pt", pickle_module=Module)
    code, _, err = ckpt(capsys, "inspect", tmp_path / "np1.pt")
    assert code == 2 and err.rstrip().endswith("pass --allow-global numpy.core.multiarray._reconstruct"), err
    allow = [a for n in ("numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
                         "numpy.dtypes.Float64DType") for a in ("--allow-global", n)]
    code, out, err = ckpt(capsys, "inspect", tmp_path / "np1.pt", *allow)
    assert code == 0 and "array([0., 1., 2.])" in out, err
    torch.save({"w": torch.ones(2), "opts": argparse_namespace()}, tmp_path / "t.pt")
    code, _, err = ckpt(capsys, "inspect", tmp_path / "t.pt", "--allow-global", "collections.OrderedDict.fromkeys",
                        "--allow-global", "argparse.Namespace")
    assert code == 0, err
    for name in ("json.decoder", "math.pi"):
        code, _, err = ckpt(capsys, "inspect", tmp_path / "t.pt", "--allow-global", name)
        assert code == 2 and f"--allow-global {name}: " in err and "not a class or function" in err, err
        assert "damaged" not in err and "Traceback" not in err, err


def test_diff_numpy_values_a_nan_equals_a_nan_and_object_arrays_by_their_elements(tmp_path, capsys):
    # A NaN with its sign bit set (0/0) against np.nan was a difference shown as 'array([nan])' vs 'array([nan])';
    # an object array differed from itself (its bytes are pointers).
    np = pytest.importorskip("numpy")
    with np.errstate(invalid="ignore"):
        computed = np.array([1.0, 0.0]) / np.array([1.0, 0.0])
    assert computed.tobytes() != np.array([1.0, np.nan]).tobytes()
    torch.save({"arr": np.array([1.0, np.nan]), "obj": np.array([10**20, "a b"], dtype=object)}, tmp_path / "a.pt")
    torch.save({"arr": computed, "obj": np.array([10**20, "a b"], dtype=object)}, tmp_path / "b.pt")
    torch.save({"arr": np.array([1.0, 2.0]), "obj": np.array([10**20, "a c"], dtype=object)}, tmp_path / "c.pt")
    allow = [a for n in ("numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
                         "numpy.dtypes.Float64DType", "numpy.dtypes.ObjectDType") for a in ("--allow-global", n)]
    code, out, err = ckpt(capsys, "diff", tmp_path / "a.pt", tmp_path / "b.pt", *allow)
    assert code == 0 and "identical" in out, (out, err)
    code, result = ckpt_json(capsys, "diff", tmp_path / "a.pt", tmp_path / "c.pt", *allow)
    assert code == 1 and [v["name"] for v in result["values_different"]] == ["arr", "obj"], result


def test_convert_keeps_an_allowed_values_whole_repr_while_diff_shortens_it(tmp_path, capsys):
    # convert --to safetensors wrote the shortened repr ("... (N characters)") that diff shows into the file.
    np, allowed, allow = numpy_rng_allowed()
    with torch.serialization.safe_globals(allowed):
        xlakit.dcp_save({"w": torch.ones(2), "rng": np.random.RandomState(0).get_state()}, tmp_path / "a")
    code, _, err = ckpt(capsys, "convert", tmp_path / "a", "--to", "safetensors", tmp_path / "a.st", *allow)
    assert code == 0, err
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a.st"), "pt") as f:
        values = json.loads(f.metadata()["xlakit.values"])
    shown = values["rng/1"] if "rng/1" in values else values["rng"][1]
    assert "characters)" not in shown and shown.startswith("array([") and shown.endswith(", dtype=uint32)")
