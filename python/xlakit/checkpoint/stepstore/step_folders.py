"""Which folder a CheckpointManager path names: `steps.LocalFolder` on a file system, or
`bucket_steps.BucketFolder` for a `gs://` / `s3://` URL.

The manager, its read-only twin and `xlakit ckpt` ask here once; both
implementations share the step model of `steps.py` and never import each other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from xlakit.checkpoint import objstore
from xlakit.checkpoint.stepstore.steps import LocalFolder

if TYPE_CHECKING:
    from xlakit.checkpoint.stepstore.bucket_steps import BucketFolder


def folder_at(directory: str | os.PathLike) -> "LocalFolder | BucketFolder":
    """A manager folder: on a file system, or a URL on object storage (bucket_steps.py)."""
    if isinstance(directory, (str, os.PathLike)) and os.fspath(directory) == "":
        raise ValueError("a manager folder cannot be the empty path (it would be the working "
                         "directory): name the folder, e.g. 'checkpoints/run1'")
    objstore.check_url(directory)
    if objstore.is_url(directory):
        from xlakit.checkpoint.stepstore import bucket_steps

        return bucket_steps.BucketFolder(directory)
    return LocalFolder(Path(directory))
