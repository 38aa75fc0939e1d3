"""A cache-aware estimate of the DRAM bytes Nsight Compute measures, per kernel.

The logical model (:mod:`attnlab.model.traffic`) counts every load against HBM.
For fused attention that is 17x too high on an H200: a K/V tile that one CTA
loads is re-read by the other CTAs of the same head *while they are resident at
the same time*, and those re-reads hit L2.  This module predicts what
``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` report, from hardware facts
and the kernel's launch, with one thing fitted to measurements: the LRU capacity of 7.

What it assumes (facts of the hardware and of the measuring tool, except 5, a
modelling choice, and 7, a modelling choice with a fitted parameter):

1. **ncu's conditions.**  ``ncu`` (default ``--cache-control all``) flushes and
   invalidates the caches before each kernel it measures, so every kernel starts
   with a cold L2: each input byte is read from DRAM at least once, even one the
   previous kernel has just written.  Lines still dirty in L2 when the kernel ends
   are written back after the measurement and are not counted.
2. **Waves of resident CTAs.**  CTAs are dispatched in launch order (x fastest);
   ``SMs x CTAs-per-SM`` of them are resident at once (CTAs-per-SM from the
   launch's threads, registers and shared memory against the SM's limits, or the
   grid itself for a persistent kernel).  The query tiles of one head are
   consecutive in launch order, and the heads of one GQA group are adjacent.
3. **K/V reuse from L2.**  The CTAs that share a KV head stream the same K/V
   tiles at about the same pace, so a tile is read from DRAM once and hit in L2
   by the others — when they are resident together.  A head whose CTAs span
   several waves re-reads its K/V from DRAM once per wave, unless its whole K/V
   (held in both L2 halves, see 4) fits in L2 between waves.
4. **Two L2 partitions.**  The L2 is split in two partitions, each caching data
   for the memory accesses of the SMs directly connected to it (NVIDIA's A100
   whitepaper; H100/H200 keep the split).  We take it that a line read by CTAs on
   both halves is held in both, so chip-wide shared reads (K/V, GEMM operands)
   occupy twice their size.
5. **Dirty lines left in L2 at the end.**  The L2 keeps the most recently
   touched lines; at the kernel's end their mix follows the kernel's own traffic
   mix.  Written bytes still resident then — ``L2 x written / (unshared reads +
   2 x shared reads + written)``, capped at the bytes written — are not counted as
   DRAM writes.  Outputs that fit in L2 outright (a one-head output, split-KV
   partials) are therefore written back only after the kernel.
6. **The kernels each provider launches** (checked against the profiler's kernel
   list): PyTorch's flash backend chooses split-KV with FlashAttention-2's
   wave-efficiency heuristic (64-row query blocks, 128-key blocks, 2 x SMs as the
   CTA budget) and otherwise 128 x 64 tiles of 128 threads; cuDNN's Hopper kernel
   is persistent (one 384-thread CTA per SM, 128 x 128 tiles) and writes no LSE
   in inference; eager PyTorch launches GEMM, scale, [mask], softmax, GEMM.
7. **The Gluon dK/dV launches' re-reads** (:func:`predict_gluon_dkdv`).  Their
   programs share the GQA group's Q, dO, LSE and D rows only while they read them at
   about the same time, and which do is decided by the program order, the read order
   and the block scheduler, not by waves: :mod:`attnlab.model.l2` replays every
   program's tile reads in that order through one LRU cache.  Its capacity is fitted
   (``hardware.GH100_L2_LRU_FIT_BYTES``, ~37 MB against the chip's 50 MiB), so these
   predictions are estimates that move steeply with it (near the fit, ~3% of the seed
   layer's launch bytes per MB of capacity), not derived facts.

Not modelled: sector granularity and partial-line writes, L2 set conflicts and a
replacement policy that is not LRU, causal grids whose early-finishing CTAs let
later heads overlap (the peers' FA-2 causal run at 32 heads read 14% more than
Q + K + V), and TLB or ECC traffic.

Checked against the peers' H200 captures (tests/test_model_cache.py):
eager, SDPA-flash and SDPA-cuDNN at N=4096, d=128, FP16, 1 and 32 heads, causal
and not — all within 15% of measured read + write bytes (worst: FA-2 causal at 32
heads, -13.6%), where the logical model is up to 20x too high for the fused kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from attnlab.checks import check_int
from attnlab.dtypes import canonical_kv_dtype
from attnlab.masking import shape_band, visible_pairs
from attnlab.model import hardware, l2
from attnlab.model import traffic as logical_traffic
from attnlab.shapes import AttentionShape, check_shape

MiB = 2**20
STATS_BYTES = 4     # LSE and split partials are FP32 in every kernel modelled here
TABLE_ENTRY_BYTES = 4  # a paged cache's block table: int32 page numbers
PARTIAL_BYTES = 4
MASK_BYTES = 1      # torch.bool


@dataclass(frozen=True)
class CacheHardware:
    """The hardware facts the model uses (Hopper defaults)."""

    name: str
    sm_count: int
    l2_bytes: int
    l2_partitions: int = 2
    shared_bytes_per_sm: int = 228 * 1024
    shared_bytes_reserved_per_cta: int = 1024
    registers_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    # The one LRU cache predict_gluon_dkdv replays row reads through: fitted, not a fact
    # (hardware.GH100_L2_LRU_FIT_BYTES); None where nothing was fitted.
    l2_lru_fit_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("sm_count", "l2_bytes", "l2_partitions", "shared_bytes_per_sm",
                     "registers_per_sm", "max_threads_per_sm", "max_ctas_per_sm"):
            check_int(name, getattr(self, name), minimum=1)
        if self.l2_lru_fit_bytes is not None:
            check_int("l2_lru_fit_bytes", self.l2_lru_fit_bytes, minimum=1)


def cache_hardware(name: str) -> CacheHardware:
    """The cache facts of a GPU in :data:`attnlab.model.hardware.GPUS` (its SMs and L2)."""
    gpu = hardware.gpu(name)
    if gpu.sm_count is None or gpu.l2_bytes is None:
        known = [g.name for g in hardware.GPUS.values() if g.sm_count and g.l2_bytes]
        raise ValueError(f"the cache model needs the SM count and L2 size of {gpu.name}; "
                         f"the GPU table has them for {', '.join(known)}")
    return CacheHardware(gpu.name, sm_count=gpu.sm_count, l2_bytes=gpu.l2_bytes,
                         l2_lru_fit_bytes=gpu.l2_lru_fit_bytes)


H200 = cache_hardware("H200")
H100_SXM = cache_hardware("H100 SXM")


@dataclass(frozen=True)
class Launch:
    """What residency depends on: threads, registers per thread, shared memory per CTA."""

    threads: int
    registers_per_thread: int
    shared_bytes: int

    def ctas_per_sm(self, hw: CacheHardware) -> int:
        by_threads = hw.max_threads_per_sm // self.threads
        # registers are allocated per warp in units of 256
        regs_per_warp = -(-self.registers_per_thread * 32 // 256) * 256
        by_registers = hw.registers_per_sm // (regs_per_warp * -(-self.threads // 32))
        by_shared = hw.shared_bytes_per_sm // (self.shared_bytes
                                               + hw.shared_bytes_reserved_per_cta)
        return max(1, min(by_threads, by_registers, by_shared, hw.max_ctas_per_sm))


@dataclass(frozen=True)
class PredictedKernel:
    """One kernel's predicted DRAM traffic under ncu's conditions."""

    role: str             # gemm_qk, scale, mask, softmax, gemm_pv, attention, split_kv, ...
    label: str
    read_bytes: int
    written_bytes: int    # bytes the kernel stores
    retained_bytes: int   # of those, still dirty in L2 when it ends (not counted)
    notes: tuple[str, ...] = field(default=())

    @property
    def write_bytes(self) -> int:
        """DRAM bytes written during the kernel (what dram__bytes_write.sum reports)."""
        return self.written_bytes - self.retained_bytes

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    def as_dict(self) -> dict:
        return {"role": self.role, "label": self.label, "read_bytes": self.read_bytes,
                "write_bytes": self.write_bytes, "written_bytes": self.written_bytes,
                "retained_bytes": self.retained_bytes, "total_bytes": self.total_bytes,
                "notes": list(self.notes)}


def retained_dirty_bytes(*, unshared_reads: int, shared_reads: int, written: int,
                         hw: CacheHardware) -> int:
    """Written bytes still in L2 at the kernel's end (assumption 5)."""
    occupancy = unshared_reads + hw.l2_partitions * shared_reads + written
    if written <= 0 or occupancy <= 0:
        return 0
    return min(written, hw.l2_bytes * written // occupancy)


def _kernel(role: str, label: str, *, unshared_reads: int, shared_reads: int, written: int,
            hw: CacheHardware, notes: tuple[str, ...] = ()) -> PredictedKernel:
    retained = retained_dirty_bytes(unshared_reads=unshared_reads, shared_reads=shared_reads,
                                    written=written, hw=hw)
    return PredictedKernel(role, label, unshared_reads + shared_reads, written, retained, notes)


def _check(shape: AttentionShape) -> AttentionShape:
    return check_shape(shape)


# ----- eager (materialising) ------------------------------------------------------------------
def predict_eager(shape: AttentionShape, hw: CacheHardware = H200) -> list[PredictedKernel]:
    """The ``eager`` provider: GEMM, scale, [masked_fill], softmax, GEMM; S and P in the
    input dtype, GQA groups stacked as rows (K/V not copied), mask built outside the call
    and applied only when it hides something."""
    s = _check(shape)
    b = s.element_bytes
    q = s.batch * s.query_heads * s.seqlen_q * s.head_dim * b
    kv = s.batch * s.kv_heads * s.seqlen_k * s.head_dim * b
    scores = s.batch * s.query_heads * s.seqlen_q * s.seqlen_k * b
    kernels = [
        _kernel("gemm_qk", "GEMM S = Q K^T", shared_reads=q + kv, unshared_reads=0,
                written=scores, hw=hw,
                notes=("Q and K tiles are read by several CTAs each: read once, L2 hits after",)),
        _kernel("scale", "scale S *= 1/sqrt(d)", unshared_reads=scores, shared_reads=0,
                written=scores, hw=hw),
    ]
    if visible_pairs(s) < s.seqlen_q * s.seqlen_k:
        # The (group x Nq, Nk) mask is broadcast over batch and KV heads; between two
        # uses of a mask line the kernel streams one group's S in and out.
        mask = s.group_size * s.seqlen_q * s.seqlen_k * MASK_BYTES
        group_scores = scores // (s.batch * s.kv_heads)
        reuse_fits = 2 * group_scores + hw.l2_partitions * mask <= hw.l2_bytes
        mask_reads = mask if reuse_fits else mask * s.batch * s.kv_heads
        kernels.append(_kernel(
            "mask", "masked_fill S (bool mask)", unshared_reads=scores, shared_reads=mask_reads,
            written=scores, hw=hw,
            notes=("mask read once" if reuse_fits else
                   "mask re-read from DRAM for every (batch, KV head): one group's S streams "
                   "through L2 between uses",)))
    kernels += [
        _kernel("softmax", "softmax P = softmax(S)", unshared_reads=scores, shared_reads=0,
                written=scores, hw=hw),
        _kernel("gemm_pv", "GEMM O = P V", unshared_reads=scores, shared_reads=kv, written=q,
                hw=hw),
    ]
    return kernels


# ----- fused forward (FlashAttention-style) ------------------------------------------------------
@dataclass(frozen=True)
class FusedTiling:
    """How a fused forward kernel covers the work."""

    block_m: int                  # query rows per CTA (work tile)
    block_n: int                  # key rows per loaded K/V tile
    launch: Launch
    persistent: bool = False      # grid = min(SMs x CTAs/SM, tiles), tiles looped in order
    writes_lse: bool = True


def kv_dram_passes(ctas_per_kv_head: int, resident_ctas: int, kv_bytes_per_head: int,
                   hw: CacheHardware) -> int:
    """How many times one KV head's K/V come from DRAM (assumption 3)."""
    if ctas_per_kv_head <= resident_ctas:
        return 1
    if hw.l2_partitions * kv_bytes_per_head <= hw.l2_bytes:
        return 1
    return math.ceil(ctas_per_kv_head / resident_ctas)


def _visible_kv_rows(shape: AttentionShape) -> int:
    """K rows that at least one query of a head may see: what its CTAs load between them."""
    first, stop = shape_band(shape).rows_key_interval(0, shape.seqlen_q)
    return max(0, stop - first)


def predict_fused_forward(shape: AttentionShape, tiling: FusedTiling,
                          hw: CacheHardware = H200, *,
                          label: str = "fused attention forward") -> list[PredictedKernel]:
    s = _check(shape)
    b = s.element_bytes
    q_tiles = -(-s.seqlen_q // tiling.block_m)
    resident = hw.sm_count * tiling.launch.ctas_per_sm(hw)
    if tiling.persistent:
        resident = min(resident, s.batch * s.query_heads * q_tiles)
    ctas_per_kv_head = q_tiles * s.group_size
    kv_rows = _visible_kv_rows(s)
    kv_bytes_per_head = 2 * kv_rows * s.head_dim * b
    passes = kv_dram_passes(ctas_per_kv_head, resident, kv_bytes_per_head, hw)
    q = s.batch * s.query_heads * s.seqlen_q * s.head_dim * b
    kv = s.batch * s.kv_heads * kv_bytes_per_head * passes
    written = q + (s.batch * s.query_heads * s.seqlen_q * STATS_BYTES if tiling.writes_lse
                   else 0)
    notes = (f"{ctas_per_kv_head} CTAs share each KV head's K/V; {resident} resident at once",
             f"K/V read from DRAM {passes}x per KV head "
             f"(logically {q_tiles * s.group_size}x: once per query tile)",
             "LSE written (FP32)" if tiling.writes_lse else "no LSE written")
    return [_kernel("attention", label, unshared_reads=q, shared_reads=kv, written=written,
                    hw=hw, notes=notes)]


def predict_split_kv(shape: AttentionShape, num_splits: int, tiling: FusedTiling,
                     hw: CacheHardware = H200, *, kv_bytes: int | None = None) -> list[PredictedKernel]:
    """Split-KV forward + combine: FP32 partial O and LSE per split, then a merge.
    ``kv_bytes``: the K/V (and descale) bytes read, where they are not the shape's dtype
    (:func:`predict_attnlab_decode`'s fp8 cache)."""
    s = _check(shape)
    if num_splits < 2:
        raise ValueError(f"num_splits must be >= 2 for a split-KV launch, got {num_splits}")
    b = s.element_bytes
    q = s.batch * s.query_heads * s.seqlen_q * s.head_dim * b
    kv = 2 * s.batch * s.kv_heads * _visible_kv_rows(s) * s.head_dim * b if kv_bytes is None \
        else kv_bytes
    rows = s.batch * s.query_heads * s.seqlen_q
    partials = num_splits * rows * (s.head_dim * PARTIAL_BYTES + STATS_BYTES)
    out = q + (rows * STATS_BYTES if tiling.writes_lse else 0)
    return [
        _kernel("split_kv", f"split-KV attention ({num_splits} splits)", unshared_reads=0,
                shared_reads=q + kv, written=partials, hw=hw,
                notes=("every split's CTAs are resident together: Q, K, V read once",
                       "partial O and LSE in FP32")),
        _kernel("combine", "combine split partials", unshared_reads=partials, shared_reads=0,
                written=out, hw=hw),
    ]


# ----- what each provider launches ------------------------------------------------------------------
def fa2_num_splits(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int,
                   max_splits: int = 128) -> int:
    """FlashAttention-2's split-KV heuristic: fill the GPU's CTA budget efficiently.

    One split when the blocks already nearly fill ``num_sms`` (80%); otherwise the
    smallest split count whose wave efficiency (waves / ceil(waves)) is within 85%
    of the best, skipping counts that do not change the blocks per split.
    """
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def blocks_per_split(n: int) -> int:
        return -(-num_n_blocks // n)

    def eligible(n: int) -> bool:
        return n == 1 or blocks_per_split(n) != blocks_per_split(n - 1)

    efficiency = {}
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = batch_nheads_mblocks * n / num_sms
            efficiency[n] = waves / math.ceil(waves)
    best = max(efficiency.values())
    for n in range(1, max_splits + 1):
        if n in efficiency and efficiency[n] >= 0.85 * best:
            return n
    return 1


# Launches of the kernels modelled (from their names and public source): threads,
# an assumed register count at the compiler's cap (these kernels are register-bound
# at d=128; ncu's launch__registers_per_thread can replace it), shared memory of
# the Q tile plus one K and one V tile in the input dtype.
def _fa2_tiling(block_m: int, block_n: int, head_dim: int, element_bytes: int) -> FusedTiling:
    shared = (block_m + 2 * block_n) * head_dim * element_bytes
    return FusedTiling(block_m, block_n, Launch(threads=128, registers_per_thread=255,
                                                shared_bytes=shared))


def sdpa_flash_splits(shape: AttentionShape, hw: CacheHardware = H200) -> int:
    """Splits PyTorch's flash backend (FA-2) picks; one-query GQA is folded first."""
    s = _check(shape)
    seqlen_q, heads = s.seqlen_q, s.query_heads
    if s.seqlen_q == 1 and s.group_size > 1 and not s.has_window:
        seqlen_q, heads = s.group_size, s.kv_heads   # FA-2's seqlenq_ngroups_swapped
    block_n = 256 if s.head_dim <= 64 else 128 if s.head_dim <= 128 else 64
    m_blocks = -(-seqlen_q // 64)
    n_blocks = -(-s.seqlen_k // block_n)
    return fa2_num_splits(s.batch * heads * m_blocks, 2 * hw.sm_count, n_blocks)


def predict_sdpa_flash(shape: AttentionShape, hw: CacheHardware = H200) -> list[PredictedKernel]:
    s = _check(shape)
    splits = sdpa_flash_splits(s, hw)
    if splits > 1:
        block_n = 256 if s.head_dim <= 64 else 128 if s.head_dim <= 128 else 64
        return predict_split_kv(s, splits, _fa2_tiling(64, block_n, s.head_dim,
                                                       s.element_bytes), hw)
    tiling = _fa2_tiling(128, 64, s.head_dim, s.element_bytes)
    return predict_fused_forward(s, tiling, hw, label="FA-2 forward (128 x 64 tiles)")


def predict_sdpa_cudnn(shape: AttentionShape, hw: CacheHardware = H200) -> list[PredictedKernel]:
    s = _check(shape)
    # one 384-thread CTA per SM (3 warpgroups), persistent over 128-row work tiles
    tiling = FusedTiling(128, 128, Launch(threads=384, registers_per_thread=168,
                                          shared_bytes=227 * 1024),
                         persistent=True, writes_lse=False)
    return predict_fused_forward(s, tiling, hw, label="cuDNN fused forward (persistent)")


def predict_attnlab(shape: AttentionShape, hw: CacheHardware = H200, *, block_m: int,
                    block_n: int, num_warps: int, num_stages: int, head_dim_padded: int,
                    launch: Launch | None = None) -> list[PredictedKernel]:
    """attnlab's Triton forward: grid (query tiles, batch x heads), O and LSE written.

    The kernel's tile configuration is passed in (the model does not import the
    kernels): :func:`attnlab.measure.compare.predict` reads it from
    ``attnlab.kernels.configs`` for the shape.
    """
    s = _check(shape)
    if launch is None:
        shared = (block_m + 2 * num_stages * block_n) * head_dim_padded * s.element_bytes
        launch = Launch(threads=32 * num_warps, registers_per_thread=255 if
                        num_warps <= 4 else 168, shared_bytes=shared)
    tiling = FusedTiling(block_m, block_n, launch)
    return predict_fused_forward(
        s, tiling, hw, label=f"attnlab forward ({block_m} x {block_n} tiles)")


KV_SCALES = ("tensor", "kv-head")


def decode_kv_bytes(shape: AttentionShape, *, kv_dtype: str | None = None,
                    kv_scales: str = "tensor") -> int:
    """The K and V bytes a GQA-packed decode reads from DRAM, each live row once: in the
    cache's dtype (``kv_dtype``, default the shape's; ``fp8`` = 1 byte), plus an fp8
    cache's fp32 descales (``kv_scales``: one K and one V factor per tensor, or per
    (batch, KV head)) -- read by every split program, but the same few bytes: from DRAM
    once."""
    s = _check(shape)
    if kv_scales not in KV_SCALES:
        raise ValueError(f"kv_scales must be one of {', '.join(KV_SCALES)}, got {kv_scales!r}")
    element = logical_traffic.kv_element_bytes(s, kv_dtype)
    kv = 2 * s.batch * s.kv_heads * _visible_kv_rows(s) * s.head_dim * element
    if kv_dtype is None or canonical_kv_dtype(kv_dtype) != "fp8":
        return kv
    factors = 1 if kv_scales == "tensor" else s.batch * s.kv_heads
    return kv + 2 * factors * STATS_BYTES


def _visible_query_rows(shape: AttentionShape) -> int:
    """Query rows of a head that see at least one key (what its dK/dV CTAs load between
    them): row r sees keys [r + lowest, r + highest] clipped to the keys, so the rows
    [-highest, seqlen_k - lowest) clipped to the queries."""
    band = shape_band(shape)
    first = 0 if band.highest is None else max(0, -band.highest)
    stop = shape.seqlen_q if band.lowest is None else min(shape.seqlen_q,
                                                          shape.seqlen_k - band.lowest)
    return max(0, stop - first)


def predict_attnlab_dq(shape: AttentionShape, hw: CacheHardware = H200, *, dq: FusedTiling,
                       lse_log2: bool = False) -> PredictedKernel:
    """attnlab's dQ launch (grid: query tiles x batch x heads, ``dq.block_m`` rows each):
    Q, dO, O and LSE of its rows read once (it forms D there), K and V streamed and shared
    by the CTAs of a KV group as in the forward (assumption 3); writes dQ, D and, where the
    Gluon dK/dV kernel follows (``lse_log2``), LSE in log2 units.  The tiling comes from
    the caller (:func:`attnlab.measure.compare.predict_backward` reads the kernels' tables)."""
    s = _check(shape)
    rows = s.batch * s.query_heads * s.seqlen_q
    act = rows * s.head_dim * s.element_bytes
    stats = rows * STATS_BYTES
    kv_per_head = 2 * _visible_kv_rows(s) * s.head_dim * s.element_bytes
    q_tiles = -(-s.seqlen_q // dq.block_m)
    resident = hw.sm_count * dq.launch.ctas_per_sm(hw)
    passes = kv_dram_passes(q_tiles * s.group_size, resident, kv_per_head, hw)
    return _kernel(
        "backward_dq", f"attnlab dQ ({dq.block_m} x {dq.block_n} tiles; forms D)",
        unshared_reads=3 * act + stats, shared_reads=s.batch * s.kv_heads * kv_per_head * passes,
        written=act + stats * (2 if lse_log2 else 1), hw=hw,
        notes=(f"K/V read from DRAM {passes}x per KV head ({q_tiles * s.group_size} CTAs "
               f"share them, {resident} resident)",
               "D" + (" and LSE (log2)" if lse_log2 else "") + " written (FP32)"))


def predict_triton_dkdv(shape: AttentionShape, hw: CacheHardware = H200, *,
                        dkdv: FusedTiling, split: bool = False) -> PredictedKernel:
    """attnlab's Triton dK/dV launch (``kernels/backward.py``; grid: key blocks x batch x
    KV heads, ``dkdv.block_n`` keys each, the group's query heads walked by one CTA): its
    K and V read once, the group's Q, dO, LSE and D rows shared by the key blocks of the
    KV head, re-read from DRAM once per wave when they do not fit; writes dK, dV once per
    KV head (no GQA reduction).  With ``split`` (``BackwardConfig.dkdv_split``) two
    programs own each key block, one forming dV (it reads Q, dO, LSE), one dK (Q, dO,
    LSE, D): the key blocks of a KV head make twice the CTAs, and the rows are counted
    once per program -- the two walk the query tiles at different speeds (2 against 3
    MMAs a tile), so the model assumes no sharing between them (Nsight Compute, d = 256
    4k causal: 255.7 MB measured, 234.1 predicted, 131.3 with one stream)."""
    s = _check(shape)
    b, d = s.element_bytes, s.head_dim
    blocks = -(-s.seqlen_k // dkdv.block_n) * (2 if split else 1)
    group_rows = s.group_size * _visible_query_rows(s)
    rows_per_kv_head = group_rows * ((2 if split else 1) * (2 * d * b + STATS_BYTES)
                                     + STATS_BYTES)
    kv = s.batch * s.kv_heads * s.seqlen_k * d * b
    resident = hw.sm_count * dkdv.launch.ctas_per_sm(hw)
    passes = kv_dram_passes(blocks, resident, rows_per_kv_head, hw)
    return _kernel(
        "backward_dkdv", f"attnlab dK/dV ({dkdv.block_n} keys x {dkdv.block_m} rows"
                         f"{'; dK and dV by separate programs' if split else ''})",
        unshared_reads=2 * kv, shared_reads=s.batch * s.kv_heads * rows_per_kv_head * passes,
        written=2 * kv, hw=hw,
        notes=(f"Q, dO, LSE, D read from DRAM {passes}x per KV head ({blocks} CTAs "
               f"share them, {resident} resident)", "dK, dV once per KV head"))


@dataclass(frozen=True)
class GluonDkdvLaunch:
    """One launch of the Gluon dK/dV kernel (``kernels/backward_sm90.py``) as the model
    takes it: the gradients it forms (both, or at a one-gradient head dim one a launch),
    the order its programs read their query tiles in, and what residency depends on.
    :func:`attnlab.measure.compare.attnlab_backward_plan` reads them from the kernels."""

    forms_dk: bool
    forms_dv: bool
    order: l2.KeyBlockOrder
    launch: Launch

    @property
    def name(self) -> str:
        return "dK/dV" if self.forms_dk and self.forms_dv else "dK" if self.forms_dk else "dV"


def predict_gluon_dkdv(shape: AttentionShape, hw: CacheHardware = H200, *,
                       launches: Sequence[GluonDkdvLaunch]) -> list[PredictedKernel]:
    """The Gluon dK/dV kernel's launches, in launch order: per launch, K (and V where it
    forms dK) read once per (batch, KV head); the group's Q, dO, LSE (and D where it forms
    dK) read as often as one LRU cache of ``hw.l2_lru_fit_bytes`` (fitted, not a fact)
    misses them with the programs in the block scheduler's order (:mod:`attnlab.model.l2`):
    programs that start together share a tile through L2, a program that starts at the
    last tile while the others are far below it reads its rows again.  Written: its
    gradient(s) once per KV head and, where ``head_split`` programs share a key block,
    each program's fp32 partial of every gradient it forms (the second of a unit to
    arrive reads the first's back: from L2, as the unit's programs run side by side)."""
    s = _check(shape)
    if hw.l2_lru_fit_bytes is None:
        fitted = [g.name for g in hardware.GPUS.values() if g.l2_lru_fit_bytes]
        raise ValueError(f"the Gluon dK/dV replay needs an L2 capacity fitted for "
                         f"{hw.name}; the GPU table has one for {', '.join(fitted)}")
    kv = s.batch * s.kv_heads * s.seqlen_k * s.head_dim * s.element_bytes  # one of K, V
    kernels = []
    for launch in launches:
        order, grads = launch.order, launch.forms_dk + launch.forms_dv
        row_bytes = 2 * s.head_dim * s.element_bytes + STATS_BYTES * (1 + launch.forms_dk)
        slots = hw.sm_count * launch.launch.ctas_per_sm(hw)
        misses = l2.lru_misses(l2.key_block_programs(s, order),
                               capacity=max(1, hw.l2_lru_fit_bytes // (order.block_m * row_bytes)),
                               slots=slots)
        rows_read = sum(count * l2.tile_rows(s, order, item) for item, count in misses.items())
        once = s.batch * s.query_heads * _visible_query_rows(s)
        units = -(-s.seqlen_k // order.block_n) * s.batch * s.kv_heads
        partials = (units * order.head_split * grads * order.block_n * s.head_dim
                    * PARTIAL_BYTES if order.head_split > 1 else 0)
        kernels.append(_kernel(
            "backward_dkdv", f"attnlab {launch.name} launch (Gluon, {order.block_n} keys x "
                             f"{order.block_m} rows)",
            unshared_reads=(1 + launch.forms_dk) * kv, shared_reads=rows_read * row_bytes,
            written=grads * kv + partials, hw=hw,
            notes=(f"Q, dO, LSE{', D' if launch.forms_dk else ''} rows read "
                   f"{rows_read / once:.2f}x each: an LRU replay of {units * order.head_split} "
                   f"programs on {slots} slots, {hw.l2_lru_fit_bytes / 1e6:.0f} MB (fitted)",
                   f"{'block-major' if order.block_major else 'head by head'}, "
                   f"{order.head_split} program(s) per key block"
                   + (", fp32 partials written" if partials else ""),
                   f"{launch.name} once per KV head")))
    return kernels


def predict_attnlab_decode(shape: AttentionShape, num_splits: int,
                           hw: CacheHardware = H200, *, kv_dtype: str | None = None,
                           kv_scales: str = "tensor", page_size: int = 0,
                           writes_lse: bool = True) -> list[PredictedKernel]:
    """attnlab's split-KV decode: the query heads of a KV group packed in one program,
    so K/V are read once per KV head; with one split the kernel writes O and LSE
    itself (no combine).  ``num_splits`` is the launcher's choice for the shape
    (:func:`attnlab.kernels.decode.launch_plan`, passed in by the caller).  ``kv_dtype``
    and ``kv_scales``: the cache's storage (:func:`decode_kv_bytes`); Q and O stay in
    the shape's dtype.  ``page_size`` (a paged cache): the same K/V rows, found through
    the block table, whose int32 entries for the live pages are read too (a split reads
    its own pages' entries; the one it reads ahead past its last tile lies in the next
    split's pages or past the sequence, masked).  ``writes_lse``: the call asked for
    the LSE (``flash_decode``'s default; ``flash_attn_with_kvcache`` writes it only
    with ``return_softmax_lse``)."""
    s = _check(shape)
    kv = decode_kv_bytes(s, kv_dtype=kv_dtype, kv_scales=kv_scales)
    if page_size:
        kv += s.batch * -(-_visible_kv_rows(s) // page_size) * TABLE_ENTRY_BYTES
    if num_splits >= 2:
        return predict_split_kv(s, num_splits, FusedTiling(s.seqlen_q, 0, Launch(128, 255, 0),
                                                           writes_lse=writes_lse),
                                hw, kv_bytes=kv)
    b = s.element_bytes
    q = s.batch * s.query_heads * s.seqlen_q * s.head_dim * b
    rows = s.batch * s.query_heads * s.seqlen_q
    return [_kernel("split_kv", "split-KV decode (1 split)", unshared_reads=0,
                    shared_reads=q + kv, written=q + (rows * STATS_BYTES if writes_lse else 0),
                    hw=hw, notes=("query heads of a KV group packed: K/V read once per KV head",))]


# The peers' kernels, predicted from the shape alone; attnlab's needs its tile
# configuration too (see predict_attnlab and attnlab.measure.compare.predict).
PREDICTORS: dict[str, Callable[..., list[PredictedKernel]]] = {
    "eager": predict_eager,
    "sdpa_flash": predict_sdpa_flash,
    "sdpa_cudnn": predict_sdpa_cudnn,
}


def predict(provider: str, shape: AttentionShape,
            hw: CacheHardware = H200) -> list[PredictedKernel]:
    """Predicted kernels of a peer provider's call, in launch order."""
    if provider not in PREDICTORS:
        raise ValueError(f"the cache model covers providers {', '.join(PREDICTORS)} (and "
                         f"attnlab through attnlab.measure.compare.predict); got {provider!r}")
    return PREDICTORS[provider](shape, hw)


# ----- the logical model, for the side-by-side table ---------------------------------------------
def logical_bytes(provider: str, shape: AttentionShape, hw: CacheHardware = H200, *,
                  attnlab_decode_splits: int | None = None,
                  kv_dtype: str | None = None) -> tuple[int, str]:
    """(read + written bytes, what was counted) of the logical, no-cache model.

    ``attnlab_decode_splits``: the split count when attnlab runs the call on its
    split-KV decode kernel (the caller knows the launcher; this module does not);
    ``kv_dtype``: that kernel's cache storage (:func:`predict_attnlab_decode`'s)."""
    traffic = logical_traffic
    s = _check(shape)
    if kv_dtype is not None and (provider != "attnlab" or attnlab_decode_splits is None):
        raise ValueError(f"the logical model takes a cache dtype for attnlab's decode kernel "
                         f"only, not {provider!r}")
    if provider == "eager":
        model = traffic.naive_traffic(s.replace(causal=False, window=(-1, -1)), kernels=4,
                                      scope="layer")
        if visible_pairs(s) < s.seqlen_q * s.seqlen_k:
            scores = s.batch * s.query_heads * s.seqlen_q * s.seqlen_k * s.element_bytes
            mask = s.group_size * s.seqlen_q * s.seqlen_k * MASK_BYTES * s.batch * s.kv_heads
            return model.total_bytes + 2 * scores + mask, \
                "naive, 4 kernels + masked_fill pass (reads S and mask, writes S)"
        return model.total_bytes, "naive, 4 kernels (scale as its own pass)"
    if provider == "sdpa_flash":
        splits = sdpa_flash_splits(s, hw)
        if splits > 1:
            block_n = 256 if s.head_dim <= 64 else 128 if s.head_dim <= 128 else 64
            tiles = s.replace(block_m=64, block_n=block_n)
            model = traffic.flash_decoding_traffic(tiles, num_splits=min(splits, tiles.kv_tiles),
                                                   pack_gqa=False, write_lse=True,
                                                   scope="layer")
            return model.total_bytes, f"Flash-Decoding, {splits} splits, no cache reuse"
        model = traffic.fused_forward_traffic(s.replace(block_m=128, block_n=64), write_lse=True,
                                              scope="layer")
        return model.total_bytes, "FA-2 forward, K/V once per query tile"
    if provider == "sdpa_cudnn":
        model = traffic.fused_forward_traffic(s.replace(block_m=128, block_n=128),
                                              write_lse=False, scope="layer")
        return model.total_bytes, "fused forward 128 x 128, K/V once per query tile"
    if provider == "attnlab" and attnlab_decode_splits is not None:
        tiles = s.replace(block_m=64, block_n=128)  # one packed row block per KV head
        cache = ", fp8 cache" if traffic.is_fp8_cache(kv_dtype) else ""
        if attnlab_decode_splits == 1:
            model = traffic.fused_forward_traffic(tiles, write_lse=True, scope="layer",
                                                  pack_gqa=True, kv_dtype=kv_dtype)
            return model.total_bytes, f"split-KV decode, 1 split, query heads packed{cache}"
        model = traffic.flash_decoding_traffic(tiles, num_splits=attnlab_decode_splits,
                                               pack_gqa=True, write_lse=True, scope="layer",
                                               kv_dtype=kv_dtype)
        return model.total_bytes, (f"Flash-Decoding, {attnlab_decode_splits} splits, query "
                                   f"heads packed, no cache reuse{cache}")
    if provider == "attnlab":
        model = traffic.fused_forward_traffic(s, write_lse=True, scope="layer")
        return model.total_bytes, "fused forward, K/V once per query tile"
    raise ValueError(f"no logical model mapped for provider {provider!r}")
