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
    documents_impl,
)
from attnlab.checks import check_bool, check_scale
from attnlab.inputs import AttentionInputs


def _run(q, k, v, *, layout: str, scale, causal: bool, window: tuple[int, int],
         softcap: float, impl: str, deterministic: bool = False, scale_name: str = "scale"
         ) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = AttentionInputs.dense(q, k, v, layout)
    impl = _resolve_impl(impl, q)
    deterministic = check_bool("deterministic", deterministic)
    scale = check_scale(scale, inputs.head_dim, name=scale_name)
    if impl == "triton":
        q, k, v = _triton_ready(q, k, v, inputs.head_dim, scale, softcap, scale_name)
        from attnlab.kernels.autograd import attention_forward
        from attnlab.kernels.decode import flash_decode
        from attnlab.kernels.dispatch import routes_to_decode

        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                  or v.requires_grad)
        if not torch.compiler.is_compiling() and routes_to_decode(
                seqlen_q=inputs.seqlen_q, seqlen_k=inputs.seqlen_k, needs_grad=needs_grad):
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
        to_bhsd = inputs.layout.to_bhsd
        out64, lse = tiled(*(to_bhsd(t).to(torch.float64) for t in (q, k, v)),
                           causal=causal, scale=scale, window=window, softcap=softcap)
        out = inputs.layout.from_bhsd(out64).to(q.dtype)
        lse = lse.to(torch.float32)
    _record_impl(impl)
    return out, lse


@documents_impl
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


@documents_impl
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


@documents_impl
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


@documents_impl
def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
              enable_gqa=False, causal=False, window_size=(-1, -1), softcap=0.0, impl="auto",
              return_lse=False, deterministic=False):
    """Attention in SDPA's layout: tensors are (batch, heads, seqlen, head_dim).

    ``attn_mask``, ``dropout_p``, ``is_causal`` (positional) and ``scale``, ``enable_gqa``
    (keyword) are ``torch.nn.functional.scaled_dot_product_attention``'s, with its meaning: ``attn_mask`` must be None (attnlab has no
    arbitrary masks: NotImplementedError), ``dropout_p`` must be 0.0, ``scale`` is the
    softmax scale (None: 1/sqrt(head_dim)), and k/v with fewer heads than q need
    ``enable_gqa=True``.  ``is_causal`` is SDPA's **top-left** causal mask (query i sees
    keys j <= i); ``causal`` is attnlab's and flash-attn's **bottom-right** one (see the
    module doc).  They agree when seqlen_q == seqlen_k; otherwise is_causal runs as
    bottom-right causal over the first seqlen_q keys (seqlen_k > seqlen_q: later keys
    are seen by no query and get zero gradient) or as the window (-1, seqlen_q -
    seqlen_k) (seqlen_q > seqlen_k).  Pass one of the two, and is_causal with a window
    only when seqlen_q == seqlen_k (a top-left window has no flash-attn spelling).
    Returns ``out``, or ``(out, lse)`` with ``return_lse=True``; both are
    differentiable.  The backward never uses atomics: bit-identical run to run with
    ``deterministic=True`` or without (flash-attn's argument, kept for drop-in use).
    """
    if attn_mask is not None:
        raise NotImplementedError("attn_mask must be None: attnlab has no arbitrary (boolean or "
                                  "additive) masks; use is_causal/causal or window_size")
    _refuse_unsupported(dropout_p=dropout_p)
    causal = check_bool("causal", causal)
    is_causal = check_bool("is_causal", is_causal)
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    return_lse = check_bool("return_lse", return_lse)
    window, softcap = _check_options(window_size, softcap)
    q, k = _check_tensor("q", q), _check_tensor("k", k)
    four_d = q.dim() == 4 == k.dim()
    if four_d and q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads and k/v {k.shape[1]}: pass enable_gqa=True "
                         "for grouped-query attention")
    if is_causal and four_d:
        if causal:
            raise ValueError("pass causal (bottom-right aligned) or is_causal (SDPA's top-left), "
                             "not both")
        k, v, causal, window = _top_left_causal(q, k, v, window)
    out, lse = _run(q, k, v, layout="bhsd", scale=scale, causal=causal, window=window,
                    softcap=softcap, impl=impl, deterministic=deterministic)
    return (out, lse) if return_lse else out


def _top_left_causal(q, k, v, window):
    """SDPA's is_causal (query i sees keys j <= i) as a bottom-right mask: (k, v, causal, window)."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if seqlen_q == seqlen_k:
        return k, v, True, window
    if window != (-1, -1):
        raise NotImplementedError(
            f"is_causal (top-left) with window_size {window} needs seqlen_q == seqlen_k, got "
            f"{seqlen_q} and {seqlen_k}: attnlab's windows are bottom-right aligned; pass "
            "causal=True for flash-attn's bottom-right mask")
    if seqlen_k > seqlen_q:  # no query reaches key seqlen_q or later
        return k[:, :, :seqlen_q], v[:, :, :seqlen_q], True, window
    return k, v, False, (-1, seqlen_q - seqlen_k)
