"""Object storage (`gs://`, `s3://`): the store and its commit protocol, below the checkpoint entry points.

This package is a lower layer: it knows objects, prefixes and deadlines, never
checkpoints. Each entry point decides once whether a path is a URL (`is_url`,
here). The saves are then one flow over `checkpoint/store/` (`store/bucket.py`
is a bucket's destination, `store/local.py` a path's: temporary files, rename,
fsync); DCP's over `torch_dcp/`'s `DcpStore`. What stays twinned has a `bucket_*`
module beside its local one, in its concern's sub-package (`file/bucket_file.py`,
`multirank/bucket_ranks.py` and `bucket_replicas.py`, `torch_dcp/bucket_dcp.py`,
`stepstore/bucket_steps.py`, `inspect/bucket_describe.py`).

* `client.py`: the one module that talks to a store (fsspec with gcsfs or
  s3fs); every request bounded by what is left of the operation's deadline and
  cancelled on the store's IO loop when it runs out;
* `answers.py`: what a failure means: transient (retried while time is left)
  or the store asking for fewer requests;
* `upload.py`: one object streamed in parts, several in flight, from the
  archive writer's bytes, hashed as sent;
* `reader.py`: a seekable file over ranged reads, for the verified readers;
* `generations.py`: the commit protocol. An object store has no rename, so a
  checkpoint at URL `U` is a prefix: data objects under names unique to the
  save (`<generation>.<host>.<pid>.<random>...`) and, written last with a
  create-only precondition, the commit record `U/xlakit-commit.<generation>.json`
  naming them. Two writers of one generation cannot both commit; readers take
  the highest committed generation; saving again writes the next one;
* `lease.py`: one CheckpointManager per URL (an object store has no lock).

docs/object-storage.md says why fsspec (measured), what each test server
emulates, and the protocol's guarantees.
"""

from __future__ import annotations

import os

SCHEMES = ("gs", "gcs", "s3")


def is_url(path: object) -> bool:
    """Whether `path` names object storage (`gs://bucket/...`, `s3://bucket/...`), not a local path."""
    if isinstance(path, os.PathLike) or not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def check_url(path: object) -> None:
    """Refuse a URL of a scheme xlakit cannot commit to safely, naming the ones it can."""
    if isinstance(path, str) and "://" in path and not is_url(path) and not path.startswith("file://"):
        scheme = path.partition("://")[0]
        raise ValueError(f"{path}: checkpoints on {scheme}:// are not supported; xlakit commits to "
                         f"gs:// and s3:// (a create-only commit record) and to local paths")
