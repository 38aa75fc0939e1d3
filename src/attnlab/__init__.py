"""attnlab: FlashAttention made fast and made explainable.

The public API is re-exported here; nothing else lives in this file.
"""

from attnlab.api import (
    attention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    last_impl,
    merge_states,
    merge_states_many,
)
from attnlab.shapes import PRESETS, AttentionShape, ModelPreset, preset

__all__ = [
    "PRESETS",
    "AttentionShape",
    "ModelPreset",
    "attention",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "last_impl",
    "merge_states",
    "merge_states_many",
    "preset",
]
__version__ = "0.1.0"
