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

The split rule is the reference's (:func:`attnlab.reference.split_kv`): a sequence
of ``kv_tiles`` tiles gives every split ``ceil(kv_tiles / num_splits)`` tiles, so
trailing splits may be empty.  Each program computes it from *its own* sequence's
live length, read on the device: the grid is sized on the host from an upper bound
(the call's known length, ``max_seqlen_k``, or the cache capacity) and programs past
their sequence's end do no loads and write LSE = -inf, which the combine drops.  No
host sync, no data-dependent allocation: the launch works under CUDA-graph capture.

Cache forms: contiguous ``(cache_batch, capacity, kv_heads, d)`` (any strides with a
unit last one; ``cache_batch_idx`` picks rows, ``cache_leftpad`` the first live key)
or vLLM-style pages ``(num_pages, page_size, kv_heads, d)`` with ``block_table
(batch, max_pages)`` int32; a tile that crosses pages gathers its rows page by page.
Offsets that can pass 2^31 elements (batch x capacity x heads x d of a 128k cache
is 8.6e9) are 64-bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attnlab.inputs import layout_named
from attnlab.kernels._primitives import (
    LOG2E,
    _finish_rows,
    _kv_band_bounds,
    _load_kv_tile,
    _mma,
    _online_softmax_step,
    _row_sees_keys,
    kernel_is_interpreted,
)
from attnlab.kernels.configs import DecodeConfig, decode_config, head_dim_padded
from attnlab.masking import effective_window, reach_window


@triton.jit
def _load_cache_tile(base, block_table_row, stride_page, stride_n, start_n, offs_d, seqlen_k,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Keys [start_n, start_n + BLOCK_N) of one sequence and KV head, (BLOCK_N, HEAD_DIM_PAD).

    PAGE_SIZE == 0: contiguous, ``base`` points at the sequence's first live key.
    Otherwise ``base`` points at the KV head inside page 0 and ``block_table_row`` at
    the sequence's page list; key n lives in page ``block_table[n // PAGE_SIZE]``.
    """
    if PAGE_SIZE == 0:
        # Advance the base in 64 bits; the in-tile offsets stay small.
        return _load_kv_tile(base + tl.cast(start_n, tl.int64) * stride_n, stride_n, 0, offs_d,
                             seqlen_k - start_n, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if PAGE_SIZE % BLOCK_N == 0:
        # The whole tile lies in one page: one table entry, rows contiguous in it.
        page = tl.load(block_table_row + start_n // PAGE_SIZE).to(tl.int64)
        rows = page * stride_page + (offs_n % PAGE_SIZE) * stride_n
    else:
        # The tile crosses pages: look the page up per row (padded rows read entry 0).
        in_range = offs_n < seqlen_k
        page = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=in_range, other=0)
        rows = page.to(tl.int64) * stride_page + (offs_n % PAGE_SIZE) * stride_n
    ptrs = base + rows[:, None] + offs_d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM),
                       other=0.0)
    if HEAD_DIM != HEAD_DIM_PAD:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _decode_tiles(
    acc, l_i, m_i, q,
    k_base, v_base, block_table_row,
    stride_kpage, stride_kn, stride_vpage, stride_vn,
    offs_m, offs_d, kv_start, kv_end,
    seqlen_k, diag_offset, window_left, window_right,
    qk_scale, softcap_log2, softcap_inv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Fold the cache's key tiles [kv_start, kv_end) into the running state (m_i, l_i, acc).

    An fp8 cache's tiles are converted to q's dtype as they are loaded (exact: every e4m3
    value is a bf16 and an fp16 value); its descale factors live outside the loop."""
    for start_n in range(kv_start, kv_end, BLOCK_N):
        k = _load_cache_tile(k_base, block_table_row, stride_kpage, stride_kn, start_n, offs_d,
                             seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                             MASKED).to(q.dtype)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT)
        p, alpha, m_i, l_i = _online_softmax_step(
            qk, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset, window_left, window_right,
            qk_scale, softcap_log2, softcap_inv, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP)
        v = _load_cache_tile(v_base, block_table_row, stride_vpage, stride_vn, start_n, offs_d,
                             seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE,
                             MASKED).to(q.dtype)
        acc = acc * alpha[:, None]
        acc = _mma(p.to(v.dtype), v, acc, UPCAST_DOT)
    return acc, l_i, m_i


# Lengths, head counts and split counts change per call: not specialised (one compile).
@triton.jit(do_not_specialize=["num_kv_heads", "group_size", "seqlen_q", "cache_seqlen",
                               "seqlen_new", "num_splits", "window_left", "window_right"])
def _split_kv_decode(
    # pointers
    Q, K, V, O_PART, LSE_PART, OUT, LSE_OUT,
    CACHE_SEQLENS, CACHE_BATCH_IDX, CACHE_LEFTPAD, BLOCK_TABLE,
    K_DESCALE, V_DESCALE,  # an fp8 cache's (batch, kv_heads) fp32 factors (DESCALED)
    # strides (batch, seq, head); the head dim is unit-stride.  For a paged cache the
    # "batch" stride of K/V is the page stride.
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_block_table,
    stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    # sizes
    num_kv_heads, group_size, seqlen_q, cache_seqlen, seqlen_new, num_splits,
    window_left, window_right,
    # scalars
    qk_scale, softcap_log2, softcap_inv,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, UPCAST_DOT: tl.constexpr, DESCALED: tl.constexpr,
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

    # This sequence's live keys: cache positions [kv_first, cache_len + seqlen_new).
    if HAS_SEQLENS:  # noqa: SIM108 -- a constexpr branch, not a runtime select
        cache_len = tl.load(CACHE_SEQLENS + off_b)
    else:
        cache_len = cache_seqlen
    kv_first = 0
    if HAS_LEFTPAD:
        kv_first = tl.load(CACHE_LEFTPAD + off_b)
    seqlen_k = cache_len + seqlen_new - kv_first

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

    if PAGE_SIZE == 0:
        if HAS_BATCH_IDX:
            cache_b = tl.load(CACHE_BATCH_IDX + off_b).to(tl.int64)
        else:
            cache_b = off_b.to(tl.int64)
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

    # Stage 1: tiles cut by the window's left edge; stage 2: tiles every row sees in
    # full (no mask); stage 3: the diagonal and the ragged last tile.
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_base, v_base, block_table_row, stride_kb, stride_kn, stride_vb,
        stride_vn, offs_m, offs_d, lo, full_lo, seqlen_k, diag_offset, window_left,
        window_right, qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM,
        HEAD_DIM_PAD, PAGE_SIZE, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_base, v_base, block_table_row, stride_kb, stride_kn, stride_vb,
        stride_vn, offs_m, offs_d, full_lo, full_hi, seqlen_k, diag_offset, window_left,
        window_right, qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM,
        HEAD_DIM_PAD, PAGE_SIZE, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)
    acc, l_i, m_i = _decode_tiles(
        acc, l_i, m_i, q, k_base, v_base, block_table_row, stride_kb, stride_kn, stride_vb,
        stride_vn, offs_m, offs_d, full_hi, hi, seqlen_k, diag_offset, window_left,
        window_right, qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM,
        HEAD_DIM_PAD, PAGE_SIZE, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)

    # A row that sees no key of this split (an empty split, a hidden row): O = 0,
    # LSE = -inf, which the combine drops; a NaN stays NaN (_finish_rows), so the
    # combine cannot drop it.
    sees_key = _row_sees_keys(offs_m, split_lo, split_hi, diag_offset, window_left,
                              window_right, HAS_LEFT, HAS_RIGHT)
    out, lse = _finish_rows(acc, l_i, m_i, sees_key)
    if DESCALED:
        out = out * tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
    if WRITE_PARTIAL:
        # Partials are (batch, seqlen_q, heads, num_splits, head_dim) fp32: the combine
        # reads one output row's splits as one contiguous block.
        row = (off_b.to(tl.int64) * seqlen_q + offs_m) * num_heads + offs_h
        slot = row * num_splits + split
        tl.store(O_PART + slot[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
        tl.store(LSE_PART + slot, lse, mask=row_valid)
    else:
        o_ptrs = (OUT + off_b.to(tl.int64) * stride_ob + offs_m[:, None] * stride_om
                  + offs_h[:, None] * stride_oh + offs_d[None, :])
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
        lse_ptrs = LSE_OUT + (off_b.to(tl.int64) * num_heads + offs_h) * seqlen_q + offs_m
        tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit(do_not_specialize=["num_heads", "seqlen_q", "num_splits"])
def _combine_partials(
    # pointers
    O_PART, LSE_PART, OUT, LSE_OUT,
    # strides of OUT (batch, seq, head)
    stride_ob, stride_om, stride_oh,
    # sizes
    num_heads, seqlen_q, num_splits,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One output row (batch, query, head): the exact merge of its splits' partials."""
    row = tl.program_id(0).to(tl.int64)
    off_h = row % num_heads
    off_m = (row // num_heads) % seqlen_q
    off_b = row // (num_heads * seqlen_q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse_row = LSE_PART + row * num_splits
    o_row = O_PART + row * num_splits * HEAD_DIM

    # Pass 1: the largest partial LSE, the base every weight is measured from.
    lse_max = tl.max(tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf")), 0)
    for s0 in range(BLOCK_S, num_splits, BLOCK_S):
        chunk = tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, tl.max(chunk, 0))
    # No split has a finite LSE: measure from 0 so every weight is exp(-inf) = 0, not NaN.
    all_empty = lse_max == float("-inf")
    base = tl.where(all_empty, 0.0, lse_max)

    # Pass 2: weights exp(lse_s - base).  A split with LSE = -inf weighs 0 and its O is
    # not read -- unless no split has a finite LSE: then O is the sum of the splits' O,
    # 0 where the row sees no key and NaN where every key it sees scored -inf (0/0, as
    # softmax over the whole row gives).  A NaN LSE (the max drops it) weighs NaN and
    # its (NaN) O is read: the row comes out NaN, never a silent drop.
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, HEAD_DIM_PAD], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        in_range = s0 + offs_s < num_splits
        lse = tl.load(lse_row + s0 + offs_s, mask=in_range, other=float("-inf"))
        weight = tl.exp(lse - base)
        o_weight = tl.where(all_empty, 1.0, weight)
        used = in_range & (o_weight != 0.0)
        o = tl.load(o_row + (s0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=used[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        total += weight
        acc += o_weight[:, None] * o
    weight_sum = tl.sum(total, 0)
    no_key = weight_sum == 0.0
    sum_safe = tl.where(no_key, 1.0, weight_sum)
    out = tl.sum(acc, 0) / sum_safe
    lse_out = tl.where(no_key, float("-inf"), base + tl.log(sum_safe))
    o_ptrs = OUT + off_b * stride_ob + off_m * stride_om + off_h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(LSE_OUT + (off_b * num_heads + off_h) * seqlen_q + off_m, lse_out)


# ---------------------------------------------------------------------------
# Policy: how many splits, and when attention()/flash_attn_func take this path
# ---------------------------------------------------------------------------

MAX_SPLITS = 128
# A split shorter than this many key tiles costs more in partial traffic and launch
# tail than its parallelism returns (FlashInfer's floor is a 128-token chunk).
MIN_TILES_PER_SPLIT = 2
WAVE_EFFICIENCY_FRACTION = 0.85
# Nominal SM count where no GPU is visible (the CPU interpreter): the H200's.
NOMINAL_SM_COUNT = 132
MIN_BLOCK_M = 16  # tl.dot's smallest M
MAX_BLOCK_M = 64


def wave_efficiency(blocks: int, slots: int) -> float:
    """Busy fraction of ``slots`` concurrent program slots over the waves ``blocks`` need."""
    return blocks / (slots * math.ceil(blocks / slots))


def choose_num_splits(*, batch: int, kv_heads: int, row_blocks: int, kv_tiles: int,
                      sm_count: int, ctas_per_sm: int) -> int:
    """Split count for one launch: enough programs to fill the GPU's program slots.

    ``kv_tiles`` is the longest sequence's key tiles (an upper bound is fine: every
    sequence divides its own tiles).  The arithmetic, with ``base = batch x kv_heads x
    row_blocks`` unsplit programs and ``slots = sm_count x ctas_per_sm`` programs the
    GPU holds at once (1 per SM at d = 128: 192 KiB of K/V stages each):

    1. a split is worth it only if every split keeps >= MIN_TILES_PER_SPLIT tiles, so
       candidates run 1 .. min(128, kv_tiles // 2), and only counts the reference's
       ceil rule really uses (``ceil(tiles / ceil(tiles / s))``: no empty splits);
    2. wave efficiency ``e(s) = base*s / (slots * ceil(base*s / slots))``; take the
       smallest ``s`` with ``e(s) >= 0.85 * max e`` (fewer splits: less partial traffic).

    Examples on the H200 with the tuned d = 128 tiling (132 SMs, one 128-key program per
    SM, so 132 slots; one query, 8 KV heads): batch 1 x 32k (256 tiles): base 8, the best
    e is 1.0 at 33 splits; 14 splits give 112/132 = 0.85 -> 14 splits of 19 tiles (the
    tuning run measured 50.9 us against 52.8 us for 29 splits).  Batch 16 x 32k: base
    128, e(1) = 128/132 = 0.97 -> no split (4.38 TB/s measured).  Batch 64: base 512 >=
    132 slots -> no split.

    Peers (../shared/research/hopper-kernels.md): FA3 takes 1 split when base >= 0.8 x
    SMs, else the same 85%-of-best rule counted in SMs (one CTA per SM: its TMA
    pipeline is deep enough), capped at 128: 15 splits at batch 1 x 8 KV heads.
    This counts program slots (SMs x resident programs of the tiling): with the tuned
    one-program-per-SM tiling at d = 128 that is FA3's count; a tiling with two
    resident programs per SM asks for about twice FA3's splits, which measured slower.
    FlashInfer: no split if batch x KV heads fills the grid, else a binary search for
    the smallest chunk (>= 128 tokens) keeping CTAs <= SMs x CTAs/SM -- the same slot
    count, searched by chunk length.  SGLang's Triton decode defaults to 8 splits
    whatever the shape, which underfills batch 1 (its PR #27786: 1.2-3.5x from more).
    """
    base = batch * kv_heads * row_blocks
    slots = sm_count * ctas_per_sm
    most = max(1, min(MAX_SPLITS, kv_tiles // MIN_TILES_PER_SPLIT))
    if base >= slots or most == 1:
        return 1
    candidates = sorted({math.ceil(kv_tiles / math.ceil(kv_tiles / s)) for s in range(1, most + 1)})
    efficiencies = {s: wave_efficiency(base * s, slots) for s in candidates}
    best = max(efficiencies.values())
    return next(s for s in candidates if efficiencies[s] >= WAVE_EFFICIENCY_FRACTION * best)


def packed_block_m(group_size: int, seqlen_q: int) -> int:
    """Packed rows per program: the group's query rows, padded to 16, at most 64."""
    rows = group_size * seqlen_q
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(rows)))


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SM_COUNT


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
):
    """Launch split-KV decode on already-validated tensors; returns (out, lse).

    ``layout`` names q's, the output's and a contiguous cache's dimension order
    (``"bshd"``: (batch, seqlen, heads, d), or ``"bhsd"``); a paged cache is always
    (num_pages, page_size, kv_heads, d) with ``block_table`` (batch, max_pages) int32.
    Keys of sequence b are cache positions ``[leftpad[b], cache_seqlens[b] + seqlen_new)``
    (``cache_seqlens`` None: the whole capacity).  ``num_splits=0`` picks the count
    (:func:`choose_num_splits`) from ``max_seqlen_k`` if given, else from the longest
    length the host knows without a sync (an int ``cache_seqlens``, or the capacity).
    Out has q's layout and dtype; LSE is (batch, heads, seqlen_q) fp32, natural log.
    ``return_partials=True`` always runs the split path and also returns the partial
    (O, LSE) as (batch, seqlen_q, heads, num_splits[, d]) fp32, for the tests.
    A float8_e4m3fn cache takes ``k_descale`` and ``v_descale``, (batch, kv_heads) fp32
    views (any strides; :func:`attnlab.checks.check_descale` builds them): the real
    cache is the stored one times them (per query sequence b, as FA3 indexes them).
    """
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
    descaled = k_descale is not None
    if config is None:
        config = decode_config(head_dim, interpreted=interpreted, fp8_cache=descaled)
    head_dim_pad = head_dim_padded(head_dim)
    block_m = packed_block_m(group_size, seqlen_q)
    row_blocks = triton.cdiv(group_size * seqlen_q, block_m)

    seqlens_tensor = isinstance(cache_seqlens, torch.Tensor)
    cache_seqlen = capacity if cache_seqlens is None else (0 if seqlens_tensor else int(cache_seqlens))
    if max_seqlen_k is None:
        max_seqlen_k = capacity if seqlens_tensor else cache_seqlen + seqlen_new
    if num_splits == 0:
        num_splits = choose_num_splits(
            batch=batch, kv_heads=num_kv_heads, row_blocks=row_blocks,
            kv_tiles=max(1, triton.cdiv(max_seqlen_k, config.block_n)),
            sm_count=sm_count(q.device), ctas_per_sm=config.ctas_per_sm)
    write_partial = num_splits > 1 or return_partials

    out_shape = lay.shape(batch, seqlen_q, num_heads, head_dim)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
    if write_partial:
        o_part = torch.empty((batch, seqlen_q, num_heads, num_splits, head_dim),
                             dtype=torch.float32, device=q.device)
        lse_part = torch.empty((batch, seqlen_q, num_heads, num_splits),
                               dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = lse  # never touched: WRITE_PARTIAL is off

    window_left, window_right = reach_window(effective_window(causal, window), seqlen_q, capacity)
    unused = lse  # a valid pointer for arguments a constexpr switch turns off
    grid = (batch * num_kv_heads, num_splits, row_blocks)
    _split_kv_decode[grid](
        q, k_cache, v_cache, o_part, lse_part, out, lse,
        cache_seqlens if seqlens_tensor else unused,
        cache_batch_idx if cache_batch_idx is not None else unused,
        cache_leftpad if cache_leftpad is not None else unused,
        block_table if paged else unused,
        k_descale if descaled else unused, v_descale if descaled else unused,
        *lay.bsh_strides(q), *stride_k, *stride_v, *lay.bsh_strides(out),
        block_table.stride(0) if paged else 0,
        *(k_descale.stride() if descaled else (0, 0)),
        *(v_descale.stride() if descaled else (0, 0)),
        num_kv_heads, group_size, seqlen_q, cache_seqlen, seqlen_new, num_splits,
        max(window_left, 0), max(window_right, 0),
        scale * LOG2E, softcap * LOG2E, (scale / softcap) if softcap > 0 else 0.0,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=block_m,
        BLOCK_N=config.block_n, PAGE_SIZE=page_size,
        HAS_SEQLENS=seqlens_tensor, HAS_BATCH_IDX=cache_batch_idx is not None,
        HAS_LEFTPAD=cache_leftpad is not None,
        HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0,
        WRITE_PARTIAL=write_partial,
        UPCAST_DOT=interpreted and q.dtype == torch.bfloat16, DESCALED=descaled,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if write_partial:
        _combine_partials[(batch * seqlen_q * num_heads,)](
            o_part, lse_part, out, lse, *lay.bsh_strides(out),
            num_heads, seqlen_q, num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            BLOCK_S=min(16, triton.next_power_of_2(num_splits)), num_warps=2, num_stages=1,
        )
    if return_partials:
        return out, lse, (o_part, lse_part)
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
        num_splits = choose_num_splits(batch=batch, kv_heads=kv_heads, row_blocks=row_blocks,
                                       kv_tiles=kv_tiles, sm_count=sm_count,
                                       ctas_per_sm=config.ctas_per_sm)
    programs = batch * kv_heads * row_blocks * num_splits
    return {"num_splits": num_splits, "programs": programs, "block_m": block_m,
            "block_n": config.block_n, "row_blocks": row_blocks, "sm_count": sm_count,
            "programs_per_sm": programs / sm_count,
            "combine_programs": batch * seqlen_q * query_heads if num_splits > 1 else 0}
