"""One pass on load: every byte of a checkpoint read at most once, counted where the bytes come in.

The count is the store layer's (`core/load_stats.py`: a local file's read calls, an object store's
ranged requests), added up over the load with `load_stats.collecting()`.
"""

from __future__ import annotations

import json

import pytest
import torch

import xlakit
from xlakit.checkpoint.core import load_stats

MiB = 1 << 20


def alternating(pairs: int) -> dict:
    """1 MiB and 1 KiB fp32 tensors in turn: small records between large ones."""
    out = {}
    for i in range(pairs):
        out[f"big{i}"] = torch.full((MiB // 4,), float(i))
        out[f"small{i}"] = torch.full((256,), float(i))
    return out


def read_by(fn) -> load_stats.LoadStats:
    with load_stats.collecting() as stats:
        fn()
    return stats


def test_a_load_reads_every_byte_of_the_file_at_most_once(tmp_path):
    # Regression (issue 35): a record under 64 KiB read a 4 MiB window, and the 1 MiB tensors inside
    # it were read again: a load of this file read twice its size.
    path = tmp_path / "alt.pt"
    state = alternating(8)
    xlakit.save(state, path)
    size = path.stat().st_size
    loaded = {}
    stats = read_by(lambda: loaded.update(xlakit.load(path)))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert size * 0.99 <= stats.bytes_read <= size, (stats, size)


def test_a_restore_reads_every_byte_once_and_skips_what_it_does_not_restore(tmp_path):
    path = tmp_path / "alt.pt"
    state = {**alternating(4), "skipped": torch.ones(3 * MiB // 4)}  # 3 MiB the template does not want
    xlakit.save(state, path)
    size = path.stat().st_size
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    stats = read_by(lambda: xlakit.restore(path, template))
    assert all(torch.equal(template[k], v) for k, v in state.items())
    assert stats.bytes_read <= size, (stats, size)
    del template["skipped"]
    stats = read_by(lambda: xlakit.restore(path, template, strict=False))
    assert stats.bytes_read <= size - 3 * MiB, (stats, size)  # read-ahead only where its bytes are used


def test_a_folder_of_shares_is_read_once_outside_the_job(tmp_path):
    # Regression (issue 35): each share's index was read twice (once to check it against the commit
    # record, once to load), and its 2 MiB record twice more through the read window.
    state = {f"layer{i}": torch.full((MiB // 2,), float(i)) for i in range(3)}
    folder = tmp_path / "shares"
    import torch.distributed as dist

    from tests.support.ranks import private_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{private_port()}", rank=0, world_size=1)
    try:
        xlakit.save(state, folder, layout="replicated", replica_parallel=True)
    finally:
        dist.destroy_process_group()
    record = json.loads((folder / "xlakit-commit.json").read_text())
    shares = sum(s["bytes"] for s in record["shares"])
    loaded = {}
    stats = read_by(lambda: loaded.update(xlakit.load(folder)))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert stats.bytes_read <= shares, (stats, shares)


@pytest.mark.slow
def test_a_load_from_a_bucket_downloads_every_byte_at_most_once(bucket):
    # Regression (issue 35): the plain load of this object downloaded twice its size.
    url = f"{bucket}/alt.pt"
    state = alternating(6)
    xlakit.save(state, url)
    from xlakit.checkpoint.file import bucket_file
    from xlakit.checkpoint.objstore.client import Location

    record = bucket_file.peek(Location.parse(url), xlakit.LoadOptions())
    size = next(iter(record["objects"].values()))["nbytes"]
    loaded = {}
    stats = read_by(lambda: loaded.update(xlakit.load(url)))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # the object once, and the commit records that say which object it is (a few hundred bytes each)
    assert stats.bytes_read <= size + (64 << 10), (stats, size)
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    stats = read_by(lambda: xlakit.restore(url, template))
    assert stats.bytes_read <= size + (64 << 10), (stats, size)


def test_a_restore_from_the_local_tier_reads_its_part_once(tmp_path):
    # Issue 35 names the local tier among the layouts read in one pass.
    shm = tmp_path / "shm"
    state = alternating(8)
    with xlakit.CheckpointManager(tmp_path / "ckpt", save_interval_steps=100,
                                  local=xlakit.LocalTier(shm, interval_steps=1, keep=2)) as mgr:
        mgr.save(1, state)  # the local tier only: the persistent tier saves every 100 steps
        (part,) = shm.rglob("part-*.pt")
        beside = sum(f.stat().st_size for f in part.parent.iterdir() if f != part)  # the step's marker
        restored = {}
        stats = read_by(lambda: restored.update(mgr.restore(1)))
        assert mgr.local.restored_from["parts"] == {0: "local"}
    assert all(torch.equal(restored[k], v) for k, v in state.items())
    size = part.stat().st_size
    assert size * 0.99 <= stats.bytes_read <= size + beside, (stats, size, beside)


def _bytes_read_by_this_process() -> int:
    """What this process's read calls returned so far (the kernel's count, page cache included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _dcp_template(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0} for k, v in state.items()}


def test_a_verified_dcp_load_reads_every_byte_once(tmp_path):
    # Regression (issue 35): each file was read whole to check it against the commit record, then DCP
    # read its items again (and each item once more for every target chunk overlapping it).
    state = {**alternating(6), "meta": {"step": 3}}
    xlakit.dcp_save(state, tmp_path / "dcp")
    record = json.loads((tmp_path / "dcp" / "xlakit-commit.json").read_text())
    size = sum(e["nbytes"] for e in record["files"].values())
    loaded = _dcp_template(state)
    before = _bytes_read_by_this_process()
    stats = read_by(lambda: xlakit.dcp_load(loaded, tmp_path / "dcp"))
    by_kernel = _bytes_read_by_this_process() - before
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k != "meta") and loaded["meta"] == {"step": 3}
    assert size * 0.99 <= stats.bytes_read <= size, (stats, size)
    # The kernel's count sees every read, the store layer's or not (the commit record itself, a few KiB).
    assert by_kernel <= size + (64 << 10), (by_kernel, size)


@pytest.mark.slow
def test_a_verified_dcp_load_from_a_bucket_downloads_every_byte_once(bucket):
    url = f"{bucket}/dcp"
    state = {**alternating(6), "meta": {"step": 3}}
    xlakit.dcp_save(state, url)
    loaded = _dcp_template(state)
    stats = read_by(lambda: xlakit.dcp_load(loaded, url))
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k != "meta") and loaded["meta"] == {"step": 3}
    size = sum(v.numel() * v.element_size() for k, v in state.items() if k != "meta")
    # the files once (their bytes, DCP's per-item headers, .metadata), and the commit records
    assert stats.bytes_read <= size * 1.05 + (64 << 10), (stats, size)


def test_a_verified_mmap_load_brings_each_page_in_once_through_the_map(tmp_path):
    # mmap=True checks every record over a memory map before torch.load maps the same pages: the
    # records count as read once, and no read call copies them a second time.
    path = tmp_path / "alt.pt"
    state = alternating(8)
    xlakit.save(state, path)
    records = sum(v.numel() * v.element_size() for v in state.values())
    before = _bytes_read_by_this_process()
    stats = read_by(lambda: state.update(loaded=xlakit.load(path, mmap=True)))
    by_kernel = _bytes_read_by_this_process() - before
    assert all(torch.equal(state["loaded"][k], v) for k, v in alternating(8).items())
    assert records <= stats.bytes_read <= path.stat().st_size, (stats, records)
    assert by_kernel < records / 4, by_kernel  # the zip's directory and index through read calls; no records


def test_a_verified_load_of_a_file_of_an_earlier_build_reads_it_once(tmp_path, monkeypatch):
    # Regression (issue 35): a file written before the structure record (its index has none) loads
    # through torch.load; it was checked over a memory map of the file, then read again by torch.load.
    import json as real_json
    from types import SimpleNamespace

    from xlakit.checkpoint.format import archive

    def index_of_an_earlier_build(obj, **kw):
        if isinstance(obj, dict) and "storages" in obj:
            obj = {k: v for k, v in obj.items() if k != "structure"}
        return real_json.dumps(obj, **kw)

    base = torch.arange(4096.0)
    state = {**alternating(8), "base": base, "view": base[10:20], "param": torch.nn.Parameter(torch.ones(4))}
    path = tmp_path / "earlier.pt"
    with monkeypatch.context() as m:
        m.setattr(archive, "json", SimpleNamespace(dumps=index_of_an_earlier_build, loads=real_json.loads))
        xlakit.save(state, path)
    assert "structure" not in archive.read_index(str(path))[0], "the file is not one of an earlier build"
    size = path.stat().st_size
    loaded = {}
    before = _bytes_read_by_this_process()
    stats = read_by(lambda: loaded.update(xlakit.load(path)))
    by_read_calls = _bytes_read_by_this_process() - before
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert stats.bytes_read <= size, (stats, size)  # the check's one pass over the map
    assert by_read_calls < size // 4, (by_read_calls, size)  # and no second pass through read calls
    # As a load without mmap returns it: views still share their storage, parameters stay parameters,
    # and nothing holds the file.
    assert loaded["view"].untyped_storage().data_ptr() == loaded["base"].untyped_storage().data_ptr()
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad
    import gc

    gc.collect()
    with open("/proc/self/maps") as f:
        assert str(path) not in f.read()
    loaded["base"][10] = -1.0
    assert loaded["view"][0] == -1.0
    # A restore into a template reads it once too (it was checked, then read again by torch.load).
    template = {k: torch.zeros_like(v) for k, v in state.items() if k != "view"}
    before = _bytes_read_by_this_process()
    xlakit.restore(path, template, strict=False)
    assert _bytes_read_by_this_process() - before < size // 4
    assert all(torch.equal(template[k], state[k]) for k in template)
