"""The cache key's canonical program bytes, as the built PJRT wrapper makes them (tests only).

Calls `xlakit_pjrt_wrap_canonical_program`, which the wrapper exports for exactly this
(csrc/pjrt_wrap/plugin.cc): loading the library starts nothing until a framework calls its GetPjrtApi.
"""

from __future__ import annotations

import ctypes
import functools

from xlakit.runtime import pjrt_wrap


@functools.lru_cache(maxsize=None)
def _function():
    fn = ctypes.CDLL(str(pjrt_wrap.library_path())).xlakit_pjrt_wrap_canonical_program
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p,
                   ctypes.c_size_t]
    return fn


def canonical_program(program_format: str, code: bytes) -> bytes:
    """What the key hashes for `code` (a program of `program_format`, "mlir" or "hlo")."""
    fn = _function()
    fmt = program_format.encode()
    capacity = 2 * len(code) + 4096
    while True:
        buf = ctypes.create_string_buffer(capacity)
        size = fn(fmt, len(fmt), code, len(code), buf, capacity)
        assert size != ctypes.c_size_t(-1).value, "the wrapper could not canonicalise (out of memory)"
        if size <= capacity:
            return buf.raw[:size]
        capacity = size
