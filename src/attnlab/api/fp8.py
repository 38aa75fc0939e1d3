"""FP8 (float8_e4m3fn) inputs: the KV cache's dtype rules and descales, and the FP8 prefill.

Two uses, FA3's and vLLM's semantics (real value = fp8 value x descale):

* an **fp8 KV cache** for :func:`attnlab.flash_attn_with_kvcache`: bf16/fp16 queries and
  output, ``k_cache``/``v_cache`` float8_e4m3fn with ``k_descale``/``v_descale``; the
  decode kernel loads e4m3 and converts it (exactly) to q's dtype, the descales folded
  into the softmax scale and the output.  New keys and values (``k=``, ``v=``, in q's
  dtype) are quantised into the cache with those descales (round to nearest even,
  saturated to +-448: :func:`attnlab.reference.fp8.quantize_e4m3`);
* the **FP8 prefill** (:func:`flash_attn_fp8_func`, what
  ``attnlab.flash_attn_interface.flash_attn_func`` runs for fp8 inputs): q, k, v
  float8_e4m3fn with q/k/v descales, bf16 output.

A descale is a torch.float32 tensor of shape () or (1,) (per tensor) or (batch, kv_heads)
(per sequence and KV head; FA3's shape), never read on the host
(:func:`attnlab.checks.check_descale`).  e5m2 and the fnuz variants are refused by name.
"""

from __future__ import annotations

import torch

from attnlab.api.common import (
    _check_has_data,
    _check_options,
    _record_impl,
    _resolve_impl,
    _triton_ready,
)
from attnlab.checks import check_bool, check_descale, check_fp8_dtype, check_scale, is_float8
from attnlab.inputs import AttentionInputs

FP8_MIN_HEAD_DIM = 32


def check_cache_dtype(name: str, cache: torch.Tensor, q: torch.Tensor) -> None:
    """A KV cache's (or an appended k/v's) dtype against q's: q's own, or for a cache
    float8_e4m3fn under bf16/fp16 queries.  TypeError naming the argument otherwise."""
    if is_float8(q):
        raise TypeError(f"q.dtype must be torch.float16 or torch.bfloat16 for "
                        f"flash_attn_with_kvcache, got {q.dtype}: the decode kernel takes no "
                        "fp8 queries (an fp8 cache takes bf16/fp16 q; fp8 q, k, v with "
                        "q_descale are the prefill's, flash_attn_interface.flash_attn_func)")
    if check_fp8_dtype(name, cache) and name.endswith("_cache"):
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"an fp8 {name} takes q of dtype torch.float16 or torch.bfloat16, "
                            f"got {q.dtype}")
        return
    if cache.dtype != q.dtype:
        also = " or torch.float8_e4m3fn (with k_descale/v_descale)" if name.endswith("_cache") \
            else " (fp8 caches quantise them on append)"
        raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}){also}, got {cache.dtype}")


def kvcache_descales(q, k_cache, v_cache, k_descale, v_descale):
    """(k_descale, v_descale) as (batch, kv_heads) views for an fp8 cache, (None, None)
    for a bf16/fp16 one.  Refused by name: a missing descale with an fp8 cache, one given
    with a cache that is not fp8, caches of two dtypes."""
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and "
                        f"{v_cache.dtype}")
    fp8 = is_float8(k_cache)
    batch, kv_heads = q.shape[0], k_cache.shape[2]
    views = []
    for name, value in (("k_descale", k_descale), ("v_descale", v_descale)):
        if value is None and fp8:
            raise ValueError(f"{name} must be given with a float8_e4m3fn cache: a torch.float32 "
                             f"tensor of shape () or (1,) (per tensor) or (batch, kv_heads) = "
                             f"({batch}, {kv_heads}); the real cache is the stored one times it "
                             "(torch.ones(1) for none)")
        if value is not None and not fp8:
            raise ValueError(f"{name} is for a float8_e4m3fn cache; k_cache is {k_cache.dtype} "
                             "(pass None)")
        views.append(None if value is None else
                     check_descale(name, value, batch=batch, kv_heads=kv_heads, device=q.device))
    return tuple(views)


def _check_fp8_inputs(q, k, v, descales) -> tuple[AttentionInputs, tuple]:
    """q, k, v float8_e4m3fn (bshd) and their three descales as (batch, kv_heads) views."""
    inputs = AttentionInputs.dense(q, k, v, "bshd")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not check_fp8_dtype(name, t):
            raise TypeError(f"{name}.dtype must be torch.float8_e4m3fn for the FP8 forward "
                            f"(q/k/v_descale given), got {t.dtype}")
    views = []
    for name, value in descales.items():
        if value is None:
            raise ValueError(f"{name} must be given with fp8 inputs: a torch.float32 tensor of "
                             f"shape (batch, kv_heads) = ({inputs.batch}, {inputs.kv_heads}), "
                             "() or (1,); the real tensor is the stored one times it "
                             "(torch.ones(1) for none)")
        views.append(check_descale(name, value, batch=inputs.batch, kv_heads=inputs.kv_heads,
                                   device=q.device))
    return inputs, tuple(views)


def flash_attn_fp8_func(q, k, v, q_descale, k_descale, v_descale, softmax_scale=None,
                        causal=False, window_size=(-1, -1), softcap=0.0, *,
                        return_lse=False, impl="auto"):
    """Attention over FP8 inputs (FA3's ``flash_attn_func`` with descales): q (batch,
    seqlen_q, heads, d), k and v (batch, seqlen_k, kv_heads, d), all float8_e4m3fn; the
    real inputs are ``q * q_descale`` etc. with each descale a float32 tensor of shape
    (batch, kv_heads) (FA3's; q's is per KV head too), () or (1,).  Returns ``out``
    (bf16), or ``(out, lse)`` with ``return_lse`` (LSE (batch, heads, seqlen_q) fp32).

    The kernel (the Triton one, or the Gluon sm_90 one where its dispatch table says)
    runs Q K^T on fp8 operands and rounds P to e4m3 for P V, as FA3;
    its error against float64 attention on the dequantised inputs is bounded by
    :func:`attnlab.accuracy.check_fp8_accuracy` (docs/usage.md, "FP8").  No backward:
    tensors that require grad are refused.  ``impl="reference"`` is the float64 oracle
    on the dequantised inputs, rounded to bf16.
    """
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    window, softcap = _check_options(window_size, softcap)
    inputs, descales = _check_fp8_inputs(q, k, v, {"q_descale": q_descale,
                                                   "k_descale": k_descale,
                                                   "v_descale": v_descale})
    if inputs.head_dim < FP8_MIN_HEAD_DIM:
        raise ValueError(f"head_dim must be in [{FP8_MIN_HEAD_DIM}, 256] for the FP8 forward (an "
                         f"fp8 MMA reduces 32 elements a step), got {inputs.head_dim}")
    if any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("the FP8 forward has no backward (as FA3's): q, k, v must not "
                                  "require grad")
    impl = _resolve_impl(impl, q)
    scale = check_scale(softmax_scale, inputs.head_dim, name="softmax_scale")
    if impl == "triton":
        from attnlab.kernels.forward import flash_forward_fp8

        _check_has_data(k=k, v=v)
        q, k, v = _triton_ready(q, k, v, inputs.head_dim, scale, softcap, "softmax_scale",
                                dtypes=(torch.float8_e4m3fn,))
        out, lse = flash_forward_fp8(q, k, v, *descales, scale=scale, causal=causal,
                                     window=window, softcap=softcap)
        _record_impl("triton")
    else:
        from attnlab.reference import tiled
        from attnlab.reference.fp8 import dequantize, per_head

        real = [inputs.layout.to_bhsd(dequantize(t, per_head(d)))
                for t, d in zip((q, k, v), _query_heads(descales, inputs), strict=True)]
        out64, lse = tiled(*real, causal=causal, scale=scale, window=window, softcap=softcap)
        out, lse = inputs.layout.from_bhsd(out64).to(torch.bfloat16), lse.to(torch.float32)
        _record_impl("reference")
    return (out, lse) if return_lse else out


def _query_heads(descales: tuple, inputs: AttentionInputs) -> tuple:
    """q's descale per query head (each KV group's factor repeated), k's and v's as given."""
    q_descale, k_descale, v_descale = descales
    return q_descale.repeat_interleave(inputs.group_size, dim=1), k_descale, v_descale
