"""The compile cache's shared tier on object storage: what warm-starts a pod whose VMs were recreated.

`xlakit.enable_persistent_cache("gs://bucket/prefix")` (or `s3://`), or for a
job that runs no xlakit code `eval "$(xlakit pjrt env gs://bucket/prefix)"`:

* a local folder stays the working cache (`local=`, by default
  `~/.cache/xlakit/compile-cache/<bucket>-<hash of the URL>`): the PJRT
  wrapper reads and writes only it, at disk speed, with its own checks;
* the bucket is the durable tier. Before the runtime starts, every entry the
  bucket holds and the folder lacks is pulled into it (`tier.SharedTier.pull`,
  bounded by `XLAKIT_CACHE_TIER_PULL_TIMEOUT_S`), so a VM with an empty disk
  hits every program that earlier processes of the job published; what the job
  compiles is published (`publisher`) within an interval and at a clean exit.

A bucket is untrusted storage and an entry is code, so the shared tier needs
the job's `XLAKIT_CACHE_KEY` (the same secret on every host): every object is
verified under it on the way in (a tampered, swapped or foreign object is a
refused miss) and the wrapper verifies it again on load.

The mechanism is Python around the runtime, not the wrapper: the wrapper
stays free of network code, credentials and retries (it runs inside the
runtime's process, beside libtpu), while fsspec's gcsfs/s3fs clients, with
the bounded, cancellable requests of `checkpoint/objstore`, are already the
tested object-storage path, with the standard credentials. A job that cannot
change its code gets the same from `xlakit pjrt env`, which pulls before it
prints the exports and starts a publisher process beside the job.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from xlakit import _knobs
from xlakit.errors import CompileCacheError
from xlakit.checkpoint import objstore
from xlakit.runtime import compile_cache, torchtpu

log = logging.getLogger("xlakit.compile_cache")
_active: dict[str, object] = {}  # this process's tier and publisher, for status()
is_url = objstore.is_url  # the shared tier's URLs are object storage's: gs://, gcs://, s3://


def default_local(url: str) -> Path:
    """The local folder a shared tier at `url` works in when none is given: one per URL, under the user's
    cache folder (`$XDG_CACHE_HOME`, else `~/.cache`)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    return base / "xlakit" / "compile-cache" / f"{bucket}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def check_url(url: str) -> None:
    """Refuse a URL that names no bucket and prefix, before anything is changed.

    Raises:
        CompileCacheError: no bucket, no prefix, or an empty or `..` part.
    """
    from xlakit.checkpoint.objstore.client import Location

    try:
        Location.parse(url)
    except ValueError:
        raise CompileCacheError(f"expected a shared tier as gs://BUCKET/PREFIX or s3://BUCKET/PREFIX, found {url!r}: "
                                "name a bucket and a folder in it (e.g. gs://my-bucket/xla-cache)") from None


def require_key(url: str) -> bytes:
    """The job's cache key, which a shared tier needs: a bucket is untrusted storage.

    Raises:
        CompileCacheError: `XLAKIT_CACHE_KEY` is unset or too short to be a secret.
    """
    try:
        secret = _knobs.get_cache_key()
    except ValueError as e:
        raise CompileCacheError(str(e)) from None
    if secret is None:
        raise CompileCacheError(
            f"expected {_knobs.CACHE_KEY} for the shared tier {url}, found it unset: a cache entry is code the "
            "job runs and a bucket is untrusted storage, so entries shared through it must carry a tag under "
            f"the job's secret; export {_knobs.CACHE_KEY} (at least 32 random bytes, the same on every host, "
            "e.g. from your secret manager), or pass a local folder")
    return secret


def open_tier(url: str, folder: Path, *, readonly: bool, max_bytes: int | None = None):
    """The shared tier at `url` mirrored by the wrapper's `folder`, its key checked; nothing requested yet.

    Raises:
        CompileCacheError: no `XLAKIT_CACHE_KEY`, or `url` names no bucket and prefix.
    """
    from xlakit.cache_tier.tier import SharedTier

    check_url(url)
    return SharedTier(url, folder, key=require_key(url), readonly=readonly, max_bytes=max_bytes)


def say_pulled(tier, report) -> None:
    """One log line for a pull: how much the shared tier gave this start, and what it refused."""
    if report.error and not report.moved:
        return  # said once already, by the tier
    log.info("compile cache shared tier %s: pulled %d entries (%d bytes downloaded, %d of entries) in %.1f s into "
             "%s; %d were here already%s%s", tier.url, report.moved, report.bytes_moved, report.entry_bytes,
             report.seconds, tier.folder, report.already,
             f"; {len(report.refused)} refused" if report.refused else "",
             f"; {report.skipped} left for later (bound reached)" if report.skipped else "")


def enable_persistent_cache(path: str | os.PathLike, *, readonly: bool | None = None,
                            trust_shared: bool | None = None, max_bytes: int | None = None,
                            local: str | os.PathLike | None = None) -> Path:
    """`compile_cache.enable_persistent_cache`, plus a shared tier when `path` is a `gs://` or `s3://` URL.

    With a URL, `local` is the working folder (default `default_local(url)`);
    the bucket's entries are pulled into it before this returns (bounded),
    and unless `readonly` what the job compiles is published on a thread and
    at a clean exit. Needs `XLAKIT_CACHE_KEY`; serves stock torch_xla through
    the PJRT wrapper (a TPU, or a plugin in torch_xla's registry).

    Raises:
        CompileCacheError: as `compile_cache.enable_persistent_cache`; with a
            URL also no key, a runtime the wrapper does not serve, or `local`
            given with a local path.
        ConfigurationError: with a URL, a shared-tier variable holds a value it
            cannot use (named, before anything is changed).
    """
    if not is_url(path):
        if local is not None:
            raise CompileCacheError(f"local= names the working folder of a shared tier; {path!r} is a local folder "
                                    "already: pass it alone, or pass a gs:// or s3:// URL with local=")
        return compile_cache.enable_persistent_cache(path, readonly=readonly, trust_shared=trust_shared,
                                                     max_bytes=max_bytes)
    url = os.fsdecode(path)
    check_url(url)
    if torchtpu.in_use():
        raise CompileCacheError(f"the shared tier ({url}) serves xlakit's PJRT wrapper under stock torch_xla; on "
                                "TorchTPU pass a local folder (its own tier-3 cache)")
    require_key(url)
    from xlakit.cache_tier.tier import settings

    settings()  # every knob checked before anything is changed
    if not compile_cache.through_wrapper():
        raise CompileCacheError(
            f"the shared tier ({url}) serves xlakit's PJRT wrapper, which this process does not go through "
            f"({_knobs.PJRT_DEVICE}={os.environ.get(_knobs.PJRT_DEVICE)!r}: the patched runtime and torch_xla's "
            "built-in CPU client cache without it); pass a local folder, or run on a TPU (PJRT_DEVICE=TPU)")
    readonly = readonly if readonly is not None else compile_cache._default_readonly()
    where = compile_cache.enable_persistent_cache(default_local(url) if local is None else local, readonly=readonly,
                                                  trust_shared=trust_shared, max_bytes=max_bytes)
    tier = open_tier(url, where, readonly=readonly, max_bytes=max_bytes)
    say_pulled(tier, tier.pull())
    if "publisher" in _active:  # enabled again: the earlier publisher's folder is published a last time
        _active["publisher"].close()
    _active.clear()
    _active["tier"] = tier
    os.environ[_knobs.CACHE_TIER_URL] = url
    if not readonly:
        from xlakit.cache_tier.publisher import Publisher

        _active["publisher"] = Publisher(tier).start()
    return where


def active():
    """This process's shared tier (a `tier.SharedTier`), or None."""
    return _active.get("tier")


def publish_now(timeout_s: float | None = None):
    """Publish this process's new entries now (for a job about to be preempted); its report, or None
    without a tier."""
    tier = active()
    if tier is None:
        return None
    return tier.publish(timeout_s or _knobs.get_float(_knobs.CACHE_TIER_EXIT_TIMEOUT_S))
