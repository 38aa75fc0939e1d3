"""attnlab: FlashAttention made fast and made explainable.

The public API is re-exported here; nothing else lives in this file.
"""

from attnlab.shapes import PRESETS, AttentionShape, ModelPreset, preset

__all__ = ["PRESETS", "AttentionShape", "ModelPreset", "preset"]
__version__ = "0.1.0"
