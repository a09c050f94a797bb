"""Where a checkpoint's bytes go: one small interface (`base.py`: a `Destination` that proposes,
tidies, opens each rank's part, commits and tidies after) with two implementations, a local file
or folder (`local.py`: committed by a rename) and an object store (`bucket.py`: committed by a
create-only record, over `objstore/`).

The flows above are written once against it: one file's pipeline (`file/pipeline.py`) and the
coordinated layouts (`multirank/`), on disk and in a bucket alike.
"""
