"""What a test sees of a CheckpointManager folder."""

import os

from xlakit.checkpoint.stepstore import steps


def names(folder) -> list[str]:
    """The entries of `folder`, but the manager's lock file."""
    return sorted(n for n in os.listdir(folder) if n != steps.LOCK_FILE)
