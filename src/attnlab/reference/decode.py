"""Flash-Decoding on the CPU: split the keys, attend per split, merge exactly.

Each split runs the FA-2 loop over a contiguous run of K/V tiles and returns a
normalised partial output with its log-sum-exp.  Two partials over disjoint keys
merge exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

A split that sees no key (empty, or every key hidden) has o = 0 and lse = -inf, and
must drop out of the merge without producing NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnlab.reference.inputs import check_attention_inputs, check_softcap, resolve_scale
from attnlab.reference.tiled import tiled_partial
from attnlab.reference.tiles import tile_plan


@dataclass(frozen=True)
class SplitState:
    """One split's partial result: O over its keys (normalised) and the LSE of its scores."""

    out: torch.Tensor  # (batch, query_heads, seqlen_q, value_dim), accumulation dtype
    lse: torch.Tensor  # (batch, query_heads, seqlen_q), natural log; -inf: no key seen
    kv_tiles: range  # the K/V tiles this split covered (may be empty)


def split_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_splits: int,
             causal: bool = False, scale: float | None = None,
             window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
             block_m: int = 128, block_n: int = 64) -> list[SplitState]:
    """Partial outputs of ``num_splits`` contiguous runs of K/V tiles (SDPA layout).

    Like flash-attn, every split gets ``ceil(kv_tiles / num_splits)`` tiles, so the last
    splits can be empty when there are more splits than tiles.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    shape = check_attention_inputs(q, k, v, causal=causal, window=window,
                                   block_m=block_m, block_n=block_n)
    plan = tile_plan(shape)
    scale = resolve_scale(scale, shape.head_dim)
    softcap = check_softcap(softcap)
    tiles_per_split = -(-plan.kv_tiles // num_splits)
    states = []
    for split in range(num_splits):
        first = min(split * tiles_per_split, plan.kv_tiles)
        tiles = range(first, min(first + tiles_per_split, plan.kv_tiles))
        out, lse = tiled_partial(q, k, v, plan, scale=scale, softcap=softcap, kv_tiles=tiles)
        states.append(SplitState(out=out, lse=lse, kv_tiles=tiles))
    return states


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact combine of two partial attentions over disjoint keys: returns (o, lse).

    o_*: (..., rows, value_dim); lse_*: (..., rows).  Rows where both sides are -inf
    stay o = 0, lse = -inf.
    """
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"o_a/o_b must share a shape (..., rows, dim) and lse_a/lse_b the "
                         f"shape (..., rows); got o {tuple(o_a.shape)}, {tuple(o_b.shape)}, "
                         f"lse {tuple(lse_a.shape)}, {tuple(lse_b.shape)}")
    lse = torch.logaddexp(lse_a, lse_b)
    # exp(-inf - (-inf)) is NaN; measuring both sides from 0 instead gives weight 0.
    base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - base).unsqueeze(-1)
    weight_b = torch.exp(lse_b - base).unsqueeze(-1)
    return weight_a * o_a + weight_b * o_b, lse


def combine_splits(states: Sequence[SplitState]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold :func:`merge_states` over every split; returns (o, lse) over all keys."""
    if not states:
        raise ValueError("states must hold at least one SplitState, got none")
    out, lse = states[0].out, states[0].lse
    for state in states[1:]:
        out, lse = merge_states(out, lse, state.out, state.lse)
    return out, lse
