"""FlashAttention-3's Python interface on attnlab's kernels: ``import attnlab.flash_attn_interface``.

The signatures, positional orders and returns are those of FA3's
``hopper/flash_attn_interface.py`` (Dao-AILab/flash-attention, read at 0251105, Aug 2026):
``flash_attn_func`` has no ``dropout_p`` (``flash_attn_func(q, k, v, 0.5, True)`` is
softmax_scale=0.5, causal=True) and returns ``out``, or ``(out, softmax_lse)`` with
``return_attn_probs=True``; ``flash_attn_varlen_func`` takes ``seqused_q``/``seqused_k``;
``flash_attn_with_kvcache`` takes ``page_table``, ``cu_seqlens_q``, ``cu_seqlens_k_new``,
``max_seqlen_q`` and ``rotary_seqlens``.  Every call maps onto attnlab's FA2-style calls
(:mod:`.dense`, :mod:`.varlen`, :mod:`.kvcache`): no kernel of its own.

**FP8** (:mod:`attnlab.api.fp8`): ``flash_attn_func`` with float8_e4m3fn q, k, v and
``q_descale``/``k_descale``/``v_descale`` ((batch, kv_heads) float32, or per tensor)
runs attnlab's FP8 forward (bf16 output, no backward); ``flash_attn_with_kvcache``
takes a float8_e4m3fn cache with ``k_descale``/``v_descale`` and bf16/fp16 queries.
Descales are required with fp8 tensors (FA3 reads a missing one as 1.0; here that is a
ValueError: pass ``torch.ones(1)``).  Refused by name: ``q_descale`` on the decode path
(fp8 queries), descales in ``flash_attn_varlen_func`` (no varlen FP8 kernel).

**Refused by name** (NotImplementedError), never ignored: ``qv`` (attnlab has no extra
query-value product), ``attention_chunk`` != 0 (chunked attention is not one diagonal band,
the only mask attnlab's kernels know), a ``scheduler_metadata`` tensor.  A v head dim other than
q's is refused by the calls below (ValueError).  ``learnable_sink`` is FA4's (flash_attn.cute),
not FA3's: FA3's signatures have no such argument, so neither do these.

**Hints** (validated, then left to attnlab's own planning; results never depend on
them): ``pack_gqa`` (attnlab's decode kernel always packs a KV group's query heads),
``sm_margin`` (attnlab sizes its split-KV grid from the device's SM count), and
``num_splits`` of ``flash_attn_func``/``flash_attn_varlen_func`` (attnlab's prefill
kernel does not split the keys; its decode route picks its own count).
``flash_attn_with_kvcache``'s ``num_splits`` is honoured (0: attnlab chooses).
``deterministic`` is accepted: attnlab's backward has no atomics, so it is bit-identical
run to run either way.  Causal and windows are bottom-right aligned, as in FA3.
"""

from __future__ import annotations

import torch

from attnlab.api import dense, fp8, kvcache, varlen
from attnlab.api.common import documents_impl
from attnlab.api.merge import _check_state, _merge_stacked_at
from attnlab.checks import check_bool, check_instance, check_int, is_float8
from attnlab.inputs import check_packed

__all__ = [
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "get_scheduler_metadata",
]


def _refuse_fa3_unsupported(*, qv, attention_chunk, **refused_descales) -> None:
    """FA3 arguments attnlab has no kernel for: refused, never ignored.  ``refused_descales``
    are descale arguments this call has no FP8 kernel for (each with why)."""
    if qv is not None:
        raise NotImplementedError("qv must be None: attnlab has no extra query-value term "
                                  "(FA3's qv adds qv @ v^T to the scores)")
    for name, (value, why) in refused_descales.items():
        if value is not None:
            raise NotImplementedError(f"{name} must be None here: {why}")
    if check_int("attention_chunk", attention_chunk, minimum=0):
        raise NotImplementedError(
            f"attention_chunk must be 0, got {attention_chunk}: attnlab's masks are one "
            "diagonal band (causal / window_size), and chunked attention is not one")


def _check_hints(*, pack_gqa, sm_margin) -> None:
    """Performance hints: checked like any argument, then left to attnlab's planner."""
    if pack_gqa is not None:
        check_bool("pack_gqa", pack_gqa)
    check_int("sm_margin", sm_margin, minimum=0)


@documents_impl
def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False, *, impl="auto"):
    """FA3's ``flash_attn_func``: q (batch, seqlen_q, heads, d), k and v (batch, seqlen_k,
    kv_heads, d).  Returns ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs``
    (LSE (batch, heads, seqlen_q) fp32, natural log).  Differentiable in q, k, v.  Runs
    :func:`attnlab.flash_attn_func`; refusals and hints as in the module doc.  With
    float8_e4m3fn q, k, v (or any descale given): :func:`attnlab.api.fp8.flash_attn_fp8_func`
    (bf16 out, no backward)."""
    _refuse_fa3_unsupported(qv=qv, attention_chunk=attention_chunk)
    _check_hints(pack_gqa=pack_gqa, sm_margin=sm_margin)
    check_int("num_splits", num_splits, minimum=0)
    return_attn_probs = check_bool("return_attn_probs", return_attn_probs)
    descales = (q_descale, k_descale, v_descale)
    if any(d is not None for d in descales) or any(is_float8(t) for t in (q, k, v)):
        out, lse = fp8.flash_attn_fp8_func(q, k, v, *descales, softmax_scale, causal,
                                           window_size, softcap, return_lse=True, impl=impl)
        return (out, lse) if return_attn_probs else out
    out, lse, _ = dense.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap,
                                        None, deterministic, True, impl=impl)
    return (out, lse) if return_attn_probs else out


@documents_impl
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, impl="auto"):
    """FA3's ``flash_attn_varlen_func``: packed q (total_q, heads, d), k and v (total_k,
    kv_heads, d), int32 ``cu_seqlens_q``/``cu_seqlens_k`` (batch + 1) as
    :func:`attnlab.flash_attn_varlen_func`.

    ``seqused_q`` / ``seqused_k`` ((batch,) int32, optional): sequence b uses only its
    first ``seqused[b]`` rows (``cu[b] .. cu[b] + seqused[b]``); causal is bottom-right
    over the used lengths, and ``max_seqlen_q/k`` must bound the used lengths.  FA3 leaves
    the output rows past ``seqused_q`` unwritten; here they are 0 with LSE = -inf, and
    the unused rows of q, k, v get zero gradient.  It costs no copy: each sequence becomes
    three for the kernel (used queries against used keys; the unused queries against no
    keys; the unused keys with no queries), at the price of two extra small host reads
    (checking seqused against cu_seqlens).

    Returns ``out`` (total_q, heads, d), or ``(out, softmax_lse)`` with
    ``return_attn_probs`` (LSE (heads, total_q) fp32).  Differentiable in q, k, v.
    Refusals and hints as in the module doc.
    """
    no_varlen_fp8 = "attnlab's FP8 forward takes dense (batch, seqlen, heads, d) inputs"
    _refuse_fa3_unsupported(qv=qv, attention_chunk=attention_chunk,
                            q_descale=(q_descale, no_varlen_fp8),
                            k_descale=(k_descale, no_varlen_fp8),
                            v_descale=(v_descale, no_varlen_fp8))
    _check_hints(pack_gqa=pack_gqa, sm_margin=sm_margin)
    check_int("num_splits", num_splits, minimum=0)
    return_attn_probs = check_bool("return_attn_probs", return_attn_probs)
    if seqused_q is not None or seqused_k is not None:
        check_packed(q, k, v)
        cu_seqlens_q, cu_seqlens_k = _used_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k,
                                                      seqused_q, seqused_k, max_seqlen_q,
                                                      max_seqlen_k)
    out, lse, _ = varlen.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale,
        causal, window_size, softcap, None, deterministic, True, impl=impl)
    return (out, lse) if return_attn_probs else out


def _used_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens of 3 x batch sequences that run seqused exactly (see flash_attn_varlen_func):
    per sequence b, (used q, used k), (unused q, no k), (no q, unused k)."""
    *_, lengths_q, lengths_k = varlen._sequence_lengths(cu_seqlens_q, cu_seqlens_k, q, k)
    batch = len(lengths_q)
    used = []
    for name, seqused, lengths in (("seqused_q", seqused_q, lengths_q),
                                   ("seqused_k", seqused_k, lengths_k)):
        if seqused is None:
            used.append(lengths)
            continue
        seqused = kvcache._check_per_sequence(name, seqused, batch, q.device)
        counts = seqused.tolist()
        for b, (count, length) in enumerate(zip(counts, lengths, strict=True)):
            if not 0 <= count <= length:
                raise ValueError(f"{name}[{b}] = {count} must be in [0, sequence {b}'s length "
                                 f"{length}] (from the cu_seqlens)")
        used.append(counts)
    varlen._check_max_seqlen("max_seqlen_q", max_seqlen_q, used[0])
    varlen._check_max_seqlen("max_seqlen_k", max_seqlen_k, used[1])
    starts_q = [0, *_running_sum(lengths_q)]
    starts_k = [0, *_running_sum(lengths_k)]
    cu_q, cu_k = [], []
    for b in range(batch):
        cu_q += [starts_q[b], starts_q[b] + used[0][b], starts_q[b + 1]]
        cu_k += [starts_k[b], starts_k[b] + used[1][b], starts_k[b] + used[1][b]]
    return tuple(torch.tensor([*cu, total], dtype=torch.int32, device=q.device)
                 for cu, total in ((cu_q, starts_q[-1]), (cu_k, starts_k[-1])))


def _running_sum(lengths: list[int]) -> list[int]:
    total, sums = 0, []
    for length in lengths:
        total += length
        sums.append(total)
    return sums


@documents_impl
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False, *,
                            impl="auto"):
    """FA3's ``flash_attn_with_kvcache``: :func:`attnlab.flash_attn_with_kvcache` (append
    k/v in place, rotary, split-KV; its rules and refusals) with FA3's names and extras.

    * ``page_table`` is the paged cache's block table (batch, max_pages) int32 (page size
      a multiple of 16; ``cache_leftpad`` is refused with a paged cache).  With
      ``cache_batch_idx`` it picks rows of ``page_table`` (FA3's rule): one index_select
      of the small table, after a host read checking the indices (skipped, and the
      indices trusted, while a CUDA graph is captured).
    * ``rotary_seqlens`` (batch,) int32: the rotary start in place of cache_seqlens
      (read only with rotary, as in FA3).
    * ``cu_seqlens_q`` (batch + 1) int32 with ``max_seqlen_q``: varlen queries, q
      (total_q, heads, d); ``cu_seqlens_k_new``: varlen new keys, k and v (total_new,
      kv_heads, d).  Each sequence is causal bottom-right against its own live keys.
      attnlab's decode kernel takes one query length per call, so these run **one attnlab
      call per sequence** (batch launches, each with its own checks and host read of
      the index tensors): correct, not fast.  A sequence with no queries but new keys, or
      (with rotary) with no new keys, is refused (NotImplementedError naming the
      cu_seqlens): each call appends and attends together.

    Returns ``out`` ((batch, seqlen_q, heads, d), or (total_q, heads, d) with
    cu_seqlens_q), or ``(out, softmax_lse)`` with ``return_softmax_lse`` (LSE (batch,
    heads, seqlen_q), or (heads, total_q)).  FA3 at 0251105 also appends its split
    accumulators to that tuple (``out, lse, *rest = ...`` reads both); attnlab has none
    to return.  No backward (as FA3).  Refusals and hints as in the module doc;
    ``num_splits`` is honoured.  An fp8 cache takes ``k_descale``/``v_descale`` (the
    module doc); ``q_descale`` is refused (the decode path takes bf16/fp16 queries).
    """
    _refuse_fa3_unsupported(qv=qv, attention_chunk=attention_chunk, q_descale=(
        q_descale, "attnlab's decode takes bf16/fp16 queries (an fp8 cache's factors are "
                   "k_descale and v_descale)"))
    _check_hints(pack_gqa=pack_gqa, sm_margin=sm_margin)
    if scheduler_metadata is not None:
        raise NotImplementedError("scheduler_metadata must be None (what get_scheduler_metadata "
                                  "returns here): attnlab plans its split count per call")
    return_softmax_lse = check_bool("return_softmax_lse", return_softmax_lse)
    check_instance("q", q, torch.Tensor)
    varlen_q = cu_seqlens_q is not None
    if varlen_q and not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"cu_seqlens_q must be a torch.int32 tensor, got "
                        f"{type(cu_seqlens_q).__name__}")
    if page_table is not None and cache_batch_idx is not None:
        batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
        page_table = _page_rows(page_table, cache_batch_idx, batch, q.device)
        cache_batch_idx = None
    if not varlen_q and max_seqlen_q is not None:
        raise ValueError("max_seqlen_q is read only with cu_seqlens_q (varlen queries); pass "
                         "None without it")
    if not varlen_q and cu_seqlens_k_new is None:
        # One attnlab call, its arguments by position (kvcache._run): a decode step builds
        # no dict of 17 options to pass on.  The LSE only where asked: unasked, the decode
        # kernel neither allocates nor writes it.
        return kvcache._run(
            (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
             cache_leftpad, page_table, rotary_seqlens, k_descale, v_descale),
            (softmax_scale, causal, window_size, softcap, rotary_interleaved, None, num_splits,
             return_softmax_lse, impl), None)
    options = dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                   cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                   block_table=page_table, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap,
                   rotary_interleaved=rotary_interleaved, num_splits=num_splits,
                   return_softmax_lse=True, impl=impl, rotary_seqlens=rotary_seqlens,
                   k_descale=k_descale, v_descale=v_descale)
    out, lse = _per_sequence(q, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new,
                             max_seqlen_q, options)
    return (out, lse) if return_softmax_lse else out


def _page_rows(page_table, cache_batch_idx, batch: int, device) -> torch.Tensor:
    """page_table[cache_batch_idx], the indices checked first (one host read)."""
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 \
            or page_table.dim() != 2:
        raise TypeError(f"page_table must be a 2-D torch.int32 tensor (rows, max_pages), got "
                        f"{getattr(page_table, 'shape', type(page_table).__name__)}")
    if page_table.device != device:
        raise ValueError(f"page_table must be on q's device {device}, got {page_table.device}")
    cache_batch_idx = kvcache._check_per_sequence("cache_batch_idx", cache_batch_idx, batch,
                                                  device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < page_table.shape[0]:
                raise ValueError(f"cache_batch_idx[{b}] = {row} must be a row of page_table: in "
                                 f"[0, {page_table.shape[0]})")
    return page_table.index_select(0, cache_batch_idx)


def _per_sequence(q, k_cache, v_cache, k, v, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                  options):
    """flash_attn_with_kvcache with varlen queries and/or new keys: one call per sequence."""
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k_new is not None
    named = []
    for name, t, packed in (("q", q, varlen_q), ("k", k, varlen_k), ("v", v, varlen_k)):
        if t is None:
            continue
        check_instance(name, t, torch.Tensor)
        if t.dim() != (3 if packed else 4):
            form = "(total, heads, head_dim) with its cu_seqlens" if packed else \
                "(batch, seqlen, heads, head_dim)"
            raise ValueError(f"{name} must be {form}, got shape {tuple(t.shape)}")
    if varlen_q:
        named.append(("cu_seqlens_q", cu_seqlens_q, "q", q.shape[0]))
    if varlen_k:
        if k is None or v is None:
            raise ValueError("cu_seqlens_k_new needs the new k and v (total_new, kv_heads, d)")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        named.append(("cu_seqlens_k_new", cu_seqlens_k_new, "k", k.shape[0]))
    _, lengths = varlen.cumulative_lengths(q.device, *named)
    lengths_q = lengths[0] if varlen_q else [q.shape[1]] * q.shape[0]
    lengths_k = lengths[-1] if varlen_k else None
    batch = len(lengths[0])
    if varlen_q:
        if max_seqlen_q is None:
            raise ValueError("max_seqlen_q must be given with cu_seqlens_q (FA3's rule)")
        varlen._check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q)
    elif q.shape[0] != batch:
        raise ValueError(f"q's batch ({q.shape[0]}) must equal cu_seqlens_k_new's ({batch})")
    if k is not None and not varlen_k and k.shape[0] != batch:
        raise ValueError(f"k's batch ({k.shape[0]}) must equal cu_seqlens_q's ({batch})")
    for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "rotary_seqlens"):
        if isinstance(options[name], torch.Tensor):
            options[name] = kvcache._check_per_sequence(name, options[name], batch, q.device)
    table = options["block_table"]
    if isinstance(table, torch.Tensor) and (table.dim() != 2 or table.shape[0] != batch):
        raise ValueError(f"page_table must be (batch, max_pages) = ({batch}, ...), got "
                         f"{tuple(table.shape)}")

    starts_q, starts_k = [0, *_running_sum(lengths_q)], [0, *_running_sum(lengths_k or [])]
    outs, lses = [], []
    for b in range(batch):
        q_b = q[starts_q[b]:starts_q[b + 1]][None] if varlen_q else q[b:b + 1]
        k_b, v_b = (None, None) if k is None else \
            ((k[starts_k[b]:starts_k[b + 1]][None], v[starts_k[b]:starts_k[b + 1]][None])
             if varlen_k else (k[b:b + 1], v[b:b + 1]))
        if k_b is not None and k_b.shape[1] == 0:
            if options["rotary_cos"] is not None:
                raise NotImplementedError(
                    f"cu_seqlens_k_new: sequence {b} appends no keys, and attnlab rotates q "
                    "only together with appended keys; give every sequence a new key")
            k_b = v_b = None
        if varlen_q and q_b.shape[1] == 0:
            if k_b is not None:
                raise NotImplementedError(
                    f"cu_seqlens_q: sequence {b} has no queries but {k_b.shape[1]} new keys; "
                    "attnlab appends keys only within an attention call")
            outs.append(q_b.new_zeros((1, 0, *q.shape[1:])))
            lses.append(torch.zeros((1, q.shape[-2], 0), dtype=torch.float32, device=q.device))
            continue
        out, lse = kvcache.flash_attn_with_kvcache(q_b, k_cache, v_cache, k_b, v_b,
                                                   **_sequence_options(options, b, q.device))
        outs.append(out)
        lses.append(lse)
    if varlen_q:
        return torch.cat([o[0] for o in outs]), torch.cat([lse[0] for lse in lses], dim=1)
    return torch.cat(outs), torch.cat(lses)


def _sequence_options(options: dict, b: int, device) -> dict:
    """Sequence b's slice of flash_attn_with_kvcache's per-batch options."""
    picked = dict(options)
    for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "rotary_seqlens",
                 "block_table"):
        if isinstance(options[name], torch.Tensor):
            picked[name] = options[name][b:b + 1]
    for name in ("k_descale", "v_descale"):  # per (batch, kv_head): sequence b's row
        if isinstance(options[name], torch.Tensor) and options[name].dim() == 2:
            picked[name] = options[name][b:b + 1]
    if options["block_table"] is None and options["cache_batch_idx"] is None:
        # A contiguous cache keeps every sequence's row: pick row b for this call.
        picked["cache_batch_idx"] = torch.tensor([b], dtype=torch.int32, device=device)
    return picked


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                           headdim, cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None,
                           cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           page_size=None, max_seqlen_k_new=0, causal=False,
                           window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    """FA3's ``get_scheduler_metadata``: the schedule to precompute for
    ``flash_attn_with_kvcache(scheduler_metadata=...)``.  attnlab plans its split count
    inside each call (from the live lengths it checks anyway), so there is nothing to
    precompute: this returns None, which flash_attn_with_kvcache reads as "plan it per
    call" -- the same result FA3 computes, with FA3's call sequence intact."""
    return None


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FA3's ``flash_attn_combine``: merge split partials stacked on dim 0.

    ``out_partial`` (num_splits, batch, seqlen, heads, d) and ``lse_partial``
    (num_splits, batch, seqlen, heads), natural log (FA3's layout; any (num_splits, ...,
    d) with lse = out.shape[:-1] works).  Returns ``(out, lse)``: out (batch, seqlen,
    heads, d) in ``out_dtype`` (default out_partial's dtype), lse (batch, seqlen, heads)
    fp32 (float64 for float64 inputs).  Computed as :func:`attnlab.merge_states` (a split
    with lse = -inf weighs 0).  ``out`` (a buffer to write into) must be None.
    """
    if out is not None:
        raise NotImplementedError("out must be None: attnlab returns a new tensor")
    _check_state("out_partial", out_partial, "lse_partial", lse_partial)
    if out_partial.dim() < 2 or lse_partial.shape != out_partial.shape[:-1] \
            or out_partial.shape[0] == 0:
        raise ValueError(f"out_partial must be (num_splits >= 1, ..., d) and lse_partial its "
                         f"shape without d; got {tuple(out_partial.shape)} and "
                         f"{tuple(lse_partial.shape)}")
    if out_dtype is not None and out_dtype not in (torch.float32, torch.float16,
                                                   torch.bfloat16, torch.float64):
        raise TypeError(f"out_dtype must be None or torch.float32, float16, bfloat16 or "
                        f"float64, got {out_dtype!r}")
    merged, lse = _merge_stacked_at(out_partial, lse_partial, 0)
    return merged.to(out_dtype or out_partial.dtype), lse
