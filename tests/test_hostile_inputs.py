"""Issue #28's hostile inputs, one test each: a clean refusal naming the argument, or
the float64 math's answer -- never a misread, a traceback or an append into the wrong row.

* index tensors (``cu_seqlens_*``, ``cache_seqlens``, ``block_table``,
  ``cache_batch_idx``, ``cache_leftpad``) of any stride are read as given (a strided
  view gives the contiguous call's bits); another dtype or device is refused by name;
* an in-place append into an expanded (stride-0), self-overlapping or shared cache is
  refused by name;
* ``softmax_scale`` and ``softcap``: the fp32 kernels' range (``checks.kernel_scale_range``)
  is enforced up front with the range in the message, and both edges compute the
  reference's answer; a number past float's range is a ValueError, not an OverflowError;
* ``window_size=(2**70, 0)`` is the window that reaches every key;
* sparse and nested tensors are TypeErrors naming the argument; meta tensors are
  refused where their values would be read.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_inputs import make_qkv, paged_copy
from attnlab import (
    attention,
    check_kvcache_indices,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    merge_state,
)
from attnlab.accuracy import check_accuracy
from attnlab.checks import FP32_MAX, SOFTCAP_REACH, kernel_scale_range
from attnlab.kernels.forward import kernel_is_interpreted
from attnlab.reference import tiled

runs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and not kernel_is_interpreted(),
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOG2E = 1.4426950408889634


def strided(values: list[int], device=DEVICE) -> torch.Tensor:
    """An int32 view with stride 2 holding ``values`` (a 99 between each pair)."""
    backing = torch.full((2 * len(values),), 99, dtype=torch.int32)
    backing[::2] = torch.tensor(values, dtype=torch.int32)
    view = backing.to(device)[::2]
    assert view.stride() == (2,)
    return view


def packed_qkv(total_q: int, total_k: int, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, 16, generator=gen).half().to(DEVICE)
               for n in (total_q, total_k, total_k))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def cache_and_append(*, batch, capacity, new):
    """(q, k_cache, v_cache, k_new, v_new) for a one-query decode step, bshd fp16."""
    q, k_cache, v_cache = make_qkv(batch, 2, 2, 1, capacity, 16, torch.float16, layout="bshd",
                                   device=DEVICE)
    fresh = make_qkv(batch, 2, 2, 1, new, 16, torch.float16, layout="bshd", seed=3,
                     device=DEVICE)
    return q, k_cache, v_cache, fresh[1], fresh[2]


def assert_same_bits(first, second):
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


# ----- index tensors: read as given ------------------------------------------------------------
@runs_kernels
def test_strided_cu_seqlens_read_the_same_tokens_as_contiguous_ones():
    """Before: the kernel assumed unit stride and read the 99s (outputs off by 5e4, NaN)."""
    lengths_q, lengths_k = [0, 3, 8], [0, 5, 12]
    q, k, v = packed_qkv(8, 12, requires_grad=True)
    dense = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (lengths_q, lengths_k)]
    views = [strided(x) for x in (lengths_q, lengths_k)]
    results = []
    for cu_q, cu_k in (dense, views):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=True, impl="triton")
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, *grads))
    assert_same_bits(*results)


@runs_kernels
def test_strided_kvcache_index_tensors_give_the_contiguous_call():
    q, k_cache, v_cache, k_new, v_new = cache_and_append(batch=3, capacity=64, new=2)
    seqlens, rows, leftpad = [40, 9, 30], [2, 0, 1], [3, 0, 7]
    contiguous = dict(cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
                      cache_batch_idx=torch.tensor(rows, dtype=torch.int32, device=DEVICE),
                      cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=DEVICE))
    views = dict(cache_seqlens=strided(seqlens), cache_batch_idx=strided(rows),
                 cache_leftpad=strided(leftpad))
    def call(indices):  # the output and both caches after the append
        caches = (k_cache.clone(), v_cache.clone())
        return flash_attn_with_kvcache(q, *caches, k_new, v_new, causal=True, impl="triton",
                                       **indices), *caches

    assert_same_bits(call(contiguous), call(views))


@runs_kernels
def test_a_transposed_block_table_gives_the_contiguous_call():
    q, k_cache, v_cache = make_qkv(2, 4, 2, 1, 64, 16, torch.float16, layout="bshd",
                                   device=DEVICE)
    (k_pages, table), (v_pages, _) = (paged_copy(c, 16, seed=2) for c in (k_cache, v_cache))
    transposed = table.t().contiguous().t()   # same values, strides (1, batch)
    assert transposed.stride() != table.stride()
    seqlens = torch.tensor([50, 17], dtype=torch.int32, device=DEVICE)
    outs = [flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=t,
                                    impl="triton") for t in (table, transposed)]
    assert torch.equal(*outs)


@pytest.mark.parametrize(("change", "error", "words"), [
    (lambda cu: cu.to(torch.int64), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    (lambda cu: cu.to("meta"), ValueError, "cu_seqlens_q must be on q's device"),
    (lambda cu: cu.to_sparse(), TypeError, "cu_seqlens_q must be a dense"),
    (lambda cu: cu.tolist(), TypeError, "cu_seqlens_q must be a torch.int32 tensor, got list"),
])
def test_index_tensors_of_another_dtype_or_device_are_refused_by_name(change, error, words):
    q, k, v = packed_qkv(3, 5)
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(error, match=words):
        flash_attn_varlen_func(q, k, v, change(cu), cu_k, 3, 5, impl="reference")


# ----- in-place appends: never into overlapping memory -----------------------------------------
def _append_args():
    return cache_and_append(batch=2, capacity=32, new=1)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=runs_kernels)])
@pytest.mark.parametrize(("make", "words"), [
    (lambda k, v: (k[:1].expand_as(k), v), "k_cache has overlapping memory"),
    (lambda k, v: (k, v[:, :1].expand_as(v)), "v_cache has overlapping memory"),
    (lambda k, v: (k, k.as_strided(k.shape, (k.stride(0), 1, 16, 1))),
     "v_cache has overlapping memory"),
    (lambda k, v: (k, k), "k_cache and v_cache are the same memory"),
])
def test_an_append_into_overlapping_memory_is_refused(make, words, impl):
    """Before: an expanded cache was accepted and one batch's key landed in another's row."""
    q, k_cache, v_cache, k_new, v_new = _append_args()
    k_cache, v_cache = make(k_cache, v_cache)
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=words):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=5, impl=impl)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_an_expanded_cache_without_an_append_is_only_read():
    q, k_cache, v_cache, _, _ = _append_args()
    expanded = k_cache[:1].expand_as(k_cache), v_cache[:1].expand_as(v_cache)
    out = flash_attn_with_kvcache(q, *expanded, cache_seqlens=20, impl="reference")
    again = flash_attn_with_kvcache(q, *(t.contiguous() for t in expanded), cache_seqlens=20,
                                    impl="reference")
    assert torch.equal(out, again)


# ----- scales and caps -------------------------------------------------------------------------
def _dense(head_dim=16, seed=0):
    return make_qkv(1, 2, 2, 3, 20, head_dim, torch.float16, layout="bshd", seed=seed,
                    device=DEVICE)


@runs_kernels
@pytest.mark.parametrize("scale", [1e-300, 1e-40, 1e38, 2**2000, -(10**400)])
def test_scales_the_kernel_cannot_represent_are_refused_with_the_range(scale):
    """Before: 1e-300 and 1e38 gave all-NaN, 2**2000 an OverflowError traceback."""
    q, k, v = _dense()
    with pytest.raises(ValueError, match=r"softmax_scale must be (in \[|a positive finite)"):
        flash_attn_func(q, k, v, softmax_scale=scale, impl="triton")


@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_numbers_past_float_range_are_a_value_error(name):
    q, k, v = _dense()
    with pytest.raises(ValueError, match=name):
        flash_attn_func(q, k, v, impl="reference", **{name: 2**2000})


@runs_kernels
@pytest.mark.parametrize("edge", ["lowest", "highest"])
def test_both_edges_of_the_scale_range_give_the_reference(edge):
    """The lowest scale underflows every score to 0 (uniform attention: the mean of v);
    the highest keeps fp16-range scores inside fp32 (attention is one-hot)."""
    q, k, v = _dense()
    lowest, highest = kernel_scale_range(16)
    scale = lowest if edge == "lowest" else highest
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True,
                                  impl="triton")
    # check_accuracy's fp16 yardstick overflows at these scales; the float64 math decides.
    want, want_lse = tiled(*(t.transpose(1, 2).double() for t in (q, k, v)), scale=scale)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), atol=1e-3, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)
    if edge == "lowest":
        uniform = v.float().mean(dim=1, keepdim=True).expand_as(out)
        torch.testing.assert_close(out.float(), uniform, atol=2e-3, rtol=0)
    outside = math.nextafter(scale, 0.0 if edge == "lowest" else math.inf)
    with pytest.raises(ValueError, match="softmax_scale must be in"):
        flash_attn_func(q, k, v, softmax_scale=outside, impl="triton")


@runs_kernels
@pytest.mark.parametrize("edge", ["lowest", "highest"])
def test_both_edges_of_the_softcap_range_give_the_reference(edge):
    q, k, v = _dense()
    scale = 0.25
    lowest, highest = scale / FP32_MAX, min(FP32_MAX / LOG2E, scale * SOFTCAP_REACH)
    softcap = lowest if edge == "lowest" else highest
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, softcap=softcap,
                                  return_attn_probs=True, impl="triton")
    result = check_accuracy(out, lse, q, k, v, scale=scale, softcap=softcap, layout="bshd")
    assert result.passed, result
    for outside in (softcap * 0.5, softcap * 2.0):
        if lowest <= outside <= highest:
            continue
        with pytest.raises(ValueError, match="softcap must be 0"):
            flash_attn_func(q, k, v, softmax_scale=scale, softcap=outside, impl="triton")


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=runs_kernels)])
def test_a_window_past_any_length_is_the_window_that_reaches_every_key(impl):
    """Before: window_size=(2**70, 0) raised OverflowError (kernel and reference)."""
    q, k, v = _dense()
    huge = flash_attn_func(q, k, v, window_size=(2**70, 0), impl=impl)
    reach = flash_attn_func(q, k, v, window_size=(23, 0), impl=impl)
    assert torch.equal(huge, reach)
    both = flash_attn_func(q, k, v, window_size=(2**70, 2**70), impl=impl)
    torch.testing.assert_close(both, flash_attn_func(q, k, v, impl=impl), atol=1e-3, rtol=0)


# ----- tensors attnlab does not read -----------------------------------------------------------
def _calls(q, k, v):
    """Each public call with (q, k, v) in its own layout."""
    thd = [t[0] for t in (q, k, v)]
    cu_q = torch.tensor([0, q.shape[1]], dtype=torch.int32)
    cu_k = torch.tensor([0, k.shape[1]], dtype=torch.int32)
    return {
        "flash_attn_func": lambda f: flash_attn_func(*f(q, k, v), impl="reference"),
        "attention": lambda f: attention(*f(*(t.transpose(1, 2) for t in (q, k, v))),
                                         impl="reference"),
        "flash_attn_varlen_func": lambda f: flash_attn_varlen_func(
            *f(*thd), cu_q, cu_k, q.shape[1], k.shape[1], impl="reference"),
        "flash_attn_with_kvcache": lambda f: flash_attn_with_kvcache(*f(q, k, v),
                                                                     impl="reference"),
        "merge_state": lambda f: merge_state(f(q, k, v)[0], torch.zeros(q.shape[:3]),
                                             q, torch.zeros(q.shape[:3])),
    }


@pytest.mark.parametrize("call", sorted(_calls(*_dense())))
@pytest.mark.parametrize(("form", "kind"), [
    (lambda t: t.to_sparse(), "layout torch.sparse_coo"),
    (lambda t: torch.nested.nested_tensor(list(t.unbind(0))), "a nested tensor"),
])
def test_sparse_and_nested_tensors_are_type_errors_naming_the_argument(call, form, kind):
    """Before: torch-internal errors from inside the computation."""
    q, k, v = (t.cpu() for t in _dense())
    name = "v_a" if call == "merge_state" else "q"
    with pytest.raises(TypeError, match=rf"^{name} must be a dense \(strided\) tensor, got {kind}$"):
        _calls(q, k, v)[call](lambda q, *rest: (form(q), *rest))


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=runs_kernels)])
def test_meta_tensors_are_refused_where_values_are_read(impl):
    """Before: the kvcache reference raised NotImplementedError from torch's copy."""
    q, k, v = (t.to("meta") for t in _dense())
    with pytest.raises(ValueError, match="q is on the meta device"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=4, impl=impl)
    if impl == "triton":
        with pytest.raises(ValueError, match="q is on the meta device"):
            flash_attn_func(q, k, v, impl=impl)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=runs_kernels)])
@pytest.mark.parametrize("form", ["cache_batch_idx", "block_table"])
def test_two_sequences_appending_into_one_cache_slot_are_refused(form, impl):
    """A repeated cache row (or page) would make one sequence's append overwrite the
    other's; reading through repeated rows without an append stays allowed."""
    q, k_cache, v_cache, k_new, v_new = _append_args()
    if form == "block_table":
        (k_cache, table), (v_cache, _) = (paged_copy(c, 16) for c in (k_cache, v_cache))
        options = dict(block_table=table.clone())
        options["block_table"][1, 0] = options["block_table"][0, 0]
    else:
        options = dict(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32, device=DEVICE))
    refusal = f"{form} makes sequences 0 and 1 append into one"
    if impl == "reference":  # read on the host: refused before anything is written
        with pytest.raises(ValueError, match=refusal):
            flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=5,
                                    impl=impl, **options)
    else:  # checked on the device: both sequences come out NaN, the record names them
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=5,
                                      impl=impl, **options)
        assert torch.isnan(out).all()
        with pytest.raises(ValueError, match=refusal):
            check_kvcache_indices(DEVICE)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, impl=impl, **options)
    check_kvcache_indices(DEVICE)  # the record was cleared; reading is allowed
