"""FlashAttention-2 backward in Triton: two kernels and their launcher.

FA-2 (Dao 2023) Algorithm 2 recomputes S and P tile by tile from Q, K and the
saved LSE instead of reading an N x N matrix back from HBM: the lesson's trade of
FLOPs for bandwidth.  With P_ij = exp(S_ij - LSE_i) and D_i = rowsum(dO ∘ O)_i,

    dV = P^T dO,   dP = dO V^T,   dS = P ∘ (dP - D),   dQ = scale dS K,   dK = scale dS^T Q.

The work is split two ways, neither of which uses atomics, so every run gives
bit-identical dQ, dK and dV (``deterministic=True`` therefore changes nothing):

* ``_attn_bwd_dq`` (launched first): one program owns ``BLOCK_M`` query rows and
  streams K/V tiles.  It forms its rows' D = rowsum(dO ∘ O) in fp32 (minus dLSE when
  the LSE output itself was differentiated: d LSE_i / d S_ij = P_ij folds into D) and
  stores D, and for the Gluon dK/dV kernel LSE in log2 units, for the kernel after it:
  no separate preprocess launch (one launch less per step, which counts at short
  sequences where the host's time per step is the bound);
* ``_attn_bwd_dkdv``: one program owns ``BLOCK_N`` keys of one KV head and streams
  the query tiles of **every query head of its GQA group** past them, so dK and dV
  are summed in registers, never through atomics or an expanded K/V.

Masking follows the forward: the skip bound drops tiles wholly outside the band
(``_q_band_bounds`` / ``_kv_band_bounds`` in ``_primitives``), band-edge and ragged
tiles run the ``MASKED`` stage, and tiles fully inside the band run the unmasked
stage with no mask arithmetic.  Softcap: with t = tanh(scale * s / c) the capped
score is c * t, whose derivative is scale * (1 - t^2), recomputed from t.

64-bit offsets: the per-(batch, head) bases and every tile's row offset are
multiplied in int64 (one scalar product per tile, not per element), so tensors past
2^31 elements are addressed correctly with no separate 32-bit path; the offsets
inside one tile (at most 128 rows times a row stride) stay int32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

import attnlab.kernels.dispatch as dispatch
from attnlab.checks import check_index_tensor, check_instance
from attnlab.inputs import TORCH_DTYPE_NAMES, AttentionInputs, layout_named
from attnlab.kernels._aot import compile_triton
from attnlab.kernels._launch import (
    DirectLauncher,
    PlanCache,
    PlannedLaunch,
    TracedLauncher,
    tensor_key,
)
from attnlab.kernels._primitives import (
    LOG2E,
    _band_visible,
    _kv_band_bounds,
    _load_kv_tile,
    _mma,
    _q_band_bounds,
    _softcap_tanh,
    kernel_is_interpreted,
    launch_is_traced,
)
from attnlab.kernels.configs import (
    BackwardConfig,
    backward_config,
    head_dim_padded,
)
from attnlab.masking import effective_window, reach_window
from attnlab.shapes import AttentionShape

if TYPE_CHECKING:  # the Gluon modules are imported only on the Triton they were built for
    from attnlab.kernels.backward_sm90 import Sm90BackwardConfig
    from attnlab.kernels.dq_sm90 import Sm90DqConfig


@triton.jit
def _lse_log2(lse):
    """LSE in log2 units.  A row that sees no key has LSE = -inf; +inf in its place makes
    exp2(s - lse) exactly 0 (P = 0, not NaN)."""
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _row_stats(lse_base, delta_base, offs_m, seqlen_q, MASKED: tl.constexpr):
    """LSE (in log2 units, ``_lse_log2``) and D of a query tile."""
    if MASKED:
        in_range = offs_m < seqlen_q
        lse = tl.load(lse_base + offs_m, mask=in_range, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=in_range, other=0.0)
    else:
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    return _lse_log2(lse), delta


# ---------------------------------------------------------------------------
# dK, dV: one program per (key block, KV head), looping over its group's query heads
# ---------------------------------------------------------------------------

@triton.jit
def _dkdv_tiles(
    dk, dv, k, v,
    q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
    offs_n, offs_d, q_begin, q_end,
    seqlen_q, diag_offset, window_left, window_right,
    qk_scale, softcap_log2, softcap_inv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WANT_DK: tl.constexpr, WANT_DV: tl.constexpr,
):
    """Add the query tiles [q_begin, q_end) of one query head to this key block's dK
    and/or dV (``WANT_DK``, ``WANT_DV``: a dV-only program never forms dP or dS).

    Works on the transposed tile (keys x rows) so dK and dV come out of two MMAs
    without transposing the accumulators."""
    for start_m in range(q_begin, q_end, BLOCK_M):
        row_offset = tl.cast(start_m, tl.int64)
        q = _load_kv_tile(q_base + row_offset * stride_qm, stride_qm, 0, offs_d,
                          seqlen_q - start_m, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        do = _load_kv_tile(do_base + row_offset * stride_dom, stride_dom, 0, offs_d,
                           seqlen_q - start_m, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        lse_log2, delta = _row_stats(lse_base, delta_base, offs_m, seqlen_q, MASKED)

        qk_t = _mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), UPCAST_DOT)
        if HAS_SOFTCAP:
            tanh_t = _softcap_tanh(qk_t, softcap_inv)
            s_t = softcap_log2 * tanh_t
        else:
            s_t = qk_t * qk_scale
        if MASKED:
            # Rows past seqlen_q and keys outside the band get P = exp2(-inf) = 0.  Keys
            # past seqlen_k are this block's padding: their dK/dV rows are never stored.
            visible = (offs_m[None, :] < seqlen_q) & _band_visible(
                offs_m[None, :], offs_n[:, None], diag_offset, window_left, window_right,
                HAS_LEFT, HAS_RIGHT)
            s_t = tl.where(visible, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - lse_log2[None, :])
        if WANT_DV:
            dv = _mma(p_t.to(do.dtype), do, dv, UPCAST_DOT)
        if WANT_DK:
            dp_t = _mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32),
                        UPCAST_DOT)
            ds_t = p_t * (dp_t - delta[None, :])
            if MASKED:
                # A hidden key's P is 0, but 0 * NaN is NaN: a row whose O is NaN (D = NaN)
                # must not reach the dK of keys it never saw.  Band-edge tiles only.
                ds_t = tl.where(visible, ds_t, 0.0)
            if HAS_SOFTCAP:
                ds_t = ds_t * (1.0 - tanh_t * tanh_t)
            dk = _mma(ds_t.to(q.dtype), q, dk, UPCAST_DOT)
    return dk, dv


@triton.jit
def _dkdv_block(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_lseb, stride_lseh, stride_deltab, stride_deltah,
    off_b, off_hk, q_rows, k_rows, start_n, group_size, seqlen_q, seqlen_k,
    window_left, window_right, qk_scale, softcap_log2, softcap_inv, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr, WANT_DK: tl.constexpr, WANT_DV: tl.constexpr,
):
    """dK and/or dV of one key block of one KV head, summed over its GQA group."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # The owned K/V block stays on chip for the whole program (V: only where dP is formed).
    k = _load_kv_tile(K + off_b * stride_kb + off_hk * stride_kh + k_rows * stride_kn, stride_kn, 0,
                      offs_d, seqlen_k - start_n, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True)
    v = k
    if WANT_DK:
        v = _load_kv_tile(V + off_b * stride_vb + off_hk * stride_vh + k_rows * stride_vn,
                          stride_vn, 0, offs_d, seqlen_k - start_n, BLOCK_N, HEAD_DIM,
                          HEAD_DIM_PAD, True)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)

    diag_offset = seqlen_k - seqlen_q
    q_lo, full_lo, full_hi, q_hi = _q_band_bounds(
        start_n, start_n + BLOCK_N - 1, seqlen_q, diag_offset, window_left, window_right,
        BLOCK_M, HAS_LEFT, HAS_RIGHT)

    for group_head in range(group_size):
        off_h = off_hk * group_size + group_head
        q_base = Q + off_b * stride_qb + off_h * stride_qh + q_rows * stride_qm
        do_base = DO + off_b * stride_dob + off_h * stride_doh + q_rows * stride_dom
        lse_base = LSE + off_b * stride_lseb + off_h * stride_lseh + q_rows
        delta_base = DELTA + off_b * stride_deltab + off_h * stride_deltah + q_rows
        # Stage 1: rows on the diagonal / the window's right edge (element mask).
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base,
            stride_qm, stride_dom, offs_n, offs_d, q_lo, full_lo,
            seqlen_q, diag_offset, window_left, window_right, qk_scale, softcap_log2, softcap_inv,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            UPCAST_DOT, WANT_DK, WANT_DV)
        # Stage 2: rows that see the whole key block (no mask).
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base,
            stride_qm, stride_dom, offs_n, offs_d, full_lo, full_hi,
            seqlen_q, diag_offset, window_left, window_right, qk_scale, softcap_log2, softcap_inv,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            UPCAST_DOT, WANT_DK, WANT_DV)
        # Stage 3: rows at the window's left edge and the ragged last query tile (mask).
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base,
            stride_qm, stride_dom, offs_n, offs_d, full_hi, q_hi,
            seqlen_q, diag_offset, window_left, window_right, qk_scale, softcap_log2, softcap_inv,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            UPCAST_DOT, WANT_DK, WANT_DV)

    # Keys no query sees never met a visible score: dK = dV = 0 exactly.
    store_mask = offs_n[:, None] < seqlen_k
    if HEAD_DIM != HEAD_DIM_PAD:
        store_mask = store_mask & (offs_d[None, :] < HEAD_DIM)
    local_n = tl.arange(0, BLOCK_N)
    if WANT_DK:
        dk_ptrs = (DK + off_b * stride_dkb + off_hk * stride_dkh + k_rows * stride_dkn
                   + local_n[:, None] * stride_dkn + offs_d[None, :])
        tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=store_mask)
    if WANT_DV:
        dv_ptrs = (DV + off_b * stride_dvb + off_hk * stride_dvh + k_rows * stride_dvn
                   + local_n[:, None] * stride_dvn + offs_d[None, :])
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_kv_heads", "group_size", "seqlen_q", "seqlen_k",
                               "num_n_blocks", "window_left", "window_right"])
def _attn_bwd_dkdv(
    # pointers
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS_Q, CU_SEQLENS_K,
    # strides (batch, head, seq); the head dim is unit-stride
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_lseb, stride_lseh, stride_deltab, stride_deltah,
    # sizes
    num_kv_heads, group_size, seqlen_q, seqlen_k, num_n_blocks,
    window_left, window_right,
    # scalars
    qk_scale, softcap_log2, softcap_inv, scale,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT_OUTPUTS: tl.constexpr,
):
    """One program per (key block, KV head), or with SPLIT_OUTPUTS two: the even one
    forms dV (S, P, P^T dO), the odd one dK (S, P, dP, dS^T Q).  Split, each program
    holds one fp32 accumulator instead of two, so a wide key block fits the registers at
    head_dim 256 (BackwardConfig.dkdv_split); the pair runs side by side, reading the
    same Q and dO tiles through L2."""
    # fp32 scalars whoever launches (Inductor passes fp64), as in forward._attn_fwd.
    qk_scale, softcap_log2 = tl.cast(qk_scale, tl.float32), tl.cast(softcap_log2, tl.float32)
    softcap_inv, scale = tl.cast(softcap_inv, tl.float32), tl.cast(scale, tl.float32)
    block_id = tl.program_id(0)
    if SPLIT_OUTPUTS:
        block_id = block_id // 2
    # Causal: the first key blocks are seen by the most queries and start first.
    start_n = block_id % num_n_blocks * BLOCK_N
    off_bh = block_id // num_n_blocks
    off_b = off_bh // num_kv_heads
    off_hk = (off_bh % num_kv_heads).to(tl.int64)
    q_start = tl.zeros([], dtype=tl.int32)
    k_start = tl.zeros([], dtype=tl.int32)
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + off_b)
        seqlen_q = tl.load(CU_SEQLENS_Q + off_b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + off_b)
        seqlen_k = tl.load(CU_SEQLENS_K + off_b + 1) - k_start
    if start_n >= seqlen_k:
        return
    off_b = off_b.to(tl.int64)
    q_rows = q_start.to(tl.int64)
    k_rows = (k_start + start_n).to(tl.int64)
    # Which outputs a program forms must be a compile-time choice; unsplit, dv_only stays
    # the constant False and only the second call is built.
    dv_only = False
    if SPLIT_OUTPUTS:
        dv_only = tl.program_id(0) % 2 == 0
    if dv_only:
        _dkdv_block(
            Q, K, V, DO, LSE, DELTA, DK, DV,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
            stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
            stride_lseb, stride_lseh, stride_deltab, stride_deltah,
            off_b, off_hk, q_rows, k_rows, start_n, group_size, seqlen_q, seqlen_k,
            window_left, window_right, qk_scale, softcap_log2, softcap_inv, scale,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            UPCAST_DOT, False, True)
    else:
        _dkdv_block(
            Q, K, V, DO, LSE, DELTA, DK, DV,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
            stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
            stride_lseb, stride_lseh, stride_deltab, stride_deltah,
            off_b, off_hk, q_rows, k_rows, start_n, group_size, seqlen_q, seqlen_k,
            window_left, window_right, qk_scale, softcap_log2, softcap_inv, scale,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
            UPCAST_DOT, True, not SPLIT_OUTPUTS)


# ---------------------------------------------------------------------------
# dQ: one program per (query block, query head), looping over K/V tiles
# ---------------------------------------------------------------------------

@triton.jit
def _dq_tiles(
    dq, q, do, lse_log2, delta,
    k_base, v_base, stride_kn, stride_vn,
    offs_m, offs_d, kv_begin, kv_end,
    seqlen_k, diag_offset, window_left, window_right,
    qk_scale, softcap_log2, softcap_inv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Add the K/V tiles [kv_begin, kv_end) to this query block's (unscaled) dQ."""
    for start_n in range(kv_begin, kv_end, BLOCK_N):
        key_offset = tl.cast(start_n, tl.int64)
        k = _load_kv_tile(k_base + key_offset * stride_kn, stride_kn, 0, offs_d,
                          seqlen_k - start_n, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        v = _load_kv_tile(v_base + key_offset * stride_vn, stride_vn, 0, offs_d,
                          seqlen_k - start_n, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT)
        if HAS_SOFTCAP:
            tanh_s = _softcap_tanh(qk, softcap_inv)
            s = softcap_log2 * tanh_s
        else:
            s = qk * qk_scale
        if MASKED:
            # Padded keys (past seqlen_k) read as 0 but would still get P > 0: mask them.
            offs_n = start_n + tl.arange(0, BLOCK_N)
            visible = (offs_n[None, :] < seqlen_k) & _band_visible(
                offs_m[:, None], offs_n[None, :], diag_offset, window_left, window_right,
                HAS_LEFT, HAS_RIGHT)
            s = tl.where(visible, s, float("-inf"))
        p = tl.math.exp2(s - lse_log2[:, None])
        dp = _mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq = _mma(ds.to(k.dtype), k, dq, UPCAST_DOT)
    return dq


@triton.jit(do_not_specialize=["num_heads", "group_size", "seqlen_q", "seqlen_k",
                               "num_m_blocks", "block_major", "window_left", "window_right"])
def _attn_bwd_dq(
    # pointers; DELTA (and LSE_LOG2) are written here, for the dK/dV kernel after this one
    Q, K, V, O, DO, LSE, DLSE, DELTA, LSE_LOG2, DQ, CU_SEQLENS_Q, CU_SEQLENS_K,
    # strides (batch, head, seq); the head dim is unit-stride.  (batch, head) of LSE and
    # dLSE, and of D and LSE_LOG2
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_lseb, stride_lseh, stride_deltab, stride_deltah,
    # sizes; the programs' order (dispatch.dq_block_major)
    num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, block_major,
    window_left, window_right,
    # scalars
    qk_scale, softcap_log2, softcap_inv, scale,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE_M: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_DLSE: tl.constexpr, WRITE_LSE_LOG2: tl.constexpr,
):
    # fp32 scalars whoever launches (Inductor passes fp64), as in forward._attn_fwd.
    qk_scale, softcap_log2 = tl.cast(qk_scale, tl.float32), tl.cast(softcap_log2, tl.float32)
    softcap_inv, scale = tl.cast(softcap_inv, tl.float32), tl.cast(scale, tl.float32)
    if block_major != 0:
        heads_by_batch = tl.num_programs(0) // num_m_blocks
        pid_m = tl.program_id(0) // heads_by_batch
        off_bh = tl.program_id(0) % heads_by_batch
    else:
        pid_m = tl.program_id(0) % num_m_blocks
        off_bh = tl.program_id(0) // num_m_blocks
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    off_hk = (off_h // group_size).to(tl.int64)
    off_h = off_h.to(tl.int64)
    q_start = tl.zeros([], dtype=tl.int32)
    k_start = tl.zeros([], dtype=tl.int32)
    seq_m_blocks = num_m_blocks
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + off_b)
        seqlen_q = tl.load(CU_SEQLENS_Q + off_b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + off_b)
        seqlen_k = tl.load(CU_SEQLENS_K + off_b + 1) - k_start
        seq_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    if pid_m >= seq_m_blocks:
        return
    # With a causal band the last query blocks do the most work, so they start first.
    start_m = ((seq_m_blocks - 1 - pid_m) if REVERSE_M else pid_m) * BLOCK_M
    off_b = off_b.to(tl.int64)
    q_rows = (q_start + start_m).to(tl.int64)
    k_rows = k_start.to(tl.int64)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_kv_tile(Q + off_b * stride_qb + off_h * stride_qh + q_rows * stride_qm, stride_qm, 0,
                      offs_d, seqlen_q - start_m, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, True)
    do = _load_kv_tile(DO + off_b * stride_dob + off_h * stride_doh + q_rows * stride_dom,
                       stride_dom, 0, offs_d, seqlen_q - start_m, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD,
                       True)
    o = _load_kv_tile(O + off_b * stride_ob + off_h * stride_oh + q_rows * stride_om, stride_om, 0,
                      offs_d, seqlen_q - start_m, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, True)
    # This block's rows of D = rowsum(dO ∘ O) (minus dLSE) and of LSE in log2 units: used
    # here and stored for the dK/dV kernel, which runs after this one.  Rows past seqlen_q
    # read q = O = dO = 0 and LSE = 0: their dS is 0 and nothing of them is stored.
    stat_offset = off_b * stride_lseb + off_h * stride_lseh + q_start + offs_m
    out_offset = off_b * stride_deltab + off_h * stride_deltah + q_start + offs_m
    in_range = offs_m < seqlen_q
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + stat_offset, mask=in_range, other=0.0)
    lse_log2 = _lse_log2(tl.load(LSE + stat_offset, mask=in_range, other=0.0))
    tl.store(DELTA + out_offset, delta, mask=in_range)
    if WRITE_LSE_LOG2:
        tl.store(LSE_LOG2 + out_offset, lse_log2, mask=in_range)
    k_base = K + off_b * stride_kb + off_hk * stride_kh + k_rows * stride_kn
    v_base = V + off_b * stride_vb + off_hk * stride_vh + k_rows * stride_vn
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    diag_offset = seqlen_k - seqlen_q
    kv_lo, full_lo, full_hi, kv_hi = _kv_band_bounds(
        start_m, start_m + BLOCK_M - 1, seqlen_k, diag_offset, window_left, window_right,
        BLOCK_N, HAS_LEFT, HAS_RIGHT)
    # Stage 1: tiles cut by the window's left edge (element mask).
    dq = _dq_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                   kv_lo, full_lo, seqlen_k, diag_offset, window_left, window_right,
                   qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD,
                   True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)
    # Stage 2: tiles wholly inside the band (no mask).
    dq = _dq_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                   full_lo, full_hi, seqlen_k, diag_offset, window_left, window_right,
                   qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD,
                   False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)
    # Stage 3: diagonal tiles and the ragged last tile (element mask).
    dq = _dq_tiles(dq, q, do, lse_log2, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                   full_hi, kv_hi, seqlen_k, diag_offset, window_left, window_right,
                   qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD,
                   True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)

    # A row that sees no key has P = 0 everywhere: dQ = 0.
    dq = dq * scale
    store_mask = offs_m[:, None] < seqlen_q
    if HEAD_DIM != HEAD_DIM_PAD:
        store_mask = store_mask & (offs_d[None, :] < HEAD_DIM)
    local_m = tl.arange(0, BLOCK_M)
    dq_ptrs = (DQ + off_b * stride_dqb + off_h * stride_dqh + q_rows * stride_dqm
               + local_m[:, None] * stride_dqm + offs_d[None, :])
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=store_mask)


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------



def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # Other strides may be anything, including 0 (an expanded dout): only the head
    # dim must be unit-stride for the kernels' vector loads.
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_dout(dout, out) -> None:
    check_instance("dout", dout, torch.Tensor)
    if dout.shape != out.shape:
        raise ValueError(f"dout must have the output's shape {tuple(out.shape)}, "
                         f"got {tuple(dout.shape)}")
    if dout.dtype != out.dtype:
        raise TypeError(f"dout must have the output's dtype {out.dtype}, got {dout.dtype}")
    if dout.device != out.device:
        raise ValueError(f"dout must be on the output's device {out.device}, got {dout.device}")


def _check_varlen(layout, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A varlen call's cu_seqlens pair as the kernels read them
    (:func:`attnlab.checks.check_index_tensor`: int32 on q's device, contiguous); a dense
    call must pass none."""
    if not layout_named(layout).is_varlen:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError(f"cu_seqlens_q/cu_seqlens_k need layout='thd', got layout={layout!r}")
        return None, None
    cu_seqlens_q = check_index_tensor("cu_seqlens_q", cu_seqlens_q, device=q.device)
    cu_seqlens_k = check_index_tensor("cu_seqlens_k", cu_seqlens_k, device=q.device)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1:
            raise ValueError(f"{name} must be 1-D for layout='thd', got shape {tuple(cu.shape)}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 2:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length batch + 1 >= 2, "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int for layout='thd', got {value!r}")
    return cu_seqlens_q, cu_seqlens_k


# One direct launcher per kernel: the compiled kernels it keeps outlive the calls.
_DKDV, _DQ = DirectLauncher(_attn_bwd_dkdv), DirectLauncher(_attn_bwd_dq)
# Backward plans by call signature (kernels/_launch.PlanCache).
_PLANS = PlanCache()


def flash_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, *,
    layout: str, scale: float, causal: bool = False,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, deterministic: bool = False,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    config: BackwardConfig | None = None, dlse: torch.Tensor | None = None,
    dkdv_sm90: Sm90BackwardConfig | None = None, dq_sm90: Sm90DqConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of attention given dO, from the forward's q, k, v, O and LSE.

    ``layout`` is ``"bshd"``, ``"bhsd"`` or ``"thd"`` (varlen: (total_tokens, heads,
    head_dim) with ``cu_seqlens_q/k`` (int32, batch + 1 entries) and
    ``max_seqlen_q/k``; LSE then is (heads, total_q)).  LSE is natural log, float32,
    as the forward returns it.  Returns gradients in the layout and dtype of q, k, v.
    ``dlse`` (optional, LSE's shape) is the gradient flowing into the LSE output.

    Deterministic always: no kernel uses atomics (dK/dV are summed over the GQA group
    in registers, dQ has its own kernel), so ``deterministic=True`` and the default
    run the same code and give bit-identical results run to run.

    dK and dV come from the Gluon sm_90 kernel (``kernels/backward_sm90.py``) where its
    committed dispatch table says it measured faster and no ``config`` was given, or
    wherever ``dkdv_sm90`` (an ``Sm90BackwardConfig``) asks for it; a call that kernel
    cannot compute is then refused with the reason, never run elsewhere.  dQ likewise
    from ``kernels/dq_sm90.py`` (``dq_sm90``, an ``Sm90DqConfig``).
    """
    layout_named(layout)  # a name this module cannot read is refused before any plan
    _check_dout(dout, out)
    cu_seqlens_q, cu_seqlens_k = _check_varlen(
        layout, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    q, k, v, out, dout = (_unit_last_stride(t) for t in (q, k, v, out, dout))
    lse = lse.contiguous()
    if dlse is not None:
        if dlse.shape != lse.shape:
            raise ValueError(f"dlse must have LSE's shape {tuple(lse.shape)}, got {tuple(dlse.shape)}")
        dlse = dlse.to(torch.float32).contiguous()
    options = dict(layout=layout, scale=scale, causal=causal, window=tuple(window),
                   softcap=softcap, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, config=config, dkdv_sm90=dkdv_sm90,
                   dq_sm90=dq_sm90, has_dlse=dlse is not None)
    tensors = (q, k, v, out, dout, lse, dlse, cu_seqlens_q, cu_seqlens_k)
    if launch_is_traced(q):
        # Traced, each launch must be a graph node (wrap_triton's HOP) for Inductor, as in
        # attnlab.kernels.forward.flash_forward.
        launchers = (TracedLauncher(wrap_triton(_attn_bwd_dkdv)),
                     TracedLauncher(wrap_triton(_attn_bwd_dq)))
        plan = _plan_backward(*tensors, launchers=launchers, **options)
    else:
        # A real call goes straight to the compiled kernels after the first call with this
        # signature (kernels/_launch), skipping the choices below.
        key = (*options.values(), q.device, tensor_key(*tensors))
        plan = _PLANS.get(key, lambda: _plan_backward(
            *tensors, launchers=(_DKDV, _DQ), **options))
    return plan(*tensors)


class _BackwardPlan:
    """The two launches for one call signature: dQ, which also writes D (and, for the
    Gluon dK/dV kernel, LSE in log2 units) for its query rows, then dK/dV (each the
    Triton kernel's ``PlannedLaunch`` or a Gluon one's).  A call allocates dQ, dK, dV and
    D (``delta_shape``: LSE's, or with rows padded to a multiple of 4 for the Gluon
    kernel's TMA copies), copies an expanded dO once where a Gluon kernel reads it
    through TMA (``copy_dout``; ``gluon_dq``: the dQ kernel is one of them), and
    launches."""

    def __init__(self, dkdv, sm90_dkdv, dq, copy_dout: bool, gluon_dq: bool,
                 delta_shape: tuple[int, ...]) -> None:
        self.dkdv, self.sm90_dkdv, self.dq = dkdv, sm90_dkdv, dq
        self.copy_dout, self.gluon_dq, self.delta_shape = copy_dout, gluon_dq, delta_shape

    def __call__(self, q, k, v, out, dout, lse, dlse, cu_seqlens_q, cu_seqlens_k):
        delta = torch.empty(self.delta_shape, dtype=torch.float32, device=lse.device)
        lse_log2 = None if self.sm90_dkdv is None else torch.empty_like(delta)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # Unused pointer arguments still need a tensor; the constexpr switch keeps them unread.
        cu_q = lse if cu_seqlens_q is None else cu_seqlens_q
        cu_k = lse if cu_seqlens_k is None else cu_seqlens_k
        # A Triton launch was planned with dO's own strides: it reads dO as given.
        tma_dout = dout.contiguous() if self.copy_dout else dout
        self.dq(q, k, v, out, tma_dout if self.gluon_dq else dout, lse,
                lse if dlse is None else dlse, delta, delta if lse_log2 is None else lse_log2,
                dq, cu_q, cu_k)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if self.sm90_dkdv is not None:
            self.sm90_dkdv((k, v, q, tma_dout, lse_log2, delta), (dk, dv))
        else:
            self.dkdv(q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k)
        return dq, dk, dv


def _plan_backward(q, k, v, out, dout, lse, dlse, cu_seqlens_q, cu_seqlens_k, *, layout,
                   scale, causal, window, softcap, max_seqlen_q, max_seqlen_k,
                   config, dkdv_sm90, dq_sm90, has_dlse, launchers) -> _BackwardPlan:
    """What ``flash_backward`` launches for tensors of these sizes, strides and alignment."""
    inputs = AttentionInputs.read(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k)
    lay, batch, num_heads, num_kv_heads = inputs.layout, inputs.batch, inputs.heads, inputs.kv_heads
    seqlen_q, seqlen_k, head_dim = inputs.seqlen_q, inputs.seqlen_k, inputs.head_dim
    # LSE: (batch, heads, seqlen_q), or (heads, total_q) for varlen.
    stat_strides = (0, lse.stride(0)) if lay.is_varlen else (lse.stride(0), lse.stride(1))

    window_left, window_right = reach_window(effective_window(causal, window), seqlen_q, seqlen_k)
    has_left, has_right = window_left >= 0, window_right >= 0
    head_dim_pad = head_dim_padded(head_dim)
    interpreted = kernel_is_interpreted()
    explicit_config = config
    if config is None:
        shape = AttentionShape(batch=batch, query_heads=num_heads, kv_heads=num_kv_heads,
                               seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                               dtype=TORCH_DTYPE_NAMES.get(q.dtype, "bf16"), causal=causal,
                               window=tuple(window))
        config = backward_config(shape, interpreted=interpreted)

    # The kernels keep offsets inside one tile (rows below 128 times a row stride) in
    # int32; only a view with an absurd row stride could pass 2^31 there.
    tile_rows = max(config.dkdv_block_m, config.dkdv_block_n, config.dq_block_m,
                    config.dq_block_n)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        row_stride = abs(lay.bhs_strides(t)[2])
        if row_stride * tile_rows + head_dim_pad > 2**31 - 1:
            raise ValueError(f"{name}'s sequence stride ({row_stride} elements) is too large for "
                             "the kernels' 32-bit in-tile offsets; pass a contiguous tensor")

    # Decided before any launch: a forced sm_90 kernel that cannot run is refused first.
    sm90 = dispatch.dkdv_config(q, k, v, dout, layout=layout, causal=causal, window=window,
                      softcap=softcap, requested=dkdv_sm90, use_table=explicit_config is None)
    gluon_dq = dispatch.dq_config(q, k, v, dout, layout=layout, causal=causal, window=window,
                                  softcap=softcap, requested=dq_sm90,
                                  use_table=explicit_config is None)
    masks = dict(HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_SOFTCAP=softcap > 0,
                 IS_VARLEN=lay.is_varlen, UPCAST_DOT=interpreted and q.dtype == torch.bfloat16)
    scalars = (max(window_left, 0), max(window_right, 0),
               scale * LOG2E, softcap * LOG2E, (scale / softcap) if softcap > 0 else 0.0, scale)
    # dQ, dK, dV are allocated contiguous in the layout of q, k, v.
    dq_strides, dk_strides = (lay.bhs_strides(torch.empty(t.shape, device="meta"))
                              for t in (q, k))
    dkdv_launcher, dq_launcher = launchers
    group_size = num_heads // num_kv_heads
    dkdv = sm90_dkdv = None
    copy_dout = any(choice is not None and choice[1] for choice in (sm90, gluon_dq))
    # The Gluon kernel copies D's rows (and LSE's in log2 units) by TMA, which needs their
    # row stride padded to 16 bytes.
    seqlen_pad = seqlen_q
    if sm90 is not None:
        from attnlab.kernels.backward_sm90 import BLOCK_N, padded_seqlen, plan_launch

        sm90_config, _, kernel_dout = sm90
        sm90_dkdv = plan_launch(
            q, k, v, kernel_dout, layout=layout, scale=scale, causal=causal, config=sm90_config,
            schedule=dispatch.dkdv_schedule(
                batch=batch, kv_heads=num_kv_heads, group_size=group_size, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, causal=causal, block_m=sm90_config.block_m,
                block_n=BLOCK_N, sm_count=dispatch.sm_count(q.device)))
        seqlen_pad = padded_seqlen(seqlen_q)
    # D is a fresh contiguous (batch, heads, seqlen_pad) tensor; varlen's has LSE's shape.
    if lay.is_varlen:
        delta_shape, delta_strides = tuple(lse.shape), stat_strides
    else:
        delta_shape = (batch, num_heads, seqlen_pad)
        delta_strides = (num_heads * seqlen_pad, seqlen_pad)
    if gluon_dq is not None:
        from attnlab.kernels.dq_sm90 import BLOCK_M as GLUON_DQ_BLOCK_M
        from attnlab.kernels.dq_sm90 import plan_launch as plan_gluon_dq

        dq_block_m, dq_block_n = GLUON_DQ_BLOCK_M, gluon_dq[0].block_n
    else:
        dq_block_m, dq_block_n = config.dq_block_m, config.dq_block_n
    q_blocks = triton.cdiv(seqlen_q, dq_block_m)
    # Varlen's per-sequence lengths are not known here: head by head.
    dq_block_major = not lay.is_varlen and dispatch.dq_block_major(
        batch=batch, heads=num_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        causal=causal and not has_left, block_m=dq_block_m, block_n=dq_block_n,
        sm_count=dispatch.sm_count(q.device))
    if sm90 is None:
        kv_blocks = triton.cdiv(seqlen_k, config.dkdv_block_n)
        programs = kv_blocks * batch * num_kv_heads * (2 if config.dkdv_split else 1)
        dkdv = PlannedLaunch(dkdv_launcher, (programs,), (
            *lay.bhs_strides(q), *lay.bhs_strides(k), *lay.bhs_strides(v),
            *lay.bhs_strides(dout), *dk_strides, *dk_strides, *stat_strides,
            *delta_strides, num_kv_heads, group_size, seqlen_q, seqlen_k, kv_blocks, *scalars,
        ), dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                BLOCK_M=config.dkdv_block_m, BLOCK_N=config.dkdv_block_n, **masks,
                SPLIT_OUTPUTS=config.dkdv_split,
                num_warps=config.num_warps, num_stages=config.num_stages))
    if gluon_dq is not None:
        dq = plan_gluon_dq(
            q, k, v, out, gluon_dq[2], layout=layout, scale=scale, causal=causal,
            config=gluon_dq[0], block_major=dq_block_major, stat_strides=stat_strides,
            delta_strides=delta_strides, has_dlse=has_dlse, write_lse_log2=sm90 is not None)
        return _BackwardPlan(dkdv, sm90_dkdv, dq, copy_dout, True, delta_shape)
    dq = PlannedLaunch(dq_launcher, (q_blocks * batch * num_heads,), (
        *lay.bhs_strides(q), *lay.bhs_strides(k), *lay.bhs_strides(v),
        *lay.bhs_strides(out), *lay.bhs_strides(dout), *dq_strides, *stat_strides,
        *delta_strides, num_heads, group_size, seqlen_q, seqlen_k, q_blocks,
        int(dq_block_major), *scalars,
    ), dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_M=config.dq_block_m, BLOCK_N=config.dq_block_n, REVERSE_M=has_right, **masks,
            HAS_DLSE=has_dlse, WRITE_LSE_LOG2=sm90 is not None,
            num_warps=config.num_warps, num_stages=config.num_stages))
    return _BackwardPlan(dkdv, sm90_dkdv, dq, copy_dout, False, delta_shape)


# ---------------------------------------------------------------------------
# Ahead of time, without a GPU: can ptxas build these tiles?
# ---------------------------------------------------------------------------

def compile_for_sm90(head_dim: int, config: BackwardConfig, *, dtype: str = "bf16",
                     causal: bool = False, window: bool = False, softcap: bool = False,
                     varlen: bool = False, write_lse_log2: bool = False,
                     kernels: tuple[str, ...] = ("dkdv", "dq")) -> tuple:
    """The dK/dV and dQ kernels (those of ``kernels``, in that order) as a call with these
    options compiles them for sm_90a, here, without a GPU (``kernels/_aot``); ``window``
    is a two-sided sliding window, ``write_lse_log2`` the dQ kernel that feeds the Gluon
    dK/dV kernel.  Raises Triton's PTXASError where ptxas cannot build one (Triton 3.6's
    ptxas dies with SIGSEGV on two-stage dQ tiles at head_dim 16 and 32:
    ``bench/ptxas_configs.py``, ``configs._BACKWARD_BASE``)."""
    masks = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), HAS_LEFT=window,
                 HAS_RIGHT=causal or window, HAS_SOFTCAP=softcap, IS_VARLEN=varlen,
                 UPCAST_DOT=False)
    launches = {
        "dkdv": (_attn_bwd_dkdv, dict(masks, BLOCK_M=config.dkdv_block_m,
                                      BLOCK_N=config.dkdv_block_n,
                                      SPLIT_OUTPUTS=config.dkdv_split)),
        "dq": (_attn_bwd_dq, dict(masks, BLOCK_M=config.dq_block_m, BLOCK_N=config.dq_block_n,
                                  REVERSE_M=causal or window, HAS_DLSE=False,
                                  WRITE_LSE_LOG2=write_lse_log2)),
    }
    compiled = []
    for name in kernels:
        kernel, constants = launches[name]
        compiled.append(compile_triton(kernel, dtype, constants, num_warps=config.num_warps,
                                       num_stages=config.num_stages))
    return tuple(compiled)
