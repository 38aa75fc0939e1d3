"""Which kernel runs a call: the one module that decides, for every launcher.

Four choices, each taken from a committed measurement or closed-form arithmetic, never
from a guess:

* **the decode route** (:func:`routes_to_decode`, asked by ``api.dense``): a short query
  against long keys, with no gradient wanted, runs the split-KV decode kernel
  (``kernels/decode.py``) instead of the forward;
* **the forward** (:func:`forward_config`, asked by ``kernels.forward``): the Gluon sm_90
  kernel where ``sm90_dispatch.json`` says it measured faster, else the Triton kernel;
  for FP8 inputs (:func:`fp8_forward_config`) likewise by ``sm90_fp8_dispatch.json``;
* **the backward's dK/dV and dQ** (:func:`dkdv_config`, :func:`dq_config`, asked by
  ``kernels.backward``): the Gluon sm_90 dK/dV (dQ) kernel where
  ``sm90_backward_dispatch.json`` (``sm90_dq_dispatch.json``) says so, else the Triton one;
* **the decode kernel's split count** (:func:`choose_num_splits`, asked by
  ``kernels.decode`` per call): from host-known sizes only (the batch, heads and the
  longest possible key count: ``max_seqlen_k``, an int ``cache_seqlens`` or the cache's
  capacity), never from an index tensor's values, and memoised per size.

Each Gluon kernel is one :class:`GluonKernel`: its module (imported only where
``kernels/_compat.py`` recognises this Triton's Gluon), its table and its config type; a
table is read once, for the installed Triton (``_sm90.dispatch_entries``).  A traced call
(torch.compile decomposing the custom ops for Inductor) keeps the Triton kernels: the
Gluon kernels build TMA descriptors from ``data_ptr()``, which fake tensors lack.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import importlib
import math
from dataclasses import dataclass

import torch

from attnlab.inputs import layout_named
from attnlab.kernels._compat import gluon_refusal
from attnlab.kernels._primitives import launch_is_traced
from attnlab.kernels.configs import length_bucket

# Decode route: the prefill kernel tiles 64-128 query rows per program, one program per
# head, so with a few query rows against many keys it runs one mostly padded row block
# per head and leaves SMs idle; the split-KV kernel packs a KV group's heads and splits
# the keys.
DECODE_MAX_SEQLEN_Q = 64
DECODE_MIN_SEQLEN_K = 256


def routes_to_decode(*, seqlen_q: int, seqlen_k: int, needs_grad: bool) -> bool:
    """Whether a dense call runs the split-KV decode kernel: ``seqlen_q`` at most
    :data:`DECODE_MAX_SEQLEN_Q` against at least :data:`DECODE_MIN_SEQLEN_K` (and four
    times ``seqlen_q``) keys.  Never when a gradient is needed (that kernel has no
    backward)."""
    return (not needs_grad and seqlen_q <= DECODE_MAX_SEQLEN_Q
            and seqlen_k >= max(DECODE_MIN_SEQLEN_K, 4 * seqlen_q))


@dataclass(frozen=True)
class GluonKernel:
    """One Gluon sm_90 kernel as the dispatcher sees it: where it lives (its ``supports``,
    ``plan_launch``, ``DEFAULT_CONFIGS``), the table of buckets it won, its config type."""

    module: str
    table_file: str
    config_type: str

    def kernel_module(self):
        return importlib.import_module(self.module)

    def table(self) -> dict:
        """(head_dim, causal, length bucket) -> config, where it measured faster."""
        if self not in _TABLES:
            from attnlab.kernels._sm90 import dispatch_entries

            config = getattr(self.kernel_module(), self.config_type)
            _TABLES[self] = {(e["head_dim"], e["causal"], e["bucket"]): config(**e["config"])
                             for e in dispatch_entries(self.table_file)}
        return _TABLES[self]

    def bucket_config(self, q, k, *, layout: str, causal: bool):
        """The table's config for this call's (head_dim, causal, length) bucket, or None."""
        lay = layout_named(layout)
        bucket = length_bucket(max(lay.seqlen(q), lay.seqlen(k)))
        return self.table().get((q.shape[-1], causal, bucket))


FORWARD_SM90 = GluonKernel("attnlab.kernels.forward_sm90", "sm90_dispatch.json", "Sm90Config")
FORWARD_FP8_SM90 = GluonKernel("attnlab.kernels.forward_sm90", "sm90_fp8_dispatch.json",
                               "Sm90Config")
DKDV_SM90 = GluonKernel("attnlab.kernels.backward_sm90", "sm90_backward_dispatch.json",
                        "Sm90BackwardConfig")
DQ_SM90 = GluonKernel("attnlab.kernels.dq_sm90", "sm90_dq_dispatch.json", "Sm90DqConfig")
# Read once per process; table_override() swaps one in for a measurement.
_TABLES: dict[GluonKernel, dict] = {}


@contextlib.contextmanager
def table_override(kernel: GluonKernel, table: dict):
    """Dispatch by ``table`` instead of the committed one inside the block (the benches
    that time a candidate table); plans built inside keep their choice."""
    saved = kernel.table()
    _TABLES[kernel] = table
    try:
        yield
    finally:
        _TABLES[kernel] = saved


def _gluon_usable(q) -> bool:
    return q.is_cuda and not launch_is_traced(q) and gluon_refusal() is None


def forward_config(q, k, v, *, layout: str, causal: bool, window, softcap: float):
    """The Gluon sm_90 forward's config for this call, or None: the Triton kernel runs it.

    Only buckets measured on the H200 are in the table; tensors past 2^31 elements are
    fine (TMA's descriptors and the O/LSE offsets are 64-bit: ``bench/sanitize_h200.py
    --phases big``)."""
    if layout_named(layout).is_varlen or not _gluon_usable(q):
        return None
    config = FORWARD_SM90.bucket_config(q, k, layout=layout, causal=causal)
    supports = FORWARD_SM90.kernel_module().supports
    if config is None or not supports(q, k, v, causal, window, softcap, config)[0]:
        return None
    return config


def fp8_forward_config(q, k, v, *, causal: bool, window, softcap: float):
    """The Gluon sm_90 kernel's config for an FP8 forward (e4m3 q, k, v; ``bshd``), or
    None: the Triton kernel runs it.  Only where ``sm90_fp8_dispatch.json`` has a bucket
    the kernel measured faster in (bench/fp8_h200.py --phases sm90, NOTES S22)."""
    if not _gluon_usable(q):
        return None
    config = FORWARD_FP8_SM90.bucket_config(q, k, layout="bshd", causal=causal)
    supports = FORWARD_FP8_SM90.kernel_module().supports_fp8
    if config is None or not supports(q, k, v, window=window, softcap=softcap,
                                      config=config)[0]:
        return None
    return config


def dkdv_config(q, k, v, dout, *, layout: str, causal: bool, window, softcap: float,
                requested=None, use_table: bool = True):
    """(the Gluon dK/dV kernel's config, whether dO must be copied for it, the dO it
    reads) when that kernel computes this call's dK, dV, else None: the Triton kernel does.

    ``requested`` (an ``Sm90BackwardConfig``) forces it, and a call it cannot compute is
    then a ValueError naming why; otherwise (``use_table``) the committed table decides."""
    return _backward_gluon_config(DKDV_SM90, "dkdv_sm90", q, k, v, dout, layout=layout,
                                  causal=causal, window=window, softcap=softcap,
                                  requested=requested, use_table=use_table)


def dq_config(q, k, v, dout, *, layout: str, causal: bool, window, softcap: float,
              requested=None, use_table: bool = True):
    """:func:`dkdv_config` for the Gluon dQ kernel (``kernels/dq_sm90.py``, its table
    ``sm90_dq_dispatch.json``; ``requested``: an ``Sm90DqConfig``)."""
    return _backward_gluon_config(DQ_SM90, "dq_sm90", q, k, v, dout, layout=layout,
                                  causal=causal, window=window, softcap=softcap,
                                  requested=requested, use_table=use_table)


def _backward_gluon_config(kernel: GluonKernel, argument: str, q, k, v, dout, *,
                           layout: str, causal: bool, window, softcap: float, requested,
                           use_table: bool):
    if requested is None and not use_table:
        return None
    if layout_named(layout).is_varlen or not _gluon_usable(q):
        if requested is not None:
            raise ValueError(f"{argument}={requested} needs a CUDA call outside torch.compile, "
                             f"layout 'bshd' or 'bhsd' and a Triton whose Gluon attnlab "
                             f"knows ({gluon_refusal() or 'this one is'})")
        return None
    from attnlab.kernels._sm90 import tma_aligned

    config = requested or kernel.bucket_config(q, k, layout=layout, causal=causal)
    if config is None:
        return None
    # An expanded dO (out.sum().backward() gives stride 0) is no TMA operand: one copy.
    copy_dout = not tma_aligned(dout)
    kernel_dout = dout.contiguous() if copy_dout else dout
    ok, reason = kernel.kernel_module().supports(q, k, v, kernel_dout, layout=layout,
                                                 window=window, softcap=softcap, config=config)
    if not ok:
        if requested is not None:
            raise ValueError(f"{argument}={config.name()} cannot compute this call: {reason}")
        return None
    return config, copy_dout, kernel_dout


# ---------------------------------------------------------------------------
# The decode kernel's split count (kernels/decode.py asks per call; the answer is a
# function of host-known sizes only, kept per size: no call reads a tensor's values).
# ---------------------------------------------------------------------------

MAX_SPLITS = 128
# A split shorter than this many keys costs more in per-program start-up, partial
# traffic and combine than its parallelism returns (FlashInfer's floor is a 128-token
# chunk).  Measured on the H200 at batch 1 (s10 run 2, decode_h200 --phases short_splits,
# bench/results/runs/2026-12-02-s10-run2/short/): d = 256's 32-key tiles at 4k / 8k keys ran
# 22.0 / 27.5 us with 64 splits of 64 keys and 18.9-19.2 / 24.7 with 16-32 splits
# (128-256 keys); d = 128's 128-key tiles are best at 256-512 keys a split.
MIN_KEYS_PER_SPLIT = 256
WAVE_EFFICIENCY_FRACTION = 0.85
# Nominal SM count where no GPU is visible (the CPU interpreter): the H200's.
NOMINAL_SM_COUNT = 132


def wave_efficiency(blocks: int, slots: int) -> float:
    """Busy fraction of ``slots`` concurrent program slots over the waves ``blocks`` need."""
    return blocks / (slots * math.ceil(blocks / slots))


@functools.lru_cache(maxsize=4096)
def choose_num_splits(*, batch: int, kv_heads: int, row_blocks: int, kv_tiles: int,
                      sm_count: int, ctas_per_sm: int, block_n: int) -> int:
    """Split count for one launch: enough programs to fill the GPU's program slots.

    ``kv_tiles`` is the longest sequence's key tiles (an upper bound is fine: every
    sequence divides its own tiles).  The arithmetic, with ``base = batch x kv_heads x
    row_blocks`` unsplit programs and ``slots = sm_count x ctas_per_sm`` programs the
    GPU holds at once (1 per SM at d = 128: 192 KiB of K/V stages each):

    1. a split is worth it only if every split keeps >= MIN_KEYS_PER_SPLIT keys (tiles of
       ``block_n``), so candidates run 1 .. min(128, kv_tiles // min_tiles), and only counts the reference's
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
    min_tiles = max(1, -(-MIN_KEYS_PER_SPLIT // block_n))
    most = max(1, min(MAX_SPLITS, kv_tiles // min_tiles))
    if base >= slots or most == 1:
        return 1
    candidates = sorted({math.ceil(kv_tiles / math.ceil(kv_tiles / s)) for s in range(1, most + 1)})
    efficiencies = {s: wave_efficiency(base * s, slots) for s in candidates}
    best = max(efficiencies.values())
    return next(s for s in candidates if efficiencies[s] >= WAVE_EFFICIENCY_FRACTION * best)


@functools.lru_cache(maxsize=64)
def sm_count(device) -> int:
    """The device's SM count (read once per device), or :data:`NOMINAL_SM_COUNT` off a GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SM_COUNT


# ---------------------------------------------------------------------------
# The backward's launch order (kernels/backward.py asks once per plan): which programs
# the block scheduler starts first, and whether a key block's query heads are shared
# between two programs.  Closed-form arithmetic on host-known sizes.
# ---------------------------------------------------------------------------

# A program's fixed work (its own block's load, its epilogue), and the merge's of a
# key block split between two programs (a fp32 partial stored, the other's read back),
# in units of one tile's work.
PROGRAM_OVERHEAD_TILES = 1.0
MERGE_OVERHEAD_TILES = 1.0
# Block-major order spreads a wave over every head's rows (less reuse in L2) and a split
# adds a merge: each is taken only where it shortens the launch by at least this much.
SCHEDULE_GAIN_FRACTION = 0.05
# With this many programs per slot the default order is already within a few percent.
SCHEDULE_MAX_WAVES = 8


def greedy_makespan(works, slots: int) -> float:
    """When the last of ``works`` (per program, in launch order) ends if the GPU starts
    each on the first of ``slots`` program slots to free up, as its block scheduler does."""
    free = [0.0] * min(slots, len(works))
    for work in works:
        heapq.heapreplace(free, free[0] + work)
    return max(free, default=0.0)


@dataclass(frozen=True)
class BackwardSchedule:
    """How a backward launch orders its programs.  ``block_major``: block by block, each
    block's (batch, head) programs together, the heaviest block first (the longest
    programs start first, so the short ones fill the tail); else head by head, as
    consecutive programs share the most rows through L2.  ``head_split``: programs per
    (key block, KV head), each taking ``group_size / head_split`` of its query heads
    (2: the two merge their partial dK, dV: one addition, the same bits either way)."""

    block_major: bool = False
    head_split: int = 1


def _pick(candidates: dict) -> BackwardSchedule:
    """The first candidate (the simplest: dict order) within SCHEDULE_GAIN_FRACTION of
    the shortest makespan."""
    best = min(candidates.values())
    return next(s for s, span in candidates.items() if span <= best / (1 - SCHEDULE_GAIN_FRACTION))


@functools.lru_cache(maxsize=1024)
def dkdv_schedule(*, batch: int, kv_heads: int, group_size: int, seqlen_q: int, seqlen_k: int,
                  causal: bool, block_m: int, block_n: int, sm_count: int) -> BackwardSchedule:
    """The Gluon dK/dV kernel's schedule: one program per (key block, batch, KV head), or
    two sharing its query heads, one program per SM.  A program's work is its query tiles
    times its query heads: causally (bottom-right) key block j sees the tiles from
    ``max(j*block_n - (seqlen_k - seqlen_q), 0)`` on, so the first blocks are the longest.
    Example, the seed's layer (24q/4kv, d = 256, 4k, 32-row tiles, 132 SMs): 128 programs
    of 4 to 129 tiles x 6 heads, the longest ~2x the average: split in two (256 programs,
    block-major) the launch's makespan is 0.52x; at 16k and beyond the default is within
    2%."""
    blocks = -(-seqlen_k // block_n)
    units = batch * kv_heads
    if not causal or units * blocks >= SCHEDULE_MAX_WAVES * sm_count:
        return BackwardSchedule()
    diag = seqlen_k - seqlen_q
    tiles = []
    for j in range(blocks):
        first = max(j * block_n - diag, 0) // block_m * block_m
        tiles.append(max(0, -(-(seqlen_q - first) // block_m)))
    candidates = {}
    for split in (1, 2) if group_size % 2 == 0 else (1,):
        heads = group_size // split
        extra = PROGRAM_OVERHEAD_TILES + (MERGE_OVERHEAD_TILES if split > 1 else 0.0)
        work = [t * heads + extra for t in tiles]
        head_major = [w for _ in range(units) for w in work for _ in range(split)]
        block_major = [w for w in work for _ in range(units * split)]
        candidates[BackwardSchedule(False, split)] = greedy_makespan(head_major, sm_count)
        candidates[BackwardSchedule(True, split)] = greedy_makespan(block_major, sm_count)
    return _pick(candidates)


@functools.lru_cache(maxsize=1024)
def dq_block_major(*, batch: int, heads: int, seqlen_q: int, seqlen_k: int, causal: bool,
                   block_m: int, block_n: int, sm_count: int) -> bool:
    """Whether the dQ kernel runs block-major (:class:`BackwardSchedule`): causally its
    last query blocks see the most keys (``REVERSE_M`` starts them first within a head);
    with few programs per SM, head by head leaves the other heads' long blocks for the
    tail.  The seed's layer at 4k (768 programs of 1 to 32 key tiles at 132 SMs): 0.85x
    the makespan block-major."""
    blocks = -(-seqlen_q // block_m)
    units = batch * heads
    if not causal or units * blocks >= SCHEDULE_MAX_WAVES * sm_count:
        return False
    diag = seqlen_k - seqlen_q
    # Rows [m, m + block_m) see keys [0, m + block_m + diag), the last block first.
    work = [max(0, -(-min(seqlen_k, m * block_m + block_m + diag) // block_n))
            + PROGRAM_OVERHEAD_TILES for m in reversed(range(blocks))]
    candidates = {BackwardSchedule(False): greedy_makespan([w for _ in range(units) for w in work],
                                                           sm_count),
                  BackwardSchedule(True): greedy_makespan([w for w in work for _ in range(units)],
                                                          sm_count)}
    return _pick(candidates).block_major
