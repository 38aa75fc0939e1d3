"""The explicit materialising baseline: S, then P, then O, each a full tensor.

This is the lesson's three-kernel path written out in PyTorch.  It computes in the
dtype of its inputs, so pass float64 tensors to use it as the oracle and the
kernel's own dtype to use it as the same-precision yardstick.
"""

from __future__ import annotations

import torch

from attnlab.reference.inputs import (
    check_attention_inputs,
    check_softcap,
    expand_kv_heads,
    resolve_scale,
)
from attnlab.reference.scores import scaled_scores, shape_mask

# S and P are materialised in full: past 2^32 scores (32 GiB each in float64) refuse
# before allocating rather than let the allocator fail (or the machine swap).
MAX_SCORE_ELEMENTS = 2**32


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
          scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
          return_scores: bool = False):
    """Attention by materialising the whole score and probability matrices.

    q: (batch, query_heads, seqlen_q, head_dim); k: (batch, kv_heads, seqlen_k, head_dim);
    v: (batch, kv_heads, seqlen_k, value_dim), kv_heads dividing query_heads (GQA).
    Returns O (batch, query_heads, seqlen_q, value_dim), or (O, S, P) with
    ``return_scores``: S the scaled, soft-capped scores with -inf where the mask hides a
    key, P = softmax(S) row by row.  A row that sees no key has P = 0 and O = 0.
    """
    shape = check_attention_inputs(q, k, v, causal=causal, window=window)
    scores = shape.batch * shape.query_heads * shape.seqlen_q * shape.seqlen_k
    if scores > MAX_SCORE_ELEMENTS:
        raise ValueError(f"naive materialises {scores:,} scores (batch x heads x seqlen_q x "
                         f"seqlen_k), more than its bound of {MAX_SCORE_ELEMENTS:,}; use "
                         f"attnlab.reference.tiled, which holds one tile at a time")
    scale = resolve_scale(scale, shape.head_dim)
    softcap = check_softcap(softcap)
    k = expand_kv_heads(k, shape.query_heads)
    v = expand_kv_heads(v, shape.query_heads)

    # 1. S = scale * Q K^T (soft-capped), then hide the keys a row may not see.
    scores = scaled_scores(q, k, scale=scale, softcap=softcap)
    visible = shape_mask(shape, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))

    # 2. P = softmax(S).  torch.softmax gives NaN on an all -inf row (0/0); such a
    #    row has no visible key, and by flash-attn's convention it contributes nothing.
    row_has_key = visible.any(dim=-1, keepdim=True)
    probabilities = torch.softmax(scores, dim=-1).masked_fill(~row_has_key, 0.0)

    # 3. O = P V.
    out = torch.matmul(probabilities, v)
    if return_scores:
        return out, scores, probabilities
    return out
