"""FlashAttention-2 forward in Triton: the kernel, its launcher, its custom op.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.kernels._primitives import (
    LOG2E,
    _load_kv_tile,
    _mma,
    _online_softmax_step,
    kernel_is_interpreted,
)
from attnlab.kernels.configs import ForwardConfig, forward_config, head_dim_padded
from attnlab.shapes import AttentionShape


@triton.jit
def _kv_tiles(
    acc, l_i, m_i, q,
    k_base, v_base,
    stride_kn, stride_vn,
    offs_m, offs_d, kv_start, kv_end,
    seqlen_k, diag_offset, window_left, window_right,
    qk_scale, softcap_log2, softcap_inv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Fold KV tiles [kv_start, kv_end) into the running softmax state (m_i, l_i, acc)."""
    for start_n in range(kv_start, kv_end, BLOCK_N):
        k = _load_kv_tile(k_base, stride_kn, start_n, offs_d, seqlen_k,
                          BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT)
        p, alpha, m_i, l_i = _online_softmax_step(
            qk, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset, window_left, window_right,
            qk_scale, softcap_log2, softcap_inv, BLOCK_N, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP)
        v = _load_kv_tile(v_base, stride_vn, start_n, offs_d, seqlen_k,
                          BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, MASKED)
        acc = acc * alpha[:, None]
        acc = _mma(p.to(v.dtype), v, acc, UPCAST_DOT)
    return acc, l_i, m_i


# Lengths, head counts and window sizes change per call; specialising on their
# divisibility would only multiply compiles.  Strides stay specialised (16-byte
# alignment enables vector loads).
@triton.jit(do_not_specialize=["num_heads", "group_size", "seqlen_q", "seqlen_k",
                               "window_left", "window_right"])
def _attn_fwd(
    # pointers
    Q, K, V, O, LSE,
    # strides (batch, head, seq); the head dim is unit-stride
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    # sizes
    num_heads, group_size, seqlen_q, seqlen_k,
    window_left, window_right,
    # scalars
    qk_scale, softcap_log2, softcap_inv,
    # meta-parameters
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    REVERSE_M: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # Query blocks of one head run next to each other so they share its K/V in L2;
    # with a causal band the last blocks do the most work, so they start first.
    pid_m = tl.program_id(0)
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    start_m = (num_m_blocks - 1 - pid_m) if REVERSE_M else pid_m
    off_bh = tl.program_id(1)
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = off_bh % num_heads
    off_hk = (off_h // group_size).to(tl.int64)
    off_h = off_h.to(tl.int64)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q_mask = offs_m[:, None] < seqlen_q
    if HEAD_DIM != HEAD_DIM_PAD:
        q_mask = q_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Bottom-right alignment: query i sees key j iff
    #   i + diag_offset - window_left <= j <= i + diag_offset + window_right.
    diag_offset = seqlen_k - seqlen_q
    m_first = start_m * BLOCK_M
    m_last = m_first + BLOCK_M - 1

    # Skip bound: the KV range any row of this block can see.  Tiles outside it
    # are never loaded.
    kv_lo = 0
    kv_hi = seqlen_k
    if HAS_LEFT:
        kv_lo = tl.maximum(m_first + diag_offset - window_left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        kv_hi = tl.minimum(tl.maximum(m_last + diag_offset + window_right + 1, 0), seqlen_k)
    kv_hi = tl.maximum(kv_hi, kv_lo)

    # Tiles that every row sees in full need no element mask.
    full_lo = kv_lo
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_LEFT:
        first_full = tl.maximum(m_last + diag_offset - window_left, 0)
        full_lo = tl.maximum(kv_lo, tl.cdiv(first_full, BLOCK_N) * BLOCK_N)
    if HAS_RIGHT:
        last_full = tl.maximum(m_first + diag_offset + window_right + 1, 0)
        full_hi = tl.minimum(full_hi, last_full // BLOCK_N * BLOCK_N)
    full_lo = tl.minimum(full_lo, kv_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), kv_hi)

    # Stage 1: tiles cut by the window's left edge (element mask).
    acc, l_i, m_i = _kv_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        kv_lo, full_lo, seqlen_k, diag_offset, window_left, window_right,
        qk_scale, softcap_log2, softcap_inv,
        BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)
    # Stage 2: tiles wholly inside the band (no mask).
    acc, l_i, m_i = _kv_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        full_lo, full_hi, seqlen_k, diag_offset, window_left, window_right,
        qk_scale, softcap_log2, softcap_inv,
        BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)
    # Stage 3: diagonal tiles and the ragged last tile (element mask).
    acc, l_i, m_i = _kv_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
        full_hi, kv_hi, seqlen_k, diag_offset, window_left, window_right,
        qk_scale, softcap_log2, softcap_inv,
        BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, UPCAST_DOT)

    # One division per row, at the end.  A row with no visible key has l = 0:
    # it outputs zeros and LSE = -inf.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
    lse_ptrs = LSE + off_bh.to(tl.int64) * seqlen_q + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}  # AttentionShape's names
MAX_HEAD_DIM = 256


def _bhs_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    if layout == "bshd":
        return t.stride(0), t.stride(2), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    layout: str, scale: float, causal: bool = False,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    config: ForwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on already-validated tensors.

    ``layout`` names the tensors' dimension order: ``"bshd"`` (flash-attn) or
    ``"bhsd"`` (SDPA).  Returns O in the same layout and LSE as (batch, heads,
    seqlen_q) float32, natural log.  Causal is bottom-right aligned.
    """
    if layout == "bshd":
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
        out = torch.empty((batch, seqlen_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        batch, num_heads, seqlen_q, head_dim = q.shape
        num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
        out = torch.empty((batch, num_heads, seqlen_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads, seqlen_q), dtype=torch.float32, device=q.device)

    window_left, window_right = window
    if causal:
        window_right = 0 if window_right < 0 else min(window_right, 0)
    has_left, has_right = window_left >= 0, window_right >= 0
    head_dim_pad = head_dim_padded(head_dim)
    if config is None:
        shape = AttentionShape(batch=batch, query_heads=num_heads, kv_heads=num_kv_heads,
                               seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                               dtype=DTYPE_NAMES[q.dtype], causal=causal, window=tuple(window))
        config = forward_config(shape, interpreted=kernel_is_interpreted())

    grid = (triton.cdiv(seqlen_q, config.block_m), batch * num_heads)
    _attn_fwd[grid](
        q, k, v, out, lse,
        *_bhs_strides(q, layout), *_bhs_strides(k, layout), *_bhs_strides(v, layout),
        *_bhs_strides(out, layout),
        num_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k,
        max(window_left, 0), max(window_right, 0),
        scale * LOG2E, softcap * LOG2E, (scale / softcap) if softcap > 0 else 0.0,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_SOFTCAP=softcap > 0,
        REVERSE_M=has_right,
        UPCAST_DOT=kernel_is_interpreted() and q.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse


# ---------------------------------------------------------------------------
# Custom op: torch.compile sees one opaque node; autograd says plainly that the
# backward is not ours yet instead of differentiating something else.
# ---------------------------------------------------------------------------

@torch.library.custom_op("attnlab::flash_fwd", mutates_args=())
def flash_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(q, k, v, layout=layout, scale=scale, causal=causal,
                         window=(window_left, window_right), softcap=softcap)


@flash_fwd_op.register_fake
def _(q, k, v, layout, scale, causal, window_left, window_right, softcap):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bshd" else q.shape[:3]
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        lse_shape, dtype=torch.float32)


def _no_backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(
        "attnlab's Triton attention has no backward kernel yet; use impl='reference' "
        "or torch SDPA for training")


flash_fwd_op.register_autograd(_no_backward)

