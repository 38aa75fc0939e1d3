"""Memory footprints of attention, each under a named scope and lifetime.

The same 64 MiB of S + P per head becomes 2 GiB or 64 GiB depending on which
lifetime you mean, so every number here comes with its scope and assumption:

- per head: S and P of one (sequence, query head), what the naive path allocates;
- one layer's transient peak: all heads of the active layer live at once;
- training retention: every attention layer's S and P kept for backward;
- softmax statistics: the running m and l of a whole head, the live state of one
  CTA, and the exported logsumexp (the only one a fused kernel writes to HBM).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from attnlab.checks import check_int
from attnlab.shapes import AttentionShape, check_shape, dtype_bytes

# Running max and sum, accumulator and LSE: FP32 in the shipped kernels.
STATS_DTYPE = "fp32"


def _score_bytes(shape: AttentionShape, score_dtype: str | None) -> int:
    return shape.element_bytes if score_dtype is None else dtype_bytes(score_dtype)


def _positive_int(value: object, name: str) -> int:
    return check_int(name, value, minimum=1)


def score_matrix_bytes(shape: AttentionShape, score_dtype: str | None = None) -> int:
    """S of one layer, materialised in full: batch x query heads x N_q x N_k elements.

    Full even when causal: a naive kernel allocates the whole matrix.  The post's
    Qwen-style layer (24 heads, FP32 scores): 384 MiB at 2,048 tokens, 6 GiB at 8,192.
    """
    check_shape(shape)
    return (shape.batch * shape.query_heads * shape.seqlen_q * shape.seqlen_k
            * _score_bytes(shape, score_dtype))


def score_tile_bytes(block_m: int, block_n: int, score_dtype: str) -> int:
    """One on-chip score tile: 128 x 64 FP16 = 16 KiB; 64 x 128 FP32 = 32 KiB."""
    return (_positive_int(block_m, "block_m") * _positive_int(block_n, "block_n")
            * dtype_bytes(score_dtype))


def scores_and_probs_per_head_bytes(shape: AttentionShape, score_dtype: str | None = None) -> int:
    """S plus P of one (sequence, query head): 64 MiB at N=4096 FP16."""
    check_shape(shape)
    return 2 * shape.seqlen_q * shape.seqlen_k * _score_bytes(shape, score_dtype)


def transient_peak_bytes(shape: AttentionShape, score_dtype: str | None = None, *,
                         heads_in_parallel: int | None = None) -> int:
    """S + P live at once in one layer when ``heads_in_parallel`` heads run together.

    Default: every (sequence, query head) of the layer at once, the lesson's 2.0 GiB
    upper bound for 32 heads.  Layers run one after another, so this is per layer.
    """
    check_shape(shape)
    all_heads = shape.batch * shape.query_heads
    # at most batch x query heads: every (sequence, head) of the layer at once
    heads = all_heads if heads_in_parallel is None else check_int(
        "heads_in_parallel", heads_in_parallel, minimum=1, maximum=all_heads)
    return heads * scores_and_probs_per_head_bytes(shape, score_dtype)


def training_retention_bytes(shape: AttentionShape, score_dtype: str | None = None, *,
                             layers: int) -> int:
    """S + P of every head of every attention layer, kept for backward (no checkpointing).

    The lesson's 64.0 GiB for 32 layers x 32 heads; weights, gradients and optimizer
    state are not in this sum.
    """
    return _positive_int(layers, "layers") * transient_peak_bytes(shape, score_dtype)


def running_stats_bytes(shape: AttentionShape) -> int:
    """m and l over every query row of one head (conceptual state): 2 x N_q x 4 B = 32 KiB."""
    check_shape(shape)
    return 2 * shape.seqlen_q * dtype_bytes(STATS_DTYPE)


def cta_live_state_bytes(block_m: int, head_dim: int, *, stats_dtype: str = STATS_DTYPE,
                         accumulator_dtype: str = STATS_DTYPE) -> dict[str, int]:
    """Live softmax state of one CTA: m and l for its B_r rows, and the B_r x d accumulator.

    At B_r=128, d=128, FP32: 1 KiB of statistics plus 64 KiB of accumulator.
    """
    rows = _positive_int(block_m, "block_m")
    dim = _positive_int(head_dim, "head_dim")
    return {"statistics": 2 * rows * dtype_bytes(stats_dtype),
            "accumulator": rows * dim * dtype_bytes(accumulator_dtype)}


def lse_bytes(shape: AttentionShape) -> int:
    """The exported logsumexp of one head, written to HBM if the kernel writes it: 16 KiB."""
    check_shape(shape)
    return shape.seqlen_q * dtype_bytes(STATS_DTYPE)


def tile_buffer_bytes(shape: AttentionShape, score_dtype: str | None = None) -> dict[str, int]:
    """On-chip tiles of the fused forward: Q 32 KiB, K and V 16 KiB each, S 16 KiB (lesson)."""
    check_shape(shape)
    row = shape.head_dim * shape.element_bytes
    return {"Q tile": shape.block_m * row, "K tile": shape.block_n * row,
            "V tile": shape.block_n * row,
            "score tile": score_tile_bytes(shape.block_m, shape.block_n,
                                           score_dtype or shape.dtype)}


@dataclass(frozen=True)
class MemoryItem:
    name: str
    scope: str
    bytes: int
    assumption: str

    def as_dict(self) -> dict:
        return asdict(self)


def memory_footprint(shape: AttentionShape, *, score_dtype: str | None = None,
                     layers: int = 1) -> list[MemoryItem]:
    """Every footprint above for one shape, each with its scope and assumption."""
    check_shape(shape)
    layers = _positive_int(layers, "layers")
    sdt = score_dtype or shape.dtype
    heads = shape.batch * shape.query_heads
    live = cta_live_state_bytes(shape.block_m, shape.head_dim)
    tiles = tile_buffer_bytes(shape, score_dtype)
    return [
        MemoryItem("S (score matrix)", "per layer", score_matrix_bytes(shape, score_dtype),
                   f"naive path, full N_q x N_k in {sdt}, {heads} (sequence, head) pairs"),
        MemoryItem("S + P", "per head", scores_and_probs_per_head_bytes(shape, score_dtype),
                   f"naive path, one (sequence, head), {sdt}"),
        MemoryItem("S + P, transient peak", "per layer",
                   transient_peak_bytes(shape, score_dtype),
                   f"all {heads} heads of the active layer in parallel; an upper bound on "
                   "scratch, not a memory plan"),
        MemoryItem("S + P, training retention", f"per model ({layers} attention layers)",
                   training_retention_bytes(shape, score_dtype, layers=layers),
                   "every layer's S and P kept for backward, no checkpointing; weights, "
                   "gradients, optimizer state excluded"),
        MemoryItem("m and l (running statistics)", "per head",
                   running_stats_bytes(shape),
                   "one FP32 max and sum per query row over the whole head; conceptual, "
                   "never all live at once"),
        MemoryItem("m and l, live", "per CTA", live["statistics"],
                   f"B_r={shape.block_m} rows of FP32 statistics, on chip"),
        MemoryItem("accumulator, live", "per CTA", live["accumulator"],
                   f"B_r x d = {shape.block_m} x {shape.head_dim} FP32, on chip"),
        MemoryItem("LSE (exported)", "per head", lse_bytes(shape),
                   "FP32 per query row, written to HBM only if the kernel exports it"),
        *(MemoryItem(name, "per CTA", size, "on chip, in the input dtype"
                     if name != "score tile" else f"on chip, {sdt}")
          for name, size in tiles.items()),
    ]
