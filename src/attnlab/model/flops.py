"""Attention FLOPs, counted exactly from the mask, and arithmetic intensity per kernel.

A FLOP here is one floating-point add or multiply (a multiply-accumulate is 2).  The
matmuls do ``2 * head_dim`` FLOPs per (query, key) pair each for ``Q K^T`` and ``P V``.
Causal work is the number of pairs the real mask permits (``N (N + 1) / 2`` for a
square causal mask), never "N^2 / 2 by hand".
"""

from __future__ import annotations

from attnlab.checks import check_int
from attnlab.masking import visible_pairs
from attnlab.shapes import AttentionShape, ModelPreset, check_shape, preset

# Matmul FLOPs per (query, key) pair and head dim: 2 for Q K^T plus 2 for P V.
MATMUL_FLOPS_PER_PAIR_PER_DIM = 4
# Elementwise softmax work per score: the max comparison, exp(x - m), the running sum
# and the final division; the lesson's "about 4 N^2 FLOPs", which against the 2 N^2 b
# bytes of S read and P written gives its ~1 FLOP/byte at FP16.
SOFTMAX_FLOPS_PER_SCORE = 4
# The separate scale pass of eager PyTorch: one multiply per score.
SCALE_FLOPS_PER_SCORE = 1
# FA-2 backward recomputes S and P, then runs four more matmuls (dV, dP, dQ, dK):
# 5 matmuls against the forward's 2, i.e. 2.5x the forward matmul FLOPs.
BACKWARD_MATMUL_FLOPS_PER_PAIR_PER_DIM = 10
# Non-attention work of a transformer forward pass: one multiply-accumulate per
# parameter per token (the usual 2N rule; embeddings and the LM head included).
NON_ATTENTION_FLOPS_PER_PARAMETER_PER_TOKEN = 2


def attention_flops(shape: AttentionShape) -> int:
    """Matmul FLOPs of one attention forward over all heads and the batch.

    ``4 * head_dim * (pairs the mask permits)`` per (batch, query head).  Example:
    the lesson's layer (32 heads, N=4096, d=128, unmasked) is 274,877,906,944 FLOPs.
    """
    check_shape(shape)
    return (MATMUL_FLOPS_PER_PAIR_PER_DIM * shape.head_dim * visible_pairs(shape)
            * shape.batch * shape.query_heads)


def conventional_attention_flops(shape: AttentionShape) -> int:
    """The benchmark-reporting convention ``4 B H Nq Nk d``, halved when causal.

    This is what flash-attn's benchmarks and the peer anchors divide by time to get
    TFLOP/s; use it only to compare against numbers reported that way.  Causal with a
    window is not covered by the convention (ValueError).
    """
    check_shape(shape)
    if shape.has_window:
        raise ValueError("window must be (-1, -1): the 4BHN^2d convention has no windowed form; "
                         "use attention_flops for the exact count")
    full = (MATMUL_FLOPS_PER_PAIR_PER_DIM * shape.batch * shape.query_heads * shape.seqlen_q
            * shape.seqlen_k * shape.head_dim)
    return full // 2 if shape.causal else full


def softmax_flops(shape: AttentionShape) -> int:
    """Elementwise softmax FLOPs over the permitted scores, all heads and the batch."""
    check_shape(shape)
    return SOFTMAX_FLOPS_PER_SCORE * visible_pairs(shape) * shape.batch * shape.query_heads


def backward_flops(shape: AttentionShape) -> int:
    """Matmul FLOPs of the FA-2 backward (recompute S, then dV, dP, dQ, dK): 2.5x forward."""
    check_shape(shape)
    return (BACKWARD_MATMUL_FLOPS_PER_PAIR_PER_DIM * shape.head_dim * visible_pairs(shape)
            * shape.batch * shape.query_heads)


def _check_preset(model: ModelPreset | str) -> ModelPreset:
    if isinstance(model, str):
        return preset(model)
    if not isinstance(model, ModelPreset):
        raise TypeError(f"preset must be a ModelPreset or a preset name, got {type(model).__name__}")
    return model


def _check_tokens(prompt_tokens: int) -> int:
    return check_int("prompt_tokens", prompt_tokens, minimum=1)


def prefill_attention_flops(model: ModelPreset | str, prompt_tokens: int) -> int:
    """Causal attention matmul FLOPs of one prefill, summed over the softmax-attention layers."""
    model = _check_preset(model)
    shape = model.shape(_check_tokens(prompt_tokens), causal=True)
    return attention_flops(shape) * model.attention_layers


def prefill_non_attention_flops(model: ModelPreset | str, prompt_tokens: int) -> int:
    """Everything else in a prefill: ~2 FLOPs per parameter per token."""
    model = _check_preset(model)
    return (NON_ATTENTION_FLOPS_PER_PARAMETER_PER_TOKEN * model.parameters
            * _check_tokens(prompt_tokens))


def attention_flop_share(model: ModelPreset | str, prompt_tokens: int) -> float:
    """Attention's share of a batch-1 causal prefill's FLOPs (a FLOP share, not a time share).

    ``lesson-8b``: 3.25% at 2,048 tokens (the lesson rounds to 3.2%), 6.29% at 4,096.
    """
    attention = prefill_attention_flops(model, prompt_tokens)
    return attention / (attention + prefill_non_attention_flops(model, prompt_tokens))


def arithmetic_intensity(flops: int, bytes_moved: int) -> float:
    """FLOPs per byte of HBM traffic."""
    check_int("flops", flops, minimum=0)
    check_int("bytes_moved", bytes_moved, minimum=0)
    if bytes_moved == 0:
        raise ValueError("bytes_moved must be > 0 to form an intensity")
    return flops / bytes_moved


def kernel_intensities(traffic) -> list[dict]:
    """FLOPs, logical bytes and FLOP/byte of every kernel in a traffic record.

    ``traffic`` is an :class:`attnlab.model.traffic.Traffic` (anything with ``.kernels``
    of ``flops`` and ``total_bytes``); not imported here: traffic imports this module.
    """
    return [
        {"kernel": k.kernel, "flops": k.flops, "bytes": k.total_bytes,
         "flop_per_byte": arithmetic_intensity(k.flops, k.total_bytes) if k.total_bytes else None}
        for k in traffic.kernels
    ]
