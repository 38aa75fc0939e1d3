"""Dense calls: ``attention`` (SDPA's layout), ``flash_attn_func`` and its packed forms
(flash-attn's layout); a short query against a long cache routes to the decode kernel."""

from __future__ import annotations

import torch

from attnlab.api.common import (
    _check_options,
    _check_reference_dtypes,
    _check_tensor,
    _record_impl,
    _refuse_unsupported,
    _resolve_impl,
    _triton_ready,
)
from attnlab.checks import check_bool, check_scale


def _check_tensors(q, k, v, layout: str) -> tuple[int, int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if layout == "bshd":
        batch, seqlen_q, heads, head_dim = q.shape
        kv_batch, seqlen_k, kv_heads, kv_dim = k.shape
    else:
        batch, heads, seqlen_q, head_dim = q.shape
        kv_batch, kv_heads, seqlen_k, kv_dim = k.shape
    if kv_batch != batch:
        raise ValueError(f"k batch ({kv_batch}) must equal q batch ({batch})")
    if kv_dim != head_dim:
        raise ValueError(f"k/v head_dim ({kv_dim}) must equal q head_dim ({head_dim})")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads})")
    if min(batch, seqlen_q, seqlen_k, heads, head_dim) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    return batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim


def _run(q, k, v, *, layout: str, scale, causal: bool, window: tuple[int, int],
         softcap: float, impl: str, deterministic: bool = False, scale_name: str = "scale"
         ) -> tuple[torch.Tensor, torch.Tensor]:
    *_, head_dim = _check_tensors(q, k, v, layout)
    impl = _resolve_impl(impl, q)
    deterministic = check_bool("deterministic", deterministic)
    scale = check_scale(scale, head_dim, name=scale_name)
    if impl == "triton":
        q, k, v = _triton_ready(q, k, v, head_dim, scale, softcap, scale_name)
        from attnlab.kernels.autograd import attention_forward
        from attnlab.kernels.decode import flash_decode, prefers_decode

        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                  or v.requires_grad)
        seqlen_q, seqlen_k = (q.shape[1], k.shape[1]) if layout == "bshd" else (q.shape[2], k.shape[2])
        if not torch.compiler.is_compiling() and prefers_decode(
                seqlen_q=seqlen_q, seqlen_k=seqlen_k, needs_grad=needs_grad):
            # A decode step (short queries, long keys): the split-KV kernel.
            out, lse = flash_decode(q, k, v, layout=layout, scale=scale, causal=causal,
                                    window=window, softcap=softcap)
            impl = "triton-decode"
        else:
            # Differentiable (custom op) when a gradient is needed or torch.compile traces;
            # a plain launch otherwise.
            out, lse = attention_forward(q, k, v, layout=layout, scale=scale, causal=causal,
                                         window=window, softcap=softcap,
                                         deterministic=deterministic)
    else:
        from attnlab.reference import tiled

        _check_reference_dtypes(q=q, k=k, v=v)
        to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
        out64, lse = tiled(*(to_bhsd(t).to(torch.float64) for t in (q, k, v)),
                           causal=causal, scale=scale, window=window, softcap=softcap)
        out = to_bhsd(out64).to(q.dtype)
        lse = lse.to(torch.float32)
    _record_impl(impl)
    return out, lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False, *, impl="auto"):
    """Drop-in for flash-attn's ``flash_attn_func``; tensors are (batch, seqlen, heads, head_dim).

    Returns ``out``, or ``(out, softmax_lse, None)`` with ``return_attn_probs=True``
    (LSE in natural log, shape (batch, heads, seqlen_q), float32).  GQA/MQA when
    k/v have fewer heads than q.  ``causal`` is bottom-right aligned (see module doc).
    Differentiable in q, k, v.  attnlab's backward never uses atomics, so it is
    bit-identical run to run whether or not ``deterministic=True``.
    """
    _refuse_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    causal = check_bool("causal", causal)
    return_attn_probs = check_bool("return_attn_probs", return_attn_probs)
    window, softcap = _check_options(window_size, softcap)
    out, lse = _run(q, k, v, layout="bshd", scale=softmax_scale, causal=causal, window=window,
                    softcap=softcap, impl=impl, deterministic=deterministic,
                    scale_name="softmax_scale")
    return (out, lse, None) if return_attn_probs else out


def _check_packed(name: str, packed, dim: int, parts: int) -> None:
    _check_tensor(name, packed)
    if packed.dim() != dim or packed.shape[dim - 3] != parts:
        layout = "(batch, seqlen, 3, heads, head_dim)" if parts == 3 else \
            "(batch, seqlen, 2, kv_heads, head_dim)"
        raise ValueError(f"{name} must be {layout}, got shape {tuple(packed.shape)}")


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *, impl="auto"):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv is (batch, seqlen, 3, heads, head_dim).

    q, k, v are views into ``qkv`` (no copy: their last stride is 1); the gradient
    comes back as one (batch, seqlen, 3, heads, head_dim) tensor.  Options and
    returns as :func:`flash_attn_func`.
    """
    _check_packed("qkv", qkv, 5, 3)
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, impl=impl)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *, impl="auto"):
    """flash-attn's ``flash_attn_kvpacked_func``: q is (batch, seqlen_q, heads, head_dim),
    kv is (batch, seqlen_k, 2, kv_heads, head_dim).  k, v are views into ``kv`` (no
    copy); options and returns as :func:`flash_attn_func`.
    """
    _check_packed("kv", kv, 5, 2)
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, impl=impl)


def attention(q, k, v, *, causal=False, scale=None, enable_gqa=False, window_size=(-1, -1),
              softcap=0.0, impl="auto", return_lse=False, deterministic=False):
    """Attention in SDPA's layout: tensors are (batch, heads, seqlen, head_dim).

    Like SDPA, k/v with fewer heads than q need ``enable_gqa=True``.  Unlike SDPA's
    ``is_causal``, ``causal`` is bottom-right aligned (see module doc).
    Returns ``out``, or ``(out, lse)`` with ``return_lse=True``; both are
    differentiable.  The backward never uses atomics: bit-identical run to run with
    ``deterministic=True`` or without (flash-attn's argument, kept for drop-in use).
    """
    causal = check_bool("causal", causal)
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    return_lse = check_bool("return_lse", return_lse)
    q, k = _check_tensor("q", q), _check_tensor("k", k)
    if q.dim() == 4 == k.dim() \
            and q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads and k/v {k.shape[1]}: pass enable_gqa=True "
                         "for grouped-query attention")
    window, softcap = _check_options(window_size, softcap)
    out, lse = _run(q, k, v, layout="bhsd", scale=scale, causal=causal, window=window,
                    softcap=softcap, impl=impl, deterministic=deterministic)
    return (out, lse) if return_lse else out
