"""xlakit._C transfer batch planning, device validation and atomic writes."""

from __future__ import annotations

import os
import random

import pytest

from xlakit import _C

DEVICES = ["TPU:0", "TPU:1", "TPU:2", "TPU:3"]


def _check_plan(sizes: list[int], cap: int) -> list[tuple[int, int, int]]:
    plan = _C.plan_transfer_batches(sizes, max_inflight_bytes=cap)
    # Consecutive, covering, in order.
    assert [b for b, _, _ in plan] == [0] + [e for _, e, _ in plan[:-1]] if plan else sizes == []
    assert (plan[-1][1] if plan else 0) == len(sizes)
    for begin, end, total in plan:
        assert total == sum(sizes[begin:end])
        assert total <= cap or end - begin == 1, (begin, end, total, cap)
    return plan


def test_plans_respect_the_cap_on_random_inputs():
    rng = random.Random(0)
    for _ in range(300):
        cap = rng.randint(1, 1000)
        sizes = [rng.choice([0, rng.randint(1, 300), rng.randint(1, 3000)]) for _ in range(rng.randint(0, 40))]
        _check_plan(sizes, cap)


def test_plan_packs_greedily():
    assert _check_plan([4, 4, 4, 4, 4], 8) == [(0, 2, 8), (2, 4, 8), (4, 5, 4)]


def test_oversized_item_travels_alone():
    assert _check_plan([1, 50, 1], 10) == [(0, 1, 1), (1, 2, 50), (2, 3, 1)]


def test_plan_does_not_overflow_near_int64_max():
    # Regression: a naive `current + next <= cap` overflows int64 here.
    big = 2**62
    assert _check_plan([big, big, big], 2**63 - 1) == [(0, 1, big), (1, 2, big), (2, 3, big)]


@pytest.mark.parametrize(("sizes", "cap", "match"), [([1], 0, "must be positive"), ([1, -2], 8, "item 1 has a negative size")])
def test_plan_rejects_bad_input(sizes, cap, match):
    with pytest.raises(ValueError, match=match):
        _C.plan_transfer_batches(sizes, max_inflight_bytes=cap)


def test_valid_device_parses():
    assert _C.validate_runtime_device("TPU:3", DEVICES) == ("TPU", 3, False)


def test_spmd_virtual_device_is_accepted_only_when_allowed():
    assert _C.validate_runtime_device("SPMD:0", DEVICES) == ("SPMD", 0, True)
    with pytest.raises(ValueError, match="SPMD virtual device, which is not accepted here"):
        _C.validate_runtime_device("SPMD:0", DEVICES, allow_virtual=False)


def test_unknown_device_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown device 'TPU:18': this process has TPU:0, TPU:1, TPU:2, TPU:3"):
        _C.validate_runtime_device("TPU:18", DEVICES)


@pytest.mark.parametrize(
    ("device", "why"),
    [
        ("tpu:0", "upper case"),
        ("xla:0", "upper case"),
        ("TPU", "expected PLATFORM:ORDINAL"),
        ("TPU:", "expected PLATFORM:ORDINAL"),
        ("TPU:-1", "non-negative decimal"),
        ("TPU:1x", "non-negative decimal"),
        ("TPU:99999999999", "out of range"),
    ],
)
def test_malformed_device_says_why_and_lists_valid(device, why):
    with pytest.raises(ValueError) as e:
        _C.validate_runtime_device(device, DEVICES)
    assert why in str(e.value)
    assert "valid devices: TPU:0, TPU:1, TPU:2, TPU:3" in str(e.value)


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "entry"
    target.write_bytes(b"old")
    _C.write_file_atomic(str(target), b"new" * 1000)
    assert target.read_bytes() == b"new" * 1000
    assert os.listdir(tmp_path) == ["entry"]


@pytest.mark.parametrize(
    ("folder_mode", "umask", "mode"),
    [
        (0o700, 0o000, 0o600),
        (0o700, 0o022, 0o600),
        (0o755, 0o000, 0o640),  # never readable by others, whatever the folder
        (0o750, 0o077, 0o640),  # the umask cannot take the group's read bit the folder asks for
        (0o770, 0o002, 0o640),
        (0o740, 0o022, 0o600),  # group may read the folder but not search it
        (0o710, 0o022, 0o600),  # ... or search but not list it
    ],
)
def test_atomic_write_gives_owner_only_or_group_read_modes_whatever_the_umask(tmp_path, folder_mode, umask, mode):
    # An entry is code the jobs run: 0600, or 0640 in a folder shared with its group (trust_shared),
    # never the umask's 0644/0664.
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(folder_mode)
    old = os.umask(umask)
    try:
        _C.write_file_atomic(str(folder / "entry"), b"x")
    finally:
        os.umask(old)
    assert (folder / "entry").stat().st_mode & 0o777 == mode


def test_atomic_write_replaces_a_link_and_never_writes_through_it(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"theirs")
    (tmp_path / "cache").mkdir()
    target = tmp_path / "cache" / "123"
    target.symlink_to(outside)
    _C.write_file_atomic(str(target), b"mine")
    assert not target.is_symlink() and target.read_bytes() == b"mine"
    assert outside.read_bytes() == b"theirs"


def test_temp_file_target_reads_the_writers_names():
    name = f"{_C.TEMP_PREFIX}123.node-7.example.org.4242.0.0123456789abcdef"
    assert _C.temp_file_target(name) == "123"


@pytest.mark.parametrize(
    "name",
    [
        "123",
        f"{_C.TEMP_PREFIX}123.4242.0.0123456789abcdef",  # the old pid.counter names: no host, no random bits
        f"{_C.TEMP_PREFIX}123.host.4242.0.0123456789ABCDEF",  # the writer prints lower-case hex
        f"{_C.TEMP_PREFIX}123.host.4242.0.0123456789abcde",
        f"{_C.TEMP_PREFIX}123.host.pid.0.0123456789abcdef",
        f"{_C.TEMP_PREFIX}123.{'h' * 65}.4242.0.0123456789abcdef",
        f"{_C.TEMP_PREFIX}.host.4242.0.0123456789abcdef",
        ".other-tmp.123.host.4242.0.0123456789abcdef",
    ],
)
def test_temp_file_target_refuses_other_names(name):
    assert _C.temp_file_target(name) is None


def test_atomic_write_failure_names_the_path_and_keeps_the_target(tmp_path):
    missing = tmp_path / "no-such-dir" / "entry"
    with pytest.raises(OSError, match="cannot create .*no-such-dir"):
        _C.write_file_atomic(str(missing), b"x")
