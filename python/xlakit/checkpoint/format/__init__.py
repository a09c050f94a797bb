"""What a checkpoint is on disk, independent of how it is written: the plan of tensors and
storages (`state.py`), the zip archive and its index (`archive.py`), the state as `torch.load` reads
it (`pickled.py`) and as xlakit reads it (`structure.py`, `zip_structure.py`), a folder's commit
record (`folders.py`) and DCP's metadata read through an allowlist (`dcp_metadata.py`).

No device, no rank, no deadline of its own: the pipelines above drive it.
"""
