"""dQ for Hopper (sm_90) in Gluon: the backward's query-stationary kernel, built like the
forward (kernels/forward_sm90.py).

Why a second dQ kernel: the Triton dQ kernel (kernels/backward.py) runs its three GEMMs
per key tile one after the other with the recomputed softmax between them; at the
seed's GQA layer (d = 256, causal, 4k) it took 0.76 of the backward's 1.66 ms on an
H100, at ~410 TFLOP/s against the Gluon dK/dV kernel's ~570 (bench/NOTES.md B23).  Here,
as in the forward, each consumer warpgroup is a partition of its own, so one
warpgroup's exponentials run under the other's GEMMs.  One program owns 128 query rows
of one query head and streams the K/V tiles of its KV head past them:

* **producer** (one warp, ``producer_regs`` registers): TMA copies of the block's Q and
  dO (once, a 64-row half per consumer), then K_j and V_j into a ``STAGES``-deep ring;
  each slot has a *ready* barrier (TMA's byte count) and an *empty* barrier both
  consumers release once their last GEMM on the slot has finished.
* **two consumers** (one warpgroup each, 64 of the rows, dQ of those rows in fp32
  registers).  Per tile: issue S = Q K_j^T and dP = dO V_j^T together; wait for S only
  and form P = exp2(S scale - LSE) while dP runs; wait for dP and form
  dS = P (dP - D); dQ += dS K_j with dS in registers (wgmma's A operand).

Before its tiles each consumer forms its rows' D = rowsum(dO ∘ O) (minus dLSE where the
LSE output was differentiated) and LSE in log2 units, and stores both for the dK/dV
kernel that runs after this one, as the Triton dQ kernel does.

Masking: bottom-right causal.  Key tiles past the block's last visible key are never
loaded; each warpgroup runs the tiles its first row sees in full unmasked, the rest of
the tiles it sees with the element mask (which also hides keys past ``seqlen_k``:
TMA zero-fills them, and a zero score is not a hidden one), and only waits out the
tiles its rows do not see at all.  Rows past ``seqlen_q`` read Q = dO = 0 (TMA) and
LSE = D = 0: their dS is 0 and nothing of them is stored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnlab.dtypes import TORCH_NAMES
from attnlab.inputs import AttentionInputs, layout_named
from attnlab.kernels._launch import int_class
from attnlab.kernels._primitives import LOG2E
from attnlab.kernels._sm90 import (
    PlannedDescriptor,
    PlannedGluonLaunch,
    backward_supports,
    check_producer_regs,
    code_evidence,
    compile_sm90,
    descriptor,
    descriptor_parts,
    launch_maxnreg,
    sized_backward_refusal,
    tma_load_box,
)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128            # two consumer warpgroups x 64 query rows
ROWS = BLOCK_M // 2
CONSUMER_WARPS = 4
CONSUMER_REGS = 240
MAXNREG = launch_maxnreg(2 * CONSUMER_WARPS)
_BLOCK_M = gl.constexpr(BLOCK_M)  # the same, readable inside the kernel
_ROWS = gl.constexpr(ROWS)
_LOG2E = gl.constexpr(LOG2E)


@gluon.jit
def _dq_tiles(dq, q_wg, do_wg, k_smem, v_smem, ready, empty, lse_log2, delta, offs_m,
              tile_lo, tile_hi, seqlen_k, diag_offset, qk_scale, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, MASKED: gl.constexpr,
              s_layout: gl.constexpr, p_layout: gl.constexpr):
    """Add the key tiles [tile_lo, tile_hi) to this warpgroup's (unscaled) dQ.  Each
    tile's dQ GEMM is waited for before the next tile's S is issued, as in the dK/dV
    kernel (leaving it in flight measured slower there, bench/NOTES.md B21)."""
    dtype: gl.constexpr = q_wg.dtype
    ROWS: gl.constexpr = q_wg.shape[0]
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    for tile in range(tile_lo, tile_hi):
        stage = tile % STAGES
        mbarrier.wait(ready.index(stage), (tile // STAGES) & 1)
        k_tile = k_smem.index(stage)
        v_tile = v_smem.index(stage)
        s = warpgroup_mma(q_wg, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_wg, v_tile.permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        s, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s, q_wg, k_tile))
        s = s * qk_scale
        if MASKED:
            offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = gl.expand_dims(offs_n, 0) < seqlen_k
            if IS_CAUSAL:
                visible = visible & (gl.expand_dims(offs_n, 0)
                                     <= gl.expand_dims(offs_m, 1) + diag_offset)
            s = gl.where(visible, s, float("-inf"))
        # LSE in log2 units, +inf where a row sees no key (P = 0, not NaN).
        p = gl.exp2(s - gl.expand_dims(lse_log2, 1))
        dp, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dp, do_wg, v_tile))
        ds = p * (dp - gl.expand_dims(delta, 1))
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), p_layout), k_tile, dq,
                           is_async=True)
        dq, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dq, k_tile))
        mbarrier.arrive(empty.index(stage), count=1)
    return dq


@gluon.jit
def _pass_tiles(ready, empty, tile_lo, tile_hi, STAGES: gl.constexpr):
    """Release the ring slots of tiles [tile_lo, tile_hi) unread: keys none of this
    warpgroup's rows see (the other warpgroup's rows of the block do)."""
    for tile in range(tile_lo, tile_hi):
        stage = tile % STAGES
        mbarrier.wait(ready.index(stage), (tile // STAGES) & 1)
        mbarrier.arrive(empty.index(stage), count=1)


@gluon.jit
def _work(num_m_blocks, block_major, IS_CAUSAL: gl.constexpr):
    """This program's (query block index, batch x head index): the Triton dQ kernel's
    order (``dispatch.dq_block_major``), causally the last (longest) blocks first."""
    pid = gl.program_id(0)
    if block_major != 0:
        heads_by_batch = gl.num_programs(0) // num_m_blocks
        block = pid // heads_by_batch
        off_bh = pid % heads_by_batch
    else:
        block = pid % num_m_blocks
        off_bh = pid // num_m_blocks
    if IS_CAUSAL:
        block = num_m_blocks - 1 - block
    return block, off_bh


@gluon.jit
def _key_tiles(rows_end, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """How many key tiles the rows before ``rows_end`` may see: bottom-right causal, row
    m sees key n when n <= m + seqlen_k - seqlen_q."""
    if IS_CAUSAL:
        kv_hi = gl.minimum(rows_end + seqlen_k - seqlen_q, seqlen_k)
        return gl.cdiv(gl.maximum(kv_hi, 0), BLOCK_N)
    return gl.cdiv(seqlen_k, BLOCK_N)


@gluon.jit
def _row_stats(O, LSE, DLSE, DELTA, LSE_LOG2, do_wg, off_b, off_h, offs_m, seqlen_q,
               stride_ob, stride_oh, stride_om, stride_lseb, stride_lseh, stride_deltab,
               stride_deltah, HAS_DLSE: gl.constexpr, WRITE_LSE_LOG2: gl.constexpr,
               acc_layout: gl.constexpr, row_layout: gl.constexpr):
    """This warpgroup's rows of D = rowsum(dO ∘ O) (minus dLSE) and of LSE in log2 units,
    stored for the dK/dV kernel and returned in ``row_layout``.  O is read in wgmma's
    accumulator layout, whose rows sit on the threads that hold them in S (the
    conversion to ``row_layout`` moves nothing)."""
    HEAD_DIM: gl.constexpr = do_wg.shape[1]
    rows = gl.convert_layout(offs_m, gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    o_ptrs = (O + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
              + gl.expand_dims(rows, 1).to(gl.int64) * stride_om + gl.expand_dims(offs_d, 0))
    o = gl.load(o_ptrs, mask=gl.expand_dims(rows, 1) < seqlen_q, other=0.0)
    do = do_wg.load(acc_layout)
    delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), 1), row_layout)
    in_range = offs_m < seqlen_q
    stat = off_b.to(gl.int64) * stride_lseb + off_h.to(gl.int64) * stride_lseh + offs_m
    if HAS_DLSE:
        delta -= gl.load(DLSE + stat, mask=in_range, other=0.0)
    lse = gl.load(LSE + stat, mask=in_range, other=0.0)
    # A row that sees no key has LSE = -inf; +inf in its place makes P exactly 0.
    lse_log2 = gl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    out = off_b.to(gl.int64) * stride_deltab + off_h.to(gl.int64) * stride_deltah + offs_m
    gl.store(DELTA + out, delta, mask=in_range)
    if WRITE_LSE_LOG2:
        gl.store(LSE_LOG2 + out, lse_log2, mask=in_range)
    return lse_log2, delta


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, O, LSE, DLSE, DELTA,
              LSE_LOG2, DQ, stride_ob, stride_oh, stride_om, stride_dqb, stride_dqh,
              stride_dqm, stride_lseb, stride_lseh, stride_deltab, stride_deltah,
              num_heads, seqlen_q, seqlen_k, num_m_blocks, block_major, qk_scale, scale,
              WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              IS_CAUSAL: gl.constexpr, HAS_DLSE: gl.constexpr,
              WRITE_LSE_LOG2: gl.constexpr):
    """Consumer warpgroup ``WG``: rows [64 WG, 64 WG + 64) of the block, their D, LSE and
    dQ."""
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    # dS stays in registers as wgmma's A operand.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    block, off_bh = _work(num_m_blocks, block_major, IS_CAUSAL)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    row0 = block * _BLOCK_M + WG * _ROWS
    offs_m = row0 + gl.arange(0, _ROWS, layout=row_layout)
    diag_offset = seqlen_k - seqlen_q
    # The block's key tiles (the producer's), those any row of this warpgroup sees, and
    # those every row of it sees in full.
    n_tiles = _key_tiles(block * _BLOCK_M + _BLOCK_M, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL)
    n_seen = _key_tiles(row0 + _ROWS, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL)
    n_unmasked = seqlen_k // BLOCK_N
    if IS_CAUSAL:
        n_unmasked = gl.minimum(gl.maximum(row0 + diag_offset + 1, 0) // BLOCK_N, n_unmasked)
    n_unmasked = gl.minimum(n_unmasked, n_seen)

    q_wg = q_smem.index(WG)
    do_wg = do_smem.index(WG)
    mbarrier.wait(q_ready.index(WG), 0)
    lse_log2, delta = _row_stats(O, LSE, DLSE, DELTA, LSE_LOG2, do_wg, off_b, off_h, offs_m,
                                 seqlen_q, stride_ob, stride_oh, stride_om, stride_lseb,
                                 stride_lseh, stride_deltab, stride_deltah, HAS_DLSE,
                                 WRITE_LSE_LOG2, acc_layout, row_layout)
    dq = gl.zeros([_ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    # Loop bounds are tensors (n_tiles * 0, not 0): Triton 3.6 needs a typed start.
    dq = _dq_tiles(dq, q_wg, do_wg, k_smem, v_smem, ready, empty, lse_log2, delta, offs_m,
                   n_tiles * 0, n_unmasked, seqlen_k, diag_offset, qk_scale, BLOCK_N, STAGES,
                   IS_CAUSAL, False, s_layout, p_layout)
    dq = _dq_tiles(dq, q_wg, do_wg, k_smem, v_smem, ready, empty, lse_log2, delta, offs_m,
                   n_unmasked, n_seen, seqlen_k, diag_offset, qk_scale, BLOCK_N, STAGES,
                   IS_CAUSAL, True, s_layout, p_layout)
    _pass_tiles(ready, empty, n_seen, n_tiles, STAGES)

    # A row that sees no key has P = 0 everywhere: dQ = 0.
    rows = row0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    dq_ptrs = (DQ + off_b.to(gl.int64) * stride_dqb + off_h.to(gl.int64) * stride_dqh
               + gl.expand_dims(rows, 1).to(gl.int64) * stride_dqm + gl.expand_dims(offs_d, 0))
    gl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty),
             mask=gl.expand_dims(rows, 1) < seqlen_q)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready,
              ready, empty, num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks,
              block_major, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              IS_CAUSAL: gl.constexpr):
    """The producer partition (one warp): the block's Q and dO halves, then the K/V
    tiles its rows may see, paced by the ring's empty barriers."""
    block, off_bh = _work(num_m_blocks, block_major, IS_CAUSAL)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    off_hk = off_h // group_size
    m_first = block * _BLOCK_M
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), 2 * q_desc.block_type.nbytes)
        tma_load_box(q_desc, [off_b, off_h, m_first + half * _ROWS, 0], q_ready.index(half),
                     q_smem.index(half))
        tma_load_box(do_desc, [off_b, off_h, m_first + half * _ROWS, 0], q_ready.index(half),
                     do_smem.index(half))
    tile_bytes: gl.constexpr = 2 * k_desc.block_type.nbytes
    for tile in range(_key_tiles(m_first + _BLOCK_M, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL)):
        stage = tile % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(empty.index(stage), ((tile // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), tile_bytes)
        tma_load_box(k_desc, [off_b, off_hk, tile * BLOCK_N, 0], ready.index(stage),
                     k_smem.index(stage))
        tma_load_box(v_desc, [off_b, off_hk, tile * BLOCK_N, 0], ready.index(stage),
                     v_smem.index(stage))


# Lengths and head counts change per call; specialising on them would multiply compiles.
@gluon.jit(do_not_specialize=["num_heads", "group_size", "seqlen_q", "seqlen_k",
                              "num_m_blocks", "block_major"])
def _attn_bwd_dq_sm90(
    # TMA descriptors (host-built, 4-D: batch, head, sequence, head dim)
    q_desc, do_desc, k_desc, v_desc,
    # O and dQ with (batch, head, seq) strides; LSE (natural log) and dLSE with
    # (batch, head) strides; D and LSE in log2 units written here, for the dK/dV kernel
    O, LSE, DLSE, DELTA, LSE_LOG2, DQ,
    stride_ob, stride_oh, stride_om, stride_dqb, stride_dqh, stride_dqm,
    stride_lseb, stride_lseh, stride_deltab, stride_deltah,
    # sizes; the programs' order (dispatch.dq_block_major)
    num_heads, group_size, seqlen_q, seqlen_k, num_m_blocks, block_major,
    # scalars: the softmax scale in log2 units, and the plain scale dQ is multiplied by
    qk_scale, scale,
    # meta-parameters
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, HAS_DLSE: gl.constexpr, WRITE_LSE_LOG2: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = DQ.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, _ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for half in gl.static_range(2):
        mbarrier.init(q_ready.index(half), count=1)
    for ring in gl.static_range(STAGES):
        mbarrier.init(ready.index(ring), count=1)
        mbarrier.init(empty.index(ring), count=2)  # released by both warpgroups

    gl.warp_specialize([
        # The default partition is consumer warpgroup 0, the first worker warpgroup 1.
        (_consumer, (q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, O, LSE, DLSE,
                     DELTA, LSE_LOG2, DQ, stride_ob, stride_oh, stride_om, stride_dqb,
                     stride_dqh, stride_dqm, stride_lseb, stride_lseh, stride_deltab,
                     stride_deltah, num_heads, seqlen_q, seqlen_k, num_m_blocks, block_major,
                     qk_scale, scale, 0, BLOCK_N, STAGES, IS_CAUSAL, HAS_DLSE,
                     WRITE_LSE_LOG2)),
        (_consumer, (q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, O, LSE, DLSE,
                     DELTA, LSE_LOG2, DQ, stride_ob, stride_oh, stride_om, stride_dqb,
                     stride_dqh, stride_dqm, stride_lseb, stride_lseh, stride_deltab,
                     stride_deltah, num_heads, seqlen_q, seqlen_k, num_m_blocks, block_major,
                     qk_scale, scale, 1, BLOCK_N, STAGES, IS_CAUSAL, HAS_DLSE,
                     WRITE_LSE_LOG2)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                     q_ready, ready, empty, num_heads, group_size, seqlen_q, seqlen_k,
                     num_m_blocks, block_major, BLOCK_N, STAGES, IS_CAUSAL)),
    ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])

    for half in gl.static_range(2):
        mbarrier.invalidate(q_ready.index(half))
    for ring in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(ring))
        mbarrier.invalidate(empty.index(ring))


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Sm90DqConfig:
    """The meta-parameters a sweep varies: the key tile and the ring's depth."""

    block_n: int
    stages: int
    producer_regs: int = 24

    def __post_init__(self) -> None:
        if self.block_n not in (32, 64, 128):
            raise ValueError(f"block_n must be 32, 64 or 128 (wgmma's N for S), "
                             f"got {self.block_n}")
        if self.stages not in (2, 3, 4):
            raise ValueError(f"stages must be 2, 3 or 4, got {self.stages}")
        check_producer_regs(self.producer_regs)

    def name(self) -> str:
        """One token for records: sm90dq[n64,s2,r24]."""
        return f"sm90dq[n{self.block_n},s{self.stages},r{self.producer_regs}]"

    @classmethod
    def from_name(cls, name: str) -> Sm90DqConfig:
        match = re.fullmatch(r"sm90dq\[n(\d+),s(\d+),r(\d+)\]", name)
        if match is None:
            raise ValueError(f"not an sm90 dQ config name: {name!r}")
        return cls(*(int(g) for g in match.groups()))


# What a config-less call and the tests run.  d = 256: Q and dO of the block take 128 KiB,
# so the key tiles are 32 rows (3 stages: 96 KiB).  d <= 128: 64-key tiles keep S, dP
# and dQ within the consumers' 240 registers.
DEFAULT_CONFIGS = {
    64: Sm90DqConfig(block_n=64, stages=3),
    128: Sm90DqConfig(block_n=64, stages=3),
    256: Sm90DqConfig(block_n=32, stages=3),
}


# What the sweep measures (bench/backward_h200.py --phases dq) and the GPU test runs: the
# defaults first; every one spill-free on Triton 3.6.0 and 3.9.0 (the CPU compile test).
CANDIDATES = {
    64: (DEFAULT_CONFIGS[64], Sm90DqConfig(128, 2), Sm90DqConfig(128, 3)),
    128: (DEFAULT_CONFIGS[128], Sm90DqConfig(64, 2), Sm90DqConfig(128, 2)),
    256: (DEFAULT_CONFIGS[256], Sm90DqConfig(32, 2)),
}


def shared_memory_bytes(head_dim: int, config: Sm90DqConfig, itemsize: int = 2) -> int:
    """Q and dO of the block + the K/V ring + barriers and slack: what one CTA
    allocates (checked against the compiled kernel by the CPU compile test)."""
    tiles = 2 * BLOCK_M * head_dim + 2 * config.stages * config.block_n * head_dim
    return tiles * itemsize + 8 * (2 + 2 * config.stages) + 1024


def refusal(*, config: Sm90DqConfig | None = None, **call) -> str | None:
    """Why this kernel must not compute a call's dQ (``call``: capability, dtype,
    head_dim, window, softcap, layout, aligned), or None when it may."""
    return sized_backward_refusal("dQ", SUPPORTED_HEAD_DIMS, DEFAULT_CONFIGS,
                                  shared_memory_bytes, config, **call)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
             layout: str, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
             config: Sm90DqConfig | None = None) -> tuple[bool, str]:
    """(True, "") if this kernel computes the call's dQ, else (False, the reason)
    (``_sm90.backward_supports``)."""
    return backward_supports(refusal, q, k, v, dout, layout=layout, window=window,
                             softcap=softcap, config=config)


class PlannedLaunch:
    """This kernel's launch for one call signature, called with the Triton dQ kernel's
    arguments (``kernels/backward._BackwardPlan``): ``(q, k, v, out, dout, lse, dlse,
    delta, lse_log2, dq, cu_seqlens_q, cu_seqlens_k)``; the last two are unused (no
    varlen here)."""

    def __init__(self, gluon: PlannedGluonLaunch) -> None:
        self.gluon = gluon

    def __call__(self, q, k, v, out, dout, lse, dlse, delta, lse_log2, dq, _cu_q, _cu_k):
        self.gluon((q, dout, k, v), (out, lse, dlse, delta, lse_log2, dq))


def plan_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                dout: torch.Tensor, *, layout: str, scale: float, causal: bool,
                config: Sm90DqConfig, block_major: bool, stat_strides: tuple[int, int],
                delta_strides: tuple[int, int], has_dlse: bool,
                write_lse_log2: bool) -> PlannedLaunch:
    """The launch for tensors of these sizes, strides and alignment: dQ (a fresh
    contiguous allocation in q's layout), D and LSE in log2 units written with
    ``delta_strides`` ((batch, head) of rows of ``seqlen_q`` or more), LSE and dLSE read
    with ``stat_strides``."""
    inputs = AttentionInputs.read(q, k, v, layout)
    batch, seqlen_q, num_heads, head_dim = (inputs.batch, inputs.seqlen_q, inputs.heads,
                                            inputs.head_dim)
    seqlen_k, num_kv_heads = inputs.seqlen_k, inputs.kv_heads
    lay = layout_named(layout)
    num_m_blocks = triton.cdiv(seqlen_q, BLOCK_M)
    grid = (num_m_blocks * batch * num_heads,)
    dq_strides = lay.bhs_strides(torch.empty(q.shape, device="meta"))
    out_strides = lay.bhs_strides(out)
    static = (*out_strides, *dq_strides, *stat_strides, *delta_strides,
              num_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k, num_m_blocks,
              int(block_major), scale * LOG2E, scale)
    descriptors = tuple(PlannedDescriptor(t, descriptor_parts(t, layout, rows))
                        for t, rows in ((q, ROWS), (dout, ROWS), (k, config.block_n),
                                        (v, config.block_n)))
    constexprs = _constexprs(head_dim, causal, config, has_dlse, write_lse_log2)
    key = (config, causal, has_dlse, write_lse_log2, head_dim, q.dtype, q.device,
           tuple(int_class(s) for s in (*out_strides, *dq_strides, *stat_strides,
                                        *delta_strides)),
           max(seqlen_q, seqlen_k, num_m_blocks, grid[0]) < 2**31)
    return PlannedLaunch(PlannedGluonLaunch(_COMPILED, _attn_bwd_dq_sm90, grid, descriptors,
                                            static, constexprs, key, MAXNREG))


def _constexprs(head_dim: int, causal: bool, config: Sm90DqConfig, has_dlse: bool,
                write_lse_log2: bool) -> dict:
    return dict(HEAD_DIM=head_dim, BLOCK_N=config.block_n, STAGES=config.stages,
                IS_CAUSAL=causal, HAS_DLSE=has_dlse, WRITE_LSE_LOG2=write_lse_log2,
                PRODUCER_REGS=config.producer_regs, CONSUMER_REGS=CONSUMER_REGS,
                num_warps=CONSUMER_WARPS)


# Launched kernels by what Triton specialises them on: later calls skip JITFunction.run.
_COMPILED: dict[tuple, object] = {}


# ---------------------------------------------------------------------------
# Compile-only path: sm_90 code without a GPU, for the CPU test and the evidence.
# ---------------------------------------------------------------------------

def compile_for_sm90(head_dim: int, config: Sm90DqConfig | None = None, *,
                     causal: bool = False, dtype: str = "bf16", has_dlse: bool = False,
                     write_lse_log2: bool = True):
    """The compiled kernel (``.asm['ptx']``, ``.asm['cubin']``, ``.metadata``) for sm_90a."""
    from triton.runtime.jit import mangle_type

    config = config or DEFAULT_CONFIGS[head_dim]
    torch_dtype = getattr(torch, TORCH_NAMES[dtype])
    example = torch.empty((1, 256, 1, head_dim), dtype=torch_dtype, device="meta")
    q_type = mangle_type(descriptor(example, "bshd", ROWS))
    kv_type = mangle_type(descriptor(example, "bshd", config.block_n))
    signature = {"q_desc": q_type, "do_desc": q_type, "k_desc": kv_type, "v_desc": kv_type,
                 "O": f"*{dtype}", "LSE": "*fp32", "DLSE": "*fp32", "DELTA": "*fp32",
                 "LSE_LOG2": "*fp32", "DQ": f"*{dtype}"}
    strides = ("stride_ob", "stride_oh", "stride_om", "stride_dqb", "stride_dqh",
               "stride_dqm", "stride_lseb", "stride_lseh", "stride_deltab", "stride_deltah")
    for name in (*strides, "num_heads", "group_size", "seqlen_q", "seqlen_k",
                 "num_m_blocks", "block_major"):
        signature[name] = "i32"
    signature.update(qk_scale="fp32", scale="fp32")
    constants = _constexprs(head_dim, causal, config, has_dlse, write_lse_log2)
    return compile_sm90(_attn_bwd_dq_sm90, signature, constants,
                        ("O", "LSE", "DLSE", "DELTA", "LSE_LOG2", "DQ", *strides), MAXNREG)


def sass_evidence(asm: dict) -> dict:
    """``_sm90.code_evidence``: roles, waits, partition barriers, spills."""
    return code_evidence(asm)[0]
