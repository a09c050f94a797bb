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


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_write_gives_the_umask_mode(tmp_path, umask, mode):
    # Regression: entries were created 0644 whatever the umask, so a
    # group-shared cache folder (umask 002) got entries its group cannot replace.
    old = os.umask(umask)
    try:
        _C.write_file_atomic(str(tmp_path / "entry"), b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "entry").stat().st_mode & 0o777 == mode


def test_atomic_write_failure_names_the_path_and_keeps_the_target(tmp_path):
    missing = tmp_path / "no-such-dir" / "entry"
    with pytest.raises(OSError, match="cannot create .*no-such-dir"):
        _C.write_file_atomic(str(missing), b"x")
