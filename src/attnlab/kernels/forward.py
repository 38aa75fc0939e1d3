"""FlashAttention-2 forward in Triton: the kernel and its launcher.

Loop order (FA-2, Dao 2023 Algorithm 1): one program owns BLOCK_M query rows of
one (batch, head); it streams K/V tiles of BLOCK_N rows through on-chip memory
and keeps the softmax state (m_i, l_i, acc) in registers.  S and P never reach
HBM: the only outputs are O and the log-sum-exp (natural log).

Causal masking and sliding windows are two separate mechanisms here, as in the
lesson (section 2.1):

* the **skip bound** — KV tiles wholly outside a query block's visible band are
  never loaded (``kv_lo``/``kv_hi`` below);
* the **element mask** — only tiles that straddle a band edge (the diagonal,
  the window's left edge, a ragged last tile) run the ``MASKED`` loop stage,
  which sets invisible scores to -inf before the running max and sum see them.

Tiles fully inside the band run the unmasked stage: no mask arithmetic at all.

Variable-length batches (``IS_VARLEN``, layout ``thd``) are the same kernel: a
program reads its sequence's first token and length from ``cu_seqlens`` and then
runs exactly the dense loop on that sequence; programs whose query block lies
past their sequence's end exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

import attnlab.kernels.dispatch as dispatch
import attnlab.kernels.index_checks as index_checks
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
    _checked_pages,
    _finish_rows,
    _flag_index_error,
    _kv_band_bounds,
    _load_cache_tile,
    _load_kv_tile,
    _load_strided_tile,
    _mma,
    _online_softmax_step,
    _page_entries,
    _row_sees_keys,
    _to_e4m3,
    kernel_is_interpreted,
    launch_is_traced,
)
from attnlab.kernels.configs import (
    ForwardConfig,
    forward_config,
    fp8_forward_config,
    head_dim_padded,
)
from attnlab.kernels.fp8_v import keys_contiguous
from attnlab.masking import effective_window, reach_window
from attnlab.shapes import AttentionShape


@triton.jit
def _kv_tiles(
    acc, l_i, m_i, bad, q,
    k_base, v_base, block_table_row, ERRORS, off_b, num_pages,
    stride_kpage, stride_kn, stride_vpage, stride_vn, stride_vd,
    offs_m, offs_d, kv_start, kv_end,
    seqlen_k, diag_offset, window_left, window_right,
    qk_scale, softcap_log2, softcap_inv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr, FP8: tl.constexpr, EMULATE_FP8: tl.constexpr,
):
    """Fold KV tiles [kv_start, kv_end) into the running softmax state (m_i, l_i, acc).
    PAGE_SIZE > 0: the keys live in a paged cache (the decode kernel's pages: one table
    lookup per tile for K and V; ``bad`` turns 1 where an entry is out of range).  The
    entries are read in the step that uses them: read a tile ahead, as the decode kernel
    reads them, the pipeliner keeps two tiles in flight here too, but at page 16 the
    128 x 128 tiles then spill inside the loop (bench/NOTES.md S13), unmeasured."""
    for start_n in range(kv_start, kv_end, BLOCK_N):
        if FP8:
            # Every stage that runs starts on a tile boundary (_kv_band_bounds: only an
            # empty stage starts at a ragged kv_hi), so this changes no value; written as
            # arithmetic, the compiler sees V's keys-contiguous rows 16-byte aligned and
            # its unmasked loads join the cp.async pipeline (tl.multiple_of did not carry
            # through Triton 3.7.1's pipeliner: V stayed a synchronous load in every stage).
            start_n = start_n // BLOCK_N * BLOCK_N
        if PAGE_SIZE == 0:
            k = _load_kv_tile(k_base, stride_kn, start_n, offs_d, seqlen_k,
                              BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        else:
            entries = _page_entries(block_table_row, start_n, seqlen_k, seqlen_k, BLOCK_N,
                                    PAGE_SIZE)
            page, tile_bad = _checked_pages(ERRORS, off_b, entries, start_n, seqlen_k,
                                            num_pages, BLOCK_N, PAGE_SIZE)
            bad = bad | tile_bad
            k = _load_cache_tile(k_base, page, stride_kpage, stride_kn, start_n, offs_d,
                                 seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, MASKED)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT)
        p, alpha, m_i, l_i = _online_softmax_step(
            qk, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset, window_left, window_right,
            qk_scale, softcap_log2, softcap_inv, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP)
        if PAGE_SIZE == 0:
            # stride_vd: 1, or the FP8 forward's keys-contiguous V (never paged).
            v = _load_strided_tile(v_base, stride_vn, stride_vd, start_n, offs_d, seqlen_k,
                                   BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        else:
            v = _load_cache_tile(v_base, page, stride_vpage, stride_vn, start_n, offs_d,
                                 seqlen_k, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE, MASKED)
        acc = acc * alpha[:, None]
        if FP8:
            # P as e4m3, as FA3 does.  The tensor core sums an fp8 product in a ~14-bit
            # accumulator (DeepSeek-V3 report, sec. 3.3.2), so each tile's P V is summed
            # there and then added to acc in fp32 (max_num_imprecise_acc = BLOCK_N: one
            # FMA with the rescale per element and tile), never the whole sequence.
            acc = tl.dot(_to_e4m3(p, EMULATE_FP8), v, acc, max_num_imprecise_acc=BLOCK_N)
        else:
            acc = _mma(p.to(v.dtype), v, acc, UPCAST_DOT)
    return acc, l_i, m_i, bad


# Lengths, head counts and window sizes change per call; specialising on their
# divisibility would only multiply compiles.  Strides stay specialised (16-byte
# alignment enables vector loads).
@triton.jit(do_not_specialize=["num_heads", "group_size", "seqlen_q", "seqlen_k", "num_m_blocks",
                               "window_left", "window_right", "num_pages"])
def _attn_fwd(
    # pointers
    Q, K, V, O, LSE,
    CU_SEQLENS_Q, CU_SEQLENS_K,  # varlen only: (batch + 1,) int32 first-token offsets
    # paged varlen only: (batch, max_pages) int32 pages, (batch,) int32 keys per sequence,
    # the index-error record (kernels/index_checks.py)
    BLOCK_TABLE, SEQUSED_K, ERRORS,
    Q_DESCALE, K_DESCALE, V_DESCALE,  # FP8 only: (batch, kv_heads) fp32 descale factors
    # strides (batch, head, seq); the head dim is unit-stride.  Varlen tensors are
    # (total_tokens, heads, head_dim) with batch stride 0: cu_seqlens places a sequence.
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_vd,  # stride_vd: 1, or the seq length (FP8)
    stride_ob, stride_oh, stride_om,
    stride_lse_b, stride_lse_h,  # LSE rows are unit-stride
    stride_block_table,
    stride_qdb, stride_qdh, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    # sizes (dense: the call's lengths; varlen: unused, each program reads its own; paged:
    # seqlen_k is the capacity, block_table.shape[1] x PAGE_SIZE)
    num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks,
    window_left, window_right, num_pages,
    # scalars
    qk_scale, softcap_log2, softcap_inv,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    REVERSE_M: tl.constexpr, UPCAST_DOT: tl.constexpr,
    IS_VARLEN: tl.constexpr, OFFSETS_64: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    FP8: tl.constexpr, EMULATE_FP8: tl.constexpr,
):
    # A 1-D grid, query blocks fastest: the blocks of one head run next to each other
    # so they share its K/V in L2 (the same order as a (blocks, batch*heads) grid),
    # and batch*heads is not held to CUDA's 65,535 limit on a grid's second axis.
    pid = tl.program_id(0)
    pid_m = pid % num_m_blocks
    off_bh = pid // num_m_blocks
    # Inductor passes Python floats as fp64 (torch.compile of attnlab::flash_fwd), a direct
    # launch as fp32; fp32 here keeps the softmax state fp32 and both results bit-equal.
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    softcap_inv = tl.cast(softcap_inv, tl.float32)
    # Scalar base offsets (batch, head, first token) are int64 always: one multiply
    # per program.  The per-row vector offsets (row * row stride) stay int32 unless
    # the launcher found that they can pass 2^31 (``OFFSETS_64``, see
    # ``offsets_need_int64``); then every stride becomes int64, and with it every
    # product below.
    if OFFSETS_64:
        stride_qm = tl.cast(stride_qm, tl.int64)
        stride_kn = tl.cast(stride_kn, tl.int64)
        stride_vn = tl.cast(stride_vn, tl.int64)
        stride_vd = tl.cast(stride_vd, tl.int64)
        stride_om = tl.cast(stride_om, tl.int64)
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = off_bh % num_heads
    off_hk = (off_h // group_size).to(tl.int64)
    off_h = off_h.to(tl.int64)
    if FP8:
        # The real q.k is q_descale x k_descale x the stored product: one factor per
        # program, folded into the scale (v_descale scales O at the end).
        qk_descale = (tl.load(Q_DESCALE + off_b * stride_qdb + off_hk * stride_qdh)
                      * tl.load(K_DESCALE + off_b * stride_kdb + off_hk * stride_kdh))
        qk_scale = qk_scale * qk_descale
        softcap_inv = softcap_inv * qk_descale

    bad = (off_b < 0).to(tl.int32)  # 1 once an index of this sequence is out of range
    if IS_VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + off_b).to(tl.int64)
        seqlen_q = (tl.load(CU_SEQLENS_Q + off_b + 1) - q_start).to(tl.int32)
        if PAGE_SIZE == 0:
            k_start = tl.load(CU_SEQLENS_K + off_b).to(tl.int64)
            keys = (tl.load(CU_SEQLENS_K + off_b + 1) - k_start).to(tl.int32)
        else:
            # The sequence's keys are its cache positions 0 .. in its pages.
            k_start = off_b * 0
            keys = seqlen_k
            if not HAS_SEQUSED:
                keys = (tl.load(CU_SEQLENS_K + off_b + 1) - tl.load(CU_SEQLENS_K + off_b))
        if HAS_SEQUSED:
            # Keys used: checked against the keys the sequence has, where read.
            used = tl.load(SEQUSED_K + off_b)
            keys_bad = (used < 0) | (used > keys)
            _flag_index_error(ERRORS, 6, off_b, 0 * off_b, used, keys, keys_bad)
            bad = bad | keys_bad.to(tl.int32)
            keys = tl.where(keys_bad, 0, used)
        seqlen_k = keys
        seq_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
        # The grid covers the longest sequence; shorter ones leave programs idle.
        if pid_m >= seq_m_blocks:
            return
    else:
        q_start = 0
        k_start = 0
        seq_m_blocks = num_m_blocks
    # With a causal band the last blocks do the most work, so they start first.
    start_m = (seq_m_blocks - 1 - pid_m) if REVERSE_M else pid_m

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_base = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
    q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :]
    q_mask = offs_m[:, None] < seqlen_q
    if HEAD_DIM != HEAD_DIM_PAD:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if PAGE_SIZE == 0:
        k_base = K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
        v_base = V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
        block_table_row = BLOCK_TABLE
    else:
        # Paged: stride_kb / stride_vb are the page strides; _kv_tiles adds the pages.
        k_base = K + off_hk * stride_kh
        v_base = V + off_hk * stride_vh
        block_table_row = BLOCK_TABLE + off_b * stride_block_table

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Bottom-right alignment (per sequence when varlen): query i sees key j iff
    #   i + diag_offset - window_left <= j <= i + diag_offset + window_right.
    diag_offset = seqlen_k - seqlen_q
    m_first = start_m * BLOCK_M
    m_last = m_first + BLOCK_M - 1

    # The skip bound [kv_lo, kv_hi): tiles outside it are never loaded; of those
    # loaded, [full_lo, full_hi) are seen in full by every row and need no element mask.
    kv_lo, full_lo, full_hi, kv_hi = _kv_band_bounds(
        m_first, m_last, seqlen_k, diag_offset, window_left, window_right,
        BLOCK_N, HAS_LEFT, HAS_RIGHT)

    # Stage 1: tiles cut by the window's left edge (element mask).
    acc, l_i, m_i, bad = _kv_tiles(
        acc, l_i, m_i, bad, q, k_base, v_base, block_table_row, ERRORS, off_b, num_pages,
        stride_kb, stride_kn, stride_vb, stride_vn, stride_vd, offs_m, offs_d,
        kv_lo, full_lo, seqlen_k, diag_offset, window_left, window_right,
        qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD,
        PAGE_SIZE, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT, FP8, EMULATE_FP8)
    # Stage 2: tiles wholly inside the band (no mask).
    acc, l_i, m_i, bad = _kv_tiles(
        acc, l_i, m_i, bad, q, k_base, v_base, block_table_row, ERRORS, off_b, num_pages,
        stride_kb, stride_kn, stride_vb, stride_vn, stride_vd, offs_m, offs_d,
        full_lo, full_hi, seqlen_k, diag_offset, window_left, window_right,
        qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD,
        PAGE_SIZE, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT, FP8, EMULATE_FP8)
    # Stage 3: diagonal tiles and the ragged last tile (element mask).
    acc, l_i, m_i, bad = _kv_tiles(
        acc, l_i, m_i, bad, q, k_base, v_base, block_table_row, ERRORS, off_b, num_pages,
        stride_kb, stride_kn, stride_vb, stride_vn, stride_vd, offs_m, offs_d,
        full_hi, kv_hi, seqlen_k, diag_offset, window_left, window_right,
        qk_scale, softcap_log2, softcap_inv, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD,
        PAGE_SIZE, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT, FP8, EMULATE_FP8)

    # One division per row, at the end: a row with no visible key outputs zeros and
    # LSE = -inf; a NaN stays NaN (_finish_rows).
    sees_key = _row_sees_keys(offs_m, 0, seqlen_k, diag_offset, window_left, window_right,
                              HAS_LEFT, HAS_RIGHT)
    out, lse = _finish_rows(acc, l_i, m_i, sees_key)
    if FP8:
        out = out * tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
    if PAGE_SIZE != 0 or HAS_SEQUSED:
        # A bad index: the whole sequence's rows are NaN (never a quiet wrong answer).
        out = tl.where(bad != 0, float("nan"), out)
        lse = tl.where(bad != 0, float("nan"), lse)

    o_base = O + off_b * stride_ob + off_h * stride_oh + q_start * stride_om
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
    # LSE: (batch, heads, seqlen_q) dense, (heads, total_q) varlen.
    lse_ptrs = LSE + off_b * stride_lse_b + off_h * stride_lse_h + q_start + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
INT32_MAX = 2**31 - 1


def offsets_need_int64(seqlen: int, row_stride: int, block_rows: int, head_dim_pad: int) -> bool:
    """True when a tile's element offsets from its (batch, head, first token) base can pass
    2^31 - 1: ``row * row_stride + column`` for every row a tile touches, including the
    masked rows of a ragged last tile (up to ``seqlen + block_rows``).

    Only this in-sequence part is 32-bit in the kernel; the base itself is int64.  So a
    (batch, heads, seqlen, dim) tensor far past 2^31 elements stays on the 32-bit fast
    path as long as one head's rows fit (bhsd: seqlen * head_dim < 2^31), while
    (batch, seqlen, heads, dim) with 600k tokens x 32 heads x 128 does not (issue #11).
    """
    return (seqlen + block_rows) * abs(row_stride) + head_dim_pad > INT32_MAX


_DIRECT_FORWARD = DirectLauncher(_attn_fwd)


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    layout: str, scale: float, causal: bool = False,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    config: ForwardConfig | None = None,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    block_table: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on already-validated tensors.

    ``layout`` names the tensors' dimension order: ``"bshd"`` (flash-attn),
    ``"bhsd"`` (SDPA) or ``"thd"`` (varlen: (total_tokens, heads, head_dim), with
    ``cu_seqlens_q/k`` int32 (batch + 1,) cumulative lengths on q's device and
    ``max_seqlen_q/k`` at least every sequence's length; the caller checked them,
    see ``attnlab.api.flash_attn_varlen_func``).  Returns O in the same layout and LSE
    float32, natural log: (batch, heads, seqlen_q), or (heads, total_q) for ``thd``
    (flash-attn's varlen layout).  Causal is bottom-right aligned, per sequence.

    Paged varlen (``thd`` only, forward only): ``block_table`` (batch, max_pages) int32
    and k, v (num_pages, page_size, kv_heads, head_dim); sequence b's keys are its cache
    positions ``0 .. seqused_k[b]`` (else ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``) read
    through its row of the table.  ``seqused_k`` also works unpaged (the first
    ``seqused_k[b]`` of sequence b's packed keys).  Table entries and seqused_k are
    range-checked on the device: a bad one makes that sequence NaN and is recorded
    (kernels/index_checks.py).
    ``descales`` is the FP8 forward's (:func:`flash_forward_fp8`, which prepares V).
    """
    layout_named(layout)  # a name this module cannot read is refused before any plan
    options = dict(layout=layout, scale=scale, causal=causal, window=tuple(window),
                   softcap=softcap, config=config, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k)
    indices = (cu_seqlens_q, cu_seqlens_k, block_table, seqused_k)
    if launch_is_traced(q):
        # Traced, each launch must be a graph node (wrap_triton's HOP) for Inductor.
        plan = _plan_forward(q, k, v, *indices,
                             launcher=TracedLauncher(wrap_triton(_attn_fwd)), descales=descales,
                             **options)
    else:
        # A real call skips that HOP's dispatch and, after the first call with this
        # signature, the choices below and JITFunction.run's argument binding.
        key = (*options.values(), q.device, tensor_key(q, k, v, *indices, *(descales or ())))
        plan = _PLANS.get(key, lambda: _plan_forward(q, k, v, *indices,
                                                     launcher=_DIRECT_FORWARD,
                                                     descales=descales, **options))
    if descales is not None:
        return plan(q, k, v, *indices, descales=descales)
    return plan(q, k, v, *indices)


def keys_contiguous_view(v: torch.Tensor) -> torch.Tensor:
    """``keys_contiguous(v)`` as the same-shaped view of V the Triton forward reads
    (stride 1 along the keys)."""
    return keys_contiguous(v)[..., :v.shape[1]].permute(0, 3, 1, 2)


def flash_forward_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_descale: torch.Tensor, k_descale: torch.Tensor,
                      v_descale: torch.Tensor, *, scale: float, causal: bool = False,
                      window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      config: ForwardConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward (FA3's semantics) on validated float8_e4m3fn q, k, v (``bshd``) and
    (batch, kv_heads) fp32 descale views: attention over q x q_descale, k x k_descale,
    v x v_descale.  Q K^T runs on fp8 operands, P is rounded to e4m3 for P V (as FA3);
    returns O in bf16 and LSE fp32 (natural log).  No backward.  The Gluon sm_90 kernel
    runs it where ``dispatch.fp8_forward_config`` says (a Triton ``config`` forces this
    module's kernel)."""
    if config is None:
        sm90 = dispatch.fp8_forward_config(q, k, v, causal=causal, window=window,
                                           softcap=softcap)
        if sm90 is not None:
            from attnlab.kernels.forward_sm90 import plan_launch

            key = ("sm90-fp8", scale, causal, sm90, q.device, tensor_key(q, k, v))
            plan = _PLANS.get(key, lambda: plan_launch(q, k, v, layout="bshd", scale=scale,
                                                       causal=causal, config=sm90))
            return plan(q, k, v, q_descale, k_descale, v_descale)
    return flash_forward(q, k, keys_contiguous_view(v), layout="bshd", scale=scale, causal=causal,
                         window=window, softcap=softcap, config=config,
                         descales=(q_descale, k_descale, v_descale))


# Forward plans by call signature (kernels/_launch.PlanCache).
_PLANS = PlanCache()


class _ForwardPlan:
    """The Triton kernel's launch for one call signature: allocates O and LSE and
    launches (an empty call only fills them)."""

    def __init__(self, out_shape, lse_shape, launch: PlannedLaunch | None,
                 errors: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        self.out_shape, self.lse_shape, self.launch = out_shape, lse_shape, launch
        self.errors = errors
        self.out_dtype = out_dtype  # None: q's (the FP8 forward writes bf16)

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table=None, seqused_k=None,
                 descales=None):
        out = torch.empty(self.out_shape, dtype=self.out_dtype or q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if self.launch is None:
            lse.fill_(float("-inf"))
            return out.zero_(), lse
        # Without descales the FP8-only pointers get any valid one (FP8 is off).
        self.launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                    self.errors, *(descales or (lse,) * 3))
        return out, lse


class _Sm90ForwardPlan:
    """The Gluon sm_90 kernel's launch (``forward_sm90.PlannedLaunch``) behind the same
    call."""

    def __init__(self, launch) -> None:
        self.launch = launch

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table=None, seqused_k=None):
        return self.launch(q, k, v)


def _plan_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, *, layout,
                  scale, causal, window, softcap, config, max_seqlen_q, max_seqlen_k, launcher,
                  descales=None):
    """What ``flash_forward`` launches for tensors of these sizes, strides and alignment
    (and, for the FP8 forward, of its descales' strides)."""
    lay = layout_named(layout)
    fp8 = descales is not None
    paged = block_table is not None
    if (paged or seqused_k is not None) and not lay.is_varlen:
        raise ValueError(f"block_table and seqused_k belong to layout 'thd', not {layout!r}")
    if not lay.is_varlen and config is None and not fp8:
        sm90_config = dispatch.forward_config(q, k, v, layout=layout, causal=causal,
                                              window=window, softcap=softcap)
        if sm90_config is not None:
            from attnlab.kernels.forward_sm90 import plan_launch

            return _Sm90ForwardPlan(plan_launch(q, k, v, layout=layout, scale=scale,
                                                causal=causal, config=sm90_config))
    if lay.is_varlen:
        # cu_seqlens_k may be absent where seqused_k gives a paged sequence's keys.
        keys_given = cu_seqlens_k is not None or (paged and seqused_k is not None)
        if cu_seqlens_q is None or not keys_given or max_seqlen_q is None \
                or max_seqlen_k is None:
            raise ValueError("layout 'thd' needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
                             "max_seqlen_k")
    elif cu_seqlens_q is not None or cu_seqlens_k is not None:
        raise ValueError(f"cu_seqlens belong to layout 'thd', not {layout!r}")
    if paged:
        # The pages stand in for packed keys: (page, position, head) strides, and the
        # longest sequence the table can hold as seqlen_k.
        page_size = k.shape[1]
        packed = [t[:, 0] for t in (k, v)]  # (num_pages, kv_heads, d): the thd view's sizes
        seqlen_k = block_table.shape[1] * page_size
        inputs = AttentionInputs.read(q, *packed, layout, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, seqlen_k)
    else:
        page_size = 0
        inputs = AttentionInputs.read(q, k, v, layout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k)
    batch, num_heads, num_kv_heads = inputs.batch, inputs.heads, inputs.kv_heads
    seqlen_q, seqlen_k, head_dim = inputs.seqlen_q, inputs.seqlen_k, inputs.head_dim
    out_shape, lse_shape = inputs.out_shape(), inputs.lse_shape()
    out_dtype = torch.bfloat16 if fp8 else None
    if batch == 0 or seqlen_q == 0 or 0 in out_shape:
        return _ForwardPlan(out_shape, lse_shape, None, out_dtype=out_dtype)
    # O and LSE are allocated contiguous: their strides follow from the shapes.
    out_meta = torch.empty(out_shape, device="meta")
    stride_lse = (0, lse_shape[1]) if lay.is_varlen else (num_heads * seqlen_q, seqlen_q)

    window_left, window_right = reach_window(effective_window(causal, window), seqlen_q, seqlen_k)
    has_left, has_right = window_left >= 0, window_right >= 0
    head_dim_pad = head_dim_padded(head_dim)
    interpreted = kernel_is_interpreted()
    if config is None and fp8:
        config = fp8_forward_config(head_dim, causal or window != (-1, -1),
                                    interpreted=interpreted)
    elif config is None:
        # Varlen takes the tiles tuned for its longest sequence.
        shape = AttentionShape(batch=batch, query_heads=num_heads, kv_heads=num_kv_heads,
                               seqlen_q=seqlen_q, seqlen_k=max(seqlen_k, 1), head_dim=head_dim,
                               dtype=TORCH_DTYPE_NAMES[q.dtype], causal=causal, window=tuple(window))
        config = forward_config(shape, interpreted=interpreted)

    q_strides, o_strides = (lay.bhs_strides(t) for t in (q, out_meta))
    if paged:  # (page, head, position): the kernel adds pages through the table
        k_strides, v_strides = ((t.stride(0), t.stride(2), t.stride(1)) for t in (k, v))
    else:
        k_strides, v_strides = (lay.bhs_strides(t) for t in (k, v))
    stride_vd = v.stride(-1)  # 1, or the FP8 forward's keys-contiguous V
    offsets_64 = (
        any(offsets_need_int64(seqlen_q, s[2], config.block_m, head_dim_pad)
            for s in (q_strides, o_strides))
        or any(offsets_need_int64(seqlen_k, s[2], config.block_n, head_dim_pad)
               for s in (k_strides, v_strides))
        or head_dim_pad * stride_vd + seqlen_k + config.block_n > INT32_MAX)
    # Per-tensor descales are stride-0 views: their strides are part of the plan's key.
    descale_strides = tuple(n for d in descales for n in d.stride()) if fp8 else (0,) * 6
    num_m_blocks = triton.cdiv(seqlen_q, config.block_m)
    grid = (num_m_blocks * batch * num_heads,)
    static = (*q_strides, *k_strides, *v_strides, stride_vd, *o_strides, *stride_lse,
              block_table.stride(0) if paged else 0, *descale_strides,
              num_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k, num_m_blocks,
              max(window_left, 0), max(window_right, 0), k.shape[0] if paged else 0,
              scale * LOG2E, softcap * LOG2E, (scale / softcap) if softcap > 0 else 0.0)
    meta = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_SOFTCAP=softcap > 0,
                REVERSE_M=has_right,
                UPCAST_DOT=interpreted and q.dtype == torch.bfloat16,
                IS_VARLEN=lay.is_varlen, OFFSETS_64=offsets_64, PAGE_SIZE=page_size,
                HAS_SEQUSED=seqused_k is not None, FP8=fp8, EMULATE_FP8=fp8 and interpreted,
                num_warps=config.num_warps, num_stages=config.num_stages)
    errors = index_checks.error_buffer(q.device) if paged or seqused_k is not None else None
    return _ForwardPlan(out_shape, lse_shape, PlannedLaunch(launcher, grid, static, meta),
                        errors, out_dtype)


# ---------------------------------------------------------------------------
# Ahead of time, without a GPU: can ptxas build these tiles?
# ---------------------------------------------------------------------------

def compile_for_sm90(head_dim: int, config: ForwardConfig, *, dtype: str = "bf16",
                     causal: bool = False, window: bool = False, softcap: bool = False,
                     varlen: bool = False, offsets_64: bool = False, page_size: int = 0):
    """The forward kernel as a call with these options compiles it for sm_90a, here,
    without a GPU (``kernels/_aot``; ``window`` a two-sided sliding window, ``page_size``
    a paged cache, which only varlen calls take); raises Triton's PTXASError where
    ptxas cannot build it.  The bf16/fp16 forward: V's head dim unit-stride
    (``stride_vd`` = 1, as a launch specialises it), FP8 off."""
    return compile_triton(_attn_fwd, dtype, dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, HAS_LEFT=window, HAS_RIGHT=causal or window,
        HAS_SOFTCAP=softcap, REVERSE_M=causal or window, UPCAST_DOT=False, IS_VARLEN=varlen,
        OFFSETS_64=offsets_64, PAGE_SIZE=page_size, HAS_SEQUSED=False, FP8=False,
        EMULATE_FP8=False, stride_vd=1), num_warps=config.num_warps,
        num_stages=config.num_stages)
