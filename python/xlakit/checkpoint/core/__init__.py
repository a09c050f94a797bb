"""What every checkpoint operation stands on: its options (`options.py`), the threads xlakit starts
(`workers.py`), the `Operation` that owns one deadline, its cancellation, its commit point and its
temporary files (`operation.py`), and temporary names, atomic replacement and fsync (`paths.py`).

The lowest sub-package of `checkpoint/`: it imports nothing else of it, and the object store
(`objstore/`) and the compile cache's shared tier run under it too.
"""
