"""The public attention calls: validate once, convert layout once, dispatch.

Two layouts, named at the boundary:

* ``bshd`` — (batch, seqlen, heads, head_dim), flash-attn's ``flash_attn_func``;
* ``bhsd`` — (batch, heads, seqlen, head_dim), PyTorch SDPA's layout.

``impl`` is an explicit choice: ``"triton"`` (our kernel), ``"reference"`` (the
CPU oracle, computed in float64), ``"auto"`` (triton on CUDA tensors, reference
on CPU tensors).  Nothing falls back silently; ``last_impl()`` says which ran.

Causal masks are aligned **bottom-right** in both APIs, as in flash-attn >= 2.1:
query i sees key j iff ``j <= i + seqlen_k - seqlen_q``.  SDPA's own
``is_causal=True`` is aligned top-left instead.  For seqlen_q=2, seqlen_k=5::

    attnlab causal (bottom-right)     SDPA is_causal (top-left)
        k: 0 1 2 3 4                      k: 0 1 2 3 4
    q0:    1 1 1 1 0                  q0:    1 0 0 0 0
    q1:    1 1 1 1 1                  q1:    1 1 0 0 0

A query row that sees no key (possible with bottom-right causal when
seqlen_q > seqlen_k, or with a window) outputs zeros and LSE = -inf.
"""

from __future__ import annotations

import torch

from attnlab.reference.inputs import check_softcap, resolve_scale

IMPLS = ("auto", "triton", "reference")
_last_impl: str | None = None


def last_impl() -> str | None:
    """Which implementation the most recent attnlab attention call ran: 'triton' or 'reference'."""
    return _last_impl


def _check_tensors(q, k, v, layout: str) -> tuple[int, int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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


def _check_options(window_size, softcap) -> tuple[tuple[int, int], float]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if any(w < -1 for w in window_size):
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    return (int(window_size[0]), int(window_size[1])), check_softcap(softcap)


def _resolve_impl(impl: str, q: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if q.is_cuda else "reference"
    if impl == "triton" and not q.is_cuda:
        from attnlab.kernels.forward import kernel_is_interpreted

        if not kernel_is_interpreted():
            raise ValueError(
                "impl='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
                "before attnlab is imported (Triton's interpreter); use impl='reference' on CPU")
    return impl


def _run(q, k, v, *, layout: str, scale, causal: bool, window: tuple[int, int],
         softcap: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    global _last_impl
    *_, head_dim = _check_tensors(q, k, v, layout)
    impl = _resolve_impl(impl, q)
    from attnlab.kernels.forward import MAX_HEAD_DIM, SUPPORTED_DTYPES, flash_forward, flash_fwd_op

    scale = resolve_scale(scale, head_dim)
    if impl == "triton":
        if q.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"the Triton kernel takes dtype torch.float16 or torch.bfloat16, got {q.dtype}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
        # The kernel needs unit stride along head_dim; anything else costs one copy.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if torch.compiler.is_compiling() or (
                torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            # The custom op: one opaque node for torch.compile, and a backward that says
            # plainly it does not exist.
            out, lse = flash_fwd_op(q, k, v, layout, scale, causal, window[0], window[1], softcap)
        else:
            # Same kernel without the custom-op dispatcher, which costs ~40 us of CPU per
            # call (measured on the CPU here): it dominates short sequences.
            out, lse = flash_forward(q, k, v, layout=layout, scale=scale, causal=causal,
                                     window=window, softcap=softcap)
    else:
        from attnlab.reference import tiled

        to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
        out64, lse = tiled(*(to_bhsd(t).to(torch.float64) for t in (q, k, v)),
                           causal=causal, scale=scale, window=window, softcap=softcap)
        out = to_bhsd(out64).to(q.dtype)
        lse = lse.to(torch.float32)
    _last_impl = impl
    return out, lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False, *, impl="auto"):
    """Drop-in for flash-attn's ``flash_attn_func``; tensors are (batch, seqlen, heads, head_dim).

    Returns ``out``, or ``(out, softmax_lse, None)`` with ``return_attn_probs=True``
    (LSE in natural log, shape (batch, heads, seqlen_q), float32).  GQA/MQA when
    k/v have fewer heads than q.  ``causal`` is bottom-right aligned (see module doc).
    The forward is deterministic, so ``deterministic`` changes nothing.
    """
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0.0: attnlab has no dropout (got {dropout_p})")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes must be None: attnlab does not support ALiBi")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    window, softcap = _check_options(window_size, softcap)
    out, lse = _run(q, k, v, layout="bshd", scale=softmax_scale, causal=causal, window=window,
                    softcap=softcap, impl=impl)
    return (out, lse, None) if return_attn_probs else out


def attention(q, k, v, *, causal=False, scale=None, enable_gqa=False, window_size=(-1, -1),
              softcap=0.0, impl="auto", return_lse=False):
    """Attention in SDPA's layout: tensors are (batch, heads, seqlen, head_dim).

    Like SDPA, k/v with fewer heads than q need ``enable_gqa=True``.  Unlike SDPA's
    ``is_causal``, ``causal`` is bottom-right aligned (see module doc).
    Returns ``out``, or ``(out, lse)`` with ``return_lse=True``.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 == k.dim() \
            and q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads and k/v {k.shape[1]}: pass enable_gqa=True "
                         "for grouped-query attention")
    window, softcap = _check_options(window_size, softcap)
    out, lse = _run(q, k, v, layout="bhsd", scale=scale, causal=causal, window=window,
                    softcap=softcap, impl=impl)
    return (out, lse) if return_lse else out
