"""The pinned `pjrt_c_api.h` the PJRT wrapping plugin compiles against, fetched once.

VERSIONS.toml `[pjrt_wrap.header]` names a wheel on PyPI, the header's path
inside it and the header's sha256. Only the header is fetched: the wheel's
zip directory and then the one member, by HTTP range requests (about 2 MB of a
260 MB wheel), so `pip install .` and `make setup` stay fast. The header lands
in a cache outside the clone (`$XDG_CACHE_HOME/xlakit/pjrt`, ~/.cache by
default) and is used only if its sha256 is the pinned one. Offline hosts set
`XLAKIT_PJRT_HEADER` to a copy of that file (checked the same way).

Standard library only: setup.py imports this module while building the wheel.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import tomllib
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

HEADER_ENV = "XLAKIT_PJRT_HEADER"
INCLUDE_PATH = Path("xla") / "pjrt" / "c" / "pjrt_c_api.h"  # as the wrapper's sources include it
_TIMEOUT_S = 60
_ATTEMPTS = 3


class HeaderError(RuntimeError):
    """The header cannot be had; the message says what was tried and how to fix it."""


@dataclass(frozen=True)
class HeaderPin:
    package: str
    version: str
    url: str
    member: str
    sha256: str
    api_version: str


def pin(pins_file: Path) -> HeaderPin:
    raw = tomllib.loads(pins_file.read_text())["pjrt_wrap"]["header"]
    return HeaderPin(**{k: str(raw[k]) for k in HeaderPin.__dataclass_fields__})


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xlakit" / "pjrt"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _get(url: str, first: int, last: int) -> bytes:
    error: Exception | None = None
    for _ in range(_ATTEMPTS):
        request = urllib.request.Request(url, headers={"Range": f"bytes={first}-{last}"})
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
                if response.status != 206:
                    raise HeaderError(f"{url} does not serve byte ranges (HTTP {response.status})")
                return response.read()
        except HeaderError:
            raise
        except OSError as e:  # URLError, timeouts, resets: try again
            error = e
    raise HeaderError(f"cannot read {url}: {error}")


def _size(url: str) -> int:
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
        return int(response.headers["Content-Length"])


def _member(url: str, name: str) -> bytes:
    """One member of the remote zip at `url`, through its central directory."""
    size = _size(url)
    tail = _get(url, max(0, size - (1 << 16) - 22), size - 1)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0:
        raise HeaderError(f"{url}: no zip end record")
    cd_size, cd_offset = struct.unpack("<II", tail[end + 12:end + 20])
    if cd_offset == 0xFFFFFFFF:  # zip64
        z = tail.rfind(b"PK\x06\x06")
        cd_size, cd_offset = struct.unpack("<QQ", tail[z + 40:z + 56])
    directory = _get(url, cd_offset, cd_offset + cd_size - 1)
    pos = 0
    while directory[pos:pos + 4] == b"PK\x01\x02":
        method, = struct.unpack("<H", directory[pos + 10:pos + 12])
        packed, = struct.unpack("<I", directory[pos + 20:pos + 24])
        name_len, extra_len, comment_len = struct.unpack("<HHH", directory[pos + 28:pos + 34])
        offset, = struct.unpack("<I", directory[pos + 42:pos + 46])
        if directory[pos + 46:pos + 46 + name_len].decode() == name:
            local = _get(url, offset, offset + 29)
            skip = 30 + sum(struct.unpack("<HH", local[26:30]))
            data = _get(url, offset + skip, offset + skip + packed - 1)
            if method == 8:
                return zlib.decompress(data, -15)
            if method == 0:
                return data
            raise HeaderError(f"{url}: {name} uses zip method {method}")
        pos += 46 + name_len + extra_len + comment_len
    raise HeaderError(f"{url} has no member {name}")


def _install(data: bytes, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)


def include_dir(pins_file: Path, *, log=lambda message: print(message, file=sys.stderr)) -> Path:
    """A folder holding `xla/pjrt/c/pjrt_c_api.h` with the pinned sha256, fetching it if needed."""
    p = pin(pins_file)
    root = cache_root() / p.sha256[:16]
    dest = root / INCLUDE_PATH
    if dest.is_file() and _sha256(dest.read_bytes()) == p.sha256:
        return root
    given = os.environ.get(HEADER_ENV)
    if given:
        data = Path(given).read_bytes()
        if _sha256(data) != p.sha256:
            raise HeaderError(f"{HEADER_ENV}={given}: expected sha256 {p.sha256} (VERSIONS.toml [pjrt_wrap.header], "
                              f"PJRT C API {p.api_version}), found {_sha256(data)}")
    else:
        log(f"xlakit: fetching pjrt_c_api.h (PJRT C API {p.api_version}) from {p.package} {p.version} "
            f"into {root}")
        try:
            data = _member(p.url, p.member)
        except (HeaderError, OSError) as e:
            raise HeaderError(f"cannot fetch the pinned pjrt_c_api.h ({e}); on a host without PyPI, copy "
                              f"{p.member} out of {p.package}=={p.version} and set {HEADER_ENV} to it") from e
        if _sha256(data) != p.sha256:
            raise HeaderError(f"{p.url}!{p.member}: expected sha256 {p.sha256}, found {_sha256(data)}; re-pin "
                              f"VERSIONS.toml [pjrt_wrap.header]")
    _install(data, dest)
    return root
