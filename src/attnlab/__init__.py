"""attnlab: FlashAttention made fast and made explainable.

The public API is re-exported here; nothing else lives in this file.
"""

from attnlab.api import attention, flash_attn_func, last_impl
from attnlab.shapes import PRESETS, AttentionShape, ModelPreset, preset

__all__ = [
    "PRESETS",
    "AttentionShape",
    "ModelPreset",
    "attention",
    "flash_attn_func",
    "last_impl",
    "preset",
]
__version__ = "0.1.0"
