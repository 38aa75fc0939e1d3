"""The CPU reference of attention: the single oracle every backend is tested against.

- :func:`naive`: the materialising baseline (S, then P, then O).
- :func:`tiled`: FlashAttention-2's forward loop with online softmax and a state trace.
- :func:`tiled_backward`: FlashAttention-2's backward loop (Algorithm 2), with a tile trace.
- :func:`tile_plan`: which K/V tiles each query tile loads, skips or masks.
- :func:`split_kv`, :func:`merge_states`, :func:`combine_splits`: Flash-Decoding.
- :func:`online_softmax_walk`: one row's walk in plain floats, for ``attnlab trace``.
- :func:`mask`: the visible-key matrix, built from :mod:`attnlab.masking` (the one
  definition of causal/window visibility).

Tensors are in SDPA layout, (batch, heads, seqlen, dim).  Pass float64 for an oracle.
"""

from attnlab.reference.backward import BackwardTileStep, tiled_backward
from attnlab.reference.decode import SplitState, combine_splits, merge_states, split_kv
from attnlab.reference.naive import naive
from attnlab.reference.scores import mask, scaled_scores, shape_mask, visible_keys
from attnlab.reference.tiled import TileStep, tiled, tiled_partial
from attnlab.reference.tiles import (
    FULL,
    MASKED,
    SKIPPED,
    KeyBand,
    QueryTilePlan,
    RowSegment,
    TilePlan,
    tile_plan,
    visible_band,
)
from attnlab.reference.walk import WalkResult, WalkStep, online_softmax_walk

__all__ = [
    "BackwardTileStep",
    "FULL",
    "MASKED",
    "SKIPPED",
    "KeyBand",
    "QueryTilePlan",
    "RowSegment",
    "SplitState",
    "TilePlan",
    "TileStep",
    "WalkResult",
    "WalkStep",
    "combine_splits",
    "mask",
    "merge_states",
    "naive",
    "online_softmax_walk",
    "scaled_scores",
    "shape_mask",
    "split_kv",
    "tile_plan",
    "tiled",
    "tiled_backward",
    "tiled_partial",
    "visible_band",
    "visible_keys",
]
