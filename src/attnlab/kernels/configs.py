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


def forward_config(shape: AttentionShape, *, interpreted: bool = False) -> ForwardConfig:
    """The tiling for one call: tuned per (padded head dim, masked or not, length bucket)."""
    if interpreted:
        return INTERPRETER_CONFIG
    key = (head_dim_padded(shape.head_dim), shape.causal or shape.has_window)
    bucket = length_bucket(max(shape.seqlen_q, shape.seqlen_k))
    return TUNED.get((*key, bucket), _BASE[key])
