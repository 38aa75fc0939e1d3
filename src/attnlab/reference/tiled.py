"""FlashAttention-2's forward pass, tile by tile, on the CPU.

Query tiles are the outer loop, K/V tiles the inner loop.  Each query row keeps a
running max ``m``, a running sum ``l`` and an unnormalised accumulator ``a``; a new
tile rescales the old state by ``alpha = exp(m_old - m_new)`` and adds its own terms;
the division ``O = a / l`` happens once, after the last tile (FA-2, Algorithm 1).

Which K/V tiles a query tile loads, and which of those need the element mask, comes
from :func:`attnlab.masking.tile_plan`, so the plan and the loop cannot
disagree.  The loop is vectorised over batch, heads and the rows of a tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.masking import MASKED, SKIPPED, TilePlan, tile_plan
from attnlab.reference.inputs import (
    accumulation_dtype,
    check_attention_inputs,
    check_softcap,
    expand_kv_heads,
    resolve_scale,
)
from attnlab.reference.scores import scaled_scores, visible_keys

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TileStep:
    """The state of one query tile's rows after it met one K/V tile.

    ``tile_class`` is ``"skipped"`` (never loaded: the state fields are None and the
    state is unchanged), ``"full"`` or ``"masked"``.  Per-row fields have shape
    (batch, query_heads, rows); ``a`` has (batch, query_heads, rows, value_dim).
    ``alpha`` is the factor the old ``l`` and ``a`` were multiplied by; ``l`` and ``a``
    are the values after the step.
    """

    query_tile: int
    kv_tile: int
    tile_class: str
    query_rows: range
    key_rows: range
    m_old: torch.Tensor | None = None
    m_new: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    l: torch.Tensor | None = None  # noqa: E741 -- the lesson's name for the running sum
    a: torch.Tensor | None = None


@dataclass
class _RowState:
    """Running softmax state of one query tile's rows (accumulation dtype)."""

    m: torch.Tensor  # running max, -inf until a visible score arrives
    l: torch.Tensor  # noqa: E741 -- running sum of exp(score - m)
    a: torch.Tensor  # unnormalised output: running sum of exp(score - m) * v


def tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
          scale: float | None = None, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
          block_m: int = 128, block_n: int = 64, trace: bool = False,
          apply_element_mask: bool = True):
    """FlashAttention-2 forward in SDPA layout; returns (O, LSE) or (O, LSE, steps).

    q: (batch, query_heads, seqlen_q, head_dim); k, v: (batch, kv_heads, seqlen_k, ·).
    O has q's dtype; LSE (batch, query_heads, seqlen_q) is the natural-log sum of
    exp(scores) per row, in the accumulation dtype (float64 for float64 inputs, else
    float32).  A row that sees no key gives O = 0 and LSE = -inf.
    ``trace=True`` adds the list of :class:`TileStep`, one per (query tile, K/V tile).
    ``apply_element_mask=False`` keeps the skip bound but drops the mask: the lesson's
    silent bug, for ``attnlab verify`` to show that it changes the answer.
    """
    shape = check_attention_inputs(q, k, v, causal=causal, window=window,
                                   block_m=block_m, block_n=block_n)
    plan = tile_plan(shape)
    steps: list[TileStep] | None = [] if trace else None
    out, lse = tiled_partial(q, k, v, plan, scale=resolve_scale(scale, shape.head_dim),
                             softcap=check_softcap(softcap), kv_tiles=range(plan.kv_tiles),
                             apply_element_mask=apply_element_mask, steps=steps)
    out = out.to(q.dtype)
    return (out, lse, steps) if trace else (out, lse)


def tiled_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan, *,
                  scale: float, softcap: float, kv_tiles: range,
                  apply_element_mask: bool = True,
                  steps: list[TileStep] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FA-2 loop over the K/V tiles in ``kv_tiles`` only (all of them, or one split).

    Inputs are assumed checked (``plan`` built from their shape).  Returns the
    normalised output over those keys and its LSE, both in the accumulation dtype —
    the partial state Flash-Decoding's combine consumes.
    """
    shape = plan.shape
    work_dtype = accumulation_dtype(q.dtype)
    k = expand_kv_heads(k, shape.query_heads)
    v = expand_kv_heads(v, shape.query_heads)
    batch, heads, value_dim = q.shape[0], q.shape[1], v.shape[-1]
    out = q.new_zeros((batch, heads, shape.seqlen_q, value_dim), dtype=work_dtype)
    lse = q.new_full((batch, heads, shape.seqlen_q), NEG_INF, dtype=work_dtype)

    for query_plan in plan.query_tiles:  # outer loop: one thread block per query tile
        rows = query_plan.rows
        q_tile = q[:, :, rows.start:rows.stop].to(work_dtype)
        state = _RowState(
            m=q_tile.new_full((batch, heads, len(rows)), NEG_INF),
            l=q_tile.new_zeros((batch, heads, len(rows))),
            a=q_tile.new_zeros((batch, heads, len(rows), value_dim)),
        )
        for kv_tile in kv_tiles:  # inner loop: stream K/V tiles past the resident Q tile
            cols = plan.key_rows(kv_tile)
            tile_class = query_plan.tile_class(kv_tile)

            # Step 1, the skip bound: a tile with no visible element is never loaded.
            # Dropping it is exact; it only saves the load and the multiply.
            if tile_class == SKIPPED:
                if steps is not None:
                    steps.append(TileStep(query_plan.query_tile, kv_tile, tile_class, rows, cols))
                continue

            k_tile = k[:, :, cols.start:cols.stop].to(work_dtype)
            v_tile = v[:, :, cols.start:cols.stop].to(work_dtype)
            scores = scaled_scores(q_tile, k_tile, scale=scale, softcap=softcap)

            # Step 2, the element mask: a loaded tile that straddles the band's edge gets
            # -inf where the key is hidden, BEFORE the running max and sum see the scores
            # (otherwise the row attends to the future and nothing raises).
            if tile_class == MASKED and apply_element_mask:
                hidden = ~visible_keys(plan.band, rows, cols, device=q.device)
                scores = scores.masked_fill(hidden, NEG_INF)

            m_old = state.m
            alpha = _online_softmax_update(state, scores, v_tile)
            if steps is not None:
                steps.append(TileStep(query_plan.query_tile, kv_tile, tile_class, rows, cols,
                                      m_old=m_old, m_new=state.m, alpha=alpha,
                                      l=state.l, a=state.a))

        # One division per row, after the last tile.  l == 0 with no visible key among
        # these tiles' keys: the row saw no key (0 and LSE = -inf).  Anything else divides,
        # so a NaN or inf that reached the state (a NaN score, an inf key) reaches O and
        # LSE as in PyTorch's attention, and a row whose every visible score is -inf gives
        # 0/0 = NaN with LSE -inf, as torch.softmax does.
        no_key = (state.l == 0) & ~_sees_key(plan, rows, kv_tiles, q.device)
        safe_l = torch.where(no_key, torch.ones_like(state.l), state.l)
        out[:, :, rows.start:rows.stop] = torch.where(
            no_key.unsqueeze(-1), torch.zeros_like(state.a), state.a / safe_l.unsqueeze(-1))
        lse[:, :, rows.start:rows.stop] = torch.where(
            no_key, torch.full_like(state.m, NEG_INF), state.m + torch.log(safe_l))
    return out, lse


def _sees_key(plan: TilePlan, rows: range, kv_tiles: range, device) -> torch.Tensor:
    """(rows,) bool: whether each query row sees any key of the tiles ``kv_tiles``."""
    if not kv_tiles:
        return torch.zeros(len(rows), dtype=torch.bool, device=device)
    keys = range(plan.key_rows(kv_tiles[0]).start, plan.key_rows(kv_tiles[-1]).stop)
    return visible_keys(plan.band, rows, keys, device=device).any(dim=-1)


def _online_softmax_update(state: _RowState, scores: torch.Tensor,
                           v_tile: torch.Tensor) -> torch.Tensor:
    """Fold one tile's (masked) scores into the running state; return alpha.

    m_new = max(m_old, rowmax(S)); alpha = exp(m_old - m_new);
    l = alpha * l + sum exp(S - m_new); a = alpha * a + exp(S - m_new) @ V.
    """
    m_new = torch.maximum(state.m, scores.amax(dim=-1))
    # A row whose scores so far are all -inf has m_new = -inf; exp(-inf - (-inf)) would
    # be NaN.  Subtracting 0 instead gives exp(-inf) = 0: no key, no contribution.
    m_base = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(state.m - m_base)
    weights = torch.exp(scores - m_base.unsqueeze(-1))
    state.l = alpha * state.l + weights.sum(dim=-1)
    state.a = alpha.unsqueeze(-1) * state.a + torch.matmul(weights, v_tile)
    state.m = m_new
    return alpha
