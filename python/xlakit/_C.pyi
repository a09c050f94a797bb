"""Type stubs for xlakit._C, the C++ core shared with the torch_xla patches (csrc/)."""

ENVELOPE_MAGIC: bytes
ENVELOPE_FORMAT_VERSION: int
TEMP_PREFIX: str
AUTH_MAGIC: bytes
CACHE_KEY_ENV: str
MIN_CACHE_KEY_BYTES: int

def cache_key_problem(key: bytes) -> str | None: ...
def cache_key_id(key: bytes) -> str: ...

def encode_entry(
    payload: bytes,
    *,
    kind: str,
    platform_name: str,
    platform_version: str,
    torch_xla_revision: str,
    patch_series_id: str,
    key: bytes | None = None,
    cache_key: str = "",
) -> bytes: ...
def inspect_header(prefix: bytes, total_size: int) -> dict[str, object]: ...
def verify_entry(
    data: bytes,
    *,
    platform_name: str | None = None,
    platform_version: str | None = None,
    patch_series_id: str | None = None,
    torch_xla_revision: str | None = None,
    key: bytes | None = None,
    expected_key: str | None = None,
) -> dict[str, object]: ...
MAX_HEADER_BYTES: int

def verify_entry_file(
    path: str,
    *,
    platform_name: str | None = None,
    platform_version: str | None = None,
    patch_series_id: str | None = None,
    torch_xla_revision: str | None = None,
    key: bytes | None = None,
    chunk_bytes: int = 1 << 20,
    expected_key: str | None = None,
) -> dict[str, object]: ...
def cache_key_material(
    *, platform_name: str, platform_version: str, patch_series_id: str, key_id: str = ""
) -> bytes: ...
def temp_file_target(name: str) -> str | None: ...
def write_file_atomic(path: str, data: bytes) -> None: ...
def plan_transfer_batches(item_bytes: list[int], *, max_inflight_bytes: int) -> list[tuple[int, int, int]]: ...
def validate_runtime_device(
    device: str, known: list[str], *, allow_virtual: bool = True
) -> tuple[str, int, bool]: ...
OWNER_ONLY: str
SHARED_TRUSTED: str
UNTRUSTED: str

def judge_cache_folder(folder: str, *, trust_shared: bool = False, entries: bool = True) -> dict[str, object]: ...

PJRT_PLUGIN_ENV: str
PJRT_CACHE_MAX_ENTRY_BYTES_ENV: str
PJRT_CACHE_MAX_BYTES_ENV: str
PJRT_DEFAULT_MAX_ENTRY_BYTES: int
PJRT_CACHE_DIR_ENV: str
PJRT_CACHE_READ_ONLY_ENV: str
PJRT_MEMORY_ACCOUNTING_ENV: str
CACHE_TRUST_SHARED_ENV: str
