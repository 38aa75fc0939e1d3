"""FlashAttention forward for Hopper (sm_90) in Gluon: warp-specialised, with FA3's overlap.

Built on Triton 3.6 and written against the Gluon spellings ``kernels/_compat.py``
probes (3.6-3.9 compile it); a Triton whose Gluon those probes do not recognise never
imports this module (docs/versions.md).

Why a second forward kernel: Triton 3.6 waits for every wgmma right after issuing it
and does not warp-specialise attention on sm_90 (bench/NOTES.md, attempts 3, 4 and 7),
so the softmax of a tile runs serially between the two matrix multiplies.  This kernel
writes FA3's schedule out by hand (Shah et al. 2024, sections 3.1-3.2) with
``gl.warp_specialize`` and three partitions:

* **producer** (one warp, shrunk to ``producer_regs`` registers by setmaxnreg): every
  TMA copy, Q as two 64-row halves, then K and V tiles into a ``STAGES``-deep ring.
  Each ring slot has a *ready* barrier (TMA completes it by byte count) and an *empty*
  barrier that both consumers release, separately for K and V, so a K slot is
  refilled as soon as its QK^T has finished, not after P.V.
* **two consumers** (4 warps = one warpgroup = 64 query rows each; BLOCK_M = 128),
  with the registers the producer gave up (240).  Each runs the intra-warpgroup
  overlap: issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1}, wait for S_j only
  (``warpgroup_mma_wait(1)``), run the softmax of tile j on the CUDA cores while
  P_{j-1} V_{j-1} is still on the tensor cores, then wait; O is rescaled either then or,
  FA3's place, while S_{j+1} runs (``Sm90Config.rescale``), and stored as it comes out
  of wgmma or in 16-byte vectors through shared memory (``Sm90Config.store``).

The grid is one program per 128-row block, or persistent (one per SM, walking the
blocks in snake order so causal work balances, ``_snake_rounds``).

Each consumer warpgroup is a partition of its own because Triton puts a
partition-wide ``bar.sync`` before every mbarrier wait and arrive: with both
warpgroups in one 8-warp partition they ran in lockstep, GEMMs together and softmax
together (bench/NOTES.md, attempt 8), and one partition each was 1.2x faster at
d = 128 (attempt 11).  With ``schedule="pingpong"`` they also take turns at issuing
their GEMMs (FA3's inter-warpgroup ping-pong), through a pair of mbarriers standing in
for the named barriers Gluon 3.6 lacks; the dispatch table says where that wins.

Masking is today's two mechanisms (kernels/forward.py): the *skip bound* (tiles past
``kv_hi`` are never loaded) and the *element mask*, applied only by the masked loop
stage (the causal diagonal band and the ragged last tile); the unmasked stage has no
mask arithmetic, and each warpgroup splits the two stages at its own first row.  Rows
past ``seqlen_q`` and keys past ``seqlen_k`` are zero-filled by TMA, whose descriptors
are per (batch, head), so a tile never reads the next sequence.  A row with no
visible key outputs O = 0 and LSE = -inf.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
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
    PlannedDescriptor,
    PlannedGluonLaunch,
    box_layout,
    check_producer_regs,
    code_evidence,
    compile_sm90,
    descriptor,
    descriptor_parts,
    hardware_refusal,
    launch_maxnreg,
    on_sm90_capability,
    partition_barrier,
    reinterpreted,
    shared_memory_refusal,
    sm_count,
    tma_aligned,
    tma_load_box,
)
from attnlab.kernels.fp8_v import keys_contiguous, keys_contiguous_shape

SUPPORTED_HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128            # two consumer warpgroups x 64 query rows
CONSUMER_WARPS = 4       # per consumer warpgroup (and partition)
CONSUMER_REGS = 240      # per consumer thread once the producer's warpgroup gave its share
# The kernel-wide register cap at launch (two consumer warpgroups and the producer's).
MAXNREG = launch_maxnreg(2 * CONSUMER_WARPS)
SCHEDULES = ("split", "pingpong")
RESCALES = ("late", "early")
STORES = ("direct", "vector")


@gluon.jit
def _softmax_tile(s, m_i, l_i, offs_m, start_n, seqlen_k, diag_offset, qk_scale,
                  BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                  s_layout: gl.constexpr):
    """Scores of one tile -> P (base m_new), the rescale alpha, new m and l."""
    if MASKED:
        # The element mask: the causal diagonal band and the ragged last tile only.
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(offs_n, 0) < seqlen_k
        if IS_CAUSAL:
            visible = visible & (gl.expand_dims(offs_n, 0)
                                 <= gl.expand_dims(offs_m, 1) + diag_offset)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row whose scores so far are all -inf (hidden keys, or an -inf key's scores in an
    # unmasked tile) keeps m = -inf; subtract 0 instead (exp2 -> 0, not NaN).  Per row.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _turn_wait(turn, step, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Block until it is this warpgroup's turn to issue its GEMMs of ``step``.

    Warpgroup 0 goes first: its wait on a fresh barrier (parity 1) passes at once; from
    then on each warpgroup's arrive completes one phase of the other's barrier, so the
    two strictly alternate and neither can run a phase ahead."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (step & 1) ^ (1 - WG))


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _snake_rounds(num_work):
    """How many work items this program takes, in boustrophedon order: round r is items
    [r grid, (r + 1) grid), program p takes item r grid + p in even rounds and
    r grid + grid - 1 - p in odd ones, so a program that drew an expensive causal block in
    one round draws a cheap one in the next (a cost simulation, tiles + 2 per block over
    132 programs at d = 128: the slowest program ends within 3% of the mean at N = 1k-8k,
    against 8-27% for a plain stride).  One program per block (grid = items) is round 0
    only.  A count, not an ``if`` per round: the branch cost the consumers spills."""
    grid = gl.num_programs(0)
    pid = gl.program_id(0)
    full = num_work // grid
    last_round_slot = pid + (full % 2) * (grid - 1 - 2 * pid)
    return full + (last_round_slot < num_work - full * grid).to(gl.int32)


@gluon.jit
def _snake_work(rounds_done):
    """The item of round ``rounds_done`` (see _snake_rounds)."""
    grid = gl.num_programs(0)
    pid = gl.program_id(0)
    return rounds_done * grid + pid + (rounds_done % 2) * (grid - 1 - 2 * pid)


@gluon.jit
def _work_block(blocks_done, num_m_blocks, num_heads, group_size, seqlen_q, seqlen_k,
                IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """This program's block of round ``blocks_done`` (``_snake_work``) -> (batch*head,
    batch, head, kv head, first row, K/V tiles to walk).

    A head's blocks are neighbours, so the programs running together share that head's
    K/V in L2 (at d = 128 a 128 x 128 K/V tile pair feeds ~128 FLOP per byte, too few
    to stream it from DRAM at the tensor cores' rate).  Causal: within a head the most
    expensive blocks (the last ones) come first, so the hardware's dynamic order ends on
    short blocks (a persistent grid balances them by its snake order, _snake_rounds).

    Skip bound (bottom-right causal): a block walks K/V only up to the last key any of
    its rows may see.  A block whose rows see no key at all still folds in tile 0, fully
    masked, so every path runs the same pipeline and ends with l = 0 -> O = 0, LSE = -inf.
    """
    work = _snake_work(blocks_done)
    start_m = work % num_m_blocks
    if IS_CAUSAL:
        start_m = num_m_blocks - 1 - start_m
    off_bh = work // num_m_blocks
    off_h = off_bh % num_heads
    m_first = start_m * BLOCK_M
    if IS_CAUSAL:
        kv_hi = gl.minimum(m_first + BLOCK_M + seqlen_k - seqlen_q, seqlen_k)
        n_tiles = gl.maximum(gl.cdiv(gl.maximum(kv_hi, 0), BLOCK_N), 1)
    else:
        n_tiles = gl.cdiv(seqlen_k, BLOCK_N)
    return off_bh, off_bh // num_heads, off_h, off_h // group_size, m_first, n_tiles


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, p_slot):
    """P as P V's A operand.  bf16/fp16: in registers, the accumulator's own layout.

    FP8: in shared memory (``p_slot``, this warpgroup's [ROWS, BLOCK_N // 4] int32 view
    of an fp8 tile), returning a placeholder.  Within each 32 keys a thread of the
    accumulator holds columns {2q, 2q+1, 8+2q, 9+2q} (+16) where the fp8 register operand
    wants {4q .. 4q+3} (+16); the key order is free as long as V's rows follow it, so
    P's columns are relabelled c -> 32a + 16h + 4q + 2g + e for c = 32a + 16h + 8g + 2q + e
    (a reshape and permute, no data movement; V's copy stores its keys in that order,
    ``keys_contiguous_v``), and each thread's four keys of a row become one word by two
    packed conversions.  Through registers Triton's lowering unpacks every such word
    into bytes and packs it again (~9 instructions a word, compiled here); a 32-bit
    store of each word and a shared-memory A operand cost two."""
    if dtype.is_fp8():
        ROWS: gl.constexpr = p.shape[0]
        WORDS: gl.constexpr = p.shape[1] // 4
        # (row, 16-key group, g, q, e) -> the four keys 2g + e of word (group, q).
        e0, e1 = gl.split(gl.reshape(p, [ROWS, WORDS // 4, 2, 4, 2]))
        k0, k2 = gl.split(gl.permute(e0, [0, 1, 3, 2]))
        k1, k3 = gl.split(gl.permute(e1, [0, 1, 3, 2]))
        k0, k1, k2, k3 = (gl.reshape(k0, [ROWS, WORDS]), gl.reshape(k1, [ROWS, WORDS]),
                          gl.reshape(k2, [ROWS, WORDS]), gl.reshape(k3, [ROWS, WORDS]))
        # Rounded to nearest even and saturated to +-448, as ``.to`` rounds.
        word = gl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi;
            cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
            cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
            mov.b32 $0, {lo, hi};
            }""", "=r,r,r,r,r", [k0, k1, k2, k3], dtype=gl.int32, is_pure=True, pack=1)
        p_slot.store(word)
        fence_async_shared()
        partition_barrier()  # every warp's words are in place before the wgmma reads them
        p_op = gl.zeros([1], gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0]))
    else:
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    return p_op


@gluon.jit
def _pv_issue(p_op, p_slot, v_tile, acc, FP8: gl.constexpr):
    """Issue P V.  bf16/fp16: P in registers, accumulated into O.  FP8: P from shared
    memory (``_p_operand``) and V's tile keys-contiguous ([HEAD_DIM, BLOCK_N]: an fp8
    wgmma reads B k-major only); the product goes to a fresh accumulator, added to O in
    fp32 by ``_pv_done``: the tensor core sums fp8 products in a ~14-bit accumulator, so
    only one tile's keys are summed there (as the Triton kernel's max_num_imprecise_acc
    = BLOCK_N), never the whole sequence."""
    if FP8:
        P_SHAPE: gl.constexpr = [p_slot.shape[0], 4 * p_slot.shape[1]]
        p_tile = reinterpreted(p_slot, v_tile.dtype, P_SHAPE,
                               gl.NVMMASharedLayout.get_default_for(P_SHAPE, v_tile.dtype))
        pv = warpgroup_mma(p_tile, v_tile.permute((1, 0)), gl.zeros_like(acc), use_acc=False,
                           is_async=True)
    else:
        pv = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    return pv


@gluon.jit
def _pv_done(pv, acc, alpha_owed, o_layout: gl.constexpr, FP8: gl.constexpr):
    """O after ``_pv_issue``'s product completed.  FP8 adds the tile's product to O and
    rebases O in one FMA: ``alpha_owed`` is the rescale O still owed when the product
    was issued (O was in the base before P's)."""
    if FP8:
        acc = acc * gl.expand_dims(gl.convert_layout(alpha_owed, gl.SliceLayout(1, o_layout)),
                                   1) + pv
    else:
        acc = pv
    return acc


@gluon.jit
def _consume_tiles(acc, p_op, alpha, m_i, l_i, s_zero, q_wg, p_slot, k_smem, v_smem, k_ready,
                   k_empty, v_ready, v_empty, turn, offs_m, tile_lo, tile_hi, n_tiles,
                   ring_base, turn_base, seqlen_k, diag_offset, qk_scale, WG: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   MASKED: gl.constexpr, PINGPONG: gl.constexpr, EARLY_RESCALE: gl.constexpr,
                   FP8: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                   p_layout: gl.constexpr):
    """One warpgroup's tiles [tile_lo, tile_hi) of a block: S_j and P_{j-1} V_{j-1} in
    flight together, softmax j between.  Under ping-pong the two GEMMs are issued in this
    warpgroup's turn and the other warpgroup issues its own during this softmax.

    ``ring_base`` counts the K/V tiles this program consumed before this block (the ring
    slot and its phase continue across blocks), ``turn_base`` the turns.  On entry K of
    ``tile_lo`` has been waited for; on exit K of ``tile_hi`` has (if it exists).

    O is rebased to the newest row maximum by ``alpha``.  EARLY_RESCALE does it as FA3
    does, right after issuing S_j (the multiply runs while S_j is on the tensor cores,
    and O is then in the base of P_{j-1}); otherwise after P_{j-1} V_{j-1} completes,
    where it delays the next tile's GEMMs.  ``alpha`` is the rescale still owed to O.
    """
    dtype: gl.constexpr = q_wg.dtype
    for tile in range(tile_lo, tile_hi):
        slot = ring_base + tile
        stage = slot % STAGES
        prev = (slot - 1) % STAGES
        mbarrier.wait(v_ready.index(prev), ((slot - 1) // STAGES) & 1)
        _turn_wait(turn, turn_base + tile, WG, PINGPONG)
        s = warpgroup_mma(q_wg, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        if EARLY_RESCALE:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        pv = _pv_issue(p_op, p_slot, v_smem.index(prev), acc, FP8)
        _turn_pass(turn, WG, PINGPONG)
        s, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s, k_smem.index(stage)))
        mbarrier.arrive(k_empty.index(stage), count=1)
        alpha_owed = alpha
        p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, tile * BLOCK_N, seqlen_k,
                                           diag_offset, qk_scale, BLOCK_N, IS_CAUSAL, MASKED,
                                           s_layout)
        # Waiting for K_{j+1} here (it is needed first thing next step) is also what keeps
        # the softmax above the wait for P_{j-1} V_{j-1}: without a branch in between,
        # ptxas 12.8 hoists wgmma.wait_group 0 right under wait_group 1 and the overlap
        # is gone (bench/NOTES.md, attempt 8: the SASS of attempt 7 shows exactly that).
        nxt = slot + 1
        mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1, pred=tile + 1 < n_tiles)
        pv, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, v_smem.index(prev)))
        acc = _pv_done(pv, acc, alpha_owed, o_layout, FP8)
        mbarrier.arrive(v_empty.index(prev), count=1)
        if not (EARLY_RESCALE or FP8):
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = _p_operand(p, dtype, p_layout, p_slot)
    return acc, p_op, alpha, m_i, l_i


@gluon.jit
def _consumer(q_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              turn, O, LSE, DESCALES, stride_ob, stride_oh, stride_om, num_heads, group_size,
              seqlen_q, seqlen_k, qk_scale, num_work, WG: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
              PINGPONG: gl.constexpr, EARLY_RESCALE: gl.constexpr,
              VECTOR_STORE: gl.constexpr, FP8: gl.constexpr):
    """Consumer warpgroup ``WG``: rows [64 WG, 64 WG + 64) of each block this program
    takes, softmax state in registers, both GEMMs, the epilogue."""
    dtype: gl.constexpr = q_smem.dtype
    ROWS: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    # One wgmma instruction reduces 32 bytes of each operand row: 16 values, 32 in fp8.
    MMA_K: gl.constexpr = 32 if FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, MMA_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, MMA_K])
    # P stays in registers as wgmma's A operand (FA3's "RS" P.V); FP8's goes through
    # shared memory instead (_p_operand) and never takes this layout.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    STORE_COLS: gl.constexpr = 32 if HEAD_DIM >= 256 else HEAD_DIM // 8
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // STORE_COLS, STORE_COLS],
                                                  [4, 1], [1, 0])
    q_wg = q_smem.index(WG)
    p_slot = p_smem.index(WG)  # FP8: this warpgroup's P (bf16/fp16: unused)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    num_m_blocks = gl.cdiv(seqlen_q, BLOCK_M)
    diag_offset = seqlen_k - seqlen_q
    num_kv_heads = num_heads // group_size

    ring_base = 0
    turn_base = 0
    for blocks_done in range(0, _snake_rounds(num_work)):
        off_bh, off_b, off_h, off_hk, m_first, n_tiles = _work_block(
            blocks_done, num_m_blocks, num_heads, group_size, seqlen_q, seqlen_k,
            IS_CAUSAL, BLOCK_M, BLOCK_N)
        if FP8:
            # DESCALES is (batch, kv_heads, 3) fp32: q's, k's, v's.  The real q.k is
            # q_descale x k_descale x the fp8 product, one factor per block, folded into
            # the scale; v_descale scales O at the end.
            descales = DESCALES + 3 * (off_b * num_kv_heads + off_hk)
            block_scale = qk_scale * gl.load(descales) * gl.load(descales + 1)
        else:
            block_scale = qk_scale
        row0 = m_first + WG * ROWS
        offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        # This warpgroup's own unmasked count: its first row is 64 later than the block's.
        if IS_CAUSAL:
            n_unmasked = gl.minimum(gl.maximum(row0 + diag_offset + 1, 0) // BLOCK_N,
                                    seqlen_k // BLOCK_N)
        else:
            n_unmasked = seqlen_k // BLOCK_N

        # Tile 0 has nothing to overlap with; it is masked only if it is a band-edge tile.
        stage0 = ring_base % STAGES
        mbarrier.wait(q_ready.index(WG), blocks_done & 1)
        mbarrier.wait(k_ready.index(stage0), (ring_base // STAGES) & 1)
        _turn_wait(turn, turn_base, WG, PINGPONG)
        s = warpgroup_mma(q_wg, k_smem.index(stage0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_wg, k_smem.index(stage0)))
        mbarrier.arrive(k_empty.index(stage0), count=1)
        if n_unmasked > 0:
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, 0, seqlen_k, diag_offset,
                                               block_scale, BLOCK_N, IS_CAUSAL, False, s_layout)
        else:
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, offs_m, 0, seqlen_k, diag_offset,
                                               block_scale, BLOCK_N, IS_CAUSAL, True, s_layout)
        p_op = _p_operand(p, dtype, p_layout, p_slot)
        nxt = ring_base + 1
        mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1, pred=n_tiles > 1)

        # Stage 1: tiles every row of this warpgroup sees in full (no mask).  Stage 2: the
        # diagonal band and the ragged last tile (element mask).
        split = gl.maximum(gl.minimum(n_unmasked, n_tiles), 1)
        acc, p_op, alpha, m_i, l_i = _consume_tiles(
            acc, p_op, alpha, m_i, l_i, s_zero, q_wg, p_slot, k_smem, v_smem, k_ready, k_empty,
            v_ready, v_empty, turn, offs_m, 1, split, n_tiles, ring_base, turn_base, seqlen_k,
            diag_offset, block_scale, WG, BLOCK_N, STAGES, IS_CAUSAL, False, PINGPONG,
            EARLY_RESCALE, FP8, s_layout, o_layout, p_layout)
        acc, p_op, alpha, m_i, l_i = _consume_tiles(
            acc, p_op, alpha, m_i, l_i, s_zero, q_wg, p_slot, k_smem, v_smem, k_ready, k_empty,
            v_ready, v_empty, turn, offs_m, split, n_tiles, n_tiles, ring_base, turn_base,
            seqlen_k, diag_offset, block_scale, WG, BLOCK_N, STAGES, IS_CAUSAL, True, PINGPONG,
            EARLY_RESCALE, FP8, s_layout, o_layout, p_layout)
        # Every S of this block is done: the producer may load the next block's Q.
        mbarrier.arrive(q_empty.index(WG), count=1)

        last = ring_base + n_tiles - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        _turn_wait(turn, turn_base + n_tiles, WG, PINGPONG)
        if EARLY_RESCALE:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        pv = _pv_issue(p_op, p_slot, v_smem.index(last % STAGES), acc, FP8)
        _turn_pass(turn, WG, PINGPONG)
        pv, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, v_smem.index(last % STAGES)))
        acc = _pv_done(pv, acc, alpha, o_layout, FP8)
        mbarrier.arrive(v_empty.index(last % STAGES), count=1)

        # One division per row, as kernels/_primitives._finish_rows: a row that sees no key
        # (causal, above the diagonal) gives O = 0, LSE = -inf; a NaN l (a NaN or +inf
        # score) gives NaN O and LSE, and l = 0 on a row that sees keys (every score -inf)
        # 0/0 = NaN.  "Saw no key" comes from the band, never from l alone.
        no_key = l_i < 0.0  # never: without the causal band every row sees every key
        if IS_CAUSAL:
            no_key = (l_i == 0.0) & (offs_m + diag_offset < 0)
        l_safe = gl.where(no_key, 1.0, l_i)
        lse = gl.where(no_key, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        if FP8:
            out = out * gl.load(descales + 2)
        out = out.to(O.dtype.element_ty)
        if VECTOR_STORE:
            # wgmma's layout gives a thread 2 adjacent columns per 8: 2- or 4-byte stores.
            # Through shared memory each thread gets 8 adjacent columns: 16-byte stores.
            out = gl.convert_layout(out, store_layout)
        offs_mo = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out.type.layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out.type.layout))
        o_base = off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
        o_ptrs = (O + o_base + gl.expand_dims(offs_mo, 1).to(gl.int64) * stride_om
                  + gl.expand_dims(offs_d, 0))
        gl.store(o_ptrs, out, mask=gl.expand_dims(offs_mo, 1) < seqlen_q)
        gl.store(LSE + off_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)

        ring_base += n_tiles
        turn_base += n_tiles + 1


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
              k_empty, v_ready, v_empty, num_heads, group_size, seqlen_q, seqlen_k, num_work,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              IS_CAUSAL: gl.constexpr, FP8: gl.constexpr):
    """The producer partition (one warp): every TMA copy, paced by the empty barriers,
    running ahead into the next block while the consumers finish this one.

    The descriptors are 4-D (batch, head, sequence, head dim) with a box of one
    (batch, head): TMA zero-fills rows past this sequence's end, never reading the next
    one.  Their boxes land in the 2-D tiles the MMAs read (``tma_load_box``).  FP8: V's
    descriptor is over its keys-contiguous copy (batch, head, head dim, sequence)."""
    ROWS: gl.constexpr = q_smem.shape[1]
    num_m_blocks = gl.cdiv(seqlen_q, BLOCK_M)

    ring_base = 0
    for blocks_done in range(0, _snake_rounds(num_work)):
        off_bh, off_b, off_h, off_hk, m_first, n_tiles = _work_block(
            blocks_done, num_m_blocks, num_heads, group_size, seqlen_q, seqlen_k,
            IS_CAUSAL, BLOCK_M, BLOCK_N)
        # A fresh mbarrier counts as having completed the phase before phase 0, so the
        # first block's Q and the first lap through the ring do not wait.
        for half in gl.static_range(2):
            mbarrier.wait(q_empty.index(half), (blocks_done & 1) ^ 1)
            mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
            tma_load_box(q_desc, [off_b, off_h, m_first + half * ROWS, 0], q_ready.index(half),
                         q_smem.index(half))
        for tile in range(n_tiles):
            slot = ring_base + tile
            stage = slot % STAGES
            free_phase = ((slot // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(stage), free_phase)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma_load_box(k_desc, [off_b, off_hk, tile * BLOCK_N, 0], k_ready.index(stage),
                         k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), free_phase)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            if FP8:
                tma_load_box(v_desc, [off_b, off_hk, 0, tile * BLOCK_N], v_ready.index(stage),
                             v_smem.index(stage))
            else:
                tma_load_box(v_desc, [off_b, off_hk, tile * BLOCK_N, 0], v_ready.index(stage),
                             v_smem.index(stage))
        ring_base += n_tiles


# Lengths and head counts change per call; specialising on them would multiply compiles.
@gluon.jit(do_not_specialize=["num_heads", "group_size", "seqlen_q", "seqlen_k", "num_work"])
def _attn_fwd_sm90(
    # TMA descriptors of q, k, v (host-built, 4-D: batch, head, sequence, head dim; fp8 V:
    # batch, head, head dim, sequence)
    q_desc, k_desc, v_desc,
    # pointers and strides (batch, head, seq) of the outputs; the head dim is unit-stride.
    # DESCALES: fp8 only, (batch, kv_heads, 3) fp32 (any fp32 pointer otherwise)
    O, LSE, DESCALES, stride_ob, stride_oh, stride_om,
    # sizes: num_work = query blocks x batch x heads, taken by the programs in turn
    num_heads, group_size, seqlen_q, seqlen_k, num_work,
    # scalars
    qk_scale,
    # meta-parameters
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr, EARLY_RESCALE: gl.constexpr,
    VECTOR_STORE: gl.constexpr, num_warps: gl.constexpr,
):
    """One program per query block (grid = num_work) or a persistent grid (one program
    per SM, each taking blocks pid, pid + grid, ...): the same code, the launcher picks.
    e4m3 q, k, v make it the FP8 forward (bf16 O)."""
    dtype: gl.constexpr = q_desc.dtype
    FP8: gl.constexpr = dtype.is_fp8()
    ROWS: gl.constexpr = BLOCK_M // 2
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    if FP8:
        vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N],
                                                                       dtype)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, HEAD_DIM, BLOCK_N], vt_layout)
        # Each consumer's P as words of four e4m3 (``_p_operand``), swizzled as the fp8
        # tile the wgmma reads.
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], dtype)
        p_words: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=p_layout.swizzle_byte_width, element_bitwidth=32, rank=2)
        p_smem = gl.allocate_shared_memory(gl.int32, [2, ROWS, BLOCK_N // 4], p_words)
    else:
        p_smem = q_smem
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for half in gl.static_range(2):
        mbarrier.init(q_ready.index(half), count=1)
        mbarrier.init(q_empty.index(half), count=1)
        mbarrier.init(turn.index(half), count=1)
    for ring in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(ring), count=1)
        mbarrier.init(k_empty.index(ring), count=2)  # released by both warpgroups
        mbarrier.init(v_ready.index(ring), count=1)
        mbarrier.init(v_empty.index(ring), count=2)

    gl.warp_specialize([
        # The default partition is consumer warpgroup 0, the first worker warpgroup 1.
        (_consumer, (q_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                     v_empty, turn, O, LSE, DESCALES, stride_ob, stride_oh, stride_om,
                     num_heads, group_size, seqlen_q, seqlen_k, qk_scale, num_work, 0, BLOCK_M,
                     BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, EARLY_RESCALE, VECTOR_STORE, FP8)),
        (_consumer, (q_smem, p_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                     v_empty, turn, O, LSE, DESCALES, stride_ob, stride_oh, stride_om,
                     num_heads, group_size, seqlen_q, seqlen_k, qk_scale, num_work, 1, BLOCK_M,
                     BLOCK_N, STAGES, IS_CAUSAL, PINGPONG, EARLY_RESCALE, VECTOR_STORE, FP8)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty,
                     k_ready, k_empty, v_ready, v_empty, num_heads, group_size, seqlen_q,
                     seqlen_k, num_work, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, FP8)),
    ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])

    for half in gl.static_range(2):
        mbarrier.invalidate(q_ready.index(half))
        mbarrier.invalidate(q_empty.index(half))
        mbarrier.invalidate(turn.index(half))
    for ring in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(ring))
        mbarrier.invalidate(k_empty.index(ring))
        mbarrier.invalidate(v_ready.index(ring))
        mbarrier.invalidate(v_empty.index(ring))


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Sm90Config:
    """The meta-parameters a tuning sweep varies (bench/sm90_h200.py)."""

    block_n: int
    stages: int
    producer_regs: int = 24
    # "split": the two consumer warpgroups run freely; "pingpong": they take turns at
    # issuing their GEMMs (FA3's schedule).  The sweep measures both per bucket.
    schedule: str = "split"
    # One program per SM walking the query blocks in turn (the producer runs ahead into
    # the next block during this one's epilogue), instead of one program per block.
    persistent: bool = False
    # Where O is rebased to a new row maximum: "late", after P_{j-1} V_{j-1} completes,
    # or "early", FA3's place, while S_j runs (see _consume_tiles).
    rescale: str = "late"
    # How O leaves: "direct" from wgmma's register layout, or "vector" (16-byte stores
    # after a shuffle through shared memory).
    store: str = "direct"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.rescale not in RESCALES:
            raise ValueError(f"rescale must be one of {RESCALES}, got {self.rescale!r}")
        if self.store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {self.store!r}")
        if self.block_n not in (64, 128):
            raise ValueError(f"block_n must be 64 or 128 (a power of two that wgmma's N and "
                             f"TMA's box take), got {self.block_n}")
        if self.stages not in (2, 3):
            raise ValueError(f"stages must be 2 or 3, got {self.stages}")
        check_producer_regs(self.producer_regs)

    def name(self) -> str:
        """The config in one token, as the sweep's records and the winners name it:
        sm90[n128,s2,r24,split] plus ",persistent", ",early", ",vector" where set."""
        flags = [f for f, on in (("persistent", self.persistent),
                                 ("early", self.rescale == "early"),
                                 ("vector", self.store == "vector")) if on]
        return (f"sm90[n{self.block_n},s{self.stages},r{self.producer_regs},"
                + ",".join([self.schedule, *flags]) + "]")

    @classmethod
    def from_name(cls, name: str) -> Sm90Config:
        """The inverse of ``name``."""
        match = re.fullmatch(r"sm90\[n(\d+),s(\d+),r(\d+),(\w+)((?:,\w+)*)\]", name)
        if match is None:
            raise ValueError(f"not an sm90 config name: {name!r}")
        block_n, stages, regs, schedule, rest = match.groups()
        flags = set(rest.split(",")[1:])
        unknown = flags - {"persistent", "early", "vector"}
        if unknown:
            raise ValueError(f"unknown flags {sorted(unknown)} in sm90 config name {name!r}")
        return cls(int(block_n), int(stages), int(regs), schedule, "persistent" in flags,
                   "early" if "early" in flags else "late",
                   "vector" if "vector" in flags else "direct")


# Per head dim, the best tiles of session 3's sweeps (bench/results/runs/2026-12-01-s3-run*)
# and the rescale/store that won most buckets in session 4's (2026-12-01-s4-run2): what a
# config-less call and the tests run.
DEFAULT_CONFIGS = {
    64: Sm90Config(block_n=128, stages=3),
    128: Sm90Config(block_n=128, stages=2, store="vector"),
    256: Sm90Config(block_n=64, stages=2, rescale="early", store="vector"),
}
# The FP8 forward's (e4m3 q, k, v): fp8 tiles take half the shared memory, so deeper
# rings.  At d = 128 a 128-key S beside O and a tile's P V (three 64-register fp32
# accumulators) spills on 3.9 (107-132 LDL/STL, compiled here) and causal on 3.6, 64 keys
# on none; d = 256 is not covered (two 64 x 256 accumulators spill at any tile).
FP8_CONFIGS = {
    64: Sm90Config(block_n=128, stages=3),
    128: Sm90Config(block_n=64, stages=3, store="vector"),
}
# What bench/fp8_h200.py --phases sm90 times (and the GPU tests check) for its table.
FP8_CANDIDATES = tuple(
    Sm90Config(block_n, stages, schedule=schedule, persistent=persistent, store="vector")
    for block_n in (64, 128) for stages in (2, 3)
    for schedule, persistent in (("split", False), ("pingpong", False), ("split", True)))


def shared_memory_bytes(head_dim: int, config: Sm90Config, fp8: bool = False) -> int:
    """Q tile + the K and V rings (+ FP8: the two consumers' P tiles) + the O staging of
    the vector store + barriers and Triton's reduction scratch: what one CTA allocates
    (within 512 bytes above ``compile_for_sm90(...).metadata.shared``, checked by the CPU
    compile test)."""
    tiles = BLOCK_M * head_dim + 2 * config.stages * config.block_n * head_dim
    tiles = tiles + BLOCK_M * config.block_n if fp8 else 2 * tiles
    staging = _VECTOR_STORE_STAGING[head_dim] if config.store == "vector" else 0
    return tiles + staging + 8 * (1 + 4 * config.stages) + 512


# Shared memory Triton 3.6 adds for the vector store's layout conversion (it stages part
# of the tile at a time), from compile_for_sm90(...).metadata.shared at each head dim.
_VECTOR_STORE_STAGING = {64: 16384, 128: 16384, 256: 32768}


def refusal(*, capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int,
            window: tuple[int, int], softcap: float, aligned: bool,
            config: Sm90Config | None = None) -> str | None:
    """Why this kernel must not run a call, or None when it may (full and bottom-right
    causal attention are both covered, so ``causal`` never decides)."""
    reason = hardware_refusal(capability, dtype)
    if reason is not None:
        return reason
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    if tuple(window) != (-1, -1):
        return "sliding windows are not implemented in the sm_90 kernel"
    if softcap != 0.0:
        return "softcap is not implemented in the sm_90 kernel"
    if not aligned:
        return ("TMA needs a unit-stride head dim, 16-byte aligned base pointers and strides, "
                "and non-empty sequences")
    config = config or DEFAULT_CONFIGS[head_dim]
    return shared_memory_refusal(config, shared_memory_bytes(head_dim, config), head_dim)


def fp8_refusal(*, capability: tuple[int, int] | None, dtypes: tuple[torch.dtype, ...],
                head_dim: int, window: tuple[int, int], softcap: float, aligned: bool,
                config: Sm90Config | None = None) -> str | None:
    """Why the FP8 forward (e4m3 q, k, v) must not run a call on this kernel, or None."""
    if len(set(dtypes)) != 1:
        return "q, k and v must share one dtype"
    reason = hardware_refusal(capability, dtypes[0], (torch.float8_e4m3fn,))
    if reason is not None:
        return reason
    if head_dim not in FP8_CONFIGS:
        return (f"head_dim must be one of {tuple(FP8_CONFIGS)} for the FP8 kernel, got "
                f"{head_dim} (at 256 its two fp32 accumulators per warpgroup spill)")
    if tuple(window) != (-1, -1) or softcap != 0.0:
        return "sliding windows and softcap are not implemented in the sm_90 kernel"
    if not aligned:
        return ("TMA needs q and k with a unit-stride head dim, 16-byte aligned base "
                "pointers and strides, and non-empty sequences")
    config = config or FP8_CONFIGS[head_dim]
    if config.rescale != "late":
        return ("the FP8 kernel rebases O as it adds each tile's P V (rescale 'late'), got "
                f"rescale {config.rescale!r}")
    return shared_memory_refusal(config, shared_memory_bytes(head_dim, config, fp8=True),
                                 head_dim)


def supports_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 config: Sm90Config | None = None) -> tuple[bool, str]:
    """(True, "") if ``flash_forward_fp8_sm90`` computes this call (bshd, any causality),
    else (False, the reason)."""
    capability = on_sm90_capability(q) if all(t.is_cuda for t in (k, v)) else None
    reason = fp8_refusal(capability=capability, dtypes=(q.dtype, k.dtype, v.dtype),
                         head_dim=q.shape[-1], window=window, softcap=softcap,
                         aligned=tma_aligned(q, k) and v.dim() == 4 and v.numel() > 0,
                         config=config)
    if reason is None and not (k.shape[-1] == v.shape[-1] == q.shape[-1]):
        reason = "q, k and v must share one head_dim"
    return reason is None, reason or ""


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
             config: Sm90Config | None = None) -> tuple[bool, str]:
    """(True, "") if ``flash_forward_sm90`` computes this call, else (False, the reason)."""
    del causal  # both full and bottom-right causal attention are covered
    capability = on_sm90_capability(q) if all(t.is_cuda for t in (k, v)) else None
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        return False, "q, k and v must share one dtype"
    reason = refusal(capability=capability, dtype=q.dtype, head_dim=q.shape[-1],
                     window=window, softcap=softcap, aligned=tma_aligned(q, k, v),
                     config=config)
    if reason is None and not (k.shape[-1] == v.shape[-1] == q.shape[-1]):
        reason = "q, k and v must share one head_dim"
    return reason is None, reason or ""


def flash_forward_sm90(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    layout: str, scale: float, causal: bool = False, config: Sm90Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``attnlab.kernels.forward.flash_forward`` (O in ``layout``, LSE as
    (batch, heads, seqlen_q) float32 natural log, bottom-right causal), for the calls
    ``supports`` accepts; anything else is refused with a ValueError naming the reason."""
    if layout_named(layout).is_varlen:
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    ok, reason = supports(q, k, v, causal, config=config)
    if not ok:
        raise ValueError(f"flash_forward_sm90 cannot run this call: {reason}")
    return launch(q, k, v, layout=layout, scale=scale, causal=causal,
                  config=config or DEFAULT_CONFIGS[q.shape[-1]])


def flash_forward_fp8_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           q_descale: torch.Tensor, k_descale: torch.Tensor,
                           v_descale: torch.Tensor, *, scale: float, causal: bool = False,
                           config: Sm90Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.forward.flash_forward_fp8``'s contract (e4m3 q, k, v in ``bshd``, (batch,
    kv_heads) fp32 descales; bf16 O, fp32 LSE) on this kernel, for the calls
    ``supports_fp8`` accepts; anything else is refused with a ValueError naming the
    reason.  Not cached: the dispatched path keeps its plan (``kernels.forward``)."""
    ok, reason = supports_fp8(q, k, v, config=config)
    if not ok:
        raise ValueError(f"flash_forward_fp8_sm90 cannot run this call: {reason}")
    config = config or FP8_CONFIGS[q.shape[-1]]
    return plan_launch(q, k, v, layout="bshd", scale=scale, causal=causal,
                       config=config)(q, k, v, q_descale, k_descale, v_descale)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str, scale: float,
           causal: bool, config: Sm90Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_forward_sm90`` without its checks, for a call ``supports`` accepted with
    this config (``kernels.dispatch.forward_config`` returns only such configs): the dispatched path
    checks once, not twice (each check is ~15-30 us of host time per call)."""
    return plan_launch(q, k, v, layout=layout, scale=scale, causal=causal,
                       config=config)(q, k, v)


class PlannedLaunch:
    """This kernel's launch for one call signature: ``(q, k, v)`` allocates O and LSE and
    launches (``_sm90.PlannedGluonLaunch``), returning (O, LSE)."""

    def __init__(self, gluon: PlannedGluonLaunch, lse_shape: tuple[int, ...]) -> None:
        self.gluon, self.lse_shape = gluon, lse_shape

    def __call__(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self.gluon((q, k, v), (out, lse, lse))  # no descales: any fp32 pointer
        return out, lse


class PlannedFp8Launch(PlannedLaunch):
    """The FP8 forward's launch for one call signature: ``(q, k, v, q_descale, k_descale,
    v_descale)`` copies V keys-contiguous in ``_p_operand``'s key order
    (``fp8_v.keys_contiguous``) and the descales into one (batch, kv_heads, 3) tensor,
    allocates a bf16 O and LSE, launches."""

    def __call__(self, q, k, v, q_descale, k_descale, v_descale):
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        descales = torch.stack((q_descale, k_descale, v_descale), dim=-1)
        self.gluon((q, k, keys_contiguous(v, permuted=True)), (out, lse, descales))
        return out, lse


def keys_contiguous_v(v: torch.Tensor, block_n: int) -> tuple[torch.Tensor, tuple]:
    """(copy, descriptor parts: ``TensorDescriptor(copy, *parts)``) of a (batch, seqlen,
    kv_heads, head_dim) e4m3 V as this kernel reads it: ``fp8_v.keys_contiguous(v,
    permuted=True)``, in tiles of ``block_n`` keys.  A meta V gives a meta copy (the
    shapes, for a plan or a compile)."""
    shape = keys_contiguous_shape(v.shape)
    copy = (torch.empty(shape, dtype=v.dtype, device="meta") if v.device.type == "meta"
            else keys_contiguous(v, permuted=True))
    box = (1, 1, v.shape[-1], block_n)
    return copy, (list(shape), list(copy.stride()), list(box), box_layout(box, v.dtype))


def plan_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str,
                scale: float, causal: bool, config: Sm90Config) -> PlannedLaunch:
    """The launch for tensors of these sizes, strides and alignment (see ``launch``)."""
    fp8 = q.dtype == torch.float8_e4m3fn
    inputs = AttentionInputs.read(q, k, k, layout)
    batch, seqlen_q, num_heads, head_dim = (inputs.batch, inputs.seqlen_q, inputs.heads,
                                            inputs.head_dim)
    seqlen_k, num_kv_heads = inputs.seqlen_k, inputs.kv_heads
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads "
                         f"({num_kv_heads})")
    num_work = triton.cdiv(seqlen_q, BLOCK_M) * batch * num_heads
    grid = (min(num_work, sm_count(q.device)) if config.persistent else num_work,)
    kernel, meta = _kernel_and_meta(config)
    # O is allocated contiguous in q's layout.
    strides = layout_named(layout).bhs_strides(torch.empty(q.shape, device="meta"))
    if fp8:  # V arrives keys-contiguous (PlannedFp8Launch): a meta copy has its strides
        v_copy, v_parts = keys_contiguous_v(v.to("meta"), config.block_n)
    else:
        v_copy, v_parts = v, descriptor_parts(v, layout, config.block_n)
    descriptors = (PlannedDescriptor(q, descriptor_parts(q, layout, BLOCK_M // 2)),
                   PlannedDescriptor(k, descriptor_parts(k, layout, config.block_n)),
                   PlannedDescriptor(v_copy, v_parts))
    static = (*strides, num_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k, num_work,
              scale * LOG2E)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
                      STAGES=config.stages, IS_CAUSAL=causal,
                      PRODUCER_REGS=config.producer_regs, **meta)
    key = launch_key(config, causal, q, strides, max(seqlen_q, seqlen_k, num_work))
    gluon = PlannedGluonLaunch(_COMPILED, kernel, grid, descriptors, static, constexprs, key,
                               MAXNREG)
    if fp8:
        return PlannedFp8Launch(gluon, (batch, num_heads, seqlen_q))
    return PlannedLaunch(gluon, (batch, num_heads, seqlen_q))


# Launched kernels by launch_key: the call after the first goes straight to the
# compiled kernel's launcher (_launch.launch_cached).
_COMPILED: dict[tuple, object] = {}


def launch_key(config: Sm90Config, causal: bool, q: torch.Tensor, out_strides, largest: int
               ) -> tuple:
    """What Triton specialises this kernel on, beyond the constexprs (config, causal, head
    dim, dtype): each output stride's value-1 / divisible-by-16 / 32-bit-or-not class, and
    whether the unspecialised sizes fit 32 bits.  The descriptors' types follow from the
    dtype and config; O and LSE are fresh allocations (always 16-byte aligned)."""
    return (config, causal, q.shape[-1], q.dtype, q.device,
            tuple(int_class(s) for s in out_strides), largest < 2**31)


def kernel_name(config: Sm90Config) -> str:
    """The name the profiler shows for a config's kernel."""
    return _kernel_and_meta(config)[0].fn.__name__


def _kernel_and_meta(config: Sm90Config):
    """The kernel and its schedule-dependent meta-parameters (num_warps = the default
    partition's warps, i.e. consumer warpgroup 0)."""
    return _attn_fwd_sm90, {"CONSUMER_REGS": CONSUMER_REGS,
                            "PINGPONG": config.schedule == "pingpong",
                            "EARLY_RESCALE": config.rescale == "early",
                            "VECTOR_STORE": config.store == "vector",
                            "num_warps": CONSUMER_WARPS}


# ---------------------------------------------------------------------------
# Compile-only path: sm_90 code (PTX, cubin) without a GPU, for the CPU test and the
# SASS evidence in bench/NOTES.md.
# ---------------------------------------------------------------------------

def compile_for_sm90(head_dim: int, config: Sm90Config | None = None, *, causal: bool = False,
                     dtype: str = "bf16"):
    """The compiled kernel (``.asm['ptx']``, ``.asm['cubin']``, ``.metadata``) for sm_90a;
    ``dtype`` "fp8" compiles the FP8 forward (e4m3 q, k, keys-contiguous V; bf16 O)."""
    from triton.runtime.jit import mangle_type

    fp8 = dtype == "fp8"
    config = config or (FP8_CONFIGS if fp8 else DEFAULT_CONFIGS)[head_dim]
    kernel, meta = _kernel_and_meta(config)
    torch_dtype = torch.float8_e4m3fn if fp8 else getattr(torch, TORCH_NAMES[dtype])
    # A meta-device tensor gives the descriptors their types without memory.
    example = torch.empty((1, 256, 1, head_dim), dtype=torch_dtype, device="meta")
    if fp8:
        copy, parts = keys_contiguous_v(example, config.block_n)
        v_desc = TensorDescriptor(copy, *parts)
    else:
        v_desc = descriptor(example, "bshd", config.block_n)
    signature = {
        "q_desc": mangle_type(descriptor(example, "bshd", BLOCK_M // 2)),
        "k_desc": mangle_type(descriptor(example, "bshd", config.block_n)),
        "v_desc": mangle_type(v_desc),
        "O": "*bf16" if fp8 else f"*{dtype}", "LSE": "*fp32", "DESCALES": "*fp32",
    }
    for axis in ("b", "h", "m"):
        signature[f"stride_o{axis}"] = "i32"
    for name in ("num_heads", "group_size", "seqlen_q", "seqlen_k", "num_work"):
        signature[name] = "i32"
    signature["qk_scale"] = "fp32"
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n,
                     STAGES=config.stages, IS_CAUSAL=causal,
                     PRODUCER_REGS=config.producer_regs, **meta)
    aligned = ("O", "LSE", "DESCALES", "stride_ob", "stride_oh", "stride_om")
    return compile_sm90(kernel, signature, constants, aligned, MAXNREG)


def overlap_evidence(asm: dict) -> dict:
    """``_sm90.code_evidence`` plus, per steady loop, the number of MUFU.EX2 that ptxas
    left between WARPGROUP.DEPBAR.LE 1 (S_j ready) and WARPGROUP.DEPBAR.LE 0
    (P_{j-1} V_{j-1} done): > 0 means overlap."""
    evidence, sass = code_evidence(asm)
    if sass is None:
        return evidence
    between, inside, count = [], False, 0
    for wait, ex2 in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([01])|(MUFU\.EX2)", sass):
        if wait == "1":
            inside, count = True, 0
        elif wait == "0" and inside:
            between.append(count)
            inside = False
        elif ex2 and inside:
            count += 1
    evidence["ex2_between_waits"] = between
    return evidence
