"""`xlakit ckpt` on replica-parallel checkpoints that real gloo ranks wrote: a folder, a manager's
folder of them, and a manager URL on a bucket."""

from __future__ import annotations

import json

import pytest

import xlakit
from tests.multirank.test_replica_parallel_manager import WORLD, run_ranks
from tests.support import replica_state
from tests.support.cli import ckpt

pytestmark = pytest.mark.multiproc


def flip_a_byte(data: bytearray) -> bytes:
    """One bit flipped in the middle of a share: tensor data (each share is MiBs of it)."""
    data[len(data) // 2] ^= 0x10
    return bytes(data)


def test_ckpt_inspects_verifies_diffs_and_converts_a_replica_parallel_folder(tmp_path, capsys):
    run_ranks("roundtrip", tmp_path)  # ckpt/ ends holding state 2
    folder = tmp_path / "ckpt"
    code, out, _ = ckpt(capsys, "inspect", "--json", str(folder))
    shown = json.loads(out)
    assert code == 0 and (shown["kind"], shown["format"], shown["version"]) == ("replicated", "xlakit-replicated", 2)
    assert [s["rank"] for s in shown["shares"]] == list(range(WORLD))
    assert [s["bytes"] for s in shown["shares"]] == [(folder / s["file"]).stat().st_size for s in shown["shares"]]
    assert {t["name"] for t in shown["tensors"]} >= {"model/layer0", "tied", "view", "opt/0/m"}
    code, out, _ = ckpt(capsys, "inspect", str(folder))
    assert "format 'xlakit-replicated', version 2" in out and f"share {WORLD - 1}: share-" in out, out

    code, out, _ = ckpt(capsys, "verify", str(folder))
    assert code == 0 and out.startswith("OK:"), out
    xlakit.save(replica_state.state(2), tmp_path / "same.pt")
    xlakit.save(replica_state.state(1), tmp_path / "older.pt")
    assert ckpt(capsys, "diff", str(folder), str(tmp_path / "same.pt"))[0] == 0
    code, out, _ = ckpt(capsys, "diff", str(folder), str(tmp_path / "older.pt"))
    assert code == 1 and "differs: view" in out and "value differs: version: 2 vs 1" in out, out
    assert ckpt(capsys, "convert", "--to", "xlakit", str(folder), str(tmp_path / "whole.pt"))[0] == 0
    assert replica_state.digest(xlakit.load(tmp_path / "whole.pt")) == replica_state.digest(replica_state.state(2))

    share = folder / shown["shares"][2]["file"]
    share.write_bytes(flip_a_byte(bytearray(share.read_bytes())))
    code, out, _ = ckpt(capsys, "verify", "--json", str(folder))
    result = json.loads(out)
    assert code == 1 and result["status"] == "damaged" and "share 2" in result["message"], result


def test_ckpt_lists_and_verifies_a_manager_folder_of_replica_parallel_steps(tmp_path, capsys):
    run_ranks("manager", tmp_path, env={"XLAKIT_TEST_TARGET": str(tmp_path / "run")})
    code, out, _ = ckpt(capsys, "ls", "--json", str(tmp_path / "run"))
    listed = json.loads(out)
    assert code == 0 and [(s["step"], s["state"], s["layout"]) for s in listed["steps"]] == [
        (2, "committed", "replicated"), (3, "committed", "replicated")], listed
    code, out, _ = ckpt(capsys, "verify", str(tmp_path / "run"))
    assert code == 0 and out.startswith("OK:"), out
    code, out, _ = ckpt(capsys, "inspect", "--json", str(tmp_path / "run" / "3"))
    shown = json.loads(out)
    assert (shown["kind"], shown["step"]["step"], shown["version"]) == ("replicated", 3, 2), shown


@pytest.mark.slow
def test_ckpt_reads_a_manager_url_of_replica_parallel_steps(bucket, tmp_path, capsys):
    from xlakit.checkpoint.objstore.client import Location, store_for

    url = f"{bucket}/run"
    run_ranks("manager", tmp_path, env={"XLAKIT_TEST_TARGET": url})
    code, out, _ = ckpt(capsys, "inspect", "--json", f"{url}/3")
    shown = json.loads(out)
    assert code == 0 and (shown["kind"], shown["version"], shown["world"]) == ("replicated", 2, WORLD), shown
    assert [s["rank"] for s in shown["shares"]] == list(range(WORLD))
    code, out, _ = ckpt(capsys, "verify", url)
    assert code == 0 and "2 committed step(s)" in out, out
    xlakit.save(replica_state.state(3), tmp_path / "same.pt")
    assert ckpt(capsys, "diff", f"{url}/3", str(tmp_path / "same.pt"))[0] == 0
    assert ckpt(capsys, "convert", "--to", "xlakit", f"{url}/3", str(tmp_path / "whole.pt"))[0] == 0
    assert replica_state.digest(xlakit.load(tmp_path / "whole.pt")) == replica_state.digest(replica_state.state(3))

    loc = Location.parse(f"{url}/3/ckpt")
    store = store_for(loc)
    (name,) = [n for n in store.list(None, loc) if n.endswith(f".share-00001-of-{WORLD:05d}.pt")]
    store.put(None, loc.child(name), flip_a_byte(bytearray(store.get(None, loc.child(name)))))
    code, out, _ = ckpt(capsys, "verify", "--json", f"{url}/3")
    result = json.loads(out)
    assert code == 1 and result["status"] == "damaged" and name in result["message"], result
