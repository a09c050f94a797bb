"""The Lightning plugin's public path: ``xlakit.lightning.XlakitCheckpointIO``.

It lives in `xlakit.integrations.lightning`; importing this module imports Lightning.
"""

from xlakit.integrations.lightning import XlakitCheckpointIO, weights_only_state

__all__ = ["XlakitCheckpointIO", "weights_only_state"]
