"""Who can put an entry into a persistent cache folder, judged before any entry is trusted.

A cache entry is code the job runs (machine code on the CPU client, a
program on a TPU). Whoever can write the cache folder, or replace it by
writing any folder above it, can make every later job run theirs; the
envelope's checksum proves an entry intact, not who wrote it. The rule is
ssh's StrictModes, applied from the cache folder up to `/`: every folder is
owned by root or by the user, and no other user can write it. A folder above
the cache may be writable by others only when it is sticky (`/tmp`): nobody
else can then rename or remove what the user owns in it. The cache folder
itself never may: a sticky bit stops removals, not new entries. Each entry
is judged too: an entry another user owns, or others can write, can be
rewritten in place with their code, whoever owns the folder (a file writable
by the owner's private group, as a stock runtime writes under umask 002,
counts as the owner's). The PJRT wrapper judges each entry as it reads it, on
the descriptor it reads (links never followed): for its folders
`entries=False` judges the folders only, so a start costs no stat per entry
and one bad file is one refused entry. Where torch_xla or TorchTPU read the
entries themselves, and for the cache tools, every file is judged here (a link
by what it leads to).

`trust_shared` is for teams that share a cache on purpose: a folder writable
by a group the user belongs to, or owned by a member of it, is accepted (and
the caller logs it). Writable by every user stays refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from xlakit import _C
from xlakit.errors import CacheFolderTrustError, CompileCacheError

OWNER_ONLY, SHARED_TRUSTED, UNTRUSTED = _C.OWNER_ONLY, _C.SHARED_TRUSTED, _C.UNTRUSTED


@dataclass(frozen=True)
class FolderTrust:
    """The verdict on a cache folder: `state` is owner-only, shared-trusted or untrusted."""

    folder: Path
    state: str
    problem: str | None = None  # names the folder at fault, its owner and mode
    fix: str | None = None
    shared: tuple[str, ...] = ()  # what only trust_shared made acceptable
    not_a_folder: bool = False  # the path is, or lies below, a device or a file: `problem` says which

    @property
    def trusted(self) -> bool:
        return self.state != UNTRUSTED

    def describe(self) -> str:
        if self.state == UNTRUSTED:
            return f"untrusted: {self.problem}; fix: {self.fix}"
        if self.state == SHARED_TRUSTED:
            return f"shared-trusted ({'; '.join(self.shared)})"
        return "owner-only (nobody but you and root can put an entry into it)"


def judge(folder: str | os.PathLike, *, trust_shared: bool = False, entries: bool = True) -> FolderTrust:
    """Whether entries in `folder` can only come from the user (and root), and if not, the fix.

    `folder` need not exist: the folders xlakit would create are owner-only,
    so the nearest existing one is judged as a folder above the cache. Links
    on the way are resolved first. The rule is C++ (csrc/core/folder_trust.h),
    shared with the PJRT wrapping plugin, which judges its folder in jobs that
    run no xlakit Python. `entries=False`: the files in the folder are left to the PJRT wrapper,
    which judges each as it reads it.
    """
    found = _C.judge_cache_folder(str(Path(folder).resolve()), trust_shared=trust_shared, entries=entries)
    return FolderTrust(Path(found["folder"]), found["state"], found["problem"], found["fix"], tuple(found["shared"]),
                       bool(found.get("not_a_folder")))


def require(folder: str | os.PathLike, *, trust_shared: bool = False, entries: bool = True) -> FolderTrust:
    """`judge(folder)`, raising where a cache there would be refused (by Python and the wrapper alike).

    Raises:
        CompileCacheError: `folder` is, or lies below, something other than a folder (said as such,
            with no chmod advised on it).
        CacheFolderTrustError: another user can write the folder or one above it.
    """
    verdict = judge(folder, trust_shared=trust_shared, entries=entries)
    if verdict.not_a_folder:
        raise CompileCacheError(f"expected a cache folder, but {verdict.problem}; fix: {verdict.fix}")
    if not verdict.trusted:
        raise CacheFolderTrustError(f"expected a cache folder only you (and root) can write, since its entries are "
                                    f"code your jobs run; found {verdict.problem}; fix: {verdict.fix}")
    return verdict


# `scheme://...`: a URL, which a path never is here (a local folder named `gs:` is no cache tier).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def refuse_shared_tier_url(path: str) -> None:
    """Refuse a URL where a local cache folder is expected (the wrapper's folder, `compile_cache`'s path).

    The one place a URL is told apart from a path. A `gs://` or `s3://` URL is
    the shared tier, which `xlakit.enable_persistent_cache` and `xlakit pjrt
    env` take (`xlakit.cache_tier`: they keep a local folder for the wrapper).

    Raises:
        CompileCacheError: `path` is a URL (`gs://...`, `s3://...`, any `scheme://`).
    """
    if _URL.match(path):
        raise CompileCacheError(
            f"expected a local cache folder, found the URL {path!r}, which is never taken for a local path: the "
            "wrapper caches in a local folder, and a gs:// or s3:// URL is the shared tier, given to "
            "xlakit.enable_persistent_cache(URL) or `xlakit pjrt env URL` (they keep a local folder for the "
            "wrapper and mirror the bucket into it); other schemes are not supported")


def local_folder(path: str | os.PathLike) -> Path:
    """The absolute cache folder a user's `path` names, by the one rule every route applies: `~` is the
    home folder, a relative path is under the working directory, links are resolved.

    Raises:
        CompileCacheError: `path` is empty (a job whose variable is unset would cache wherever it
            started) or a URL (`refuse_shared_tier_url`).
    """
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise CompileCacheError(
            f"expected a cache folder, found an empty path {text!r} (an unset variable?): it would cache in "
            "the working directory, wherever the job started; pass the folder, e.g. ~/xla-cache")
    refuse_shared_tier_url(text)
    return Path(text).expanduser().resolve()
