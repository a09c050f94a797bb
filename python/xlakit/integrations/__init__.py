"""Plugins for training frameworks, on top of the checkpoint package.

* `lightning.py`: `XlakitCheckpointIO`, Lightning's checkpoints written and
  read by xlakit (public path `xlakit.lightning`).
"""
