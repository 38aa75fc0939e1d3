"""attnlab: FlashAttention made fast and made explainable.

The public API is re-exported here; nothing else lives in this file.
"""

# The public calls are named once, in attnlab.api.__all__.
from attnlab.api import *  # noqa: F403
from attnlab.api import __all__ as _API_NAMES
from attnlab.shapes import PRESETS, AttentionShape, ModelPreset, preset

__all__ = [*_API_NAMES, "PRESETS", "AttentionShape", "ModelPreset", "preset"]
__version__ = "0.1.0"
