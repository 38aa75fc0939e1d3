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

import threading

import torch

from attnlab.checks import check_bool, check_int, check_scale, check_softcap, check_window
from attnlab.reference.inputs import check_reference_dtype

IMPLS = ("auto", "triton", "reference")
# Per thread: two threads calling attnlab each see the implementation their own call ran.
_calls = threading.local()


def last_impl() -> str | None:
    """Which implementation this thread's most recent attnlab attention call ran: 'triton',
    'triton-decode' (the split-KV kernel: decode-shaped calls and flash_attn_with_kvcache)
    or 'reference'; None before the thread's first call."""
    return getattr(_calls, "impl", None)


def _record_impl(impl: str) -> None:
    """What :func:`last_impl` answers in this thread (every entry point sets it here)."""
    _calls.impl = impl


def _check_reference_dtypes(**tensors: torch.Tensor) -> None:
    """Refuse (TypeError with the allowed list) a dtype the float64 reference would only
    pretend to compute in: an int, bool, complex or fp8 tensor cast to float64."""
    for name, tensor in tensors.items():
        check_reference_dtype(name, tensor)


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
    """window_size and softcap as attnlab.checks reads them (NumPy and 0-d tensors too)."""
    return check_window(window_size, name="window_size"), check_softcap(softcap, name="softcap")


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


def _triton_ready(q, k, v, head_dim: int):
    """q, k, v as the Triton kernels take them (fp16/bf16, head_dim <= 256, unit last stride)."""
    from attnlab.kernels.forward import MAX_HEAD_DIM, SUPPORTED_DTYPES

    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"the Triton kernel takes dtype torch.float16 or torch.bfloat16, got {q.dtype}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
    # The kernel needs unit stride along head_dim; anything else costs one copy.
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def _run(q, k, v, *, layout: str, scale, causal: bool, window: tuple[int, int],
         softcap: float, impl: str, deterministic: bool = False, scale_name: str = "scale"
         ) -> tuple[torch.Tensor, torch.Tensor]:
    *_, head_dim = _check_tensors(q, k, v, layout)
    impl = _resolve_impl(impl, q)
    deterministic = check_bool("deterministic", deterministic)
    scale = check_scale(scale, head_dim, name=scale_name)
    if impl == "triton":
        q, k, v = _triton_ready(q, k, v, head_dim)
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


def _refuse_unsupported(*, dropout_p=0.0, alibi_slopes=None) -> None:
    """flash-attn arguments attnlab has no kernel for: refused, never ignored."""
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0.0: attnlab has no dropout (got {dropout_p})")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes must be None: attnlab does not support ALiBi")


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
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
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
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 == k.dim() \
            and q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads and k/v {k.shape[1]}: pass enable_gqa=True "
                         "for grouped-query attention")
    window, softcap = _check_options(window_size, softcap)
    out, lse = _run(q, k, v, layout="bhsd", scale=scale, causal=causal, window=window,
                    softcap=softcap, impl=impl, deterministic=deterministic)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------
# KV cache and decode: flash_attn_with_kvcache, merge_states
# ---------------------------------------------------------------------------

def _check_index_tensor(name: str, t, batch: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype torch.int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def _check_kvcache_tensors(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                           cache_batch_idx, cache_leftpad, block_table) -> int:
    """Shapes, dtypes and devices of flash_attn_with_kvcache's tensors; returns the capacity."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or min(q.shape) == 0:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, heads, head_dim), non-empty; got "
                         f"shape {tuple(q.shape)}")
    batch, seqlen_q, heads, head_dim = q.shape
    paged = block_table is not None
    cache_form = "(num_pages, page_size, kv_heads, head_dim)" if paged else \
        "(batch_cache, seqlen_cache, kv_heads, head_dim)"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or min(t.shape) == 0:
            raise ValueError(f"{name} must be 4-D {cache_form}, non-empty; got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    kv_heads, cache_dim = k_cache.shape[2], k_cache.shape[3]
    if cache_dim != head_dim:
        raise ValueError(f"k_cache/v_cache head_dim ({cache_dim}) must equal q's ({head_dim})")
    if heads % kv_heads:
        raise ValueError(f"k_cache's kv_heads ({kv_heads}) must divide q's heads ({heads})")

    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be a torch.int32 tensor (batch, max_pages), got "
                            f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"block_table must be (batch, max_pages) = ({batch}, >= 1), got "
                             f"{tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on q's device {q.device}, got {block_table.device}")
        page_size = k_cache.shape[1]
        if page_size % 16:
            raise ValueError(f"the paged cache's page size (k_cache.shape[1]) must be a multiple "
                             f"of 16, got {page_size}")
        if cache_batch_idx is not None:
            raise NotImplementedError("cache_batch_idx must be None with a paged cache "
                                      "(block_table already picks each sequence's pages)")
        if cache_leftpad is not None:
            raise NotImplementedError("cache_leftpad must be None with a paged cache")
        capacity = block_table.shape[1] * page_size
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache's batch ({k_cache.shape[0]}) must equal q's ({batch}) "
                             "unless cache_batch_idx picks the rows")
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _check_index_tensor(name, t, batch, q.device)
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index_tensor("cache_seqlens", cache_seqlens, batch, q.device)
    elif cache_seqlens is not None and cache_seqlens > capacity:
        raise ValueError(f"cache_seqlens must be an int in [0, capacity = {capacity}], got "
                         f"{cache_seqlens}")

    if (k is None) != (v is None):
        raise ValueError("k and v must both be given (new keys and values to append) or both None")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[1] == 0 or t.shape[2:] != (kv_heads, head_dim):
                raise ValueError(f"{name} must be (batch, seqlen_new, kv_heads, head_dim) = "
                                 f"({batch}, >= 1, {kv_heads}, {head_dim}), got {tuple(t.shape)}")
            if t.dtype != q.dtype:
                raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given when k and v are appended (where to write them)")
        if isinstance(cache_seqlens, int) and cache_seqlens + k.shape[1] > capacity:
            raise ValueError(f"cache_seqlens + seqlen_new ({cache_seqlens} + {k.shape[1]}) must be "
                             f"<= the cache capacity {capacity}")

    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must both be given or both None")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin need the new k and v (flash-attn rotates q and "
                             "the appended keys together)")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point torch.Tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), "
                             f"got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if rotary_dim % 16 or rotary_dim > head_dim or rotary_dim == 0:
            raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1]) must be a multiple of 16 in "
                             f"[16, head_dim={head_dim}], got {rotary_dim}")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos/rotary_sin must cover every cache position: seqlen_ro "
                             f"({rotary_cos.shape[0]}) must be >= the cache capacity {capacity}")
    return capacity


def _check_kvcache_contents(q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                            block_table, *, capacity: int, seqlen_new: int,
                            rotary_positions: int, rotary_len: int) -> int | None:
    """Bounds that depend on index tensors' values, checked with one host read.

    Returns the longest live key count (for the split count), or None when the check
    is skipped: while a CUDA graph is being captured a host read is impossible, and
    the indices are the caller's responsibility (the kernel trusts them).
    """
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if not any(isinstance(t, torch.Tensor)
               for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table)):
        # No index tensors: every bound is host arithmetic.  The device path below costs
        # ~15 tiny launches and a host sync, which dominated a 4k-cache decode step on the
        # H200 (370 us per call against ~20 us of kernel time, bench run 1).
        start = capacity if cache_seqlens is None else cache_seqlens
        if start + seqlen_new > capacity:
            raise ValueError(f"cache_seqlens = {start} must be in [0, capacity - seqlen_new] = "
                             f"[0, {capacity - seqlen_new}] (capacity {capacity})")
        if rotary_len and start + rotary_positions > rotary_len:
            raise ValueError(f"rotary_cos/rotary_sin have {rotary_len} positions but this call "
                             f"rotates up to position {start + rotary_positions - 1}")
        return start + seqlen_new
    batch = q.shape[0]
    device = q.device
    if cache_seqlens is None:
        starts = torch.full((batch,), capacity, dtype=torch.int64, device=device)
    elif isinstance(cache_seqlens, torch.Tensor):
        starts = cache_seqlens.to(torch.int64)
    else:
        starts = torch.full((batch,), int(cache_seqlens), dtype=torch.int64, device=device)
    ends = starts + seqlen_new
    firsts = (cache_leftpad.to(torch.int64) if cache_leftpad is not None
              else torch.zeros_like(ends))
    flags = [(starts.min() < 0) | (ends.max() > capacity),
             (firsts.min() < 0) | (firsts > starts).any()]
    if cache_batch_idx is not None:
        flags.append((cache_batch_idx.min() < 0) | (cache_batch_idx.max() >= k_cache.shape[0]))
    if block_table is not None:
        page_size = k_cache.shape[1]
        pages_used = (ends + page_size - 1) // page_size
        used = torch.arange(block_table.shape[1], device=device)[None, :] < pages_used[:, None]
        bad = used & ((block_table < 0) | (block_table >= k_cache.shape[0]))
        flags.append(bad.any())
    summary = torch.stack([torch.stack(flags).to(torch.int64).max(),
                           (ends - firsts).max(), starts.max() + rotary_positions]).tolist()
    if summary[0]:
        _raise_bad_indices(starts, ends, firsts, cache_batch_idx, block_table, k_cache, capacity,
                           seqlen_new)
    if rotary_len and summary[2] > rotary_len:
        raise ValueError(f"rotary_cos/rotary_sin have {rotary_len} positions but this call "
                         f"rotates up to position {summary[2] - 1}")
    return int(summary[1])


def _raise_bad_indices(starts, ends, firsts, cache_batch_idx, block_table, k_cache, capacity,
                       seqlen_new) -> None:
    """The error for the first bad index argument (only reached when one is bad)."""
    starts_list, ends_list, firsts_list = starts.tolist(), ends.tolist(), firsts.tolist()
    for b, (start, end) in enumerate(zip(starts_list, ends_list, strict=True)):
        if start < 0 or end > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {start} must be in [0, capacity - seqlen_new] "
                             f"= [0, {capacity - seqlen_new}] (capacity {capacity})")
    for b, (first, start) in enumerate(zip(firsts_list, starts_list, strict=True)):
        if not 0 <= first <= start:
            raise ValueError(f"cache_leftpad[{b}] = {first} must be in [0, cache_seqlens[{b}]] = "
                             f"[0, {start}]")
    if cache_batch_idx is not None:
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < k_cache.shape[0]:
                raise ValueError(f"cache_batch_idx[{b}] = {row} must be in [0, {k_cache.shape[0]})")
    if block_table is None:
        return
    page_size = k_cache.shape[1]
    for b, row in enumerate(block_table.tolist()):
        for j in range(-(-ends_list[b] // page_size)):
            if not 0 <= row[j] < k_cache.shape[0]:
                raise ValueError(f"block_table[{b}, {j}] = {row[j]} must be a page index in "
                                 f"[0, num_pages = {k_cache.shape[0]})")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            impl="auto", max_seqlen_k=None):
    """Drop-in for flash-attn's ``flash_attn_with_kvcache``: attend q to a KV cache,
    appending new keys and values first.

    Tensors (``bshd``): q (batch, seqlen_q, heads, d); a contiguous cache
    (batch_cache, seqlen_cache, kv_heads, d), or a paged one (num_pages, page_size,
    kv_heads, d) with ``block_table`` (batch, max_pages) int32 (vLLM layout; page size
    a multiple of 16).  ``k``, ``v`` (batch, seqlen_new, kv_heads, d) are written IN
    PLACE at positions ``cache_seqlens[b] ...`` (nothing else in the cache is
    written), then attended to.  ``cache_seqlens``: an int or (batch,) int32 tensor,
    the cache length before the append (None: the whole cache).  ``cache_batch_idx``
    (batch,) int32 picks cache rows; ``cache_leftpad`` (batch,) int32 is each
    sequence's first live position.  Rotary (``rotary_cos``/``rotary_sin``
    (seqlen_ro, rotary_dim / 2), rotary_dim a multiple of 16 <= d) rotates q and the
    new k at their cache positions: new key j at ``cache_seqlens + j``; query i at
    ``cache_seqlens + i`` when causal or windowed, else every query at
    ``cache_seqlens`` (flash-attn's rule).  Causal is bottom-right over the live keys.

    Returns ``out`` (batch, seqlen_q, heads, d), or ``(out, lse)`` with
    ``return_softmax_lse`` (LSE (batch, heads, seqlen_q) fp32, natural log).

    ``num_splits=0`` chooses the split count (:func:`attnlab.kernels.decode.choose_num_splits`)
    from the longest live length.  Bounds of the index tensors (cache_seqlens within the
    capacity, leftpad <= cache_seqlens, batch indices and the used block_table entries in
    range) are checked with one host read before any kernel runs — except while a CUDA
    graph is being captured (``torch.cuda.is_current_stream_capturing()``), where no host
    read is possible: there the values are trusted.  The split count uses ``max_seqlen_k``
    (an optional upper bound on any sequence's live keys; it changes speed, never the
    result) when given, else the live maximum that check read, else (under capture)
    the capacity.
    ``impl``: "triton" (the split-KV kernel; ``last_impl()`` = "triton-decode"),
    "reference" (float64 oracle) or "auto".
    """
    from attnlab.kernels.decode import MAX_SPLITS, flash_decode
    from attnlab.kernels.forward import MAX_HEAD_DIM, SUPPORTED_DTYPES
    from attnlab.reference.decode import (
        append_to_cache,
        apply_rotary,
        as_lengths,
        kvcache_attention,
        positions_from,
    )

    _refuse_unsupported(alibi_slopes=alibi_slopes)
    causal = check_bool("causal", causal)
    rotary_interleaved = check_bool("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = check_bool("return_softmax_lse", return_softmax_lse)
    window, softcap = _check_options(window_size, softcap)
    num_splits = check_int("num_splits", num_splits, minimum=0, maximum=MAX_SPLITS)
    if max_seqlen_k is not None:
        max_seqlen_k = check_int("max_seqlen_k", max_seqlen_k, minimum=0)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = check_int("cache_seqlens", cache_seqlens, minimum=0)
    capacity = _check_kvcache_tensors(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                      cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    impl = _resolve_impl(impl, q)
    batch, seqlen_q, _, head_dim = q.shape
    scale = check_scale(softmax_scale, head_dim, name="softmax_scale")
    if impl == "triton":
        if q.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"the Triton kernel takes dtype torch.float16 or torch.bfloat16, got {q.dtype}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have unit stride along head_dim (it is updated in "
                                 f"place, so attnlab cannot copy it), got strides {t.stride()}")
    else:  # before the append: a refused call writes nothing into the cache
        _check_reference_dtypes(q=q, k_cache=k_cache, v_cache=v_cache)
    seqlen_new = 0 if k is None else k.shape[1]
    local = causal or window != (-1, -1)
    rotary_positions = (max(seqlen_new, seqlen_q) if local else seqlen_new) \
        if rotary_cos is not None else 0
    live_max = _check_kvcache_contents(
        q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        capacity=capacity, seqlen_new=seqlen_new, rotary_positions=rotary_positions,
        rotary_len=0 if rotary_cos is None else rotary_cos.shape[0])

    if rotary_cos is not None:
        start = as_lengths(cache_seqlens, batch, q.device)
        q = apply_rotary(q, rotary_cos, rotary_sin,
                         positions_from(start, seqlen_q, same_position=not local),
                         interleaved=rotary_interleaved)
        k = apply_rotary(k, rotary_cos, rotary_sin, positions_from(start, seqlen_new),
                         interleaved=rotary_interleaved)
    if k is not None:
        append_to_cache(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=cache_batch_idx,
                        block_table=block_table)

    options = dict(cache_seqlens=cache_seqlens, seqlen_new=seqlen_new,
                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                   block_table=block_table, scale=scale, causal=causal, window=window,
                   softcap=softcap)
    if impl == "triton":
        if q.stride(-1) != 1:
            q = q.contiguous()
        if block_table is not None and block_table.stride(1) != 1:
            block_table = block_table.contiguous()
            options["block_table"] = block_table
        out, lse = flash_decode(q, k_cache, v_cache, num_splits=num_splits,
                                max_seqlen_k=max_seqlen_k if max_seqlen_k is not None else live_max,
                                **options)
        _record_impl("triton-decode")
    else:
        out, lse = kvcache_attention(q, k_cache, v_cache, **options)
        _record_impl("reference")
    return (out, lse) if return_softmax_lse else out


def merge_states_many(outs, lses):
    """Exact merge of partial attentions over disjoint key sets: returns (out, lse).

    ``outs``: a sequence of tensors (..., d); ``lses``: the matching (...) natural-log
    LSEs (for flash_attn_func's (batch, heads, seqlen) LSE next to a (batch, seqlen,
    heads, d) output, pass ``lse.transpose(1, 2)``).  Computed in fp32 (float64 when
    any input is float64); out comes back in ``outs[0]``'s dtype, lse in the work dtype.
    A partial with LSE = -inf contributes nothing; merging only empty partials gives
    (0, -inf), never NaN.  The formula is the reference's, :func:`attnlab.reference.decode.merge_stacked`.
    """
    from attnlab.reference.decode import merge_stacked

    for name, parts in (("outs", outs), ("lses", lses)):
        if isinstance(parts, torch.Tensor) or not isinstance(parts, (list, tuple)) or not parts:
            raise TypeError(f"{name} must be a non-empty list or tuple of tensors, got "
                            f"{type(parts).__name__}")
        for i, t in enumerate(parts):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{name}[{i}] must be a floating-point torch.Tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per partial, got {len(outs)} and {len(lses)}")
    for i, (o, lse) in enumerate(zip(outs, lses, strict=True)):
        if o.dim() < 1 or o.shape[:-1] != lse.shape or o.shape != outs[0].shape:
            raise ValueError(f"outs[{i}] must be {tuple(outs[0].shape)} and lses[{i}] its shape "
                             f"without the last dim; got {tuple(o.shape)} and {tuple(lse.shape)}")
        if o.device != outs[0].device or lse.device != outs[0].device:
            raise ValueError(f"every partial must be on {outs[0].device}; outs[{i}]/lses[{i}] are on "
                             f"{o.device}/{lse.device}")
    work = torch.float64 if any(t.dtype == torch.float64 for t in (*outs, *lses)) else torch.float32
    out, lse = merge_stacked(torch.stack([o.to(work) for o in outs]),
                             torch.stack([lse.to(work) for lse in lses]))
    return out.to(outs[0].dtype), lse


def merge_states(out_a, lse_a, out_b, lse_b):
    """Exact merge of two partial attentions: see :func:`merge_states_many`."""
    return merge_states_many([out_a, out_b], [lse_a, lse_b])


# ---------------------------------------------------------------------------
# Variable-length batches: layout thd, (total_tokens, heads, head_dim)
# ---------------------------------------------------------------------------


def _check_varlen_tensors(q, k, v) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) of packed q, k, v; the same rules as the dense calls."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total_tokens, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    _, heads, head_dim = q.shape
    _, kv_heads, kv_dim = k.shape
    if kv_dim != head_dim:
        raise ValueError(f"k/v head_dim ({kv_dim}) must equal q head_dim ({head_dim})")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads})")
    if head_dim == 0:
        raise ValueError(f"empty input: head_dim is 0 (q {tuple(q.shape)})")
    return heads, kv_heads, head_dim


def _sequence_lengths(cu_seqlens_q, cu_seqlens_k, q, k) -> tuple[list[int], list[int]]:
    """Per-sequence lengths from validated cu_seqlens: one device-to-host copy of both."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.int32 tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                             f"{tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same batch + 1 entries, "
                         f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    entries = cu_seqlens_q.shape[0]
    offsets = torch.cat((cu_seqlens_q, cu_seqlens_k)).tolist()
    lengths = []
    for name, cu, total, tensor in (("cu_seqlens_q", offsets[:entries], q.shape[0], "q"),
                                    ("cu_seqlens_k", offsets[entries:], k.shape[0], "k")):
        if cu[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
        steps = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        if min(steps) < 0:
            i = steps.index(min(steps))
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i + 1}] = {cu[i + 1]} "
                             f"< {name}[{i}] = {cu[i]}")
        if cu[-1] != total:
            raise ValueError(f"{name}[-1] must equal {tensor}'s total tokens {total} "
                             f"({tensor}.shape[0]), got {cu[-1]}")
        lengths.append(steps)
    return lengths[0], lengths[1]


def _check_max_seqlen(name: str, value, lengths: list[int]) -> int:
    value = check_int(name, value, minimum=0)
    longest = max(lengths)
    if value < longest:
        raise ValueError(f"{name} ({value}) is smaller than sequence {lengths.index(longest)}'s "
                         f"length {longest}")
    return value


def _varlen_reference(q, k, v, lengths_q, lengths_k, *, scale, causal, window, softcap):
    """Per-sequence float64 reference calls, concatenated (differentiable)."""
    from attnlab.reference import tiled

    heads, head_dim = q.shape[1], q.shape[2]
    outs, lses = [], []
    q_start = k_start = 0
    for length_q, length_k in zip(lengths_q, lengths_k, strict=True):
        q_seq = q[q_start:q_start + length_q]
        if length_q and length_k:
            to_bhsd = (lambda t: t.transpose(0, 1)[None].to(torch.float64))
            out64, lse = tiled(to_bhsd(q_seq), to_bhsd(k[k_start:k_start + length_k]),
                               to_bhsd(v[k_start:k_start + length_k]), causal=causal,
                               scale=scale, window=window, softcap=softcap)
            outs.append(out64[0].transpose(0, 1).to(q.dtype))
            lses.append(lse[0].to(torch.float32))
        else:  # no keys (or no queries): zeros and -inf, the kernel's convention
            outs.append(q_seq.new_zeros((length_q, heads, head_dim)))
            lses.append(torch.full((heads, length_q), float("-inf"), device=q.device))
        q_start += length_q
        k_start += length_k
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, impl="auto"):
    """Drop-in for flash-attn's ``flash_attn_varlen_func``: a batch of sequences of any lengths.

    q is (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim): the
    sequences packed one after another.  ``cu_seqlens_q`` / ``cu_seqlens_k`` are
    torch.int32 tensors of batch + 1 cumulative lengths on q's device (sequence i is
    rows ``cu[i]:cu[i+1]``); sequences may be empty and seqlen_q may differ from seqlen_k
    per sequence.  ``max_seqlen_q/k`` must be at least the longest length.  Causal is
    bottom-right aligned per sequence; a query with no visible key (or a sequence with
    no keys) outputs zeros and LSE = -inf.

    Returns ``out`` (total_q, heads, head_dim), or ``(out, softmax_lse, None)`` with
    ``return_attn_probs=True``; LSE is (heads, total_q) float32, flash-attn's varlen layout.

    The checks of cu_seqlens (int32, on q's device, 1-D, first entry 0, non-decreasing,
    last entry = total tokens, the max_seqlen bounds) read their values on the host:
    one small device-to-host copy per call, so a call cannot be captured in a CUDA
    graph.  Every check runs before any kernel.  ``block_table`` (a paged KV cache) is
    not supported.  ``impl="reference"`` runs the float64 reference per sequence.
    """
    if block_table is not None:
        raise NotImplementedError(
            "block_table must be None: attnlab's varlen call takes contiguous packed k/v, "
            "not a paged KV cache")
    _refuse_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    causal = check_bool("causal", causal)
    deterministic = check_bool("deterministic", deterministic)
    return_attn_probs = check_bool("return_attn_probs", return_attn_probs)
    window, softcap = _check_options(window_size, softcap)
    _, _, head_dim = _check_varlen_tensors(q, k, v)
    impl = _resolve_impl(impl, q)
    scale = check_scale(softmax_scale, head_dim, name="softmax_scale")
    lengths_q, lengths_k = _sequence_lengths(cu_seqlens_q, cu_seqlens_k, q, k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k)
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    if impl == "triton":
        q, k, v = _triton_ready(q, k, v, head_dim)
        from attnlab.kernels.autograd import attention_forward

        # The launch grid covers the longest real sequence, not the caller's bound.
        out, lse = attention_forward(
            q, k, v, layout="thd", deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max(lengths_q),
            max_seqlen_k=max(lengths_k), **options)
    else:
        _check_reference_dtypes(q=q, k=k, v=v)
        out, lse = _varlen_reference(q, k, v, lengths_q, lengths_k, **options)
    _record_impl(impl)
    return (out, lse, None) if return_attn_probs else out


def _check_varlen_packed(name: str, packed, parts: int) -> None:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != 4 or packed.shape[1] != parts:
        layout = "(total_tokens, 3, heads, head_dim)" if parts == 3 else \
            "(total_k, 2, kv_heads, head_dim)"
        raise ValueError(f"{name} must be {layout}, got shape {tuple(packed.shape)}")


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, impl="auto"):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: qkv is (total_tokens, 3, heads,
    head_dim), one ``cu_seqlens`` / ``max_seqlen`` for queries and keys.  q, k, v are
    views into qkv (no copy); options and returns as :func:`flash_attn_varlen_func`."""
    _check_varlen_packed("qkv", qkv, 3)
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, impl=impl)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, *,
                                    impl="auto"):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: q is (total_q, heads, head_dim), kv
    (total_k, 2, kv_heads, head_dim).  k, v are views into kv (no copy); options and
    returns as :func:`flash_attn_varlen_func`."""
    _check_varlen_packed("kv", kv, 2)
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  impl=impl)
