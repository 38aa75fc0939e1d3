"""Exact merges of partial attentions over disjoint key sets: FlashInfer's cascade calls
``merge_state`` (two states) and ``merge_states`` (stacked states), on attnlab's LSE.

A state is ``(v, s)``: the attention output over one key segment and its log-sum-exp.
Merging states over disjoint segments gives exactly the attention over their union.

**The base of s.**  FlashInfer's ``s`` is base 2 (its kernels use ``exp2``/``log2``);
every LSE attnlab returns (``flash_attn_func``, varlen, ``flash_attn_with_kvcache``,
``attention(return_lse=True)``, the FA3 module) is natural log, like flash-attn's.  These
calls take and return **natural-log** s, so attnlab's own outputs chain directly; a
FlashInfer LSE converts with ``s * math.log(2)`` (and back with ``/ math.log(2)``).
"""

from __future__ import annotations

import torch

from attnlab.checks import check_strided

# The layouts merge_state accepts, named once for its errors and docs.
MERGE_STATE_LAYOUTS = (
    "4-D v (batch, seqlen, heads, dim) with s (batch, heads, seqlen) -- what flash_attn_func "
    "and flash_attn_with_kvcache return; any other rank: s = v.shape[:-1], e.g. FlashInfer's "
    "v (seq_len, heads, dim) with s (seq_len, heads)")


def _check_state(v_name: str, v, s_name: str, s) -> None:
    for name, t in ((v_name, v), (s_name, s)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        check_strided(name, t)
    if v.dim() < 1:
        raise ValueError(f"{v_name} must have a last (head_dim) dimension, got a 0-d tensor")
    if s.device != v.device:
        raise ValueError(f"{s_name} must be on {v_name}'s device {v.device}, got {s.device}")


def _merge_stacked_at(v: torch.Tensor, s: torch.Tensor, state_dim: int):
    """Merge the states stacked along ``state_dim`` of v (..., dim) and s = v.shape[:-1].

    Computed and returned in fp32 (float64 when an input is float64).  The formula is the reference's
    (:func:`attnlab.reference.decode.merge_stacked`): a state with s = -inf contributes
    nothing, merging only empty states gives (0, -inf), never NaN.
    """
    from attnlab.reference.decode import merge_stacked

    work = torch.float64 if torch.float64 in (v.dtype, s.dtype) else torch.float32
    out, lse = merge_stacked(v.movedim(state_dim, 0).to(work), s.movedim(state_dim, 0).to(work))
    return out, lse


def merge_state(v_a, s_a, v_b, s_b):
    """FlashInfer's ``merge_state``: merge two states; returns ``(v, s)`` over both segments.

    Layouts (chosen by v's rank, the same for both states)::

        4-D   v (batch, seqlen, heads, dim)   s (batch, heads, seqlen)   flash_attn_func's
        else  v (..., dim)                    s = v.shape[:-1]           FlashInfer's (seq, heads, dim)

    The returned s has the layout s_a came in, so merges chain.  For ``attention()``'s
    (batch, heads, seqlen, dim) output pass ``out.transpose(1, 2)`` (its LSE is already
    (batch, heads, seqlen)); a varlen output (total, heads, dim) pairs with ``lse.T``.
    Shapes alone decide, so a layout not listed whose shape happens to fit (say a
    (batch, heads, seqlen, dim) v with heads == seqlen) would be misread: transpose first.
    s is natural log (see the module doc: FlashInfer's is base 2).  Computed in fp32
    (float64 when an input is float64); v comes back in v_a's dtype, s in the work dtype.
    """
    _check_state("v_a", v_a, "s_a", s_a)
    _check_state("v_b", v_b, "s_b", s_b)
    if v_a.shape != v_b.shape or s_a.shape != s_b.shape or v_a.device != v_b.device:
        raise ValueError(f"the two states must match: v_a {tuple(v_a.shape)} on {v_a.device}, "
                         f"v_b {tuple(v_b.shape)} on {v_b.device}; s_a {tuple(s_a.shape)}, "
                         f"s_b {tuple(s_b.shape)}")
    flash_layout = v_a.dim() == 4
    expected = (v_a.shape[0], v_a.shape[2], v_a.shape[1]) if flash_layout else v_a.shape[:-1]
    if s_a.shape != expected:
        raise ValueError(f"s_a must be {tuple(expected)} for v_a {tuple(v_a.shape)}, got "
                         f"{tuple(s_a.shape)}; layouts: {MERGE_STATE_LAYOUTS}")
    if flash_layout:
        s_a, s_b = s_a.transpose(1, 2), s_b.transpose(1, 2)
    out, lse = _merge_stacked_at(torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), 0)
    return out.to(v_a.dtype), (lse.transpose(1, 2) if flash_layout else lse)


def merge_states(v, s):
    """FlashInfer's ``merge_states``: merge states stacked along dim 1; returns ``(v, s)``.

    v is (seq_len, num_states, heads, dim) and s (seq_len, num_states, heads), FlashInfer's
    layout (any v (n, num_states, ..., dim) with s = v.shape[:-1]); the result is
    (seq_len, heads, dim) and (seq_len, heads).  s is natural log (see the module doc:
    FlashInfer's is base 2).  Computed in fp32 (float64 when an input is float64): v comes
    back in its dtype, s in the work dtype.  A state with s = -inf contributes nothing;
    a row whose states are all empty gives (0, -inf), never NaN; a NaN in a live state
    stays NaN.
    """
    _check_state("v", v, "s", s)
    if v.dim() < 3 or s.shape != v.shape[:-1] or v.shape[1] == 0:
        raise ValueError(f"v must be (seq_len, num_states >= 1, ..., dim) and s v.shape[:-1]; got "
                         f"v {tuple(v.shape)} and s {tuple(s.shape)}")
    out, lse = _merge_stacked_at(v, s, 1)
    return out.to(v.dtype), lse
