"""A manager's folder of steps: one folder (or bucket prefix) per step, found from commit records
alone (`steps.py` on disk, `bucket_steps.py` in a bucket, `step_folders.py` choosing), which steps
to keep (`retention.py`), the step to roll back to (`rollback.py`), and read-only access to it
(`readonly.py`).
"""
