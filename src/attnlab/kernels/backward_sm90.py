"""dK and dV for Hopper (sm_90) in Gluon: the backward's K/V-stationary kernel,
warp-specialised like the forward (kernels/forward_sm90.py).

Why a second dK/dV kernel: in Triton 3.6 the dK/dV kernel (kernels/backward.py) runs
its four GEMMs per tile one after the other with the softmax recomputation between
them, at ~386 TFLOP/s against the dQ kernel's ~560 (bench/NOTES.md, "Backward"); it is
half the backward's time.  Here the recomputation overlaps the tensor cores.  One
program owns ``BLOCK_N = 128`` keys of one (batch, KV head) and streams the query tiles
of every query head of its GQA group past them (dK and dV are summed in registers, no
atomics, deterministic), with three partitions:

* **producer** (one warp, ``PRODUCER_REGS`` registers): TMA copies of the owned K and V
  block (once), then Q_j, dO_j and the tile's LSE and D rows per query tile into a
  ``STAGES``-deep ring.  Each slot has a *ready* barrier (completed by TMA's byte count)
  and an *empty* barrier both consumers release once their last GEMM on the slot has
  finished.
* **two consumers** (one warpgroup each, 64 of the block's keys, dK and dV of those
  keys in fp32 registers).  Per tile, transposed so dK and dV come out without a
  transpose: issue S^T = K Q_j^T and dP^T = V dO_j^T together; wait for S^T only and
  form P^T = exp2(S^T scale - LSE) while dP^T runs; issue dV += P^T dO_j (P^T stays in
  registers, wgmma's A operand); wait for dP^T and form dS^T = P^T (dP^T - D) while
  dV runs; issue dK += dS^T Q_j.  The two warpgroups are separate partitions, so
  one's exponentials run under the other's GEMMs (the forward's attempt-11 lesson).

dQ is the Triton dQ kernel's job (kernels/backward.py), as is D = rowsum(dO ∘ O): that
kernel runs first and also writes LSE in log2 units for this one, both in rows padded to
a multiple of 4 (``padded_seqlen``, TMA's 16-byte strides): LSE and D then come from shared
memory where P and dS need them, instead of sitting in registers replicated across the
threads of a column for the whole tile (16 each at 64-row tiles; with them there, 64-row
tiles at d = 128 spilled).

Masking: bottom-right causal only (windows and softcap stay on the Triton kernel).
Query tiles wholly above the band are never loaded (the forward's skip bound, seen
from the keys' side); tiles crossing the diagonal run the element mask; the rest run
unmasked.  Rows past ``seqlen_q`` need no mask: TMA zero-fills their Q, dO, LSE and D,
so there S = 0, P = 1, dP = 0 and dS = P (dP - D) = 0, and with dO = Q = 0 they add
nothing to dV or dK.  Keys past ``seqlen_k`` are the block's padding, computed and never
stored.
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from attnlab.dtypes import TORCH_NAMES
from attnlab.inputs import AttentionInputs, layout_named
from attnlab.kernels._launch import int_class
from attnlab.kernels._primitives import LOG2E
from attnlab.kernels._sm90 import (
    ROW_RING_LAYOUT,
    PlannedDescriptor,
    PlannedGluonLaunch,
    backward_supports,
    check_producer_regs,
    code_evidence,
    compile_sm90,
    descriptor,
    descriptor_parts,
    launch_maxnreg,
    row_slot,
    row_stat_descriptor_parts,
    sized_backward_refusal,
    tma_load_box,
)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# At d = 256 dK and dV together would take 2 x 64 x 256 fp32 per warpgroup, 256 registers
# a thread: there a launch forms one of them (one accumulator, 128 registers), the dV
# launch then the dK launch (bench/NOTES.md B20's split, in Gluon).
ONE_GRADIENT_PER_LAUNCH = (256,)
BLOCK_N = 128            # two consumer warpgroups x 64 keys
KEYS_PER_WARPGROUP = BLOCK_N // 2
_KEYS = gl.constexpr(KEYS_PER_WARPGROUP)  # the same, readable inside the kernel
CONSUMER_WARPS = 4
CONSUMER_REGS = 240
# The kernel-wide register cap at launch (two consumer warpgroups and the producer's).
MAXNREG = launch_maxnreg(2 * CONSUMER_WARPS)


@gluon.jit
def _dkdv_tiles(dk, dv, k_wg, v_wg, q_smem, do_smem, lse_smem, delta_smem, ready, empty,
                offs_n, m_lo, m_hi, heads, ring, diag_offset, qk_scale,
                BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                FORM_DK: gl.constexpr, FORM_DV: gl.constexpr,
                s_layout: gl.constexpr, p_layout: gl.constexpr):
    """Add the query tiles [m_lo, m_hi) of ``heads`` query heads to this warpgroup's dK
    and/or dV (the one not formed is passed through untouched): the last tile first, each
    tile for every head in turn (the producer's order, ``_load_tiles``).

    ``ring`` counts the tiles this program consumed before (the slot and its phase).
    Each tile's accumulates are waited for before the next tile's S^T is issued: leaving
    them in flight under it measured 4-15% slower at d = 256 (bench/NOTES.md B21)."""
    dtype: gl.constexpr = q_smem.dtype
    KEYS: gl.constexpr = k_wg.shape[0]
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
    # One loop over (tile, head) steps: nested loops kept more values live across the
    # outer step and spilled them (Triton 3.6.0, compiled here).
    last = m_lo + (gl.cdiv(m_hi - m_lo, BLOCK_M) - 1) * BLOCK_M
    for step in range(gl.cdiv(m_hi - m_lo, BLOCK_M) * heads):
        start_m = last - step // heads * BLOCK_M
        stage = ring % STAGES
        mbarrier.wait(ready.index(stage), (ring // STAGES) & 1)
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        s_t = warpgroup_mma(k_wg, q_tile.permute((1, 0)), s_zero, use_acc=False,
                            is_async=True)
        if FORM_DK:
            dp_t = warpgroup_mma(v_wg, do_tile.permute((1, 0)), s_zero, use_acc=False,
                                 is_async=True)
            s_t, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, k_wg))
        else:
            s_t, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, k_wg))
        s_t = s_t * qk_scale
        if MASKED:
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
            visible = (gl.expand_dims(offs_n, 1) <= gl.expand_dims(offs_m, 0) + diag_offset)
            s_t = gl.where(visible, s_t, float("-inf"))
        # LSE in log2 units, +inf where a row sees no key or is padding (P = 0, not
        # NaN).  LSE and D are read from shared memory where they are needed, not held
        # from the top of the tile: those replicated registers made 64-row tiles spill.
        # (A global load of D here cost 9%, session 5 run 2; a shared one's latency is
        # far shorter.)
        lse_log2 = row_slot(lse_smem, stage).load(row_layout)
        p_t = gl.exp2(s_t - gl.expand_dims(lse_log2, 0))
        if FORM_DV:
            dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), p_layout), do_tile, dv,
                               is_async=True)
        if FORM_DK:
            # dV (where formed) runs on under dS.
            dp_t, _ = warpgroup_mma_wait(num_outstanding=1 if FORM_DV else 0,
                                         deps=(dp_t, v_wg))
            delta = row_slot(delta_smem, stage).load(row_layout)
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
            # Unlike kernels/backward.py, hidden keys' dS is not zeroed here: the select
            # costs the kernel 10-193 spilled registers on Triton 3.6.0 (compile test),
            # so a NaN row (D = NaN) can also reach the dK of keys it never saw
            # (docs/reliability.md).
            dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), p_layout), q_tile, dk,
                               is_async=True)
        if FORM_DK and FORM_DV:
            dv, dk, _, _ = warpgroup_mma_wait(num_outstanding=0,
                                              deps=(dv, dk, q_tile, do_tile))
        elif FORM_DK:
            dk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dk, q_tile, do_tile))
        else:
            dv, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(dv, q_tile, do_tile))
        mbarrier.arrive(empty.index(stage), count=1)
        ring += 1
    return dk, dv, ring


@gluon.jit
def _query_bounds(start_n, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  IS_CAUSAL: gl.constexpr):
    """[m_lo, m_full): query tiles that cross the diagonal (element mask); [m_full,
    seqlen_q): tiles whose rows see the whole key block.  Bottom-right causal: row m sees
    key n when n <= m + seqlen_k - seqlen_q, so tiles whose last row is before the
    block's first key are skipped (never loaded)."""
    if IS_CAUSAL:
        diag_offset = seqlen_k - seqlen_q
        m_lo = gl.maximum(start_n - diag_offset, 0) // BLOCK_M * BLOCK_M
        m_full = gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - diag_offset, 0), BLOCK_M) * BLOCK_M
        m_full = gl.minimum(gl.maximum(m_full, m_lo), seqlen_q)
    else:
        m_lo = seqlen_q * 0  # a tensor, as the loops' bounds must be
        m_full = m_lo
    return m_lo, m_full


@gluon.jit
def _work(num_kv_blocks, num_kv_heads, block_major, BLOCK_N: gl.constexpr,
          HEAD_SPLIT: gl.constexpr):
    """This program's (key block start, batch, KV head, its part of the group's query
    heads, its (batch, KV head, key block) unit).  ``dispatch.dkdv_schedule`` orders the
    units: head by head, the first key blocks (causally the longest) first, or
    ``block_major``: every head's first block, then every head's second, ...  The
    ``HEAD_SPLIT`` programs of a unit are adjacent."""
    pid = gl.program_id(0)
    unit = pid // HEAD_SPLIT
    heads_by_batch = gl.num_programs(0) // HEAD_SPLIT // num_kv_blocks
    if block_major != 0:
        block = unit // heads_by_batch
        off_bh = unit % heads_by_batch
    else:
        block = unit % num_kv_blocks
        off_bh = unit // num_kv_blocks
    return (block * BLOCK_N, off_bh // num_kv_heads, off_bh % num_kv_heads, pid % HEAD_SPLIT,
            off_bh * num_kv_blocks + block)


@gluon.jit
def _store_keys(G, grad, off_b, off_hk, key0, seqlen_k, stride_b, stride_h, stride_n, rows):
    """This warpgroup's rows of dK or dV, as they come out of wgmma, where ``rows`` (a
    [KEYS, 1] mask) says so.  Keys no query sees never met a visible score: their rows
    are exactly 0."""
    KEYS: gl.constexpr = grad.shape[0]
    HEAD_DIM: gl.constexpr = grad.shape[1]
    offs_k = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, grad.type.layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, grad.type.layout))
    ptrs = (G + off_b.to(gl.int64) * stride_b + off_hk.to(gl.int64) * stride_h
            + gl.expand_dims(offs_k, 1).to(gl.int64) * stride_n + gl.expand_dims(offs_d, 0))
    gl.store(ptrs, grad, mask=(gl.expand_dims(offs_k, 1) < seqlen_k) & rows)


@gluon.jit
def _partial(PARTIALS, slot, grad, GRADS: gl.constexpr, INDEX: gl.constexpr):
    """Where gradient ``INDEX`` (of the ``GRADS`` a launch forms) of partial ``slot`` sits
    in the launch's fp32 workspace, element for element as ``grad`` (a warpgroup's
    accumulator) holds it."""
    KEYS: gl.constexpr = grad.shape[0]
    HEAD_DIM: gl.constexpr = grad.shape[1]
    offs_k = gl.arange(0, KEYS, layout=gl.SliceLayout(1, grad.type.layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, grad.type.layout))
    base = (slot.to(gl.int64) * GRADS + INDEX) * (KEYS * HEAD_DIM)
    return PARTIALS + base + gl.expand_dims(offs_k, 1) * HEAD_DIM + gl.expand_dims(offs_d, 0)


@gluon.jit
def _store_grads(DK, DV, dk, dv, off_b, off_hk, key0, seqlen_k, scale, stride_dkb,
                 stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                 FORM_DK: gl.constexpr, FORM_DV: gl.constexpr, rows):
    dtype: gl.constexpr = DK.dtype.element_ty
    if FORM_DK:
        _store_keys(DK, (dk * scale).to(dtype), off_b, off_hk, key0, seqlen_k, stride_dkb,
                    stride_dkh, stride_dkn, rows)
    if FORM_DV:
        _store_keys(DV, dv.to(dtype), off_b, off_hk, key0, seqlen_k, stride_dvb, stride_dvh,
                    stride_dvn, rows)


@gluon.jit
def _consumer(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty,
              DK, DV, PARTIALS, ARRIVALS, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
              stride_dvh, stride_dvn, num_kv_heads, group_size, seqlen_q, seqlen_k,
              num_kv_blocks, block_major, qk_scale, scale, WG: gl.constexpr,
              BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
              FORM_DK: gl.constexpr, FORM_DV: gl.constexpr, HEAD_SPLIT: gl.constexpr):
    """Consumer warpgroup ``WG``: keys [64 WG, 64 WG + 64) of the block, their dK and/or
    dV (``FORM_DK``, ``FORM_DV``) over this program's query heads.  With ``HEAD_SPLIT``
    = 2 the other program of the unit holds the other heads' sums: each stores its fp32
    partial, and per 8 rows (``_arrive``) the second to arrive adds the first's to its
    own and stores the gradient (one addition of two terms: the same bits whichever
    comes second)."""
    KEYS: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    # P^T and dS^T stay in registers as wgmma's A operand.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)

    start_n, off_b, off_hk, part, unit = _work(num_kv_blocks, num_kv_heads, block_major,
                                               2 * KEYS, HEAD_SPLIT)
    key0 = start_n + WG * KEYS
    offs_n = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    m_lo, m_full = _query_bounds(start_n, seqlen_q, seqlen_k, BLOCK_M, 2 * KEYS, IS_CAUSAL)
    diag_offset = seqlen_k - seqlen_q
    heads = group_size // HEAD_SPLIT
    k_wg = k_smem.index(WG)
    v_wg = v_smem.index(WG)
    mbarrier.wait(kv_ready, 0)
    ring = seqlen_q * 0  # a tensor: the ring position is loop-carried
    # One accumulator per gradient formed; the other name is a pass-through the
    # compiler drops (a one-gradient launch holds 128 registers of accumulator, not 256).
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    # The tiles come in the producer's order (``_producer``); the ring carries them.
    dk, dv, ring = _dkdv_tiles(dk, dv, k_wg, v_wg, q_smem, do_smem, lse_smem, delta_smem,
                               ready, empty, offs_n, m_full, seqlen_q, heads, ring,
                               diag_offset, qk_scale, BLOCK_M, STAGES, False, FORM_DK,
                               FORM_DV, s_layout, p_layout)
    if IS_CAUSAL:
        dk, dv, ring = _dkdv_tiles(dk, dv, k_wg, v_wg, q_smem, do_smem, lse_smem,
                                   delta_smem, ready, empty, offs_n, m_lo, m_full, heads,
                                   ring, diag_offset, qk_scale, BLOCK_M, STAGES, True,
                                   FORM_DK, FORM_DV, s_layout, p_layout)
    if HEAD_SPLIT == 1:
        every_row = gl.full([KEYS, 1], 1, gl.int1, layout=acc_layout)
        _store_grads(DK, DV, dk, dv, off_b, off_hk, key0, seqlen_k, scale, stride_dkb,
                     stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, FORM_DK,
                     FORM_DV, every_row)
    else:
        GRADS: gl.constexpr = 2 if FORM_DK and FORM_DV else 1
        DV_INDEX: gl.constexpr = GRADS - 1
        pair = unit * 2 + WG
        if FORM_DK:
            gl.store(_partial(PARTIALS, pair * 2 + part, dk, GRADS, 0), dk)
        if FORM_DV:
            gl.store(_partial(PARTIALS, pair * 2 + part, dv, GRADS, DV_INDEX), dv)
        rows = gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
        second = gl.expand_dims(_arrive(ARRIVALS + pair * (KEYS // 8) + rows // 8) == 1, 1)
        other = pair * 2 + 1 - part
        if FORM_DK:
            dk = dk + gl.load(_partial(PARTIALS, other, dk, GRADS, 0), mask=second, other=0.0)
        if FORM_DV:
            dv = dv + gl.load(_partial(PARTIALS, other, dv, GRADS, DV_INDEX), mask=second,
                              other=0.0)
        _store_grads(DK, DV, dk, dv, off_b, off_hk, key0, seqlen_k, scale, stride_dkb,
                     stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, FORM_DK,
                     FORM_DV, second)


@gluon.jit
def _arrive(counters):
    """Per warp and 8-row half of its 16 accumulator rows (``counters``: one per row, the
    8 rows of a half sharing one): the half's arrivals before this one, 0 or 1, as every
    lane of the warp sees it.  Lane 0 counts for the warp, after a warp barrier that
    orders the lanes' partial stores before its release; its acquire, the shuffle and a
    second warp barrier order the lanes' loads of the other program's partial after it.
    The second arrival returns the counter to 0 for the next launch.  In PTX, not with
    a scalar atomic: that broadcasts its result through a shared-memory scratch word,
    which moved the LSE ring off TMA's 128-byte alignment (session 17: "misaligned
    address" at d = 256)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred lead, last;
        .reg .b32 old, zero, lane;
        mov.u32 old, 0;
        mov.u32 zero, 0;
        mov.u32 lane, %laneid;
        setp.eq.u32 lead, lane, 0;
        bar.warp.sync -1;
        @lead atom.acq_rel.gpu.global.add.u32 old, [$1], 1;
        setp.eq.and.u32 last, old, 1, lead;
        @last st.relaxed.gpu.global.u32 [$1], zero;
        shfl.sync.idx.b32 $0, old, 0, 31, -1;
        bar.warp.sync -1;
        }""",
        "=r,l", [counters], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_tiles(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                delta_smem, ready, empty, off_b, first_head, heads, m_lo, m_hi, ring,
                tile_bytes: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                FORM_DK: gl.constexpr):
    """Q_j, dO_j and their LSE and D rows for the query tiles [m_lo, m_hi), the last tile
    first and each tile for every head in turn: the programs of a KV head that start
    together then read the same rows at about the same time, the later ones from L2.
    (Measured, the launch still reads ~3x the rows once: programs that start later begin
    at the last tile while the first wave is far below it; bench/NOTES.md B23.)"""
    last = m_lo + (gl.cdiv(m_hi - m_lo, BLOCK_M) - 1) * BLOCK_M
    for step in range(gl.cdiv(m_hi - m_lo, BLOCK_M) * heads):
        start_m = last - step // heads * BLOCK_M
        off_h = first_head + step % heads
        stage = ring % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(empty.index(stage), ((ring // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), tile_bytes)
        tma_load_box(q_desc, [off_b, off_h, start_m, 0], ready.index(stage),
                     q_smem.index(stage))
        tma_load_box(do_desc, [off_b, off_h, start_m, 0], ready.index(stage),
                     do_smem.index(stage))
        # Past seqlen_q TMA zero-fills LSE and D, as it does Q and dO.
        tma_load_box(lse_desc, [off_b, off_h, start_m], ready.index(stage),
                     lse_smem.index(stage))
        if FORM_DK:
            tma_load_box(delta_desc, [off_b, off_h, start_m], ready.index(stage),
                         delta_smem.index(stage))
        ring += 1
    return ring


@gluon.jit
def _producer(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem,
              do_smem, lse_smem, delta_smem, kv_ready, ready, empty, num_kv_heads, group_size,
              seqlen_q, seqlen_k, num_kv_blocks, block_major, BLOCK_M: gl.constexpr,
              STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, FORM_DK: gl.constexpr,
              HEAD_SPLIT: gl.constexpr):
    """The producer partition (one warp): the K/V block once, then the query tiles of
    this program's query heads, paced by the ring's empty barriers: the unmasked tiles,
    then (causal) the diagonal's, in the consumers' order.  Each box lands in the tile
    the MMAs read (``tma_load_box``).  A dV-only launch (no ``FORM_DK``) needs neither V
    nor D."""
    KEYS: gl.constexpr = k_smem.shape[1]
    tile_bytes: gl.constexpr = (2 * q_desc.block_type.nbytes + lse_desc.block_type.nbytes
                                + (delta_desc.block_type.nbytes if FORM_DK else 0))

    start_n, off_b, off_hk, part, _unit = _work(num_kv_blocks, num_kv_heads, block_major,
                                                2 * KEYS, HEAD_SPLIT)
    mbarrier.expect(kv_ready, (4 if FORM_DK else 2) * k_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma_load_box(k_desc, [off_b, off_hk, start_n + half * KEYS, 0], kv_ready,
                     k_smem.index(half))
        if FORM_DK:
            tma_load_box(v_desc, [off_b, off_hk, start_n + half * KEYS, 0], kv_ready,
                         v_smem.index(half))

    m_lo, m_full = _query_bounds(start_n, seqlen_q, seqlen_k, BLOCK_M, 2 * KEYS, IS_CAUSAL)
    heads = group_size // HEAD_SPLIT
    first_head = off_hk * group_size + part * heads
    ring = seqlen_q * 0  # a tensor: the ring position is loop-carried
    ring = _load_tiles(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                       delta_smem, ready, empty, off_b, first_head, heads, m_full, seqlen_q,
                       ring, tile_bytes, BLOCK_M, STAGES, FORM_DK)
    if IS_CAUSAL:
        ring = _load_tiles(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                           delta_smem, ready, empty, off_b, first_head, heads, m_lo, m_full,
                           ring, tile_bytes, BLOCK_M, STAGES, FORM_DK)


# Lengths and head counts change per call; specialising on them would multiply compiles.
@gluon.jit(do_not_specialize=["num_kv_heads", "group_size", "seqlen_q", "seqlen_k",
                              "num_kv_blocks", "block_major"])
def _attn_bwd_dkdv_sm90(
    # TMA descriptors (host-built, 4-D: batch, head, sequence, head dim)
    k_desc, v_desc, q_desc, do_desc,
    # TMA descriptors of LSE (log2 units) and D: (batch, heads, seqlen_q) fp32 views of
    # rows padded to padded_seqlen
    lse_desc, delta_desc,
    # dK, dV with (batch, head, seq) strides; a split launch's fp32 partials and its
    # arrival counters (zero, and left zero)
    DK, DV, PARTIALS, ARRIVALS,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    # sizes; the order of the programs (dispatch.dkdv_schedule)
    num_kv_heads, group_size, seqlen_q, seqlen_k, num_kv_blocks, block_major,
    # scalars: softmax scale in log2 units, and the plain scale dK is multiplied by
    qk_scale, scale,
    # meta-parameters
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, FORM_DK: gl.constexpr, FORM_DV: gl.constexpr,
    HEAD_SPLIT: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = DK.dtype.element_ty
    KEYS: gl.constexpr = _KEYS
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, HEAD_DIM], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    # One plain row per slot: the unswizzled bytes the TMA box [1, 1, BLOCK_M] writes.
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], ROW_RING_LAYOUT)
    # dP = V dO^T and D are dK's alone: a dV-only launch names K's and LSE's buffers
    # for them and never reads them (its shared memory is then 2 x 64 x d x 2 B smaller).
    if FORM_DK:
        v_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], kv_layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M],
                                               ROW_RING_LAYOUT)
    else:
        v_smem = k_smem
        delta_smem = lse_smem
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for ring in gl.static_range(STAGES):
        mbarrier.init(ready.index(ring), count=1)
        mbarrier.init(empty.index(ring), count=2)  # released by both warpgroups

    gl.warp_specialize([
        # The default partition is consumer warpgroup 0, the first worker warpgroup 1.
        (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready,
                     empty, DK, DV, PARTIALS, ARRIVALS, stride_dkb, stride_dkh, stride_dkn,
                     stride_dvb, stride_dvh, stride_dvn, num_kv_heads, group_size, seqlen_q,
                     seqlen_k, num_kv_blocks, block_major, qk_scale, scale, 0, BLOCK_M,
                     STAGES, IS_CAUSAL, FORM_DK, FORM_DV, HEAD_SPLIT)),
        (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready,
                     empty, DK, DV, PARTIALS, ARRIVALS, stride_dkb, stride_dkh, stride_dkn,
                     stride_dvb, stride_dvh, stride_dvn, num_kv_heads, group_size, seqlen_q,
                     seqlen_k, num_kv_blocks, block_major, qk_scale, scale, 1, BLOCK_M,
                     STAGES, IS_CAUSAL, FORM_DK, FORM_DV, HEAD_SPLIT)),
        (_producer, (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem,
                     q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty,
                     num_kv_heads, group_size, seqlen_q, seqlen_k, num_kv_blocks,
                     block_major, BLOCK_M, STAGES, IS_CAUSAL, FORM_DK, HEAD_SPLIT)),
    ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(kv_ready)
    for ring in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(ring))
        mbarrier.invalidate(empty.index(ring))


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Sm90BackwardConfig:
    """The meta-parameters the backward sweep varies (bench/backward_h200.py)."""

    block_m: int
    stages: int
    producer_regs: int = 24
    # A one-gradient head dim's dV launch has no V block and no D: room for larger
    # query tiles than the dK launch's.  0: the same tiles as the dK launch.
    dv_block_m: int = 0
    dv_stages: int = 0

    def __post_init__(self) -> None:
        for field, value in (("block_m", self.block_m), ("dv_block_m", self.dv_block_m)):
            if value not in (32, 64, 128) and not (field == "dv_block_m" and value == 0):
                raise ValueError(f"{field} must be 32, 64 or 128 (wgmma's N for S^T), "
                                 f"got {value}")
        for field, value in (("stages", self.stages), ("dv_stages", self.dv_stages)):
            if value not in (2, 3, 4) and not (field == "dv_stages" and value == 0):
                raise ValueError(f"{field} must be 2, 3 or 4, got {value}")
        if bool(self.dv_block_m) != bool(self.dv_stages):
            raise ValueError("dv_block_m and dv_stages are set together (or both 0)")
        check_producer_regs(self.producer_regs)

    def name(self) -> str:
        """One token for records: sm90bwd[m64,s2,r24], plus ",v64x2" where the dV launch
        has tiles of its own."""
        flags = f",v{self.dv_block_m}x{self.dv_stages}" if self.dv_block_m else ""
        return f"sm90bwd[m{self.block_m},s{self.stages},r{self.producer_regs}{flags}]"

    @classmethod
    def from_name(cls, name: str) -> Sm90BackwardConfig:
        match = re.fullmatch(r"sm90bwd\[m(\d+),s(\d+),r(\d+)(?:,v(\d+)x(\d+))?\]", name)
        if match is None:
            raise ValueError(f"not an sm90 backward config name: {name!r}")
        return cls(*(int(g or 0) for g in match.groups()))

    def launches(self, head_dim: int) -> tuple[tuple[bool, bool, int, int], ...]:
        """(FORM_DK, FORM_DV, block_m, stages) of each launch at this head dim: at a
        one-gradient head dim the dV launch, then the dK launch."""
        if head_dim not in ONE_GRADIENT_PER_LAUNCH:
            return ((True, True, self.block_m, self.stages),)
        dv_tiles = (self.dv_block_m, self.dv_stages) if self.dv_block_m else \
            (self.block_m, self.stages)
        return ((False, True, *dv_tiles), (True, False, self.block_m, self.stages))


# What a config-less call and the tests run: the tiles the dispatch table takes most
# (session 6 run 4's sweep: d = 64 m128 s2 in every bucket, d = 128 m64 s2 in 6 of
# 10), spill-free since LSE and D come through shared memory.
DEFAULT_CONFIGS = {
    64: Sm90BackwardConfig(block_m=128, stages=2),
    128: Sm90BackwardConfig(block_m=64, stages=2),
    # The dK launch's K, V blocks (128 KiB) leave room for 32-row Q/dO tiles only; the dV
    # launch's 64-row tiles measured 1-4% faster (s15 run 4, every bucket).
    256: Sm90BackwardConfig(block_m=32, stages=2, dv_block_m=64, dv_stages=2),
}


def launch_shared_memory_bytes(head_dim: int, form_dk: bool, block_m: int, stages: int,
                               itemsize: int = 2) -> int:
    """The K (and V) block + the Q/dO ring + the fp32 LSE (and D) ring + barriers and
    slack: what one CTA of one launch allocates (V and D only where it forms dK)."""
    blocks = (2 if form_dk else 1) * BLOCK_N * head_dim
    tiles = blocks + 2 * stages * block_m * head_dim
    rows = (2 if form_dk else 1) * stages * block_m * 4
    return tiles * itemsize + rows + 8 * (1 + 2 * stages) + 512


def shared_memory_bytes(head_dim: int, config: Sm90BackwardConfig, itemsize: int = 2) -> int:
    """What one CTA allocates in the largest of the config's launches."""
    return max(launch_shared_memory_bytes(head_dim, form_dk, block_m, stages, itemsize)
               for form_dk, _, block_m, stages in config.launches(head_dim))


def padded_seqlen(seqlen_q: int) -> int:
    """The row length of the LSE and D buffers this kernel reads: a multiple of 4 fp32,
    so the row stride is a multiple of 16 bytes as TMA needs (the padding is unread)."""
    return triton.cdiv(seqlen_q, 4) * 4


def refusal(*, config: Sm90BackwardConfig | None = None, **call) -> str | None:
    """Why this kernel must not compute a call's dK, dV (``call``: capability, dtype,
    head_dim, window, softcap, layout, aligned), or None when it may."""
    return sized_backward_refusal("dK/dV", SUPPORTED_HEAD_DIMS, DEFAULT_CONFIGS,
                                  shared_memory_bytes, config, **call)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
             layout: str, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
             config: Sm90BackwardConfig | None = None) -> tuple[bool, str]:
    """(True, "") if this kernel computes the call's dK, dV, else (False, the reason)
    (``_sm90.backward_supports``)."""
    return backward_supports(refusal, q, k, v, dout, layout=layout, window=window,
                             softcap=softcap, config=config)


class PlannedLaunches:
    """Launches made one after the other with the same arguments: at d = 256 the dV
    launch, then the dK launch (``ONE_GRADIENT_PER_LAUNCH``).  A split schedule's
    launches share one fp32 workspace for the partials and one zeroed set of arrival
    counters (each launch leaves them zero)."""

    def __init__(self, launches: tuple[PlannedGluonLaunch, ...], *, partials: int = 0,
                 arrivals: int = 0) -> None:
        self.launches, self.partials, self.arrivals = launches, partials, arrivals

    def __call__(self, bases: tuple, tensors: tuple) -> None:
        dk = tensors[0]
        if self.partials:
            partials = torch.empty(self.partials, dtype=torch.float32, device=dk.device)
            arrivals = torch.zeros(self.arrivals, dtype=torch.int32, device=dk.device)
        else:
            partials = arrivals = dk  # any pointer: the kernel reads neither
        for launch in self.launches:
            launch(bases, (*tensors, partials, arrivals))


def plan_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                layout: str, scale: float, causal: bool,
                config: Sm90BackwardConfig, schedule=None) -> PlannedLaunches:
    """The launch(es) for tensors of these sizes, strides and alignment, in the program
    order of ``schedule`` (a ``dispatch.BackwardSchedule``; None: head by head, unsplit).
    Called as ``planned((k, v, q, dout, lse_log2, delta), (dk, dv))``: dK, dV, LSE·log2 e
    and D must be fresh contiguous allocations, the last two (batch, heads,
    ``padded_seqlen``)."""
    inputs = AttentionInputs.read(q, k, k, layout)
    batch, seqlen_q, num_heads, head_dim = (inputs.batch, inputs.seqlen_q, inputs.heads,
                                            inputs.head_dim)
    seqlen_k, num_kv_heads = inputs.seqlen_k, inputs.kv_heads
    group_size = num_heads // num_kv_heads
    block_major, head_split = (schedule.block_major, schedule.head_split) if schedule else \
        (False, 1)
    # The kernel merges exactly two partials (one addition: the same bits either way).
    if head_split not in (1, 2) or group_size % head_split:
        raise ValueError(f"head_split must be 1 or 2 and divide the GQA group ({group_size} "
                         f"query heads per KV head), got {head_split}")
    num_kv_blocks = triton.cdiv(seqlen_k, BLOCK_N)
    units = num_kv_blocks * batch * num_kv_heads
    grid = (units * head_split,)
    # dK and dV are allocated contiguous in the layout of k and v.
    out_strides = 2 * layout_named(layout).bhs_strides(torch.empty(k.shape, device="meta"))
    rows = torch.empty((batch, num_heads, padded_seqlen(seqlen_q)), dtype=torch.float32,
                       device="meta")
    static = (*out_strides,
              num_kv_heads, group_size, seqlen_q, seqlen_k, num_kv_blocks, int(block_major),
              scale * LOG2E, scale)
    key_blocks = (PlannedDescriptor(k, descriptor_parts(k, layout, KEYS_PER_WARPGROUP)),
                  PlannedDescriptor(v, descriptor_parts(v, layout, KEYS_PER_WARPGROUP)))
    launches = []
    for launch in config.launches(head_dim):
        block_m = launch[2]
        row_descriptor = PlannedDescriptor(rows, row_stat_descriptor_parts(rows, seqlen_q,
                                                                           block_m))
        descriptors = (*key_blocks,
                       PlannedDescriptor(q, descriptor_parts(q, layout, block_m)),
                       PlannedDescriptor(dout, descriptor_parts(dout, layout, block_m)),
                       row_descriptor, row_descriptor)  # LSE·log2 e and D
        # dK and dV are fresh allocations (16-byte aligned).
        key = (config, causal, *launch[:2], head_split, head_dim, q.dtype, q.device,
               tuple(int_class(s) for s in out_strides),
               max(seqlen_q, seqlen_k, num_kv_blocks, grid[0]) < 2**31)
        launches.append(PlannedGluonLaunch(
            _COMPILED, _attn_bwd_dkdv_sm90, grid, descriptors, static,
            _constexprs(head_dim, causal, config, launch, head_split), key, MAXNREG))
    if head_split == 1:
        return PlannedLaunches(tuple(launches))
    # Per unit and consumer warpgroup: each program's partial of every gradient a launch
    # forms (the most of its launches), and a counter per 8 of its 64 rows.
    grads = max(launch[0] + launch[1] for launch in config.launches(head_dim))
    return PlannedLaunches(tuple(launches), partials=units * 2 * head_split * grads
                           * KEYS_PER_WARPGROUP * head_dim,
                           arrivals=units * 2 * KEYS_PER_WARPGROUP // 8)


def _constexprs(head_dim: int, causal: bool, config: Sm90BackwardConfig, launch: tuple,
                head_split: int = 1) -> dict:
    """The kernel's meta-parameters for one of ``config.launches(head_dim)``."""
    form_dk, form_dv, block_m, stages = launch
    return dict(HEAD_DIM=head_dim, BLOCK_M=block_m, STAGES=stages, IS_CAUSAL=causal,
                FORM_DK=form_dk, FORM_DV=form_dv, HEAD_SPLIT=head_split,
                PRODUCER_REGS=config.producer_regs, CONSUMER_REGS=CONSUMER_REGS,
                num_warps=CONSUMER_WARPS)


# Launched kernels by what Triton specialises them on (config, mask, head dim, dtype,
# device, the strides' classes, 32-bit sizes): later calls skip JITFunction.run.
_COMPILED: dict[tuple, object] = {}


# ---------------------------------------------------------------------------
# Compile-only path: sm_90 code without a GPU, for the CPU test and the evidence.
# ---------------------------------------------------------------------------

def compile_for_sm90(head_dim: int, config: Sm90BackwardConfig | None = None, *,
                     causal: bool = False, dtype: str = "bf16", form: str = "",
                     head_split: int = 1):
    """The compiled kernel (``.asm['ptx']``, ``.asm['cubin']``, ``.metadata``) for sm_90a:
    ``form`` "dk" or "dv" is one launch of a one-gradient head dim (default: its dK
    launch, the larger), "dkdv" the two-gradient kernel; ``head_split`` 2 the split
    schedule's (partials merged at the end)."""
    from triton.runtime.jit import mangle_type

    config = config or DEFAULT_CONFIGS[head_dim]
    forms = {("dk" if launch[0] else "") + ("dv" if launch[1] else ""): launch
             for launch in config.launches(head_dim)}
    form = form or ("dk" if "dk" in forms else "dkdv")
    if form not in forms:
        raise ValueError(f"form must be one of {sorted(forms)} at head_dim {head_dim}, "
                         f"got {form!r}")
    block_m = forms[form][2]
    torch_dtype = getattr(torch, TORCH_NAMES[dtype])
    example = torch.empty((1, 256, 1, head_dim), dtype=torch_dtype, device="meta")
    kv_type = mangle_type(descriptor(example, "bshd", KEYS_PER_WARPGROUP))
    q_type = mangle_type(descriptor(example, "bshd", block_m))
    rows = torch.empty((1, 1, 256), dtype=torch.float32, device="meta")
    row_type = mangle_type(TensorDescriptor(rows, *row_stat_descriptor_parts(rows, 256,
                                                                             block_m)))
    signature = {"k_desc": kv_type, "v_desc": kv_type, "q_desc": q_type, "do_desc": q_type,
                 "lse_desc": row_type, "delta_desc": row_type,
                 "DK": f"*{dtype}", "DV": f"*{dtype}", "PARTIALS": "*fp32", "ARRIVALS": "*i32"}
    strides = ("stride_dkb", "stride_dkh", "stride_dkn", "stride_dvb", "stride_dvh",
               "stride_dvn")
    for name in (*strides, "num_kv_heads", "group_size", "seqlen_q", "seqlen_k",
                 "num_kv_blocks", "block_major"):
        signature[name] = "i32"
    signature.update(qk_scale="fp32", scale="fp32")
    constants = _constexprs(head_dim, causal, config, forms[form], head_split)
    return compile_sm90(_attn_bwd_dkdv_sm90, signature, constants,
                        ("DK", "DV", "PARTIALS", "ARRIVALS", *strides), MAXNREG)


def sass_evidence(asm: dict) -> dict:
    """``_sm90.code_evidence``: roles, waits, partition barriers, spills."""
    return code_evidence(asm)[0]


# ---------------------------------------------------------------------------
# Dispatch: where this kernel measured faster than the Triton dK/dV kernel
# ---------------------------------------------------------------------------

