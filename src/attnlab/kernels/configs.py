"""Tile configurations for the forward kernel.

The GPU table is the output of ``bench/tune_forward.py`` on the H200: each
(head_dim, masked, length bucket) entry is the fastest configuration measured
there (bench/results/forward_tuning.jsonl).  Tuning happens offline on the GPU,
keyed on length buckets, never in CI; at run time a lookup costs nothing and the
first call only pays one compile.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.shapes import AttentionShape


@dataclass(frozen=True)
class ForwardConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


# The interpreter's cost is per block operation, so moderate tiles are fastest
# on the CPU, and small enough that test shapes still span several tiles.
INTERPRETER_CONFIG = ForwardConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)


# The length bands the tuning tables are keyed on.
LENGTH_BUCKETS = (1024, 2048, 4096, 8192, 16384)


def length_bucket(seqlen: int) -> int:
    """Length bands the tuning table is keyed on: next power of two, 1k..16k clamp."""
    bucket = 1024
    while bucket < seqlen and bucket < 16384:
        bucket *= 2
    return bucket


# (head_dim_pad, masked) -> config where no tuned bucket applies: the 4k winners for
# d=64/128/256; d<=32 keep Triton's Hopper tutorial's shape (not tuned yet).
_BASE: dict[tuple[int, bool], ForwardConfig] = {
    (16, False): ForwardConfig(128, 64, 4, 3),
    (32, False): ForwardConfig(128, 64, 4, 3),
    (64, False): ForwardConfig(128, 64, 8, 3),
    (128, False): ForwardConfig(128, 128, 8, 3),
    (256, False): ForwardConfig(128, 64, 8, 2),
    (16, True): ForwardConfig(128, 64, 4, 3),
    (32, True): ForwardConfig(128, 64, 4, 3),
    (64, True): ForwardConfig(128, 64, 8, 3),
    (128, True): ForwardConfig(128, 64, 8, 3),
    (256, True): ForwardConfig(128, 64, 8, 2),
}

# (head_dim_pad, masked, length_bucket) -> the fastest accurate config measured on the
# H200 (bf16; bench/results/runs/2026-11-29-run2/forward_tuning.jsonl, commit 424a369).
# Buckets the run did not cover fall back to _BASE.
TUNED: dict[tuple[int, bool, int], ForwardConfig] = {
    (64, False, 1024): ForwardConfig(128, 64, 8, 3),
    (64, False, 2048): ForwardConfig(128, 64, 8, 3),
    (64, False, 4096): ForwardConfig(128, 64, 8, 4),
    (64, False, 8192): ForwardConfig(128, 64, 8, 3),
    (64, False, 16384): ForwardConfig(128, 64, 8, 4),
    (64, True, 1024): ForwardConfig(64, 64, 4, 3),
    (64, True, 2048): ForwardConfig(128, 64, 8, 3),
    (64, True, 4096): ForwardConfig(128, 64, 8, 3),
    (64, True, 8192): ForwardConfig(128, 64, 8, 3),
    (64, True, 16384): ForwardConfig(128, 64, 8, 3),
    (128, False, 1024): ForwardConfig(128, 64, 8, 3),
    (128, False, 2048): ForwardConfig(128, 128, 8, 3),
    (128, False, 4096): ForwardConfig(128, 128, 8, 3),
    (128, False, 8192): ForwardConfig(128, 128, 8, 3),
    (128, False, 16384): ForwardConfig(128, 128, 8, 3),
    (128, True, 1024): ForwardConfig(64, 64, 4, 3),
    (128, True, 2048): ForwardConfig(128, 64, 8, 3),
    (128, True, 4096): ForwardConfig(128, 64, 8, 3),
    (128, True, 8192): ForwardConfig(128, 128, 8, 3),
    (128, True, 16384): ForwardConfig(128, 128, 8, 3),
    (256, True, 1024): ForwardConfig(128, 64, 8, 2),
    (256, True, 4096): ForwardConfig(128, 64, 8, 2),
    (256, True, 16384): ForwardConfig(128, 64, 8, 2),
}


def head_dim_padded(head_dim: int) -> int:
    """The kernel's register tile width along d: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


# The FP8 forward (float8_e4m3fn q, k, v): an fp8 tile is half a bf16 one's bytes, so the
# masked d = 128 case takes 128-key steps too.  Not tuned on the H200 yet
# (bench/fp8_h200.py --phases tune times alternatives).
_FP8_BASE: dict[tuple[int, bool], ForwardConfig] = {
    **{key: config for key, config in _BASE.items() if key[0] <= 64},
    (128, False): ForwardConfig(128, 128, 8, 3),
    (128, True): ForwardConfig(128, 128, 8, 3),
    (256, False): ForwardConfig(128, 64, 8, 2),
    (256, True): ForwardConfig(128, 64, 8, 2),
}


def fp8_forward_config(head_dim: int, masked: bool, *, interpreted: bool = False) -> ForwardConfig:
    """The FP8 forward's tiling for one head dim (and whether a mask cuts tiles)."""
    if interpreted:
        return INTERPRETER_CONFIG
    return _FP8_BASE[(head_dim_padded(head_dim), masked)]


def forward_config(shape: AttentionShape, *, interpreted: bool = False) -> ForwardConfig:
    """The tiling for one call: tuned per (padded head dim, masked or not, length bucket)."""
    if interpreted:
        return INTERPRETER_CONFIG
    return _forward_entry(head_dim_padded(shape.head_dim), shape.causal or shape.has_window,
                          length_bucket(max(shape.seqlen_q, shape.seqlen_k)))


def _forward_entry(head_dim_pad: int, masked: bool, bucket: int) -> ForwardConfig:
    return TUNED.get((head_dim_pad, masked, bucket), _BASE[head_dim_pad, masked])


def forward_choices(head_dim: int, masked: bool) -> tuple[ForwardConfig, ...]:
    """Every config :func:`forward_config` can give a call at this head dim, masked or not
    (over all lengths): what must build on every supported Triton (bench/ptxas_configs.py)."""
    return tuple(dict.fromkeys(_forward_entry(head_dim_padded(head_dim), masked, bucket)
                               for bucket in LENGTH_BUCKETS))


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of the two backward kernels.

    dK/dV kernel: one program owns ``dkdv_block_n`` keys and streams query tiles of
    ``dkdv_block_m`` rows past them; dQ kernel: one program owns ``dq_block_m`` query
    rows and streams key tiles of ``dq_block_n`` (and forms D for those rows).

    ``dkdv_split``: two dK/dV programs per key block, one forming dV (S, P^T dO), one
    dK (S, dP, dS^T Q), each holding one fp32 accumulator, not two.  Five MMAs per tile
    pair instead of four, but at head_dim 256 a 128-key block then fits the registers:
    the unsplit 64-key block spills there and its S and dP MMAs, 64 rows over two
    warpgroups, run twice (bench/NOTES.md B19, bench/backward_d256_tiles.py).
    """

    dkdv_block_m: int
    dkdv_block_n: int
    dq_block_m: int
    dq_block_n: int
    num_warps: int
    num_stages: int
    dkdv_split: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dkdv_split, bool):
            raise TypeError(f"dkdv_split must be a bool, got {self.dkdv_split!r}")
        for name in ("dkdv_block_m", "dkdv_block_n", "dq_block_m", "dq_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


# Small tiles keep the interpreter's per-op cost low and make test shapes span
# several tiles in both directions (B_c > B_r in the dK/dV kernel, B_r > B_c in dQ).
INTERPRETER_BACKWARD_CONFIG = BackwardConfig(32, 64, 64, 32, num_warps=4, num_stages=1)

# (head_dim_pad, masked) -> untuned H200 starting points (the Triton tutorial's and FA3's
# shapes: K/V-stationary 128 keys against 64-row query tiles at d <= 128; at d = 256 the
# fp32 dK and dV accumulators alone take 2 * 64 * 256 * 4 B = 128 KiB, so the owned
# key block halves).  bench/backward_h200.py's sweep replaces these with measured winners.
# Head dims 8-32 take one stage: with two, Triton 3.6.0's ptxas dies (SIGSEGV) building
# the dQ kernel for 11 of the 32 dtype x causal x softcap x varlen variants at d = 16/32
# (other tiles fail elsewhere); with one, all 32 build (bench/ptxas_configs.py, NOTES B15).
_BACKWARD_BASE: dict[tuple[int, bool], BackwardConfig] = {
    (16, False): BackwardConfig(64, 128, 128, 64, 8, 1),
    (32, False): BackwardConfig(64, 128, 128, 64, 8, 1),
    (64, False): BackwardConfig(64, 128, 128, 64, 8, 2),
    (128, False): BackwardConfig(64, 128, 128, 64, 8, 2),
    (256, False): BackwardConfig(64, 64, 64, 64, 8, 1),
    (16, True): BackwardConfig(64, 128, 128, 64, 8, 1),
    (32, True): BackwardConfig(64, 128, 128, 64, 8, 1),
    (64, True): BackwardConfig(64, 128, 128, 64, 8, 2),
    (128, True): BackwardConfig(64, 128, 128, 64, 8, 2),
    (256, True): BackwardConfig(64, 64, 64, 64, 8, 1),
}

# (head_dim_pad, masked, length_bucket) -> the fastest accurate config measured on the
# H200, as bench/backward_h200.py printed them (bf16, backward alone): run 2 of
# 2026-12-01 (bench/results/runs/2026-12-01-run2/backward_tuning.jsonl) found 3 stages
# instead of 2 (d = 128: 306 TFLOP/s causal, 394 full) and, at d = 64 causal, half the
# dK/dV rows with 4 warps (290); the second session's run 2
# (bench/results/runs/2026-12-01-s2-run2/backward_tuning.jsonl) the same for d = 64
# without a mask (375 against the base tiles' 258); session 10's run 2
# (bench/results/runs/2026-12-02-s10-run2/bwd/backward_tuning.jsonl, the GQA layer 24q/4kv
# at 4k) half the owned keys with 4 warps and 2 stages at d = 256 (161 TFLOP/s causal
# against the base tiles' 143, 188 unmasked against 127), and its run 4 (the compile
# sweep's candidates, bench/backward_d256_tiles.py) 32-row query tiles over 64 keys with
# 8 warps and 3 stages, dQ 128 x 32 (spill-free wgmma): 193 causal, 224 unmasked; session
# 12's run 1 (bench/results/runs/2026-12-02-s12-run1/bwdtune/backward_tuning.jsonl) the
# split dK/dV programs over 128 keys: 32 query rows at 2 stages causal (237 against 193),
# 16 rows at 3 stages unmasked (258 against 222, the same run's unsplit 32 x 64).
# Other buckets take the nearest one.
BACKWARD_TUNED: dict[tuple[int, bool, int], BackwardConfig] = {
    (64, False, 4096): BackwardConfig(32, 128, 128, 64, 4, 3),
    (64, True, 4096): BackwardConfig(32, 128, 64, 64, 4, 3),
    (128, False, 4096): BackwardConfig(64, 128, 128, 64, 8, 3),
    (128, True, 4096): BackwardConfig(64, 128, 128, 64, 8, 3),
    (256, False, 4096): BackwardConfig(16, 128, 128, 32, 8, 3, dkdv_split=True),
    (256, True, 4096): BackwardConfig(32, 128, 128, 32, 8, 2, dkdv_split=True),
}


def backward_config(shape: AttentionShape, *, interpreted: bool = False) -> BackwardConfig:
    """The backward tiling for one call, keyed like :func:`forward_config`."""
    if interpreted:
        return INTERPRETER_BACKWARD_CONFIG
    return _backward_entry(head_dim_padded(shape.head_dim), shape.causal or shape.has_window,
                           length_bucket(max(shape.seqlen_q, shape.seqlen_k)))


def _backward_entry(head_dim_pad: int, masked: bool, bucket: int) -> BackwardConfig:
    # A bucket the sweep did not measure takes the nearest measured bucket of the same
    # (head dim, masked) before the untuned base: a measured tile beats a guess.
    measured = [b for (d, m, b) in BACKWARD_TUNED if (d, m) == (head_dim_pad, masked)]
    if not measured:
        return _BACKWARD_BASE[head_dim_pad, masked]
    nearest = min(measured, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
    return BACKWARD_TUNED[head_dim_pad, masked, nearest]


def backward_choices(head_dim: int, masked: bool) -> tuple[BackwardConfig, ...]:
    """Every config :func:`backward_config` can give a call at this head dim, masked or
    not (over all lengths), as :func:`forward_choices`."""
    return tuple(dict.fromkeys(_backward_entry(head_dim_padded(head_dim), masked, bucket)
                               for bucket in LENGTH_BUCKETS))


# ----- what ptxas cannot build --------------------------------------------------------------
# (kernel, head_dim_pad, config) -> where ptxas failed to build it for sm_90a (compiled on
# the CPU by bench/ptxas_configs.py; the builds are in bench/results/ptxas/).  No table
# above may choose one (tests/test_ptxas_configs.py).  Kernels: "triton-forward",
# "triton-dkdv", "triton-dq".
PTXAS_FAILURES: dict[tuple[str, int, ForwardConfig | BackwardConfig], str] = {
    ("triton-dq", 16, BackwardConfig(64, 128, 128, 64, 8, 2)):
        "Triton 3.6.0: ptxas SIGSEGV, e.g. d=16 causal bf16 and d=16 softcap (NOTES B15)",
    ("triton-dq", 32, BackwardConfig(64, 128, 128, 64, 8, 2)):
        "Triton 3.6.0: ptxas SIGSEGV, e.g. d=32 causal bf16 and d=32 fp16 softcap varlen "
        "(NOTES B15)",
}


# ----- decode (split-KV) ---------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the split-KV decode kernel.

    ``block_n`` keys per loop step; ``ctas_per_sm`` is how many split programs of this
    tiling one SM holds at once (shared memory bound: num_stages K+V tiles of
    block_n x d), which is what the split-count heuristic fills.

    A paged cache's tiles start at multiples of block_n: a tile inside one page is
    addressed from one scalar base exactly like a contiguous tile, and a tile spanning
    pages reads its block_n / page_size table entries once and broadcasts them over
    page-local offsets (addressing every key from its own entry, the first form, ran
    1.20-1.33x contiguous's time at page 16; this one 1.04-1.10x: session 12 run 1,
    bench/NOTES.md S13).
    """

    block_n: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.ctas_per_sm < 1:
            raise ValueError(f"ctas_per_sm must be >= 1, got {self.ctas_per_sm}")


# Small key tiles on the CPU, so test caches of a few hundred keys span several tiles
# and many splits.
INTERPRETER_DECODE_CONFIG = DecodeConfig(block_n=32, num_warps=4, num_stages=1, ctas_per_sm=2)

# head_dim_pad -> config.  d = 128 is tuned on the H200 (bench/decode_h200.py --tune,
# run 3 under CUDA-graph replay, 32 q / 8 kv heads, bf16; bench/results/decode_tuning.jsonl):
# 128-key steps with 3 stages hold 3 x 2 x 128 x 128 x 2 B = 192 KiB of K/V per program,
# one program per SM, and ~15 splits at batch 1 (FA3's count) beat the 29 that two
# 64-key programs per SM asked for: 50.9 vs 52.8 us at 1 x 32k, 139 vs 146 us at 1 x 128k;
# at 16 x 32k one split reads 4.38 TB/s.  The other head dims are not tuned yet.
_DECODE_BASE: dict[int, DecodeConfig] = {
    16: DecodeConfig(64, 4, 3, 4),
    32: DecodeConfig(64, 4, 3, 4),
    64: DecodeConfig(64, 4, 3, 3),
    128: DecodeConfig(128, 4, 3, 1),
    256: DecodeConfig(32, 4, 3, 2),
}


# An fp8 (e4m3) cache (fp16 MMAs over converted tiles, kernels/decode.py): the kernel is
# bound by its instruction latency more than by bytes, so it wants two resident programs
# per SM (ctas_per_sm = 2 doubles the splits that fill them).  Tuned on the H200 (s10 run
# 1, bench/fp8_h200.py --phases tune, graph replay, bench/results/fp8_tuning.jsonl):
# d = 128, 128-key steps with two programs per SM: 309.6 us at 16 x 32k against 398.1
# with one (the bf16 tiling), 41.6 vs 44.9 at 1 x 32k; d = 256, 64-key steps with two:
# 303.3 vs 395.5 at 16 x 32k (1 x 32k: 43.0-44.6 for every candidate).
_DECODE_FP8: dict[int, DecodeConfig] = {**_DECODE_BASE, 128: DecodeConfig(128, 4, 3, 2),
                                        256: DecodeConfig(64, 4, 3, 2)}


def decode_config(head_dim: int, *, interpreted: bool = False,
                  fp8_cache: bool = False) -> DecodeConfig:
    """The decode kernel's tiling for one head dim (and cache dtype)."""
    if interpreted:
        return INTERPRETER_DECODE_CONFIG
    return (_DECODE_FP8 if fp8_cache else _DECODE_BASE)[head_dim_padded(head_dim)]
