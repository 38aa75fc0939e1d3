"""The KV cache's write half in Triton: rotary embedding and the in-place append of
``flash_attn_with_kvcache``, one launch, no host read.

One program per (sequence, new token): it range-checks the sequence's indices
(``_primitives._sequence_bounds``), finds its cache slot (row and position, or page
and offset through ``block_table``), checks that no other append of the call writes
that slot, and writes the token's keys (rotated at cache position ``start + t``) and
values into every KV head's row; with rotary it also writes q's rotated copy (query
``t`` at ``start + t`` when causal or windowed, else every query at ``start``;
``start`` is ``rotary_seqlens[b]`` when given, else ``cache_seqlens[b]``: flash-attn's
and FA3's rule, the reference's ``apply_rotary``).  Rotation runs in fp32 and rounds
once to the tensor's dtype, as the reference does.  An fp8 (e4m3) cache (QUANTISE)
stores each new key and value as that value over its (sequence, KV head) descale,
rounded to nearest even and saturated to +-448: ``attnlab.reference.fp8.quantize_e4m3``
of the rotated tensor, bit for bit.

A bad index writes nothing for that sequence (and the attention kernel returns NaN
for it); a slot two appends share receives NaN in K and V from both (so both
sequences' outputs are NaN, never one sequence's key under the other's name); a
rotary position past ``rotary_cos`` rotates to NaN.  Each is recorded for
:func:`attnlab.check_kvcache_indices` (kernels/index_checks.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import attnlab.kernels.index_checks as index_checks
from attnlab.kernels._launch import DirectLauncher, PlannedLaunch
from attnlab.kernels._primitives import (
    _flag_index_error,
    _round_on_grid,
    _sequence_bounds,
    _to_e4m3,
    kernel_is_interpreted,
)
from attnlab.kernels.configs import head_dim_padded


@triton.jit
def _store_row(src, dst, x, mask, to_nan, descale, QUANTISE: tl.constexpr,
               EMULATE: tl.constexpr):
    """x (fp32) into ``dst`` in its dtype, NaN where ``to_nan``.  QUANTISE (an fp8
    cache): rounded to ``src``'s dtype first (what the reference quantises), divided
    by ``descale`` in fp32, saturated to +-448 (a NaN stays NaN), then rounded to
    e4m3 (``_to_e4m3``'s rounding is sign-symmetric)."""
    x = tl.where(to_nan, float("nan"), x)
    if QUANTISE:
        if EMULATE:  # the interpreter's fp32 -> bf16/fp16 cast truncates: round first
            if src.dtype.element_ty == tl.bfloat16:
                x = _round_on_grid(x, 7, -119)  # bf16 below 2^-119: far under e4m3's grid
            else:
                x = _round_on_grid(x, 10, -14)
        x = x.to(src.dtype.element_ty).to(tl.float32) / descale
        x = _to_e4m3(tl.where(x > 448.0, 448.0, tl.where(x < -448.0, -448.0, x)), EMULATE)
    tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_row(src, dst, cos_row, sin_row, stride_cos_d, stride_sin_d, to_nan, descale,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                ROTARY_HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
                QUANTISE: tl.constexpr, EMULATE: tl.constexpr):
    """One head's row from ``src`` to ``dst``: the first 2 x ROTARY_HALF features rotated
    (pairs (2i, 2i + 1) interleaved, else (i, i + ROTARY_HALF)), the rest copied; NaN
    throughout where ``to_nan``; quantised over ``descale`` with QUANTISE (_store_row)."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tail = (offs_d >= 2 * ROTARY_HALF) & (offs_d < HEAD_DIM)
    x = tl.load(src + offs_d, mask=tail, other=0.0).to(tl.float32)
    _store_row(src, dst + offs_d, x, tail, to_nan, descale, QUANTISE, EMULATE)
    if ROTARY_HALF > 0:
        offs_i = tl.arange(0, HALF_PAD)
        pairs = offs_i < ROTARY_HALF
        if INTERLEAVED:
            first = 2 * offs_i
            second = first + 1
        else:
            first = offs_i
            second = offs_i + ROTARY_HALF
        x1 = tl.load(src + first, mask=pairs, other=0.0).to(tl.float32)
        x2 = tl.load(src + second, mask=pairs, other=0.0).to(tl.float32)
        c = tl.load(cos_row + offs_i * stride_cos_d, mask=pairs, other=0.0).to(tl.float32)
        s = tl.load(sin_row + offs_i * stride_sin_d, mask=pairs, other=0.0).to(tl.float32)
        _store_row(src, dst + first, x1 * c - x2 * s, pairs, to_nan, descale, QUANTISE,
                   EMULATE)
        _store_row(src, dst + second, x1 * s + x2 * c, pairs, to_nan, descale, QUANTISE,
                   EMULATE)


@triton.jit
def _shared_slot(ERRORS, b, pos, page, row, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX,
                 BLOCK_TABLE, stride_block_table, cache_seqlen, seqlen_new, capacity,
                 cache_batch, batch, shared_columns,
                 PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                 HAS_BATCH_IDX: tl.constexpr, BLOCK_B: tl.constexpr):
    """(contested, other): whether another append of this call writes the slot that
    sequence ``b``'s position ``pos`` writes (cache row ``row``, or page ``page``) --
    another sequence's, or ``b``'s own through a page its table repeats -- and the
    smallest such sequence.  Sequences with bad indices write nothing and are skipped."""
    other = batch
    for b0 in range(0, batch, BLOCK_B):
        ob = b0 + tl.arange(0, BLOCK_B)
        start, _, orow, obad = _sequence_bounds(
            ERRORS, ob, ob < batch, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX,
            cache_seqlen, seqlen_new, capacity, cache_batch, HAS_SEQLENS, HAS_LEFTPAD,
            HAS_BATCH_IDX, False)
        live = (ob < batch) & ~obad
        if PAGE_SIZE == 0:
            hit = live & (ob != b) & (orow == row) & (pos >= start) & (pos < start + seqlen_new)
        else:
            # The columns sequence ob writes, each at this slot's in-page offset.
            hit = ob < 0
            for c in range(0, shared_columns):
                column = start // PAGE_SIZE + c
                at = column * PAGE_SIZE + pos % PAGE_SIZE
                writes = live & (at >= start) & (at < start + seqlen_new)
                their = tl.load(BLOCK_TABLE + ob.to(tl.int64) * stride_block_table + column,
                                mask=writes, other=-1)
                hit = hit | (writes & (their == page) & ((ob != b) | (at != pos)))
        other = tl.minimum(other, tl.min(tl.where(hit, ob, batch), 0))
    return other < batch, other


# Lengths and counts change per call (one compile); cache_seqlen (an int cache_seqlens)
# follows the tensors: a planned launch passes it per call.
@triton.jit(do_not_specialize=["cache_seqlen", "batch", "tokens", "seqlen_q", "seqlen_new",
                               "num_heads", "num_kv_heads", "capacity", "cache_batch",
                               "num_pages", "seqlen_ro", "shared_columns"])
def _rotary_append(
    # pointers
    Q, Q_OUT, K_NEW, V_NEW, K_CACHE, V_CACHE, COS, SIN,
    CACHE_SEQLENS, CACHE_BATCH_IDX, CACHE_LEFTPAD, BLOCK_TABLE, ROTARY_SEQLENS, ERRORS,
    K_DESCALE, V_DESCALE,  # an fp8 cache's (batch, kv_heads) fp32 factors (QUANTISE)
    cache_seqlen,
    # strides (batch, seq, head) of q, q_out, k, v; (row or page, position, head) of the
    # caches; (position, feature) of cos and sin; the head dims are unit-stride
    stride_qb, stride_qm, stride_qh, stride_ob, stride_om, stride_oh,
    stride_kb, stride_km, stride_kh, stride_vb, stride_vm, stride_vh,
    stride_kcb, stride_kcn, stride_kch, stride_vcb, stride_vcn, stride_vch,
    stride_cos, stride_cos_d, stride_sin, stride_sin_d, stride_block_table,
    stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    # sizes
    batch, tokens, seqlen_q, seqlen_new, num_heads, num_kv_heads, capacity, cache_batch,
    num_pages, seqlen_ro, shared_columns,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROTARY_HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr, ROTATE_Q: tl.constexpr,
    Q_SAME_POSITION: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_ROTARY_SEQLENS: tl.constexpr, CHECK_SHARED: tl.constexpr, BLOCK_B: tl.constexpr,
    QUANTISE: tl.constexpr, EMULATE_FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // tokens
    t = pid % tokens
    cache_len, _, row, bad = _sequence_bounds(
        ERRORS, b, b >= 0, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX, cache_seqlen,
        seqlen_new, capacity, cache_batch, HAS_SEQLENS, HAS_LEFTPAD, HAS_BATCH_IDX, True)
    if HAS_ROTARY_SEQLENS:  # noqa: SIM108 -- a constexpr branch, not a runtime select
        start = tl.load(ROTARY_SEQLENS + b)
    else:
        start = cache_len

    if t < seqlen_new:
        pos = cache_len + t
        if PAGE_SIZE == 0:
            page = 0
            k_dst = K_CACHE + row.to(tl.int64) * stride_kcb + pos.to(tl.int64) * stride_kcn
            v_dst = V_CACHE + row.to(tl.int64) * stride_vcb + pos.to(tl.int64) * stride_vcn
        else:
            column = pos // PAGE_SIZE
            page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_block_table + column,
                           mask=~bad, other=0)
            bad_page = ~bad & ((page < 0) | (page >= num_pages))
            _flag_index_error(ERRORS, 3, b, column, page, num_pages + 0 * b, bad_page)
            bad = bad | bad_page
            page = tl.where(bad, 0, page)
            in_page = (pos % PAGE_SIZE).to(tl.int64)
            k_dst = K_CACHE + page.to(tl.int64) * stride_kcb + in_page * stride_kcn
            v_dst = V_CACHE + page.to(tl.int64) * stride_vcb + in_page * stride_vcn
        contested = bad & ~bad
        if CHECK_SHARED:
            contested, other = _shared_slot(
                ERRORS, b, pos, page, row, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX,
                BLOCK_TABLE, stride_block_table, cache_seqlen, seqlen_new, capacity,
                cache_batch, batch, shared_columns, PAGE_SIZE, HAS_SEQLENS, HAS_LEFTPAD,
                HAS_BATCH_IDX, BLOCK_B)
            contested = contested & ~bad
            # The record's limit names the form (index_checks): 1 pages, 0 cache rows.
            _flag_index_error(ERRORS, 4, b, pos, other, (PAGE_SIZE > 0) + 0 * b, contested)
        at = start + t
        rotary_bad = bad & ~bad
        if ROTARY_HALF > 0:
            rotary_bad = ~bad & ((at < 0) | (at >= seqlen_ro))
            _flag_index_error(ERRORS, 5, b, t, at, seqlen_ro + 0 * b, rotary_bad)
            at = tl.where(rotary_bad, 0, at)
        cos_row = COS + at.to(tl.int64) * stride_cos
        sin_row = SIN + at.to(tl.int64) * stride_sin
        if bad.to(tl.int32) == 0:
            k_src = K_NEW + b.to(tl.int64) * stride_kb + t * stride_km
            v_src = V_NEW + b.to(tl.int64) * stride_vb + t * stride_vm
            for h in range(0, num_kv_heads):
                k_descale = 1.0
                v_descale = 1.0
                if QUANTISE:
                    k_descale = tl.load(K_DESCALE + b.to(tl.int64) * stride_kdb + h * stride_kdh)
                    v_descale = tl.load(V_DESCALE + b.to(tl.int64) * stride_vdb + h * stride_vdh)
                _rotate_row(k_src + h * stride_kh, k_dst + h * stride_kch, cos_row, sin_row,
                            stride_cos_d, stride_sin_d, contested | rotary_bad, k_descale,
                            HEAD_DIM, HEAD_DIM_PAD, ROTARY_HALF, HALF_PAD, INTERLEAVED,
                            QUANTISE, EMULATE_FP8)
                _rotate_row(v_src + h * stride_vh, v_dst + h * stride_vch, cos_row, sin_row,
                            stride_cos_d, stride_sin_d, contested, v_descale, HEAD_DIM,
                            HEAD_DIM_PAD, 0, HALF_PAD, INTERLEAVED, QUANTISE, EMULATE_FP8)

    if ROTATE_Q:  # noqa: SIM102 -- a constexpr branch around a runtime one
        if t < seqlen_q:
            if Q_SAME_POSITION:  # noqa: SIM108 -- a constexpr branch
                at_q = start
            else:
                at_q = start + t
            q_bad = (at_q < 0) | (at_q >= seqlen_ro)
            _flag_index_error(ERRORS, 5, b, t, at_q, seqlen_ro + 0 * b, q_bad)
            at_q = tl.where(q_bad, 0, at_q)
            q_src = Q + b.to(tl.int64) * stride_qb + t * stride_qm
            q_dst = Q_OUT + b.to(tl.int64) * stride_ob + t * stride_om
            for h in range(0, num_heads):
                _rotate_row(q_src + h * stride_qh, q_dst + h * stride_oh,
                            COS + at_q.to(tl.int64) * stride_cos,
                            SIN + at_q.to(tl.int64) * stride_sin, stride_cos_d, stride_sin_d,
                            q_bad, 1.0, HEAD_DIM, HEAD_DIM_PAD, ROTARY_HALF, HALF_PAD,
                            INTERLEAVED, False, EMULATE_FP8)


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

# Sequences compared at once by the shared-slot check.
SHARED_BLOCK_B = 64
_APPEND = DirectLauncher(_rotary_append)


class AppendPlan:
    """The append (and rotary) launch for one call signature: every size, stride and
    switch fixed once; a call allocates q's rotated copy (with rotary) and launches.

    ``indices`` are the index tensors the call passes (None where absent), as the
    kernel reads them: cache_seqlens (a tensor, or None for an int), cache_batch_idx,
    cache_leftpad, block_table, rotary_seqlens.  ``descales``: an fp8 cache's
    (batch, kv_heads) k/v descale views (None for a bf16/fp16 cache); a call passes
    tensors sharing their data pointers (the strides are planned here)."""

    def __init__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, *, indices,
                 capacity: int, interleaved: bool, q_same_position: bool,
                 descales=(None, None)) -> None:
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_seqlens = indices
        k_descale, v_descale = descales
        quantise = k_descale is not None
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_new, num_kv_heads = k.shape[1], k.shape[2]
        paged = block_table is not None
        self.rotary = rotary_cos is not None
        rotary_half = rotary_cos.shape[1] if self.rotary else 0
        tokens = max(seqlen_new, seqlen_q if self.rotary else 0)
        self.q_shape = q.shape
        q_out_strides = torch.empty(q.shape, device="meta").stride()[:3]
        page_size = k_cache.shape[1] if paged else 0
        # Columns of the block table a run of seqlen_new positions can touch.
        shared_columns = -(-(seqlen_new - 1) // page_size) + 1 if paged else 0
        self.errors = index_checks.error_buffer(q.device)
        cos_strides = (rotary_cos.stride() if self.rotary else (0, 0))
        sin_strides = (rotary_sin.stride() if self.rotary else (0, 0))
        static = (
            *q.stride()[:3], *q_out_strides, *k.stride()[:3], *v.stride()[:3],
            *k_cache.stride()[:3], *v_cache.stride()[:3], *cos_strides, *sin_strides,
            block_table.stride(0) if paged else 0,
            *(k_descale.stride() if quantise else (0, 0)),
            *(v_descale.stride() if quantise else (0, 0)),
            batch, tokens, seqlen_q, seqlen_new, num_heads, num_kv_heads, capacity,
            0 if paged else k_cache.shape[0], k_cache.shape[0] if paged else 0,
            rotary_cos.shape[0] if self.rotary else 0, shared_columns)
        meta = dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), ROTARY_HALF=rotary_half,
            HALF_PAD=triton.next_power_of_2(max(rotary_half, 1)), INTERLEAVED=interleaved,
            ROTATE_Q=self.rotary, Q_SAME_POSITION=q_same_position, PAGE_SIZE=page_size,
            HAS_SEQLENS=cache_seqlens is not None, HAS_BATCH_IDX=cache_batch_idx is not None,
            HAS_LEFTPAD=cache_leftpad is not None,
            HAS_ROTARY_SEQLENS=self.rotary and rotary_seqlens is not None,
            CHECK_SHARED=paged or cache_batch_idx is not None, BLOCK_B=SHARED_BLOCK_B,
            QUANTISE=quantise, EMULATE_FP8=quantise and kernel_is_interpreted(),
            num_warps=1, num_stages=1)
        self.launch = PlannedLaunch(_APPEND, (batch * tokens,), static, meta)

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, indices,
                 cache_seqlen: int, descales=(None, None)) -> torch.Tensor:
        """Append (in place) and return q as the attention reads it: its rotated copy
        with rotary, else q itself."""
        q_out = torch.empty(self.q_shape, dtype=q.dtype, device=q.device) if self.rotary else q
        unused = self.errors  # a valid pointer for arguments a constexpr switch turns off
        self.launch(q, q_out, k, v, k_cache, v_cache,
                    unused if rotary_cos is None else rotary_cos,
                    unused if rotary_sin is None else rotary_sin,
                    *(unused if t is None else t for t in indices), self.errors,
                    *(unused if t is None else t for t in descales), cache_seqlen)
        return q_out
