"""What `xlakit ckpt` reads: what a path or URL holds, from metadata only (`describe.py`,
`bucket_describe.py`), streamed verification (`integrity.py`), and comparing and converting the
tensors (`tensors.py`).
"""
