"""Flash-Decoding in Triton: a split-KV kernel, a log-sum-exp combine, their launcher.

A decode step has few query rows and a long cache: the cost is streaming K/V once,
and one program per (batch, head) leaves most SMs idle (issue #13: 492 us at 1 x 32k
against cuDNN's 38 us).  Here the cache of each sequence is cut into ``num_splits``
contiguous runs of key tiles and each run is its own program:

* **split kernel** (:func:`_split_kv_decode`), grid ``(batch * kv_heads, num_splits,
  row blocks)``.  A program holds *all* query heads of its KV group together (GQA
  packing): packed row ``r`` is query position ``r // group_size`` of head
  ``kv_head * group_size + r % group_size``, padded to at least 16 rows for the MMA,
  so every K/V byte is read once per KV head, not once per query head.  It runs
  the FA-2 loop over its run of tiles and writes a normalised fp32 partial output
  and its natural-log LSE (or, with one split, the final output directly);
* **combine kernel** (:func:`_combine_partials`), one program per output row: the
  exact merge ``o = sum_s exp(lse_s - lse) o_s``, ``lse = log sum_s exp(lse_s)``.
  Merging in the split launch instead (its last program per
  row block, counted by atomics) measured slower at every point, 2.5-39 us (NOTES S19).

The split rule is the reference's (:func:`attnlab.reference.split_kv`): a sequence
of ``kv_tiles`` tiles gives every split ``ceil(kv_tiles / num_splits)`` tiles, so
trailing splits may be empty.  Each program computes it from *its own* sequence's
live length, read on the device: the grid is sized on the host from an upper bound
(the call's known length, ``max_seqlen_k``, or the cache capacity) and programs past
their sequence's end do no loads and write LSE = -inf, which the merge drops.  No
host sync, no data-dependent allocation: the launch works under CUDA-graph capture.
Every index a program reads (cache_seqlens, cache_leftpad, cache_batch_idx, the
block_table entries it uses) is range-checked there: a bad one is never an address,
its sequence's rows come out NaN, and it is recorded (kernels/index_checks.py).
What a call signature fixes (tiles, strides, grids, the launches' constant arguments,
the compiled kernels) is kept per signature (``_DecodePlan``); a call picks its split
count from host-known sizes (kernels/dispatch.py), allocates (the output, the LSE when
asked for, one partials buffer) and launches.

Cache forms: contiguous ``(cache_batch, capacity, kv_heads, d)`` (any strides with a
unit last one; ``cache_batch_idx`` picks rows, ``cache_leftpad`` the first live key)
or vLLM-style pages ``(num_pages, page_size, kv_heads, d)`` with ``block_table
(batch, max_pages)`` int32; a tile that crosses pages gathers its rows page by page.
Offsets that can pass 2^31 elements (batch x capacity x heads x d of a 128k cache
is 8.6e9) are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import attnlab.kernels.dispatch as dispatch
import attnlab.kernels.index_checks as index_checks
from attnlab.inputs import layout_named
from attnlab.kernels._aot import compile_triton
from attnlab.kernels._launch import DirectLauncher, PlanCache, PlannedLaunch, tensor_key
from attnlab.kernels._primitives import (
    LOG2E,
    _checked_pages,
    _finish_rows,
    _kv_band_bounds,
    _load_cache_tile,
    _mma,
    _online_softmax_step,
    _page_entries,
    _row_sees_keys,
    _sequence_bounds,
    kernel_is_interpreted,
)
from attnlab.kernels.configs import DecodeConfig, decode_config, head_dim_padded
from attnlab.masking import effective_window, reach_window


@triton.jit
def _fp16_rows(q):
    """bf16 rows ``q`` as fp16, each scaled by a power of two that puts its largest
    magnitude in [2^14, 2^15], and each row's inverse scale.

    Exact wherever a value is within 2^28 of its row's largest (fp16 keeps bf16's 8
    significant bits over 30 binades), so a bf16 q of any magnitude meets an fp8 cache
    in fp16 MMAs: e4m3 -> fp16 is one packed conversion per two values, e4m3 -> bf16
    three per value through fp32, and the conversion pipe's 16 per cycle per SM made
    that kernel conversion-bound (bench/NOTES.md, S7).  Both factors are built from
    their exponent bits (exact; MUFU's exp2 is an approximation).  A zero row scales
    by 2^114 and stays 0; an inf stays inf and a NaN stays NaN in its own row only."""
    amax = tl.max(tl.abs(q.to(tl.float32)), 1)
    # floor(log2) may miss by one at a power of two, which keeps the top in [2^14, 2^15].
    exponent = tl.minimum(tl.maximum(tl.floor(tl.log2(amax)), -100.0), 127.0).to(tl.int32)
    scale = ((127 + 14 - exponent) << 23).to(tl.float32, bitcast=True)
    unscale = ((127 - 14 + exponent) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * scale[:, None]).to(tl.float16), unscale


@triton.jit
def _decode_tiles(
    acc, l_i, m_i, bad, q,
    k_base, v_base, block_table_row, ERRORS, off_b, num_pages, q_unscale,
    stride_kpage, stride_kn, stride_vpage, stride_vn,
    offs_m, offs_d, kv_start, kv_end,
    seqlen_k, diag_offset, window_left, window_right,
    qk_scale, softcap_log2, softcap_inv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PER_PAGE: tl.constexpr, ROW_SCALED_Q: tl.constexpr,
):
    """Fold the cache's key tiles [kv_start, kv_end) into the running state (m_i, l_i,
    acc); ``bad`` turns 1 where a page entry is out of range (_checked_pages).

    An fp8 cache's tiles are converted to fp16 as they are loaded (exact: every e4m3 value
    is an fp16 value) and meet q's fp16 rows (:func:`_fp16_rows`), whose power-of-two row
    scales ``q_unscale`` undoes on the scores; its descale factors live outside the loop."""
    next_entries = 0
    if PAGE_SIZE != 0:
        next_entries = _page_entries(block_table_row, kv_start, seqlen_k, kv_end, BLOCK_N,
                                     PAGE_SIZE, PER_PAGE)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        if PER_PAGE:
            # Every stage starts on a multiple of BLOCK_N (the band and split bounds are).
            start_n = tl.multiple_of(start_n, BLOCK_N)
        if PAGE_SIZE == 0:
            page = 0
        else:
            # One table lookup per tile serves both K and V, read a tile ahead: K/V
            # addresses that waited on a table load in the same step left Triton's
            # pipeliner one tile of K/V in flight (every copy awaited before the MMA);
            # from a value carried round the loop it keeps two, as contiguous caches get.
            entries = next_entries
            next_entries = _page_entries(block_table_row, start_n + BLOCK_N, seqlen_k, kv_end,
                                         BLOCK_N, PAGE_SIZE, PER_PAGE)
            page, tile_bad = _checked_pages(ERRORS, off_b, entries, start_n, seqlen_k,
                                            num_pages, BLOCK_N, PAGE_SIZE, PER_PAGE)
            bad = bad | tile_bad
        k = _load_cache_tile(k_base, page, stride_kpage, stride_kn, start_n, offs_d,
                             seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, MASKED,
                             PER_PAGE).to(q.dtype)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT)
        if ROW_SCALED_Q:
            qk = qk * q_unscale[:, None]
        p, alpha, m_i, l_i = _online_softmax_step(
            qk, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset, window_left, window_right,
            qk_scale, softcap_log2, softcap_inv, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP)
        v = _load_cache_tile(v_base, page, stride_vpage, stride_vn, start_n, offs_d,
                             seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, MASKED,
                             PER_PAGE).to(q.dtype)
        acc = acc * alpha[:, None]
        acc = _mma(p.to(v.dtype), v, acc, UPCAST_DOT)
    return acc, l_i, m_i, bad


# Lengths, head counts and split counts change per call: not specialised (one compile).
# The arguments that change from call to call with one plan (cache_seqlen) come right
# after the tensors: a planned launch passes them with the tensors.
@triton.jit(do_not_specialize=["cache_seqlen", "num_kv_heads", "group_size", "seqlen_q",
                               "seqlen_new", "num_splits", "window_left", "window_right",
                               "capacity", "cache_batch", "num_pages"])
def _split_kv_decode(
    # pointers
    Q, K, V, O_PART, OUT, LSE_OUT,
    CACHE_SEQLENS, CACHE_BATCH_IDX, CACHE_LEFTPAD, BLOCK_TABLE, ERRORS,
    K_DESCALE, V_DESCALE,  # an fp8 cache's (batch, kv_heads) fp32 factors (DESCALED)
    # the call's int cache_seqlens (unused with the tensor)
    cache_seqlen,
    # strides (batch, seq, head); the head dim is unit-stride.  For a paged cache the
    # "batch" stride of K/V is the page stride.
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_block_table,
    stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    # sizes
    num_kv_heads, group_size, seqlen_q, seqlen_new, num_splits,
    window_left, window_right, capacity, cache_batch, num_pages,
    # scalars
    qk_scale, softcap_log2, softcap_inv,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, UPCAST_DOT: tl.constexpr, PER_PAGE: tl.constexpr,
    DESCALED: tl.constexpr, ROW_SCALED_Q: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_b = pid_bh // num_kv_heads
    off_hk = pid_bh % num_kv_heads
    num_heads = num_kv_heads * group_size
    if DESCALED:
        # An fp8 cache: the real keys are k_descale x the stored ones, so k_descale joins
        # the softmax scale (once per program, not per score); v_descale scales O at the
        # end.  The loop stays one conversion per element.
        k_descale = tl.load(K_DESCALE + off_b * stride_kdb + off_hk * stride_kdh)
        qk_scale = qk_scale * k_descale
        softcap_inv = softcap_inv * k_descale

    # This sequence's live keys: cache positions [kv_first, cache_len + seqlen_new), each
    # index read and range-checked on the device (a bad one: no keys, NaN out).
    cache_len, kv_first, cache_b, seq_bad = _sequence_bounds(
        ERRORS, off_b, off_b >= 0, CACHE_SEQLENS, CACHE_LEFTPAD, CACHE_BATCH_IDX,
        cache_seqlen, seqlen_new, capacity, cache_batch, HAS_SEQLENS, HAS_LEFTPAD,
        HAS_BATCH_IDX, True)
    seqlen_k = tl.where(seq_bad, 0, cache_len + seqlen_new - kv_first)

    # The reference's split rule on this sequence's own tiles.
    kv_tiles = tl.cdiv(seqlen_k, BLOCK_N)
    tiles_per_split = tl.cdiv(kv_tiles, num_splits)
    first_tile = tl.minimum(split * tiles_per_split, kv_tiles)
    split_lo = first_tile * BLOCK_N
    split_hi = tl.minimum((first_tile + tiles_per_split) * BLOCK_N, seqlen_k)

    # GQA packing: row r is query position r // group_size of the group's head r % group_size.
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m = offs_r // group_size
    offs_h = off_hk * group_size + offs_r % group_size
    row_valid = offs_r < group_size * seqlen_q
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + offs_m[:, None] * stride_qm
              + offs_h[:, None] * stride_qh + offs_d[None, :])
    q_mask = row_valid[:, None]
    if HEAD_DIM != HEAD_DIM_PAD:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    # An fp8 cache meets fp16 rows of q (_fp16_rows: a bf16 q's rows scaled into range).
    q_unscale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    if ROW_SCALED_Q:
        q, q_unscale = _fp16_rows(q)

    if PAGE_SIZE == 0:
        cache_b = cache_b.to(tl.int64)
        k_base = K + cache_b * stride_kb + off_hk.to(tl.int64) * stride_kh
        v_base = V + cache_b * stride_vb + off_hk.to(tl.int64) * stride_vh
        if HAS_LEFTPAD:
            k_base += kv_first.to(tl.int64) * stride_kn
            v_base += kv_first.to(tl.int64) * stride_vn
        block_table_row = BLOCK_TABLE
    else:
        k_base = K + off_hk.to(tl.int64) * stride_kh
        v_base = V + off_hk.to(tl.int64) * stride_vh
        block_table_row = BLOCK_TABLE + off_b.to(tl.int64) * stride_block_table

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bad = seq_bad.to(tl.int32)

    # Bottom-right alignment over this sequence's live keys; the band of the block's
    # real query positions, cut to this split's keys.
    diag_offset = seqlen_k - seqlen_q
    m_first = (pid_m * BLOCK_M) // group_size
    m_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group_size, seqlen_q - 1)
    kv_lo, full_lo, full_hi, kv_hi = _kv_band_bounds(
        m_first, m_last, seqlen_k, diag_offset, window_left, window_right,
        BLOCK_N, HAS_LEFT, HAS_RIGHT)
    lo = tl.maximum(kv_lo, split_lo)
    hi = tl.maximum(tl.minimum(kv_hi, split_hi), lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)

    # Stage 0: tiles cut by the window's left edge; stage 1: tiles every row sees in
    # full (no mask); stage 2: the diagonal and the ragged last tile (unrolled).
    for stage in tl.static_range(3):
        if stage == 0:
            start, end = lo, full_lo
        elif stage == 1:
            start, end = full_lo, full_hi
        else:
            start, end = full_hi, hi
        acc, l_i, m_i, bad = _decode_tiles(
            acc, l_i, m_i, bad, q, k_base, v_base, block_table_row, ERRORS, off_b, num_pages,
            q_unscale, stride_kb, stride_kn, stride_vb, stride_vn, offs_m, offs_d, start, end,
            seqlen_k, diag_offset, window_left, window_right, qk_scale, softcap_log2, softcap_inv,
            BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, stage != 1, HAS_LEFT,
            HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT, PER_PAGE, ROW_SCALED_Q)

    # A row that sees no key of this split (an empty split, a hidden row): O = 0,
    # LSE = -inf, which the merge drops; a NaN stays NaN (_finish_rows), so the
    # merge cannot drop it.  A bad index makes the whole split NaN, so the combined
    # row is NaN too.
    sees_key = _row_sees_keys(offs_m, split_lo, split_hi, diag_offset, window_left,
                              window_right, HAS_LEFT, HAS_RIGHT)
    out, lse = _finish_rows(acc, l_i, m_i, sees_key)
    if DESCALED:
        out = out * tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
    out = tl.where(bad != 0, float("nan"), out)
    lse = tl.where(bad != 0, float("nan"), lse)
    if WRITE_PARTIAL:
        # Partials are (batch, seqlen_q, heads, num_splits, head_dim) fp32, then the LSEs
        # (batch, seqlen_q, heads, num_splits): one buffer, one allocation per call.  The
        # combine reads one output row's splits as one contiguous block.
        row = (off_b.to(tl.int64) * seqlen_q + offs_m) * num_heads + offs_h
        rows = tl.num_programs(0).to(tl.int64) * group_size * seqlen_q  # batch x heads x seqlen_q
        slot = row * num_splits + split
        tl.store(O_PART + slot[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
        tl.store(O_PART + rows * num_splits * HEAD_DIM + slot, lse, mask=row_valid)
    else:
        o_ptrs = (OUT + off_b.to(tl.int64) * stride_ob + offs_m[:, None] * stride_om
                  + offs_h[:, None] * stride_oh + offs_d[None, :])
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
        if WRITE_LSE:
            lse_ptrs = LSE_OUT + (off_b.to(tl.int64) * num_heads + offs_h) * seqlen_q + offs_m
            tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_heads", "seqlen_q", "num_splits", "total_rows"])
def _combine_partials(
    # pointers: the split kernel's partials buffer (O, then LSE), the output and its LSE
    O_PART, OUT, LSE_OUT,
    # strides of OUT (batch, seq, head)
    stride_ob, stride_om, stride_oh,
    # sizes
    num_heads, seqlen_q, num_splits, total_rows,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, LSE_CHUNK: tl.constexpr,
    O_CHUNK: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """One output row (batch, query, head): the exact merge of its splits' partials."""
    row = tl.program_id(0).to(tl.int64)
    off_h = row % num_heads
    off_m = (row // num_heads) % seqlen_q
    off_b = row // (num_heads * seqlen_q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse_row = O_PART + total_rows * num_splits * HEAD_DIM + row * num_splits
    o_row = O_PART + row * num_splits * HEAD_DIM

    # Pass 1: the largest partial LSE, the base every weight is measured from.
    offs_s = tl.arange(0, LSE_CHUNK)
    lse_max = tl.max(tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf")), 0)
    for s0 in range(LSE_CHUNK, num_splits, LSE_CHUNK):
        chunk = tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, tl.max(chunk, 0))
    # No split has a finite LSE: measure from 0 so every weight is exp(-inf) = 0, not NaN.
    all_empty = lse_max == float("-inf")
    base = tl.where(all_empty, 0.0, lse_max)

    # Pass 2: weights exp(lse_s - base), O_CHUNK splits per step.  A split with LSE =
    # -inf weighs 0 and its O is dropped -- unless no split has a finite LSE: then O is
    # the sum of the splits' O, 0 where the row sees no key and NaN where every key it
    # sees scored -inf (0/0, as softmax over the whole row gives).  A NaN LSE (the max
    # drops it) weighs NaN and its (NaN) O is kept: the row comes out NaN, never dropped.
    # O is loaded whatever its weight (then selected), so a step's O and LSE loads do not
    # wait on each other: one round trip per step, not two.
    offs_c = tl.arange(0, O_CHUNK)
    total = tl.zeros([O_CHUNK], dtype=tl.float32)
    acc = tl.zeros([O_CHUNK, HEAD_DIM_PAD], dtype=tl.float32)
    for s0 in range(0, num_splits, O_CHUNK):
        in_range = s0 + offs_c < num_splits
        lse = tl.load(lse_row + s0 + offs_c, mask=in_range, other=float("-inf"))
        o = tl.load(o_row + (s0 + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=in_range[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        weight = tl.exp(lse - base)
        o_weight = tl.where(all_empty, 1.0, weight)
        total += weight
        acc += tl.where((o_weight != 0.0)[:, None], o_weight[:, None] * o, 0.0)
    weight_sum = tl.sum(total, 0)
    no_key = weight_sum == 0.0
    sum_safe = tl.where(no_key, 1.0, weight_sum)
    out = tl.sum(acc, 0) / sum_safe
    o_ptrs = OUT + off_b * stride_ob + off_m * stride_om + off_h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
    if WRITE_LSE:
        lse_out = tl.where(no_key, float("-inf"), base + tl.log(sum_safe))
        tl.store(LSE_OUT + (off_b * num_heads + off_h) * seqlen_q + off_m, lse_out)


# ---------------------------------------------------------------------------
# Tiling (the split count: kernels/dispatch.py)
# ---------------------------------------------------------------------------

MIN_BLOCK_M = 16  # tl.dot's smallest M
MAX_BLOCK_M = 64


def packed_block_m(group_size: int, seqlen_q: int) -> int:
    """Packed rows per program: the group's query rows, padded to 16, at most 64."""
    rows = group_size * seqlen_q
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(rows)))


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

def flash_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
    scale: float, causal: bool = False, window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, cache_seqlens: int | torch.Tensor | None = None,
    seqlen_new: int = 0, cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    num_splits: int = 0, max_seqlen_k: int | None = None, layout: str = "bshd",
    config: DecodeConfig | None = None, return_partials: bool = False,
    k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
    write_lse: bool = True,
):
    """Launch split-KV decode on already-validated tensors; returns (out, lse).

    ``layout`` names q's, the output's and a contiguous cache's dimension order
    (``"bshd"``: (batch, seqlen, heads, d), or ``"bhsd"``); a paged cache is always
    (num_pages, page_size, kv_heads, d) with ``block_table`` (batch, max_pages) int32.
    Keys of sequence b are cache positions ``[leftpad[b], cache_seqlens[b] + seqlen_new)``
    (``cache_seqlens`` None: the whole capacity).  ``num_splits=0`` picks the count
    (:func:`attnlab.kernels.dispatch.choose_num_splits`) from ``max_seqlen_k`` if given,
    else from the longest length the host knows without reading a tensor (an int
    ``cache_seqlens``, or the capacity).  The index tensors are read and range-checked
    on the device only (kernels/index_checks.py).
    Out has q's layout and dtype; LSE is (batch, heads, seqlen_q) fp32, natural log
    (None with ``write_lse=False``: neither allocated nor written).
    ``return_partials=True`` always runs the split path and also returns the partial
    (O, LSE) as (batch, seqlen_q, heads, num_splits[, d]) fp32, for the tests.
    A float8_e4m3fn cache takes ``k_descale`` and ``v_descale``, (batch, kv_heads) fp32
    views (any strides; :func:`attnlab.checks.check_descale` builds them): the real
    cache is the stored one times them (per query sequence b, as FA3 indexes them).
    """
    seqlens_tensor = isinstance(cache_seqlens, torch.Tensor)
    plan = decode_plan(q, k_cache, v_cache, layout=layout, scale=scale, causal=causal,
                       window=window, softcap=softcap, seqlens_tensor=seqlens_tensor,
                       seqlen_new=seqlen_new, indices=(cache_batch_idx, cache_leftpad, block_table),
                       config=config, return_partials=return_partials,
                       descales=(k_descale, v_descale), write_lse=write_lse)
    if seqlens_tensor:
        cache_seqlen = 0
    else:
        cache_seqlen = plan.capacity if cache_seqlens is None else cache_seqlens
    return plan.run(q, k_cache, v_cache, cache_seqlens if seqlens_tensor else None,
                    cache_batch_idx, cache_leftpad, block_table, cache_seqlen, num_splits,
                    max_seqlen_k, (k_descale, v_descale))


def decode_plan(q, k_cache, v_cache, *, scale: float, causal: bool = False,
                window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                seqlens_tensor: bool = False, seqlen_new: int = 0, indices=(None, None, None),
                layout: str = "bshd", config: DecodeConfig | None = None,
                return_partials: bool = False, descales=(None, None),
                write_lse: bool = True) -> _DecodePlan:
    """The kept plan for calls shaped like these tensors (``indices``: cache_batch_idx,
    cache_leftpad, block_table or None; ``descales``: an fp8 cache's (batch, kv_heads)
    k/v descale views, or None), made on first sight.  Its ``run(q, k_cache, v_cache,
    cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cache_seqlen, num_splits,
    max_seqlen_k, descales)`` launches: what :func:`flash_decode` does after its lookup
    (the descales passed per call share the planned views' data pointers; their strides
    are the plan's)."""
    key = (layout, scale, causal, tuple(window), softcap, seqlens_tensor, seqlen_new, config,
           return_partials, write_lse, q.device,
           tensor_key(q, k_cache, v_cache, *indices, *descales))
    return _PLANS.get(key, lambda: _DecodePlan(
        q, k_cache, v_cache, layout=layout, scale=scale, causal=causal, window=window,
        softcap=softcap, seqlens_tensor=seqlens_tensor, seqlen_new=seqlen_new,
        indices=indices, config=config, return_partials=return_partials, descales=descales,
        write_lse=write_lse))


# Decode plans by call signature (kernels/_launch.PlanCache); each keeps its launches
# per split count.
_PLANS = PlanCache()
_SPLIT = DirectLauncher(_split_kv_decode)
_COMBINE = DirectLauncher(_combine_partials)


class _DecodePlan:
    """What one call signature (sizes, strides, dtypes, alignment, which index tensors,
    options) fixes: tiles, strides, grids, the launches' constant arguments.  A call
    only picks the split count (memoised arithmetic), allocates its outputs and
    launches: no tensor's values are read."""

    def __init__(self, q, k_cache, v_cache, *, layout, scale, causal, window, softcap,
                 seqlens_tensor, seqlen_new, indices, config, return_partials,
                 descales, write_lse) -> None:
        cache_batch_idx, cache_leftpad, block_table = indices
        k_descale, v_descale = descales
        descaled = k_descale is not None
        lay = layout_named(layout)
        batch, seqlen_q, num_heads, head_dim = q.shape[0], lay.seqlen(q), lay.heads(q), q.shape[-1]
        paged = block_table is not None
        if paged:
            page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
            capacity = block_table.shape[1] * page_size
            stride_k = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
            stride_v = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        else:
            page_size = 0
            stride_k, stride_v = lay.bsh_strides(k_cache), lay.bsh_strides(v_cache)
            capacity, num_kv_heads = lay.seqlen(k_cache), lay.heads(k_cache)
        group_size = num_heads // num_kv_heads
        interpreted = kernel_is_interpreted()
        self.config = config or decode_config(head_dim, interpreted=interpreted,
                                              fp8_cache=descaled)
        head_dim_pad = head_dim_padded(head_dim)
        block_m = packed_block_m(group_size, seqlen_q)
        self.row_blocks = triton.cdiv(group_size * seqlen_q, block_m)
        self.batch, self.seqlen_q, self.num_heads, self.head_dim = batch, seqlen_q, num_heads, head_dim
        self.num_kv_heads, self.capacity, self.seqlen_new = num_kv_heads, capacity, seqlen_new
        self.seqlens_tensor, self.return_partials = seqlens_tensor, return_partials
        self.write_lse = write_lse
        self.sms = dispatch.sm_count(q.device)
        self.out_shape = lay.shape(batch, seqlen_q, num_heads, head_dim)
        self.lse_shape = (batch, num_heads, seqlen_q)
        out_strides = lay.bsh_strides(torch.empty(self.out_shape, device="meta"))
        checked = seqlens_tensor or any(t is not None for t in indices)
        # Where the kernel records a bad index (made here, outside any graph capture).
        self.errors = index_checks.error_buffer(q.device) if checked else None

        window_left, window_right = reach_window(effective_window(causal, window), seqlen_q,
                                                 capacity)
        self.split_static = (
            *lay.bsh_strides(q), *stride_k, *stride_v, *out_strides,
            block_table.stride(0) if paged else 0,
            *(k_descale.stride() if descaled else (0, 0)),
            *(v_descale.stride() if descaled else (0, 0)),
            num_kv_heads, group_size, seqlen_q, seqlen_new)
        self.split_tail = (
            max(window_left, 0), max(window_right, 0), capacity,
            k_cache.shape[0] if not paged else 0, k_cache.shape[0] if paged else 0,
            scale * LOG2E, softcap * LOG2E, (scale / softcap) if softcap > 0 else 0.0)
        self.split_meta = dict(
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=block_m,
            BLOCK_N=self.config.block_n, PAGE_SIZE=page_size,
            HAS_SEQLENS=seqlens_tensor, HAS_BATCH_IDX=cache_batch_idx is not None,
            HAS_LEFTPAD=cache_leftpad is not None,
            HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
            UPCAST_DOT=interpreted and q.dtype == torch.bfloat16,
            PER_PAGE=paged, DESCALED=descaled,
            ROW_SCALED_Q=descaled and q.dtype == torch.bfloat16,
            num_warps=self.config.num_warps, num_stages=self.config.num_stages)
        self.head_dim_pad, self.out_strides = head_dim_pad, out_strides
        self.launches: dict[int, tuple] = {}
        # Tensor cache_seqlens: the capacity bounds every length, so one count serves.
        self.capacity_splits = self._splits_for(capacity)

    def splits(self, num_splits: int, cache_seqlen: int, max_seqlen_k: int | None) -> int:
        """The call's split count: as asked, else from the longest possible key count."""
        if num_splits:
            return num_splits
        if max_seqlen_k is not None:
            return self._splits_for(max_seqlen_k)
        if self.seqlens_tensor:
            return self.capacity_splits
        return self._splits_for(cache_seqlen + self.seqlen_new)

    def _splits_for(self, max_seqlen_k: int) -> int:
        return dispatch.choose_num_splits(
            batch=self.batch, kv_heads=self.num_kv_heads, row_blocks=self.row_blocks,
            kv_tiles=max(1, -(-max_seqlen_k // self.config.block_n)), sm_count=self.sms,
            ctas_per_sm=self.config.ctas_per_sm, block_n=self.config.block_n)

    def _launch(self, num_splits: int) -> tuple:
        """(split launch, combine launch or None, the partials buffer's fp32 elements or 0)
        for ``num_splits``: with one split the kernel writes the output itself."""
        write_partial = num_splits > 1 or self.return_partials
        split = PlannedLaunch(
            _SPLIT, (self.batch * self.num_kv_heads, num_splits, self.row_blocks),
            (*self.split_static, num_splits, *self.split_tail),
            dict(self.split_meta, WRITE_PARTIAL=write_partial, WRITE_LSE=self.write_lse))
        combine, partials_size = None, 0
        if write_partial:
            rows = self.batch * self.seqlen_q * self.num_heads
            # One fp32 buffer: every split's O rows, then their LSEs (the kernel finds them).
            partials_size = rows * num_splits * (self.head_dim + 1)
            splits = triton.next_power_of_2(num_splits)
            # Two warps: LSEs 64 at a time; O tiles of 64 values a thread (32 splits per
            # step at d = 128, 16 at d = 256).
            combine = PlannedLaunch(
                _COMBINE, (rows,),
                (*self.out_strides, self.num_heads, self.seqlen_q, num_splits, rows),
                dict(HEAD_DIM=self.head_dim, HEAD_DIM_PAD=self.head_dim_pad,
                     LSE_CHUNK=min(64, splits), O_CHUNK=min(splits, 4096 // self.head_dim_pad),
                     WRITE_LSE=self.write_lse, num_warps=2, num_stages=1))
        self.launches[num_splits] = split, combine, partials_size
        return split, combine, partials_size

    def run(self, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, cache_seqlen: int, num_splits: int, max_seqlen_k,
            descales=(None, None)):
        num_splits = self.splits(num_splits, cache_seqlen, max_seqlen_k)
        split, combine, partials_size = self.launches.get(num_splits) or self._launch(num_splits)
        # q's dtype and device are the plan's (its key holds them): new_empty parses
        # neither, and sizes one by one parse faster than a tuple (the call's allocations
        # ~0.7 us less than by torch.empty(shape, dtype=..., device=...), NOTES S21).
        out = q.new_empty(*self.out_shape)
        lse = q.new_empty(*self.lse_shape, dtype=torch.float32) if self.write_lse else None
        # Any valid pointer, for arguments a constexpr switch turns off.
        unused = out
        partials = q.new_empty(partials_size, dtype=torch.float32) if partials_size else unused
        lse_out = unused if lse is None else lse
        split.launch(q, k_cache, v_cache, partials, out, lse_out,
                     unused if cache_seqlens is None else cache_seqlens,
                     unused if cache_batch_idx is None else cache_batch_idx,
                     unused if cache_leftpad is None else cache_leftpad,
                     unused if block_table is None else block_table,
                     unused if self.errors is None else self.errors,
                     unused if descales[0] is None else descales[0],
                     unused if descales[1] is None else descales[1], cache_seqlen)
        if combine is not None:
            combine.launch(partials, out, lse_out)
        if self.return_partials:
            rows = (self.batch, self.seqlen_q, self.num_heads, num_splits)
            slots = self.batch * self.seqlen_q * self.num_heads * num_splits
            o_part = partials[:slots * self.head_dim].view(*rows, self.head_dim)
            return out, lse, (o_part, partials[slots * self.head_dim:].view(rows))
        return out, lse


def launch_plan(*, batch: int, kv_heads: int, query_heads: int, seqlen_q: int, seqlen_k: int,
                head_dim: int, sm_count: int, num_splits: int = 0,
                fp8_cache: bool = False) -> dict:
    """What :func:`flash_decode` launches for one shape: splits, programs, programs per SM.

    Pure arithmetic (no launch), for the benchmark's blocks-vs-SMs table.
    """
    config = decode_config(head_dim, fp8_cache=fp8_cache)
    group_size = query_heads // kv_heads
    block_m = packed_block_m(group_size, seqlen_q)
    row_blocks = triton.cdiv(group_size * seqlen_q, block_m)
    kv_tiles = max(1, triton.cdiv(seqlen_k, config.block_n))
    if num_splits == 0:
        num_splits = dispatch.choose_num_splits(
            batch=batch, kv_heads=kv_heads, row_blocks=row_blocks, kv_tiles=kv_tiles,
            sm_count=sm_count, ctas_per_sm=config.ctas_per_sm, block_n=config.block_n)
    programs = batch * kv_heads * row_blocks * num_splits
    return {"num_splits": num_splits, "programs": programs, "block_m": block_m,
            "block_n": config.block_n, "row_blocks": row_blocks, "sm_count": sm_count,
            "programs_per_sm": programs / sm_count,
            "combine_programs": batch * seqlen_q * query_heads if num_splits > 1 else 0}


# ---------------------------------------------------------------------------
# Ahead of time, without a GPU: what Triton makes of a launch
# ---------------------------------------------------------------------------

def compile_for_sm90(head_dim: int, config: DecodeConfig, *, page_size: int = 0,
                     dtype: str = "bf16", group_size: int = 4, seqlen_q: int = 1,
                     ):
    """The split-KV kernel as a call of ``seqlen_q`` new tokens on a bf16/fp16 cache
    (tensor cache_seqlens, causal, contiguous or paged with ``page_size``) compiles it for
    sm_90a, here, without a GPU (``kernels/_aot``)."""
    return compile_triton(_split_kv_decode, dtype, dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim),
        BLOCK_M=packed_block_m(group_size, seqlen_q), BLOCK_N=config.block_n,
        PAGE_SIZE=page_size, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False,
        HAS_LEFT=False, HAS_RIGHT=seqlen_q > 1, HAS_SOFTCAP=False, WRITE_PARTIAL=True,
        UPCAST_DOT=False, PER_PAGE=page_size > 0, DESCALED=False, ROW_SCALED_Q=False,
        WRITE_LSE=False),
        num_warps=config.num_warps, num_stages=config.num_stages)
