"""xlakit._C cache envelope: round trip, golden bytes, every corruption detected."""

from __future__ import annotations

import hmac
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from xlakit import _C, _knobs
from xlakit.runtime import compile_cache
from tests.support import REPO

IDENTITY = dict(platform_name="tpu", platform_version="libtpu 0.0.36", patch_series_id="xlakit1:abc")


def _entry(payload: bytes = b"compiled-executable-bytes" * 7, **over) -> bytes:
    """A plain entry, or an authenticated one given `key=`."""
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
                          torch_xla_revision="c", patch_series_id="d", cache_key="e")
    assert got[:-9].hex() == (
        "584c4b43" "0200" "01" "00"  # magic, format version, kind, reserved
        "010061" "010062" "010063" "010064" "010065"  # five length-prefixed strings, the cache key last
        "0100000000000000"  # payload length
    )
    assert got[-1:] == b"P"  # payload, after the FNV-1a 64 of header-before-checksum + payload
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


KEY = b"k" * 32
OTHER_KEY = b"o" * 32


def _variants() -> dict[str, bytes]:
    out = {}
    for key in (None, KEY):
        entry = _entry(b"payload-" * 50, key=key)
        flipped = bytearray(entry)
        flipped[-3] ^= 0x10
        prefix = "keyed_" if key else ""
        out.update({f"{prefix}good": entry, f"{prefix}flipped": bytes(flipped), f"{prefix}truncated": entry[:-7],
                    f"{prefix}trailing": entry + b"\0", f"{prefix}header_only": entry[:20],
                    f"{prefix}empty_payload": _entry(b"", key=key)})
    out["keyed_tag_only"] = out["keyed_good"][:40]
    out["keyed_future_format"] = out["keyed_good"][:4] + b"\x02\x00" + out["keyed_good"][6:]
    out["keyed_torn_inner_header"] = out["keyed_good"][:60]
    return out


@pytest.mark.parametrize("chunk_bytes", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize("key", [None, KEY, OTHER_KEY])
@pytest.mark.parametrize("identity", [None, IDENTITY, {**IDENTITY, "platform_version": "libtpu 0.0.37"}])
def test_file_verification_in_pieces_matches_verification_in_memory(tmp_path, chunk_bytes, key, identity):
    for name, data in _variants().items():
        path = tmp_path / name
        path.write_bytes(data)
        streamed = _C.verify_entry_file(str(path), chunk_bytes=chunk_bytes, key=key, **(identity or {}))
        assert streamed == _C.verify_entry(data, key=key, **(identity or {})), (name, chunk_bytes)


def test_file_verification_reads_no_link_and_names_what_it_cannot_open(tmp_path):
    (tmp_path / "real").write_bytes(_entry())
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError, match=r"cannot open .*link"):
        _C.verify_entry_file(str(tmp_path / "link"))
    with pytest.raises(OSError, match=r"cannot open .*missing: No such file"):
        _C.verify_entry_file(str(tmp_path / "missing"))


def test_a_header_longer_than_any_fixed_prefix_is_read_whole(tmp_path):
    entry = _entry(b"p", platform_version="v" * 0xFFFF, patch_series_id="s" * 0xFFFF)
    assert len(entry) - 1 > 2 * 0xFFFF and len(entry) - 1 <= _C.MAX_HEADER_BYTES
    (tmp_path / "e").write_bytes(entry)
    info = _C.verify_entry_file(str(tmp_path / "e"), chunk_bytes=3)
    assert info["ok"] and len(info["platform_version"]) == 0xFFFF
    assert _C.inspect_header(entry[:_C.MAX_HEADER_BYTES], len(entry))["ok"]


def _recompute_checksum(plain: bytes, payload_length: int) -> bytes:
    """What a tamperer does after changing a plain entry: recompute its FNV checksum (no key needed)."""
    offset = len(plain) - payload_length
    checksum = _fnv1a64(plain[:offset - 8] + plain[offset:])
    return plain[:offset - 8] + checksum.to_bytes(8, "little") + plain[offset:]


def _tampered(entry: bytes, payload_length: int) -> bytes:
    plain = bytearray(entry[38:])
    plain[-1] ^= 0x01  # one instruction of the executable changed
    return entry[:38] + _recompute_checksum(bytes(plain), payload_length)


def test_golden_authenticated_layout_is_a_tag_over_the_plain_entry():
    # Changing this layout makes every authenticated entry a miss: bump the auth format version with it.
    payload = b"P"
    keyed = _entry(payload, key=KEY)
    plain = _entry(payload)
    assert keyed[:6].hex() == "584c4b41" "0100"  # magic "XLKA", auth format version
    assert keyed[6:38] == hmac.new(KEY, plain, "sha256").digest()
    assert keyed[38:] == plain
    info = _C.verify_entry(keyed, key=KEY, **IDENTITY)
    assert info["ok"] and info["authenticated"] and info["tag_checked"] and info["payload_length"] == 1


def test_a_tampered_entry_with_a_recomputed_checksum_is_refused_with_the_key():
    payload = b"exe" * 100
    bad = _tampered(_entry(payload, key=KEY), len(payload))
    assert _C.verify_entry(bad)["ok"]  # the checksum alone is satisfied: that is the attack
    info = _C.verify_entry(bad, key=KEY, **IDENTITY)
    assert info["status"] == "bad_tag" and not info["ok"] and info["tag_checked"]
    assert "does not verify under this job's XLAKIT_CACHE_KEY" in info["message"]


def test_with_a_key_plain_and_foreign_entries_are_not_loadable():
    assert _C.verify_entry(_entry(), key=KEY)["status"] == "unauthenticated"
    assert _C.verify_entry(_entry(key=OTHER_KEY), key=KEY)["status"] == "bad_tag"
    assert _C.verify_entry(b"\x08\x01stock", key=KEY)["status"] == "bad_magic"
    assert not _C.verify_entry(_entry(key=KEY))["tag_checked"]  # without a key: integrity only


def test_every_single_bit_flip_of_an_authenticated_entry_is_detected_with_the_key():
    entry = _entry(b"xy" * 20, key=KEY)
    for i in range(len(entry)):
        bad = bytearray(entry)
        bad[i] ^= 0x04
        assert not _C.verify_entry(bytes(bad), key=KEY)["ok"], f"flip at byte {i} went unnoticed"


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="key must not be empty"):
        _C.verify_entry(_entry(), key=b"")


@pytest.fixture(scope="module")
def openssl_check(tmp_path_factory) -> Path:
    """tests/cpp/entry_mac_check.cc: the runtime's calls over core/entry_mac_openssl.h and the system OpenSSL."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None or not Path("/usr/include/openssl/hmac.h").exists():
        pytest.skip("needs a C++ compiler and OpenSSL headers (Debian: libssl-dev)")
    root = REPO
    out = tmp_path_factory.mktemp("cpp") / "entry_mac_check"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", f"-I{root / 'csrc'}",
                    str(root / "tests/cpp/entry_mac_check.cc"),
                    *sorted(str(p) for p in (root / "csrc/core").glob("envelope*.cc")), "-lcrypto",
                    "-o", str(out)], check=True, timeout=300)
    return out


def _check(binary: Path, *args: str, key: bytes | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLAKIT_CACHE_KEY"}
    if key is not None:
        env["XLAKIT_CACHE_KEY"] = key.decode()
    return subprocess.run([str(binary), *args], env=env, capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


@pytest.mark.slow
def test_the_runtimes_openssl_check_refuses_what_the_tools_refuse(openssl_check, tmp_path):
    payload = b"exe" * 100
    cases = {"good": _entry(payload, key=KEY), "tampered": _tampered(_entry(payload, key=KEY), len(payload)),
             "plain": _entry(payload), "other_key": _entry(payload, key=OTHER_KEY)}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    verdicts = {name: _check(openssl_check, "verify", str(tmp_path / name), key=KEY) for name in cases}
    assert verdicts == {"good": "ok 11 " + payload.decode(), "tampered": "bad_tag 11", "plain": "unauthenticated 00",
                        "other_key": "bad_tag 11"}
    assert _check(openssl_check, "verify", str(tmp_path / "tampered"), key=None) == "ok 10 " + "exe" * 99 + "exd"


@pytest.mark.slow
def test_entries_the_runtime_writes_verify_in_the_tools(openssl_check, tmp_path):
    _check(openssl_check, "encode", str(tmp_path / "e"), "compiled", key=KEY)
    data = (tmp_path / "e").read_bytes()
    assert _C.verify_entry(data, key=KEY)["ok"] and _C.verify_entry(data, key=OTHER_KEY)["status"] == "bad_tag"
    assert data[38:] == _C.encode_entry(b"compiled", kind="executable", platform_name="cpu", platform_version="",
                                        torch_xla_revision="", patch_series_id="")


@pytest.mark.slow
def test_the_runtime_refuses_a_key_python_refuses(openssl_check, tmp_path):
    # Regression: Python refused an XLAKIT_CACHE_KEY shorter than 32 bytes, the runtime's C++ took any
    # non-empty one and tagged entries under it.
    short, minimum = b"k" * 31, b"k" * 32
    (tmp_path / "plain").write_bytes(_entry(b"exe"))
    (tmp_path / "tagged").write_bytes(_entry(b"exe", key=KEY))
    for name in ("plain", "tagged"):  # nothing loads under it, and nothing is called bad (erased) for it
        assert _check(openssl_check, "verify", str(tmp_path / name), key=short) == "key_refused 00"
    with pytest.raises(subprocess.CalledProcessError):  # and nothing is written under it
        _check(openssl_check, "encode", str(tmp_path / "e"), "compiled", key=short)
    assert _check(openssl_check, "verify", str(tmp_path / "plain"), key=minimum) == "unauthenticated 00"
    with pytest.raises(ValueError, match="holds 31 bytes, expected a secret of at least 32"):
        with _knobs.override(XLAKIT_CACHE_KEY=short.decode()):
            _knobs.get_cache_key()


def test_the_key_variable_and_its_rule_live_in_the_core():
    # Regression: _knobs and _C each spelled the variable's name, and the minimum length lived in Python.
    assert _knobs.CACHE_KEY is _C.CACHE_KEY_ENV and _knobs.MIN_CACHE_KEY_BYTES == _C.MIN_CACHE_KEY_BYTES == 32
    assert _C.cache_key_problem(b"x" * 31) and _C.cache_key_problem(b"x" * 32) is None
    assert _C.cache_key_problem(b"") is None  # an empty key is no key
    key = b"s" * 40
    assert compile_cache.key_id(key) == hmac.new(key, b"xlakit-cache-key-id", "sha256").hexdigest()[:16]
    plain = _C.cache_key_material(platform_name="tpu", platform_version="v", patch_series_id="s")
    keyed = _C.cache_key_material(platform_name="tpu", platform_version="v", patch_series_id="s",
                                  key_id=compile_cache.key_id(key))
    assert keyed != plain and plain == _C.cache_key_material(platform_name="tpu", platform_version="v",
                                                              patch_series_id="s", key_id="")


def test_headers_of_authenticated_entries_are_read_without_the_key():
    entry = _entry(b"z" * 1000, key=KEY)
    info = _C.inspect_header(entry[:300], len(entry))
    assert info["ok"] and info["authenticated"] and not info["tag_checked"] and info["payload_length"] == 1000
    assert _C.inspect_header(entry[:300], len(entry) + 1)["status"] == "trailing_bytes"
    assert _C.inspect_header(entry[:20], 20)["status"] == "truncated"
