"""KV cache and decode: ``flash_attn_with_kvcache`` (flash-attn's semantics: append in
place, rotary, paged caches, split-KV)."""

from __future__ import annotations

import itertools
from types import NoneType

import torch

from attnlab.api.common import (
    _check_has_data,
    _check_options,
    _check_page_table,
    _check_per_sequence,
    _check_reference_dtypes,
    _check_tensor,
    _check_triton_inputs,
    _record_impl,
    _refuse_unsupported,
    _resolve_impl,
    documents_impl,
)
from attnlab.api.fp8 import check_cache_dtype, kvcache_descales
from attnlab.checks import check_bool, check_int, check_scale
from attnlab.kernels._launch import PlanCache


def _check_append_destination(name: str, cache: torch.Tensor) -> None:
    """ValueError when an in-place append into ``cache`` could write one element for two
    positions: a stride-0 (expanded) or otherwise self-overlapping view.  Sorted by stride,
    each dimension must step past everything the smaller-stride dimensions span."""
    span = 0
    for size, stride in sorted(((n, st) for n, st in zip(cache.shape, cache.stride(), strict=True)
                                if n > 1), key=lambda dim: dim[1]):
        if stride <= span:
            raise ValueError(
                f"{name} has overlapping memory (strides {tuple(cache.stride())} for shape "
                f"{tuple(cache.shape)}, e.g. an expand()ed view): appending k/v in place would "
                "write one element for several cache positions; pass a cache that owns its "
                "memory (.contiguous() or .clone())")
        span += stride * (size - 1)


def _check_kvcache_tensors(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                           cache_batch_idx, cache_leftpad, block_table) -> tuple[int, dict]:
    """Shapes, dtypes and devices of flash_attn_with_kvcache's tensors.  Returns the
    capacity and the index tensors as the kernel reads them (contiguous int32)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
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
        check_cache_dtype(name, t, q)
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
        block_table, capacity = _check_page_table(block_table, k_cache, batch, q.device)
        if cache_batch_idx is not None:
            raise NotImplementedError("cache_batch_idx must be None with a paged cache "
                                      "(block_table already picks each sequence's pages)")
        if cache_leftpad is not None:
            raise NotImplementedError("cache_leftpad must be None with a paged cache")
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != batch:
            raise ValueError(f"k_cache's batch ({k_cache.shape[0]}) must equal q's ({batch}) "
                             "unless cache_batch_idx picks the rows")
    if cache_batch_idx is not None:
        cache_batch_idx = _check_per_sequence("cache_batch_idx", cache_batch_idx, batch, q.device)
    if cache_leftpad is not None:
        cache_leftpad = _check_per_sequence("cache_leftpad", cache_leftpad, batch, q.device)
    if isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _check_per_sequence("cache_seqlens", cache_seqlens, batch, q.device)
    elif cache_seqlens is not None and cache_seqlens > capacity:
        raise ValueError(f"cache_seqlens must be an int in [0, capacity = {capacity}], got "
                         f"{cache_seqlens}")

    if (k is None) != (v is None):
        raise ValueError("k and v must both be given (new keys and values to append) or both None")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t)
            if t.dim() != 4 or t.shape[0] != batch or t.shape[1] == 0 or t.shape[2:] != (kv_heads, head_dim):
                raise ValueError(f"{name} must be (batch, seqlen_new, kv_heads, head_dim) = "
                                 f"({batch}, >= 1, {kv_heads}, {head_dim}), got {tuple(t.shape)}")
            check_cache_dtype(name, t, q)
            if t.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given when k and v are appended (where to write them)")
        if isinstance(cache_seqlens, int) and cache_seqlens + k.shape[1] > capacity:
            raise ValueError(f"cache_seqlens + seqlen_new ({cache_seqlens} + {k.shape[1]}) must be "
                             f"<= the cache capacity {capacity}")
        _check_append_destination("k_cache", k_cache)
        _check_append_destination("v_cache", v_cache)
        if k_cache.data_ptr() == v_cache.data_ptr() and k_cache.device.type != "meta":
            raise ValueError("k_cache and v_cache are the same memory: appending v in place "
                             "would overwrite the keys just appended")

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
    # Every call reads the cache's values (and an append writes them), on either impl.
    _check_has_data(q=q, k_cache=k_cache, v_cache=v_cache)
    return capacity, dict(cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                          cache_leftpad=cache_leftpad, block_table=block_table)


def _check_kvcache_contents(q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                            block_table, *, capacity: int, seqlen_new: int,
                            rotary_positions: int, rotary_len: int,
                            rotary_seqlens=None) -> int:
    """The reference path's bounds that depend on index tensors' values, checked with
    one host read (the Triton path checks them on the device: kernels/index_checks.py).

    Returns the longest live key count.
    """
    if not any(isinstance(t, torch.Tensor)
               for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                         rotary_seqlens)):
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
    # Rotary positions start at rotary_seqlens (FA3's) when given, else at cache_seqlens.
    rotary_starts = starts if rotary_seqlens is None else rotary_seqlens.to(torch.int64)
    destinations = _append_destinations(starts, seqlen_new, cache_batch_idx, block_table,
                                        row_size=k_cache.shape[1])
    if destinations is not None:
        flat = destinations.flatten().sort().values
        flags.append((flat[1:] == flat[:-1]).any())
    summary = torch.stack([torch.stack(flags).to(torch.int64).max(), (ends - firsts).max(),
                           rotary_starts.max() + rotary_positions, rotary_starts.min()]).tolist()
    if summary[0]:
        _raise_bad_indices(starts, ends, firsts, cache_batch_idx, block_table, k_cache, capacity,
                           seqlen_new)
        _raise_shared_destination(destinations, block_table)
    if rotary_len and summary[3] < 0:
        raise ValueError(f"rotary_seqlens must be >= 0, got a minimum of {summary[3]}")
    if rotary_len and summary[2] > rotary_len:
        raise ValueError(f"rotary_cos/rotary_sin have {rotary_len} positions but this call "
                         f"rotates up to position {summary[2] - 1}")
    return int(summary[1])


def _append_destinations(starts, seqlen_new, cache_batch_idx, block_table, *, row_size):
    """(batch, seqlen_new) flat cache slots the append writes, or None when they cannot
    collide (no append, or each sequence its own cache row).  ``row_size`` is
    k_cache.shape[1]: a contiguous cache's slot is row * capacity + position, a paged
    one's page * page_size + position % page_size (out-of-range entries are clamped here:
    their own check names them first)."""
    if not seqlen_new or (cache_batch_idx is None and block_table is None):
        return None
    positions = starts[:, None] + torch.arange(seqlen_new, device=starts.device)
    if block_table is None:
        return cache_batch_idx.to(torch.int64)[:, None] * row_size + positions
    columns = (positions // row_size).clamp(0, block_table.shape[1] - 1)
    pages = torch.gather(block_table.to(torch.int64), 1, columns)
    return pages * row_size + positions % row_size


def _raise_shared_destination(destinations, block_table) -> None:
    """The error for two sequences appending into one cache slot (one would overwrite the
    other's new key in place)."""
    if destinations is None:
        return
    name = "block_table" if block_table is not None else "cache_batch_idx"
    owner: dict[int, int] = {}
    for b, row in enumerate(destinations.tolist()):
        for slot in row:
            if slot in owner:
                raise ValueError(f"{name} makes sequences {owner[slot]} and {b} append into one "
                                 f"cache slot: the in-place append would overwrite new keys "
                                 f"with other new keys; give each sequence its own "
                                 f"{'pages' if block_table is not None else 'cache row'}")
            owner[slot] = b


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


@documents_impl
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            impl="auto", max_seqlen_k=None, rotary_seqlens=None,
                            k_descale=None, v_descale=None):
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
    sequence's first live position; with a paged cache both are refused
    (NotImplementedError: the block table already picks and orders each sequence's
    pages, and paged caches have no left padding here).  Rotary (``rotary_cos``/``rotary_sin``
    (seqlen_ro, rotary_dim / 2), rotary_dim a multiple of 16 <= d) rotates q and the
    new k at their cache positions: new key j at ``cache_seqlens + j``; query i at
    ``cache_seqlens + i`` when causal or windowed, else every query at
    ``cache_seqlens`` (flash-attn's rule); ``rotary_seqlens`` ((batch,) int32, FA3's
    argument) replaces cache_seqlens as the rotary start, and is read only with rotary
    (as in FA3).  Causal is bottom-right over the live keys.

    Returns ``out`` (batch, seqlen_q, heads, d), or ``(out, lse)`` with
    ``return_softmax_lse`` (LSE (batch, heads, seqlen_q) fp32, natural log).

    **Index tensors are checked on the device, not the host** (``impl="triton"``, what
    CUDA tensors run): the call never reads their values on the host, so it costs no
    device-to-host synchronisation and captures whole (rotary, append, attention,
    combine) in a CUDA graph.  Every value is range-checked where a kernel reads it
    (cache_seqlens in [0, capacity - seqlen_new], cache_leftpad in [0, cache_seqlens],
    cache_batch_idx a cache row, the block_table entries a sequence uses in [0,
    num_pages), rotary positions within rotary_cos, no two appends into one cache slot).
    A bad one is never used as an address: that sequence's new keys are not written
    (a slot two appends share gets NaN), its output and LSE are NaN, and the kernel
    records it; :func:`attnlab.check_kvcache_indices` raises the ValueError naming it
    (and clears the record) -- call it wherever the caller synchronises anyway.  An
    int ``cache_seqlens`` is checked on the host, at once.  ``impl="reference"``
    reads the index tensors on the host and raises the ValueError before anything is
    written.

    ``num_splits=0`` chooses the split count (:func:`attnlab.kernels.dispatch.choose_num_splits`)
    from host-known sizes: ``max_seqlen_k`` (an optional upper bound on any sequence's
    live keys; it changes speed, never the result) when given, else an int
    ``cache_seqlens`` + seqlen_new, else the cache capacity.  What a call's sizes,
    strides, dtypes and options fix (the checks, tiles, grids, launch arguments) is
    worked out once per signature and kept.
    ``impl``: "triton" (the split-KV kernel; ``last_impl()`` = "triton-decode"),
    "reference" (float64 oracle) or "auto".

    **FP8 cache** (:mod:`attnlab.api.fp8`): k_cache and v_cache float8_e4m3fn with
    ``k_descale``/``v_descale`` (torch.float32, shape () or (1,) per tensor, or (batch,
    kv_heads); the real cache is the stored one times them, vLLM's k_scale/v_scale), q
    and the output bf16/fp16.  Appended k/v (q's dtype) are stored as ``k / k_descale``
    rounded to nearest e4m3, saturated to +-448.  fp8 queries, e5m2 and fnuz caches
    are refused by name.
    """
    return _run(
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
         cache_leftpad, block_table, rotary_seqlens, k_descale, v_descale),
        (softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
         num_splits, return_softmax_lse, impl), max_seqlen_k)


def _run(tensors: tuple, options: tuple, max_seqlen_k):
    """flash_attn_with_kvcache (and FA3's, attnlab.api.fa3) after its arguments are named:
    ``tensors`` (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
    cache_batch_idx, cache_leftpad, block_table, rotary_seqlens, k_descale, v_descale) and
    ``options`` (softmax_scale, causal, window_size, softcap, rotary_interleaved,
    alibi_slopes, num_splits, return_softmax_lse, impl), two tuples: a decode step passes
    them on without naming 23 arguments again (bench/decode_host_python.py)."""
    key = _signature(tensors, options)
    plan = None if key is None else _CALLS.find(key)
    if plan is None:
        plan = _plan_call(tensors, options)
        if key is not None:
            _CALLS.get(key, lambda: plan)
    if max_seqlen_k is not None and (type(max_seqlen_k) is not int or max_seqlen_k < 0):
        max_seqlen_k = check_int("max_seqlen_k", max_seqlen_k, minimum=0)
    return plan.run(tensors, max_seqlen_k)


def _signature(tensors: tuple, options: tuple) -> tuple | None:
    """The key a call's plan is kept under, or None where an argument's form is not
    keyed (then the call is validated and planned from scratch): the options, whether
    the two caches share memory where k/v are appended (refused), then per tensor its
    dtype, sizes, strides, device and 16-byte alignment (None for an absent one).  An
    int cache_seqlens is keyed by kind only, max_seqlen_k not at all: each call checks
    its own.  An fp8 cache's descales are keyed by form like the tensors (their values
    are never read on the host).  No tensor object is remembered: a decode step's q is
    a new tensor every step, and one object's sizes, strides, dtype and memory can all
    change in place (resize_, as_strided_, set_, ``.data =``).

    This runs on every decode call (bench/NOTES.md S9, S21): ``type(x)`` written out
    per option (CPython calls it inline; through ``map`` it costs several times more),
    one loop, one tuple per tensor."""
    (softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
     return_softmax_lse, impl) = options
    if (type(softmax_scale), type(causal), type(window_size), type(softcap),
            type(rotary_interleaved), type(alibi_slopes), type(num_splits),
            type(return_softmax_lse), type(impl)) not in _KEYED_OPTION_TYPES:
        return None
    # A window of two ints only (a bool is not one); any other is checked from scratch.
    if len(window_size) != 2 or type(window_size[0]) is not int or \
            type(window_size[1]) is not int:
        return None
    try:
        key = [options, tensors[3] is not None and tensors[1].data_ptr() == tensors[2].data_ptr()]
        for t in tensors:
            if t is None:
                key.append(None)
            elif type(t) is _TENSOR:
                key.append((t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16))
            elif type(t) is int:
                # cache_seqlens (its value checked per call); an int anywhere else fails
                # the plan's checks, so no plan is ever kept under such a key.
                key.append(int)
            else:  # a list, a NumPy value, a tensor subclass: validated per call
                return None
    except (RuntimeError, AttributeError):  # no data_ptr (not a tensor); sparse / nested
        return None
    return tuple(key)


# Per option (in the signature's order), the types a signature keys by value; others
# are validated from scratch per call.  Never a bool where a number is meant nor a
# number where a bool is: True == 1 == 1.0, so causal=1 would find causal=True's plan
# and skip the check that refuses it.  An int and a float of one value check alike.
_OPTION_TYPES = (
    (float, int, NoneType),  # softmax_scale
    (bool,),  # causal
    (tuple,),  # window_size (its two entries: ints)
    (float, int),  # softcap
    (bool,),  # rotary_interleaved
    (NoneType,),  # alibi_slopes (anything else is refused)
    (int,),  # num_splits
    (bool,),  # return_softmax_lse
    (str,),  # impl
)
_KEYED_OPTION_TYPES = frozenset(itertools.product(*_OPTION_TYPES))
_TENSOR = torch.Tensor
# Plans by signature (kernels/_launch.PlanCache: the most recent 512).
_CALLS = PlanCache()


def _plan_call(tensors: tuple, options: tuple):
    """Every check that a call's signature decides (raising the clear error), and the
    plan that runs such calls: :class:`_TritonCall` or :class:`_ReferenceCall`
    (``tensors`` and ``options`` as :func:`_run` takes them)."""
    from attnlab.kernels.dispatch import MAX_SPLITS

    (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
     cache_leftpad, block_table, rotary_seqlens, k_descale, v_descale) = tensors
    (softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
     return_softmax_lse, impl) = options

    _refuse_unsupported(alibi_slopes=alibi_slopes)
    causal = check_bool("causal", causal)
    rotary_interleaved = check_bool("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = check_bool("return_softmax_lse", return_softmax_lse)
    window, softcap = _check_options(window_size, softcap)
    num_splits = check_int("num_splits", num_splits, minimum=0, maximum=MAX_SPLITS)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = check_int("cache_seqlens", cache_seqlens, minimum=0)
    capacity, indices = _check_kvcache_tensors(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table)
    descales = kvcache_descales(q, k_cache, v_cache, k_descale, v_descale)
    if rotary_seqlens is not None:
        indices["rotary_seqlens"] = _check_per_sequence("rotary_seqlens", rotary_seqlens,
                                                        q.shape[0], q.device)
    impl = _resolve_impl(impl, q)
    head_dim = q.shape[3]
    scale = check_scale(softmax_scale, head_dim, name="softmax_scale")
    if impl == "triton":
        _check_triton_inputs(q, head_dim, scale, softcap)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have unit stride along head_dim (it is updated in "
                                 f"place, so attnlab cannot copy it), got strides {t.stride()}")
        if capacity >= 2**31 or k_cache.shape[0] >= 2**31:
            raise ValueError(f"the cache's capacity ({capacity}) must be < 2^31 positions")
    else:  # before the append: a refused call writes nothing into the cache
        _check_reference_dtypes(q=q, **({} if descales[0] is not None else
                                        {"k_cache": k_cache, "v_cache": v_cache}))
    seqlen_new = 0 if k is None else k.shape[1]
    local = causal or window != (-1, -1)
    rotary_positions = (max(seqlen_new, q.shape[1]) if local else seqlen_new) \
        if rotary_cos is not None else 0
    shape = dict(capacity=capacity, seqlen_new=seqlen_new, rotary_positions=rotary_positions,
                 rotary_len=0 if rotary_cos is None else rotary_cos.shape[0],
                 local=local, return_lse=return_softmax_lse,
                 options=dict(scale=scale, causal=causal, window=window, softcap=softcap))
    if impl == "triton":
        # Which index arguments arrive as views the kernels cannot read: copied per call.
        copies = tuple(isinstance(t, torch.Tensor) and not t.is_contiguous()
                       for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                                 rotary_seqlens))
        return _TritonCall(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, indices,
                           copies=copies, interleaved=rotary_interleaved,
                           num_splits=num_splits, descales=descales, **shape)
    return _ReferenceCall(interleaved=rotary_interleaved, **shape)


def _check_int_start(cache_seqlens, *, capacity: int, seqlen_new: int, rotary_positions: int,
                     rotary_len: int) -> int:
    """An int (or absent) cache_seqlens against the capacity and rotary table: host
    arithmetic, every call.  Returns the start position."""
    start = capacity if cache_seqlens is None else cache_seqlens
    if type(start) is not int:
        start = check_int("cache_seqlens", start, minimum=0)
    if start < 0 or start + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens = {start} must be in [0, capacity - seqlen_new] = "
                         f"[0, {capacity - seqlen_new}] (capacity {capacity})")
    if rotary_len and start + rotary_positions > rotary_len:
        raise ValueError(f"rotary_cos/rotary_sin have {rotary_len} positions but this call "
                         f"rotates up to position {start + rotary_positions - 1}")
    return start


class _TritonCall:
    """One signature's Triton path: the append/rotary launch (kernels/append.py) when k
    and v are given, then the decode plan (kernels/decode.py).  A call checks an int
    cache_seqlens, copies index tensors the kernels cannot read as given (a strided
    view), and launches; no value of any tensor is read on the host."""

    def __init__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, indices, *,
                 copies, interleaved, num_splits, capacity, seqlen_new, rotary_positions, rotary_len,
                 local, return_lse, options, descales) -> None:
        from attnlab.kernels.append import AppendPlan
        from attnlab.kernels.decode import decode_plan

        self.capacity, self.seqlen_new = capacity, seqlen_new
        self.rotary_positions, self.rotary_len = rotary_positions, rotary_len
        self.num_splits, self.return_lse = num_splits, return_lse
        self.int_seqlens = not isinstance(indices["cache_seqlens"], torch.Tensor)
        names = ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                 "rotary_seqlens")
        self.copies, self.copy_any = copies, any(copies)
        # rotary_seqlens is read only with rotary (FA3's rule).
        self.read_rotary_seqlens = rotary_cos is not None
        kernel_indices = tuple(None if self.int_seqlens and n == "cache_seqlens" else
                               indices.get(n) for n in names)
        if not self.read_rotary_seqlens:
            kernel_indices = (*kernel_indices[:4], None)
        self.q_copy = q.stride(-1) != 1 and rotary_cos is None
        attended = q
        self.append = None
        if k is not None:
            self.append = AppendPlan(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                     indices=kernel_indices, capacity=capacity,
                                     interleaved=interleaved, q_same_position=not local,
                                     descales=descales)
            if rotary_cos is not None:
                attended = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.q_copy:
            attended = q.contiguous()
        self.decode = decode_plan(attended, k_cache, v_cache, seqlen_new=seqlen_new,
                                  seqlens_tensor=not self.int_seqlens,
                                  indices=kernel_indices[1:4], descales=descales,
                                  write_lse=return_lse, **options)

    def run(self, tensors: tuple, max_seqlen_k):
        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
         cache_leftpad, block_table, rotary_seqlens, k_descale, v_descale) = tensors
        # An fp8 cache's descales go to the kernels as given: the plan keeps the strides
        # of their (batch, kv_heads) views (a view shares its tensor's data pointer).
        descales = (k_descale, v_descale)
        if self.int_seqlens:
            cache_seqlen = _check_int_start(
                cache_seqlens, capacity=self.capacity, seqlen_new=self.seqlen_new,
                rotary_positions=self.rotary_positions, rotary_len=self.rotary_len)
            cache_seqlens = None
        else:
            cache_seqlen = 0
        if not self.read_rotary_seqlens:
            rotary_seqlens = None
        if self.copy_any:
            cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_seqlens = (
                t.contiguous() if copy else t for t, copy in zip(
                    (cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                     rotary_seqlens), self.copies, strict=True))
        if self.q_copy:
            q = q.contiguous()
        if self.append is not None:
            q = self.append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                            (cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                             rotary_seqlens), cache_seqlen, descales)
        out, lse = self.decode.run(q, k_cache, v_cache, cache_seqlens, cache_batch_idx,
                                   cache_leftpad, block_table, cache_seqlen, self.num_splits,
                                   max_seqlen_k, descales)
        _record_impl("triton-decode")
        return (out, lse) if self.return_lse else out


class _ReferenceCall:
    """One signature's float64 reference path: the index tensors read on the host and
    checked (ValueError before anything is written), then rotary, the append and the
    attention of attnlab.reference.decode."""

    def __init__(self, *, interleaved, capacity, seqlen_new, rotary_positions, rotary_len,
                 local, return_lse, options) -> None:
        self.interleaved, self.capacity, self.seqlen_new = interleaved, capacity, seqlen_new
        self.rotary_positions, self.rotary_len = rotary_positions, rotary_len
        self.local, self.return_lse, self.options = local, return_lse, options

    def run(self, tensors: tuple, max_seqlen_k):
        from attnlab.reference.decode import (
            append_to_cache,
            apply_rotary,
            as_lengths,
            kvcache_attention,
            positions_from,
        )
        from attnlab.reference.fp8 import per_head, quantize_e4m3

        (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
         cache_leftpad, block_table, rotary_seqlens, k_descale, v_descale) = tensors
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary_seqlens = (
            t.contiguous() if isinstance(t, torch.Tensor) else t
            for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                      rotary_seqlens))
        if not isinstance(cache_seqlens, torch.Tensor):
            _check_int_start(cache_seqlens, capacity=self.capacity, seqlen_new=self.seqlen_new,
                             rotary_positions=self.rotary_positions, rotary_len=self.rotary_len)
        _check_kvcache_contents(
            q, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
            capacity=self.capacity, seqlen_new=self.seqlen_new,
            rotary_positions=self.rotary_positions, rotary_len=self.rotary_len,
            rotary_seqlens=None if rotary_cos is None else rotary_seqlens)
        batch, seqlen_q = q.shape[:2]
        if rotary_cos is not None:
            start = as_lengths(cache_seqlens if rotary_seqlens is None else rotary_seqlens,
                               batch, q.device)
            q = apply_rotary(q, rotary_cos, rotary_sin,
                             positions_from(start, seqlen_q, same_position=not self.local),
                             interleaved=self.interleaved)
            k = apply_rotary(k, rotary_cos, rotary_sin, positions_from(start, self.seqlen_new),
                             interleaved=self.interleaved)
        k_descale, v_descale = kvcache_descales(q, k_cache, v_cache, k_descale, v_descale)
        if k is not None:
            if k_descale is not None:
                k = quantize_e4m3(k, per_head(k_descale))
                v = quantize_e4m3(v, per_head(v_descale))
            append_to_cache(k_cache, v_cache, k, v, cache_seqlens,
                            cache_batch_idx=cache_batch_idx, block_table=block_table)
        out, lse = kvcache_attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                     seqlen_new=self.seqlen_new, cache_batch_idx=cache_batch_idx,
                                     cache_leftpad=cache_leftpad, block_table=block_table,
                                     k_descale=k_descale, v_descale=v_descale, **self.options)
        _record_impl("reference")
        return (out, lse) if self.return_lse else out


def check_kvcache_indices(device=None) -> None:
    """Raise ValueError naming every bad index tensor value that an attnlab kernel read
    on ``device`` (default: the current CUDA device, else the CPU) since the last check
    -- a cache_seqlens past the capacity, a block_table entry outside the page pool, two
    sequences appending into one slot, ... (see :func:`flash_attn_with_kvcache`) -- and
    clear the record.  Returns None when every index was in range.  Synchronises with the
    device: call it where the caller synchronises anyway (after reading sampled tokens)."""
    from attnlab.kernels.index_checks import check_index_errors

    check_index_errors(device)
