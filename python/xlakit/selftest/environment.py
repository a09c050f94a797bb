"""What the self-test reads of its environment, and the environment its child processes get.

The report lists the variables that shape a run (the runtime's, the PJRT
wrapper's, xlakit's, the launcher's), so that a pasted report says how the job
was set up. It never holds a secret: a variable whose name says it holds one
(`XLAKIT_CACHE_KEY`, `*_TOKEN`, `*SECRET*`, ...) is shown as set, with its
length (and for the cache key its id, an HMAC of a constant that reveals
nothing of the key), never its value, and `scrub` removes those values from
anything else the report carries (a child's error line, a path). In any URL,
the user:password and the query's values (a token, a signature) are hidden.

The children compile into the self-test's own temporary cache folder, so the
job's own cache settings (its folder, read-only flag, size bounds) are set
aside for them and named in the report.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

from xlakit import _C, _knobs

# torch.distributed's launcher (torchrun) sets these for every rank.
RANK, WORLD_SIZE, LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
_PREFIXES = ("XLAKIT_", "XLA_", "PJRT_", "TPU_", "LIBTPU_", "TORCH_TPU_", "JAX_", "CUDA_", "NCCL_")
_NAMES = (_knobs.TORCH_DEVICE_BACKEND_AUTOLOAD, RANK, WORLD_SIZE, LOCAL_RANK, "LOCAL_WORLD_SIZE", "GROUP_RANK",
          MASTER_ADDR, MASTER_PORT, "TORCHELASTIC_RUN_ID", "CLOUD_TPU_TASK_ID", "TMPDIR")
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|AUTH|SIGNATURE|COOKIE")
# A URL's user:password (up to the last "@" before its query; a password may hold a "/") and the
# values of its query (an access token, a signed URL's signature) are hidden wherever a URL appears.
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>]+")
_URL_USER = re.compile(r"^([^:]+://)[^@?#]*@")
_QUERY_VALUE = re.compile(r"([?&][^=&#]+=)[^&#]*")
# The job's own cache settings, set aside for the children (they use the self-test's temporary folder).
_CACHE_PREFIXES = ("XLAKIT_PJRT_CACHE_", "XLA_PERSISTENT_CACHE_")
_CACHE_NAMES = (_knobs.TORCH_TPU_TIER3_CACHE_ROOT, _knobs.CACHE_TIER_URL)
NOT_SHOWN = "<not shown>"


def matters(name: str) -> bool:
    return name.startswith(_PREFIXES) or name in _NAMES


def _is_secret(name: str) -> bool:
    return bool(_SECRET_NAME.search(name.upper()))


def shown(name: str, value: str) -> str:
    """The value as the report shows it: a secret as its length (the cache key with its id)."""
    if not _is_secret(name):
        return _hide_in_urls(value)
    if name == _knobs.CACHE_KEY and len(value.encode()) >= _knobs.MIN_CACHE_KEY_BYTES:
        return f"<set: {len(value.encode())} bytes, id {_C.cache_key_id(value.encode())}; value {NOT_SHOWN}>"
    return f"<set: {len(value.encode())} bytes; value {NOT_SHOWN}>"


def variables(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that shape this run, sorted, secrets shown as set."""
    environ = os.environ if environ is None else environ
    return {k: shown(k, environ[k]) for k in sorted(environ) if matters(k)}


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """The values `scrub` removes: every secret-named variable's (however it is named), longest first."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if _is_secret(k) and len(v) >= 4}
    return sorted(found, key=len, reverse=True)


def scrub(obj: Any, secrets: list[str]) -> Any:
    """`obj` (JSON-like) with every secret value replaced, wherever it appears in a string."""
    if isinstance(obj, str):
        for s in secrets:
            obj = obj.replace(s, NOT_SHOWN)
        return _hide_in_urls(obj)
    if isinstance(obj, dict):
        return {scrub(k, secrets): scrub(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, secrets) for v in obj]
    return obj


def _hide_in_urls(text: str) -> str:
    def hidden(url: re.Match) -> str:
        url = _URL_USER.sub(lambda m: m.group(1) + NOT_SHOWN + "@", url.group(0))
        return _QUERY_VALUE.sub(lambda m: m.group(1) + NOT_SHOWN, url)

    return _URL.sub(hidden, text)


def _is_cache_setting(name: str) -> bool:
    return name.startswith(_CACHE_PREFIXES) or name in _CACHE_NAMES


def cache_settings_set_aside(environ: dict[str, str] | None = None) -> list[str]:
    environ = os.environ if environ is None else environ
    return sorted(k for k in environ if _is_cache_setting(k))


def set_aside_here() -> None:
    """Set the job's cache settings aside in this process (a child, once its manifest is taken)."""
    for name in cache_settings_set_aside():
        del os.environ[name]


def child_env(*, set_aside: bool = True) -> dict[str, str]:
    """This environment for a child: this very xlakit first on the path; the job's cache settings set aside
    unless `set_aside` is False (the stack child, whose manifest is the job's)."""
    env = {k: v for k, v in os.environ.items() if not (set_aside and _is_cache_setting(k))}
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this xlakit package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def job() -> dict[str, Any]:
    """Where this process stands in a launched job (torchrun or a pod launcher): rank, world, host."""
    def whole(name: str, default: int) -> int:
        raw = os.environ.get(name, "")
        return int(raw) if raw.strip().isdigit() else default

    return {"rank": whole(RANK, 0), "world": whole(WORLD_SIZE, 1), "local_rank": whole(LOCAL_RANK, 0),
            "host": socket.gethostname(), "pid": os.getpid()}
