"""EXPERIMENT (not used by attnlab): FlashAttention-2 forward for Hopper in Gluon with FA3's overlap.

Accurate on the H200 (108/108 cases) but 6-8% slower than the Triton kernel at d=128 and
~20-40% slower at d=64 (bench/NOTES.md, attempt 7); kept as the starting point for the
warp-specialised version, which is where FA3's gain comes from.

Why a second kernel: Triton 3.6 waits for every wgmma right after issuing it
(bench/NOTES.md, attempt 3), so the softmax of a tile never overlaps a matrix
multiply.  Gluon exposes the instructions: this kernel issues S_j = Q K_j^T, then
P_{j-1} V_{j-1}, waits for S_j only (``warpgroup_mma_wait(1)``), and runs the
softmax of tile j on the CUDA cores while P_{j-1} V_{j-1} is still on the tensor
cores (FA3, Shah et al. 2024, section 3.2).  K/V tiles arrive by TMA into a
two-stage ring guarded by mbarriers.

Scope (``supports`` checks it): sm_90, fp16/bf16, head_dim 64 or 128, full or
causal (bottom-right, seqlen_q <= seqlen_k), no window, no softcap.  Skip bound and
element mask stay two
steps: tiles past ``kv_hi`` are never loaded, and only tiles at or past
``mask_from`` apply the mask.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnlab.kernels.forward import LOG2E

BLOCK_M = 128
BLOCK_N = 128
STAGES = 2
NUM_WARPS = 8  # two warpgroups of 64 query rows each


@gluon.jit
def _softmax_step(s, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset, mask_from, qk_scale,
                  BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """Scores of one tile -> P (base m_new), the rescale alpha, new m and l."""
    if start_n + BLOCK_N > mask_from:
        # The element mask: only band-edge tiles (the diagonal, the ragged last tile).
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(offs_n, 0) < seqlen_k
        if IS_CAUSAL:
            visible = visible & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m, 1) + diag_offset)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row with no visible key so far keeps m = -inf; subtract 0 instead (exp2 -> 0, not NaN).
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile, stage, pred,
             BLOCK_N: gl.constexpr):
    mbarrier.expect(k_bars.index(stage), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [tile * BLOCK_N, 0], k_bars.index(stage),
                                    k_smem.index(stage), pred=pred)
    mbarrier.expect(v_bars.index(stage), v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [tile * BLOCK_N, 0], v_bars.index(stage),
                                    v_smem.index(stage), pred=pred)


@gluon.jit
def _attn_fwd_sm90(
    # pointers
    Q, K, V, O, LSE,
    # strides (batch, head, seq); the head dim is unit-stride
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    # sizes
    num_heads, group_size, seqlen_q, seqlen_k,
    # scalars
    qk_scale,
    # meta-parameters
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    pid_m = gl.program_id(0)
    num_m_blocks = gl.cdiv(seqlen_q, BLOCK_M)
    # With a causal band the last query blocks do the most work: start them first.
    start_m = (num_m_blocks - 1 - pid_m) if IS_CAUSAL else pid_m
    off_bh = gl.program_id(1)
    off_b = (off_bh // num_heads).to(gl.int64)
    off_h = off_bh % num_heads
    off_hk = (off_h // group_size).to(gl.int64)
    off_h = off_h.to(gl.int64)

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = tma.make_tensor_descriptor(Q + off_b * stride_qb + off_h * stride_qh,
                                        shape=[seqlen_q, HEAD_DIM], strides=[stride_qm, 1],
                                        block_shape=[BLOCK_M, HEAD_DIM], layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K + off_b * stride_kb + off_hk * stride_kh,
                                        shape=[seqlen_k, HEAD_DIM], strides=[stride_kn, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V + off_b * stride_vb + off_hk * stride_vh,
                                        shape=[seqlen_k, HEAD_DIM], strides=[stride_vn, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM], layout=kv_layout)

    # One warpgroup owns 64 rows: warps stacked along M; instruction n = the tile width.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for ring in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(ring), count=1)
        mbarrier.init(v_bars.index(ring), count=1)

    # Skip bound: the last key any row of this block may see (bottom-right causal).
    diag_offset = seqlen_k - seqlen_q
    m_first = start_m * BLOCK_M
    if IS_CAUSAL:
        kv_hi = gl.minimum(m_first + BLOCK_M + diag_offset, seqlen_k)
        mask_from = gl.minimum((m_first + diag_offset + 1) // BLOCK_N * BLOCK_N,
                               seqlen_k // BLOCK_N * BLOCK_N)
    else:
        kv_hi = seqlen_k
        mask_from = seqlen_k // BLOCK_N * BLOCK_N
    n_tiles = gl.cdiv(kv_hi, BLOCK_N)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m_first, 0], q_bar, q_smem)
    for ring in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, ring, ring, ring < n_tiles,
                 BLOCK_N)

    offs_m = m_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # Tile 0: nothing to overlap with yet.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_smem, k_smem.index(0)))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, 0, seqlen_k, diag_offset, mask_from,
                                       qk_scale, BLOCK_N, IS_CAUSAL, s_layout)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for tile in range(1, n_tiles):
        stage = tile % STAGES
        prev = (tile - 1) % STAGES
        mbarrier.wait(k_bars.index(stage), (tile // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_bars.index(prev), ((tile - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # S_j is done; P_{j-1} V_{j-1} keeps the tensor cores busy during the softmax.
        s, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s, k_smem.index(stage)))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, tile * BLOCK_N, seqlen_k,
                                           diag_offset, mask_from, qk_scale, BLOCK_N, IS_CAUSAL,
                                           s_layout)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_smem.index(prev)))
        # Both tiles in stage `prev` are consumed: refill it with tile + 1.
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, tile - 1 + STAGES, prev,
                 tile - 1 + STAGES < n_tiles, BLOCK_N)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_smem.index(last)))

    mbarrier.invalidate(q_bar)
    for ring in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(ring))
        mbarrier.invalidate(v_bars.index(ring))

    # One division per row; rows with no visible key give O = 0, LSE = -inf.
    has_keys = l_i > 0.0
    l_safe = gl.where(has_keys, l_i, 1.0)
    lse = gl.where(has_keys, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)

    offs_mo = m_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (O + off_b * stride_ob + off_h * stride_oh + gl.expand_dims(offs_mo, 1) * stride_om
              + gl.expand_dims(offs_d, 0))
    gl.store(o_ptrs, out.to(dtype), mask=gl.expand_dims(offs_mo, 1) < seqlen_q)
    gl.store(LSE + off_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

_allocator_set = False


def supports(q: torch.Tensor, head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool,
             window: tuple[int, int], softcap: float, strides_16b: bool) -> bool:
    """Whether this kernel computes the call (else the Triton kernel does)."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)
            and q.dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128)
            and window == (-1, -1) and softcap == 0.0 and not (causal and seqlen_q > seqlen_k)
            and strides_16b)


def flash_forward_sm90(q, k, v, out, lse, bhs_strides, *, num_heads, num_kv_heads, seqlen_q,
                       seqlen_k, head_dim, scale, causal) -> None:
    """Launch on validated tensors; ``bhs_strides`` are the four tensors' (b, h, s) strides."""
    global _allocator_set
    if not _allocator_set:
        # Device-side TMA descriptors live in a scratch buffer Triton asks the host for.
        triton.set_allocator(
            lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _allocator_set = True
    batch = q.shape[0]
    grid = (triton.cdiv(seqlen_q, BLOCK_M), batch * num_heads)
    _attn_fwd_sm90[grid](
        q, k, v, out, lse, *bhs_strides,
        num_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k, scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES, IS_CAUSAL=causal,
        num_warps=NUM_WARPS,
    )
