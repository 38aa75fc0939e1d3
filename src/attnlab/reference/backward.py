"""FlashAttention-2's backward pass, tile by tile, on the CPU (FA-2 Algorithm 2).

K/V tiles are the outer loop and query tiles the inner loop, the order of the
Triton dK/dV kernel: one K/V tile's dK and dV are finished before the next tile
starts, while dQ is accumulated across K/V tiles.  Nothing of size N x N is kept:
each tile recomputes its scores S from Q and K and its probabilities from the saved
LSE, ``P = exp(S - LSE)``; then, with ``D = rowsum(dO * O)``,

    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),
    dQ += dS' K,    dK += dS'^T Q,   dS' = dS * dS/d(QK^T)

where ``dS/d(QK^T)`` is ``scale``, or ``scale * (1 - tanh^2)`` under a softcap.
Which tiles are loaded, skipped or masked comes from the same
:func:`attnlab.reference.tiles.tile_plan` as the forward; GQA is computed on the
expanded K/V and the group's dK/dV summed at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.reference.inputs import (
    accumulation_dtype,
    check_attention_inputs,
    check_softcap,
    expand_kv_heads,
    resolve_scale,
)
from attnlab.reference.scores import visible_keys
from attnlab.reference.tiled import tiled
from attnlab.reference.tiles import MASKED, SKIPPED, tile_plan


@dataclass(frozen=True)
class BackwardTileStep:
    """One (K/V tile, query tile) meeting of the backward loop.

    ``tile_class`` is ``"skipped"`` (never loaded; ``p`` and ``ds`` are None),
    ``"full"`` or ``"masked"``.  ``p`` is the recomputed probability tile and ``ds``
    the gradient of the (soft-capped) scores, both (batch, query_heads, rows, cols).
    """

    kv_tile: int
    query_tile: int
    tile_class: str
    query_rows: range
    key_rows: range
    p: torch.Tensor | None = None
    ds: torch.Tensor | None = None


def tiled_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                   out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                   causal: bool = False, scale: float | None = None,
                   window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   block_m: int = 128, block_n: int = 64, trace: bool = False):
    """dQ, dK, dV of attention in SDPA layout; returns (dq, dk, dv) or (dq, dk, dv, steps).

    q: (batch, query_heads, seqlen_q, head_dim); k, v: (batch, kv_heads, seqlen_k, ·);
    dout: like the output.  ``out`` and ``lse`` are the forward's (computed with
    :func:`attnlab.reference.tiled` when not given).  Gradients have the inputs'
    dtypes; the work is done in the accumulation dtype (float64 for float64).  A query
    row that sees no key gets dQ = 0; a key no query sees gets dK = dV = 0.
    """
    shape = check_attention_inputs(q, k, v, causal=causal, window=window,
                                   block_m=block_m, block_n=block_n)
    scale = resolve_scale(scale, shape.head_dim)
    softcap = check_softcap(softcap)
    expected = (*q.shape[:3], v.shape[-1])
    if not isinstance(dout, torch.Tensor) or tuple(dout.shape) != expected:
        got = tuple(dout.shape) if isinstance(dout, torch.Tensor) else type(dout).__name__
        raise ValueError(f"dout must have the output's shape {expected}, got {got}")
    if out is None or lse is None:
        out, lse = tiled(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                         block_m=block_m, block_n=block_n)
    plan = tile_plan(shape)
    work = accumulation_dtype(q.dtype)
    group = shape.group_size
    q_w, do_w = q.to(work), dout.to(work)
    k_w = expand_kv_heads(k, shape.query_heads).to(work)
    v_w = expand_kv_heads(v, shape.query_heads).to(work)
    delta = (do_w * out.to(work)).sum(dim=-1)  # D = rowsum(dO * O)
    # A row with no visible key has LSE = -inf; +inf instead makes P = exp(S - LSE) = 0.
    lse_w = lse.to(work)
    lse_safe = torch.where(torch.isneginf(lse_w), torch.full_like(lse_w, float("inf")), lse_w)

    dq = torch.zeros_like(q_w)
    dk = torch.zeros_like(k_w)
    dv = torch.zeros_like(v_w)
    steps: list[BackwardTileStep] | None = [] if trace else None
    for kv_tile in range(plan.kv_tiles):  # outer loop: one program per K/V tile
        cols = plan.key_rows(kv_tile)
        k_tile, v_tile = k_w[:, :, cols.start:cols.stop], v_w[:, :, cols.start:cols.stop]
        dk_tile, dv_tile = torch.zeros_like(k_tile), torch.zeros_like(v_tile)
        for query_plan in plan.query_tiles:  # inner loop: stream the query tiles past it
            rows = query_plan.rows
            tile_class = query_plan.tile_classes[kv_tile]
            if tile_class == SKIPPED:  # the skip bound: P is 0 on the whole tile
                if steps is not None:
                    steps.append(BackwardTileStep(kv_tile, query_plan.query_tile, tile_class,
                                                  rows, cols))
                continue
            q_tile, do_tile = q_w[:, :, rows.start:rows.stop], do_w[:, :, rows.start:rows.stop]
            raw = torch.matmul(q_tile, k_tile.transpose(-2, -1))
            if softcap > 0:
                tanh = torch.tanh(raw * (scale / softcap))
                scores, score_slope = softcap * tanh, scale * (1 - tanh * tanh)
            else:
                scores, score_slope = raw * scale, scale
            if tile_class == MASKED:
                hidden = ~visible_keys(plan.band, rows, cols, device=q.device)
                scores = scores.masked_fill(hidden, float("-inf"))
            p = torch.exp(scores - lse_safe[:, :, rows.start:rows.stop, None])
            dv_tile += torch.matmul(p.transpose(-2, -1), do_tile)
            dp = torch.matmul(do_tile, v_tile.transpose(-2, -1))
            ds = p * (dp - delta[:, :, rows.start:rows.stop, None])
            d_raw = ds * score_slope
            dq[:, :, rows.start:rows.stop] += torch.matmul(d_raw, k_tile)
            dk_tile += torch.matmul(d_raw.transpose(-2, -1), q_tile)
            if steps is not None:
                steps.append(BackwardTileStep(kv_tile, query_plan.query_tile, tile_class, rows,
                                              cols, p=p, ds=ds))
        dk[:, :, cols.start:cols.stop] = dk_tile
        dv[:, :, cols.start:cols.stop] = dv_tile

    def group_sum(grad: torch.Tensor) -> torch.Tensor:  # GQA: the query heads sharing a KV head
        batch, _, seqlen, dim = grad.shape
        return grad.view(batch, shape.kv_heads, group, seqlen, dim).sum(dim=2)

    grads = (dq.to(q.dtype), group_sum(dk).to(k.dtype), group_sum(dv).to(v.dtype))
    return (*grads, steps) if trace else grads
