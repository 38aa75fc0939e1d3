"""Attention across devices: the sequence sharded over a ``torch.distributed`` group.

- :func:`ring_attention`, :func:`ring_flash_attn_func`: exact attention (forward and
  backward) over a sharded sequence, K/V passed round a ring (layout ``bshd``).
- :func:`shard_sequence`, :func:`unshard_sequence`: a full sequence to this rank's
  shard and back (zig-zag order when causal).

Orchestration only: the per-block compute is the single-device kernels or the CPU
reference; nothing here has Triton of its own.
"""

from attnlab.distributed.ring import (
    RingBlock,
    required_multiple,
    ring_attention,
    ring_flash_attn_func,
    ring_step_block,
    shard_ranges,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "RingBlock",
    "required_multiple",
    "ring_attention",
    "ring_flash_attn_func",
    "ring_step_block",
    "shard_ranges",
    "shard_sequence",
    "unshard_sequence",
]
