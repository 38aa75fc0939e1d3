"""Variable-length batches: layout thd, (total_tokens, heads, head_dim), with
``cu_seqlens`` (flash-attn's ``flash_attn_varlen_func`` and its packed forms)."""

from __future__ import annotations

import torch

from attnlab.api.common import (
    _check_options,
    _check_page_table,
    _check_per_sequence,
    _check_reference_dtypes,
    _record_impl,
    _refuse_unsupported,
    _resolve_impl,
    _triton_ready,
    documents_impl,
)
from attnlab.checks import (
    check_bool,
    check_index_tensor,
    check_instance,
    check_int,
    check_scale,
)
from attnlab.inputs import check_packed, check_paged_keys


def _sequence_lengths(cu_seqlens_q, cu_seqlens_k, q, k
                      ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """cu_seqlens_q/k as the kernel reads them and the per-sequence lengths they hold."""
    (cu_q, cu_k), (lengths_q, lengths_k) = cumulative_lengths(
        q.device, ("cu_seqlens_q", cu_seqlens_q, "q", q.shape[0]),
        ("cu_seqlens_k", cu_seqlens_k, "k", k.shape[0]))
    return cu_q, cu_k, lengths_q, lengths_k


def cumulative_lengths(device, *named) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each ``(name, cu_seqlens, tensor name, its total tokens)``'s cu_seqlens as the
    kernels read it (:func:`attnlab.checks.check_index_tensor`: int32 on ``device``, any
    strides taken as given, handed back contiguous) and its per-sequence lengths.

    Every cu_seqlens must be 1-D with batch + 1 >= 2 entries (the same batch for all),
    start at 0, never decrease and end at the tensor's total (a total of None: no last
    entry to match, a paged cache's keys); their values are read with one
    device-to-host copy.
    """
    named = [(name, check_index_tensor(name, cu, device=device), tensor, total)
             for name, cu, tensor, total in named]
    for name, cu, _, _ in named:
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                             f"{tuple(cu.shape)}")
    (first, first_cu, _, _), *others = named
    for name, cu, _, _ in others:
        if cu.shape != first_cu.shape:
            raise ValueError(f"{first} and {name} must have the same batch + 1 entries, "
                             f"got {first_cu.shape[0]} and {cu.shape[0]}")
    entries = first_cu.shape[0]
    offsets = torch.cat([cu for _, cu, _, _ in named]).tolist()
    lengths = []
    for i, (name, _, tensor, total) in enumerate(named):
        cu = offsets[i * entries:(i + 1) * entries]
        if cu[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
        steps = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
        if min(steps) < 0:
            j = steps.index(min(steps))
            raise ValueError(f"{name} must be non-decreasing, got {name}[{j + 1}] = {cu[j + 1]} "
                             f"< {name}[{j}] = {cu[j]}")
        if total is not None and cu[-1] != total:
            raise ValueError(f"{name}[-1] must equal {tensor}'s total tokens {total} "
                             f"({tensor}.shape[0]), got {cu[-1]}")
        lengths.append(steps)
    return [cu for _, cu, _, _ in named], lengths


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


@documents_impl
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None,
                           impl="auto"):
    """Drop-in for flash-attn's ``flash_attn_varlen_func``: a batch of sequences of any lengths.

    q is (total_q, heads, head_dim), k and v (total_k, kv_heads, head_dim): the
    sequences packed one after another.  ``cu_seqlens_q`` / ``cu_seqlens_k`` are
    torch.int32 tensors of batch + 1 cumulative lengths on q's device (sequence i is
    rows ``cu[i]:cu[i+1]``); sequences may be empty and seqlen_q may differ from seqlen_k
    per sequence.  ``max_seqlen_q/k`` must be at least the longest length.  Causal is
    bottom-right aligned per sequence; a query with no visible key (or a sequence with
    no keys) outputs zeros and LSE = -inf.

    **Paged keys (chunked prefill)**: with ``block_table`` ((batch, max_pages) int32),
    k and v are a paged cache (num_pages, page_size, kv_heads, head_dim), page size a
    multiple of 16, and sequence b's keys are its cache positions ``0 .. n_b`` read
    through its row of the table, with ``n_b = seqused_k[b]`` when ``seqused_k``
    ((batch,) int32) is given, else ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``
    (flash-attn's semantics; ``cu_seqlens_k`` may then be None).  ``seqused_k``
    without a table uses the first ``seqused_k[b]`` of sequence b's packed keys.  Both
    are forward only: a call that needs a gradient is refused (NotImplementedError).
    The table's entries and seqused_k are checked on the device, not the host: a bad
    one makes that sequence's rows NaN and is reported by
    :func:`attnlab.check_kvcache_indices` (``impl="reference"`` reads them on the host
    and raises at once).

    Returns ``out`` (total_q, heads, head_dim), or ``(out, softmax_lse, None)`` with
    ``return_attn_probs=True``; LSE is (heads, total_q) float32, flash-attn's varlen layout.

    The checks of cu_seqlens (int32, on q's device, 1-D, first entry 0, non-decreasing,
    last entry = total tokens (not for a paged cache's keys), the max_seqlen bounds)
    read their values on the host: one small device-to-host copy per call, so a call
    cannot be captured in a CUDA graph.  Every check runs before any kernel.
    ``impl="reference"`` runs the float64 reference per sequence.
    """
    _refuse_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    causal = check_bool("causal", causal)
    deterministic = check_bool("deterministic", deterministic)
    return_attn_probs = check_bool("return_attn_probs", return_attn_probs)
    window, softcap = _check_options(window_size, softcap)
    if block_table is not None or seqused_k is not None:
        out, lse = _used_keys_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, block_table, seqused_k, impl=impl,
                                     softmax_scale=softmax_scale, causal=causal, window=window,
                                     softcap=softcap)
        return (out, lse, None) if return_attn_probs else out
    check_packed(q, k, v)
    impl = _resolve_impl(impl, q)
    scale = check_scale(softmax_scale, q.shape[-1], name="softmax_scale")
    cu_seqlens_q, cu_seqlens_k, lengths_q, lengths_k = _sequence_lengths(
        cu_seqlens_q, cu_seqlens_k, q, k)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k)
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    if impl == "triton":
        q, k, v = _triton_ready(q, k, v, q.shape[-1], scale, softcap)
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


def _used_keys_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      block_table, seqused_k, *, impl, softmax_scale, causal, window, softcap):
    """flash_attn_varlen_func with a paged cache and/or seqused_k (forward only)."""
    paged = block_table is not None
    if paged:
        check_paged_keys(q, k, v)
    else:
        check_packed(q, k, v)
    impl = _resolve_impl(impl, q)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(
            "flash_attn_varlen_func with block_table or seqused_k is forward only (no "
            "backward kernel reads pages or used-key counts): call it under torch.no_grad() "
            "or on tensors that do not require grad")
    scale = check_scale(softmax_scale, q.shape[-1], name="softmax_scale")
    if cu_seqlens_k is None and seqused_k is None:
        raise ValueError("cu_seqlens_k may be None only when seqused_k gives each sequence's "
                         "keys")
    named = [("cu_seqlens_q", cu_seqlens_q, "q", q.shape[0])]
    if cu_seqlens_k is not None:
        named.append(("cu_seqlens_k", cu_seqlens_k, "k", None if paged else k.shape[0]))
    cus, lengths = cumulative_lengths(q.device, *named)
    cu_seqlens_q, lengths_q = cus[0], lengths[0]
    cu_seqlens_k, lengths_k = (cus[1], lengths[1]) if cu_seqlens_k is not None else (None, None)
    batch = len(lengths_q)
    capacity = None
    if paged:
        block_table, capacity = _check_page_table(block_table, k, batch, q.device, "k")
        for b, n in enumerate(lengths_k or ()):
            if n > capacity:
                raise ValueError(f"cu_seqlens_k gives sequence {b} {n} keys, more than its "
                                 f"block_table row holds (capacity {capacity} = "
                                 f"block_table.shape[1] x page size)")
    if seqused_k is not None:
        seqused_k = _check_per_sequence("seqused_k", seqused_k, batch, q.device)
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q)
    if lengths_k is not None and seqused_k is None:
        _check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k)
    else:
        check_int("max_seqlen_k", max_seqlen_k, minimum=0)
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    if impl == "triton":
        q, k, v = _triton_ready(q, k, v, q.shape[-1], scale, softcap)
        from attnlab.kernels.forward import flash_forward

        out, lse = flash_forward(
            q, k, v, layout="thd", cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max(lengths_q), max_seqlen_k=capacity or max(lengths_k),
            block_table=block_table, seqused_k=seqused_k, **options)
    else:
        _check_reference_dtypes(q=q, k=k, v=v)
        keys = _used_key_counts(seqused_k, lengths_k, capacity)
        if paged:
            k, v = (_gather_pages(t, block_table, keys) for t in (k, v))
        else:
            k, v = (_first_keys(t, lengths_k, keys) for t in (k, v))
        out, lse = _varlen_reference(q, k, v, lengths_q, keys, **options)
    _record_impl(impl)
    return out, lse


def _used_key_counts(seqused_k, lengths_k, capacity) -> list[int]:
    """The reference's keys per sequence: seqused_k read on the host and checked against
    the keys each sequence has (its cu_seqlens_k length, else the paged capacity)."""
    if seqused_k is None:
        return lengths_k
    used = seqused_k.tolist()
    for b, n in enumerate(used):
        limit = capacity if lengths_k is None else lengths_k[b]
        if not 0 <= n <= limit:
            raise ValueError(f"seqused_k[{b}] = {n} (keys of the sequence) must be in [0, "
                             f"{limit}] (the keys sequence {b} has)")
    return used


def _gather_pages(pages, block_table, keys: list[int]) -> torch.Tensor:
    """Each sequence's first keys[b] cache positions from its pages, packed (thd)."""
    page_size, rows = pages.shape[1], block_table.tolist()
    parts = []
    for b, n in enumerate(keys):
        used = rows[b][:-(-n // page_size)]
        for j, page in enumerate(used):
            if not 0 <= page < pages.shape[0]:
                raise ValueError(f"block_table[{b}, {j}] = {page} must be a page index in "
                                 f"[0, num_pages = {pages.shape[0]})")
        parts.append(pages[torch.tensor(used, dtype=torch.long, device=pages.device)]
                     .flatten(0, 1)[:n])
    return torch.cat(parts, dim=0)


def _first_keys(packed, lengths_k: list[int], keys: list[int]) -> torch.Tensor:
    """Each sequence's first keys[b] of its packed keys, packed again."""
    starts = [0]
    for n in lengths_k:
        starts.append(starts[-1] + n)
    return torch.cat([packed[start:start + n] for start, n in zip(starts, keys, strict=False)])


def _check_varlen_packed(name: str, packed, parts: int) -> None:
    check_instance(name, packed, torch.Tensor)
    if packed.dim() != 4 or packed.shape[1] != parts:
        layout = "(total_tokens, 3, heads, head_dim)" if parts == 3 else \
            "(total_k, 2, kv_heads, head_dim)"
        raise ValueError(f"{name} must be {layout}, got shape {tuple(packed.shape)}")


@documents_impl
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


@documents_impl
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
