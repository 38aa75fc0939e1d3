"""Checks shared by every reference entry point: tensors, options, and GQA head sharing.

The reference takes SDPA layout, ``(batch, heads, seqlen, dim)``; K and V may have
fewer heads than Q when that number divides Q's (GQA/MQA): query head h uses KV
head ``h // (query_heads // kv_heads)``, as flash-attn and SDPA's ``enable_gqa`` do.
"""

from __future__ import annotations

import torch

from attnlab.checks import check_instance, check_scale
from attnlab.checks import check_softcap as _check_softcap
from attnlab.inputs import TORCH_DTYPE_NAMES  # the dtypes the reference accepts
from attnlab.shapes import AttentionShape


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Running max, sum and accumulator dtype: FP32 as the shipped kernels, FP64 stays FP64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(head_dim) unless given (a positive finite number)."""
    return check_scale(scale, head_dim, name="scale")


def check_softcap(softcap: float) -> float:
    """flash-attn's softcap: a finite float >= 0, 0 meaning off."""
    return _check_softcap(softcap, name="softcap")


def check_reference_dtype(name: str, tensor: torch.Tensor) -> None:
    """TypeError naming the dtypes the reference computes in, for any other dtype.

    Call it before converting a tensor: an int, bool or complex tensor cast to
    float64 would silently compute something else.
    """
    if tensor.dtype not in TORCH_DTYPE_NAMES:
        allowed = ", ".join(str(d) for d in TORCH_DTYPE_NAMES)
        raise TypeError(f"{name}.dtype must be one of {allowed}, got {tensor.dtype}")


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           causal: bool, window: tuple[int, int],
                           block_m: int = 128, block_n: int = 64) -> AttentionShape:
    """Validate q, k, v (SDPA layout) and the masking options; return the call's shape.

    Building the :class:`AttentionShape` re-validates ``window``, ``causal`` and the
    block sizes with the same messages every other module gives.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_instance(name, tensor, torch.Tensor)
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, dim), got shape "
                             f"{tuple(tensor.shape)}")
        check_reference_dtype(name, tensor)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, query_heads, seqlen_q, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch {batch}, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on (batch, heads, seqlen), got {tuple(k.shape[:3])} "
                         f"and {tuple(v.shape[:3])}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k's head dim must equal q's {head_dim}, got {k.shape[3]}")
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if kv_heads == 0 or query_heads % kv_heads != 0:
        raise ValueError(f"k's heads must divide q's heads (GQA), got q heads={query_heads}, "
                         f"k heads={kv_heads}")
    if v.shape[3] == 0:
        raise ValueError("v's head dim must be positive, got 0")
    window = tuple(window) if isinstance(window, (tuple, list)) else window
    return AttentionShape(
        batch=batch, query_heads=query_heads, kv_heads=kv_heads, seqlen_q=seqlen_q,
        seqlen_k=seqlen_k, head_dim=head_dim, dtype=TORCH_DTYPE_NAMES[q.dtype], causal=causal,
        window=window, block_m=block_m, block_n=block_n,
    )


def expand_kv_heads(kv: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Repeat each KV head for the query heads that share it (head h uses h // group)."""
    group = query_heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)
