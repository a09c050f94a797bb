"""One checkpoint file, saved and read: plan, sync, transfer, write, commit (`pipeline.py`), the
same in the background (`background.py`), the read (`loading.py`) and the read into a template
(`restoring.py` with `matching.py`; `live.py` for a template holding the model and optimizer
themselves); device to host (`transfer.py`, `spmd.py`); the same file on
object storage (`bucket_file.py`).
"""
