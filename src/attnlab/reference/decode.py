"""Flash-Decoding on the CPU: split the keys, attend per split, merge exactly.

Each split runs the FA-2 loop over a contiguous run of K/V tiles and returns a
normalised partial output with its log-sum-exp.  Two partials over disjoint keys
merge exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

A split that sees no key (empty, or every key hidden) has o = 0 and lse = -inf, and
must drop out of the merge without producing NaN.

The second half is the KV cache's bookkeeping (rotary positions, the in-place append,
paged gathers) and the float64 oracle of ``flash_attn_with_kvcache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnlab.masking import split_plan
from attnlab.reference.inputs import check_attention_inputs, check_softcap, resolve_scale
from attnlab.reference.tiled import NEG_INF, tiled, tiled_partial
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
    splits can be empty when there are more splits than tiles
    (:func:`attnlab.masking.split_plan`, the rule the decode kernel applies per sequence).
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    shape = check_attention_inputs(q, k, v, causal=causal, window=window,
                                   block_m=block_m, block_n=block_n)
    plan = tile_plan(shape)
    scale = resolve_scale(scale, shape.head_dim)
    softcap = check_softcap(softcap)
    states = []
    for tiles in split_plan(plan.kv_tiles, num_splits):
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
    return merge_stacked(torch.stack((o_a, o_b)), torch.stack((lse_a, lse_b)))


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one merge formula: partials stacked on dim 0, (parts, ..., rows, dim) and
    (parts, ..., rows), computed in their dtype.  Returns (o, lse) over all parts.

    A part with lse = -inf (it saw no key) weighs exactly 0 and its o is never
    multiplied in (so even a NaN there contributes nothing); all parts empty gives
    o = 0, lse = -inf.  Any other part counts, NaN included: a NaN in a live part's o or
    lse makes the merged row NaN, as PyTorch's attention would, rather than vanish.
    """
    if outs.dim() < 2 or outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs must be (parts, ..., rows, dim) and lses (parts, ..., rows); "
                         f"got {tuple(outs.shape)} and {tuple(lses.shape)}")
    lse = torch.logsumexp(lses, dim=0)
    # exp(-inf - (-inf)) is NaN; measuring every part from 0 instead gives weight 0.
    base = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses - base).unsqueeze(-1)
    # Select on the part being empty, not on its weight: NaN > 0 is False, which would
    # silently drop a NaN partial.
    empty = torch.isneginf(lses).unsqueeze(-1)
    terms = torch.where(empty, torch.zeros_like(outs), weights * outs)
    return terms.sum(dim=0), lse


def combine_splits(states: Sequence[SplitState]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge every split's partial (:func:`merge_stacked`); returns (o, lse) over all keys."""
    if not states:
        raise ValueError("states must hold at least one SplitState, got none")
    return merge_stacked(torch.stack([s.out for s in states]), torch.stack([s.lse for s in states]))


# ----- the KV cache: rotary, append, gather, attend (flash_attn_with_kvcache's semantics) -----
#
# Sequence b of a call lives in cache positions [leftpad[b], cache_seqlens[b]) and the
# call appends its seqlen_new new keys at [cache_seqlens[b], cache_seqlens[b] + seqlen_new)
# before attending; causal alignment is over the live keys (leftpad excluded).  Rotary
# positions are cache positions, as in flash-attn: new key j sits at cache_seqlens[b] + j;
# query i at cache_seqlens[b] + i when causal or windowed, else every query at
# cache_seqlens[b].  These functions are the one definition of that bookkeeping: the
# API runs them before either the Triton kernel or the float64 reference attends.

def as_lengths(cache_seqlens: int | torch.Tensor, batch: int, device) -> torch.Tensor:
    """``cache_seqlens`` as a (batch,) int64 tensor on ``device`` (an int broadcasts)."""
    if isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens.to(device=device, dtype=torch.int64)
    return torch.full((batch,), int(cache_seqlens), dtype=torch.int64, device=device)


def positions_from(start: torch.Tensor, count: int, *, same_position: bool = False) -> torch.Tensor:
    """(batch, count) positions start[b] + j, or start[b] for every j."""
    steps = torch.arange(count, device=start.device, dtype=torch.int64)
    if same_position:
        steps = torch.zeros_like(steps)
    return start.to(torch.int64)[:, None] + steps[None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 *, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, heads, d) at ``positions`` (batch, seqlen).

    cos/sin are (seqlen_ro, rotary_dim / 2); the first rotary_dim features rotate, the
    rest pass through.  Interleaved (GPT-J) pairs features (0, 1), (2, 3), ...; not
    interleaved (GPT-NeoX) pairs i with i + rotary_dim / 2.  Computed in fp32 (float64
    stays float64) and returned in x's dtype, as flash-attn stores it.
    """
    half = cos.shape[1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos[positions].to(work).unsqueeze(2)  # (batch, seqlen, 1, half)
    s = sin[positions].to(work).unsqueeze(2)
    rotated = x[..., :2 * half].to(work)
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def append_to_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, cache_seqlens: int | torch.Tensor, *,
                    cache_batch_idx: torch.Tensor | None = None,
                    block_table: torch.Tensor | None = None) -> None:
    """Write k, v (batch, seqlen_new, kv_heads, d) into the caches in place, at cache
    positions cache_seqlens[b] + j of cache row cache_batch_idx[b] (or of the pages
    block_table[b] names).  Nothing else in the caches is written; device-side indexing
    only, so it runs under CUDA-graph capture."""
    batch, seqlen_new = k.shape[:2]
    positions = positions_from(as_lengths(cache_seqlens, batch, k.device), seqlen_new)
    if block_table is None:
        rows = (torch.arange(batch, device=k.device) if cache_batch_idx is None
                else cache_batch_idx.to(torch.int64))
        index = (rows[:, None].expand(batch, seqlen_new), positions)
    else:
        page_size = k_cache.shape[1]
        pages = torch.gather(block_table.to(torch.int64), 1, positions // page_size)
        index = (pages, positions % page_size)
    for cache, new in ((k_cache, k), (v_cache, v)):
        if cache.dtype == torch.float8_e4m3fn:
            # Bytes in, bytes out: index_put_ on a uint8 view is there for every device and
            # torch build (the e4m3 values were rounded by quantize_e4m3).
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache[index] = new


def cache_keys(cache: torch.Tensor, b: int, first: int, stop: int, *,
               cache_batch_idx: torch.Tensor | None = None,
               block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence b's cache positions [first, stop) as a dense (stop - first, kv_heads, d)."""
    if block_table is None:
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        return cache[row, first:stop]
    page_size = cache.shape[1]
    pages = block_table[b, :-(-stop // page_size)].to(torch.int64)
    return cache[pages].flatten(0, 1)[first:stop]


def kvcache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                      cache_seqlens: int | torch.Tensor | None, seqlen_new: int = 0,
                      cache_batch_idx: torch.Tensor | None = None,
                      cache_leftpad: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, scale: float | None = None,
                      causal: bool = False, window: tuple[int, int] = (-1, -1),
                      softcap: float = 0.0, k_descale: torch.Tensor | None = None,
                      v_descale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 oracle of the attend half of ``flash_attn_with_kvcache`` (bshd q).

    Gathers each sequence's live keys [leftpad[b], cache_seqlens[b] + seqlen_new) (the
    append already done) and runs :func:`tiled` on them in float64.  Returns out
    (batch, seqlen_q, heads, d) in q's dtype and LSE (batch, heads, seqlen_q) fp32.
    A sequence with no live key outputs zeros and LSE = -inf.  An fp8 cache is read as
    its stored values times ``k_descale``/``v_descale`` ((batch, kv_heads), sequence b's
    row), exactly, in float64.
    """
    batch, seqlen_q, heads, head_dim = q.shape
    capacity = (k_cache.shape[1] if block_table is None
                else block_table.shape[1] * k_cache.shape[1])
    ends = (as_lengths(capacity if cache_seqlens is None else cache_seqlens, batch, "cpu")
            + seqlen_new).tolist()
    firsts = [0] * batch if cache_leftpad is None else cache_leftpad.to("cpu").tolist()
    out = torch.zeros((batch, seqlen_q, heads, v_cache.shape[-1]), dtype=torch.float64)
    lse = torch.full((batch, heads, seqlen_q), NEG_INF, dtype=torch.float64)
    for b in range(batch):
        if ends[b] <= firsts[b]:
            continue
        keys = [cache_keys(c, b, firsts[b], ends[b], cache_batch_idx=cache_batch_idx,
                           block_table=block_table).to("cpu", torch.float64)
                for c in (k_cache, v_cache)]
        if k_descale is not None:
            keys = [t * d[b].to("cpu", torch.float64)[:, None]
                    for t, d in zip(keys, (k_descale, v_descale), strict=True)]
        keys = [t.transpose(0, 1)[None] for t in keys]
        query = q[b:b + 1].to("cpu", torch.float64).transpose(1, 2)
        out_b, lse_b = tiled(query, *keys, causal=causal, scale=scale, window=window,
                             softcap=softcap)
        out[b] = out_b[0].transpose(0, 1)
        lse[b] = lse_b[0]
    return out.to(q.device, q.dtype), lse.to(q.device, torch.float32)
