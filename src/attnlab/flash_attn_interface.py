"""FlashAttention-3's module name: ``from attnlab.flash_attn_interface import flash_attn_func``
(FA3's import is ``from flash_attn_interface import ...``).  The calls live in
:mod:`attnlab.api.fa3`, which says what is supported, refused and hinted."""

from attnlab.api.fa3 import *  # noqa: F403
from attnlab.api.fa3 import __all__  # noqa: F401
