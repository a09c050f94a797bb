"""xlakit._C cache envelope: round trip, golden bytes, every corruption detected."""

from __future__ import annotations

import pytest

from xlakit import _C

IDENTITY = dict(platform_name="tpu", platform_version="libtpu 0.0.36", patch_series_id="xlakit1:abc")


def _entry(payload: bytes = b"compiled-executable-bytes" * 7, **over) -> bytes:
    fields = dict(kind="executable", torch_xla_revision="c04e61c", **IDENTITY)
    fields.update(over)
    return _C.encode_entry(payload, **fields)


def test_round_trip_reports_every_header_field():
    payload = bytes(range(256)) * 3
    info = _C.verify_entry(_entry(payload, kind="hlo_module"), **IDENTITY)
    assert info["ok"] and info["status"] == "ok" and info["message"] == ""
    assert info["kind"] == "hlo_module"
    assert info["platform_name"] == "tpu"
    assert info["platform_version"] == "libtpu 0.0.36"
    assert info["torch_xla_revision"] == "c04e61c"
    assert info["patch_series_id"] == "xlakit1:abc"
    assert info["payload_length"] == len(payload)
    assert info["format_version"] == _C.ENVELOPE_FORMAT_VERSION


def _fnv1a64(data: bytes) -> int:
    h = 14695981039346656037
    for c in data:
        h = ((h ^ c) * 1099511628211) & (2**64 - 1)
    return h


def test_golden_bytes_pin_the_format():
    # Changing these bytes makes every existing cache entry a miss: bump
    # ENVELOPE_FORMAT_VERSION and update this test together.
    got = _C.encode_entry(b"P", kind="executable", platform_name="a", platform_version="b",
                          torch_xla_revision="c", patch_series_id="d")
    assert got.hex() == (
        "584c4b43" "0100" "01" "00"  # magic, format version, kind, reserved
        "010061" "010062" "010063" "010064"  # four length-prefixed strings
        "0100000000000000"  # payload length
        "627f09aa13a52d7b"  # FNV-1a 64 of header-before-checksum + payload
        "50"  # payload
    )
    assert _fnv1a64(got[:-9] + got[-1:]).to_bytes(8, "little") == got[-9:-1]


def test_empty_payload_round_trips():
    assert _C.verify_entry(_entry(b""))["payload_length"] == 0


def test_every_single_bit_flip_is_detected():
    entry = _entry(b"xy" * 40)
    for i in range(len(entry)):
        for bit in (0, 7):
            bad = bytearray(entry)
            bad[i] ^= 1 << bit
            info = _C.verify_entry(bytes(bad))
            assert not info["ok"], f"flip of bit {bit} at byte {i} went unnoticed"


def test_every_truncation_is_detected_as_truncated():
    entry = _entry()
    for n in range(4, len(entry)):
        info = _C.verify_entry(entry[:n])
        assert info["status"] == "truncated", (n, info)
        assert "truncated" in info["message"]


def test_trailing_bytes_are_reported():
    info = _C.verify_entry(_entry() + b"\0")
    assert info["status"] == "trailing_bytes"
    assert "1 bytes after the payload" in info["message"]


def test_foreign_file_is_bad_magic_and_says_what_it_found():
    info = _C.verify_entry(b"\x08\x01HloModuleProto...")
    assert info["status"] == "bad_magic"
    assert "expected magic 'XLKC'" in info["message"]
    assert info["kind"] is None


def test_platform_version_mismatch_is_reported_as_such():
    info = _C.verify_entry(_entry(), **{**IDENTITY, "platform_version": "libtpu 0.0.37"})
    assert info["status"] == "platform_version_mismatch"
    assert "'libtpu 0.0.36'" in info["message"] and "'libtpu 0.0.37'" in info["message"]


@pytest.mark.parametrize(
    ("field", "status"),
    [("platform_name", "platform_mismatch"), ("patch_series_id", "patch_series_mismatch")],
)
def test_other_identity_mismatches(field, status):
    info = _C.verify_entry(_entry(), **{**IDENTITY, field: "other"})
    assert info["status"] == status
    assert "'other'" in info["message"]


def test_partial_identity_is_rejected():
    with pytest.raises(ValueError, match="pass all of"):
        _C.verify_entry(_entry(), platform_name="tpu")
    with pytest.raises(ValueError, match="torch_xla_revision only together"):
        _C.verify_entry(_entry(), torch_xla_revision="c04e61c")


def test_torch_xla_revision_is_checked_when_given():
    # Regression: the revision was written into every entry and never compared.
    info = _C.verify_entry(_entry(), **IDENTITY, torch_xla_revision="d15ea5e")
    assert info["status"] == "torch_xla_revision_mismatch"
    assert "'c04e61c'" in info["message"] and "'d15ea5e'" in info["message"]
    assert _C.verify_entry(_entry(), **IDENTITY, torch_xla_revision="c04e61c")["ok"]
    assert _C.verify_entry(_entry(), **IDENTITY)["ok"]  # not given: not compared


def test_unknown_kind_is_rejected_when_encoding():
    with pytest.raises(ValueError, match="kind must be"):
        _entry(kind="plan")


def test_header_inspection_needs_no_payload():
    entry = _entry(b"z" * 10_000)
    info = _C.inspect_header(entry[:200], len(entry))
    assert info["ok"] and info["payload_length"] == 10_000
    assert _C.inspect_header(entry[:200], len(entry) - 1)["status"] == "truncated"


def test_cache_key_material_separates_fields():
    a = _C.cache_key_material(platform_name="tpu", platform_version="ab", patch_series_id="c")
    b = _C.cache_key_material(platform_name="tpu", platform_version="a", patch_series_id="bc")
    assert a != b
