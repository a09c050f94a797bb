"""`CheckpointManager`: when to save, what to keep, where to resume (`checkpoint_manager.py`), with its
clean exit (`manager_exit.py`) and preemption notices (`preemption.py`).
"""
