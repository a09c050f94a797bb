"""`CheckpointManager`: when to save, what to keep, where to resume (`checkpoint_manager.py`), with its
clean exit (`manager_exit.py`) and preemption notices (`preemption.py`).
"""


def __getattr__(name: str):
    # This was the module of `CheckpointManager` until issue 36: its names work for one release.
    from xlakit import _moved

    return _moved.attribute(__name__, name)
