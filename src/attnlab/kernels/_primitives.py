"""The @triton.jit pieces every attnlab kernel shares: the MMA, tile loads, the
online-softmax step.  Forward, backward and decode import them from here; a
kernel file holds only its own loop and launcher.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# exp(x) = exp2(x * log2(e)): the kernel works in base 2 (one MUFU.EX2 per score) and
# converts the LSE back to natural log with ln(2) = 0.6931471805599453 at the end.
LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b in fp32.  UPCAST is for Triton 3.6's CPU interpreter only, whose
    bf16 dot multiplies the raw 16-bit patterns; on a GPU the operands stay 16-bit."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _load_kv_tile(base, stride_n, start_n, offs_d, seqlen_k,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                  MASKED: tl.constexpr):
    """One (BLOCK_N, HEAD_DIM_PAD) tile of K or V from this (batch, kv head)'s base pointer;
    rows past seqlen_k and padded columns read 0."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    ptrs = base + offs_n[:, None] * stride_n + offs_d[None, :]
    if MASKED:
        # A band-edge tile may also be the ragged last tile of the sequence.
        return tl.load(ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if HEAD_DIM != HEAD_DIM_PAD:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _online_softmax_step(qk, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset,
                         window_left, window_right, qk_scale, softcap_log2, softcap_inv,
                         BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
                         HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Scores of one tile -> probabilities p (base m_new), rescale alpha, new m and l."""
    if HAS_SOFTCAP:
        # softcap * tanh(s / softcap), with tanh(x) = 1 - 2 / (exp(2x) + 1); kept in
        # the log2 domain so the exponentials below stay exp2.
        x = qk * softcap_inv
        qk = softcap_log2 * (1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0))
        score_scale = 1.0
    else:
        # The softmax scale is folded into the exp2 argument (one FMA per score).
        score_scale = qk_scale
    if MASKED:
        # The element mask: invisible scores become -inf before max and sum see them.
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = offs_n[None, :] < seqlen_k
        if HAS_RIGHT:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_offset + window_right)
        if HAS_LEFT:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_offset - window_left)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * score_scale)
        # A row that has seen no visible key yet keeps m = -inf; subtracting 0
        # instead of -inf makes exp2 give 0 rather than NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * score_scale)
        m_safe = m_new
    p = tl.math.exp2(qk * score_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


def kernel_is_interpreted() -> bool:
    """True when Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_mma, JITFunction)
