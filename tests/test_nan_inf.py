"""NaN and infinity honesty: one grid runs every kernel path through the same cases.

The float64 math decides (issue #28).  ``expected`` (tests/ieee_reference.py) is
attention in float64 with ``torch.softmax`` (:func:`attnlab.reference.naive`), so IEEE
arithmetic says what a NaN or an infinity does:

* a NaN anywhere in a row's visible scores (a NaN in q, or in a key it sees) makes the
  row's O and LSE NaN; a NaN in v makes NaN the O column it sits in, LSE stays finite;
* a +inf score (``q . k`` with an infinite key component) makes the row NaN:
  ``softmax`` computes ``exp(inf - inf)``.  ``torch.logsumexp`` says +inf there; the
  expected LSE is NaN instead, as the reference's and the kernels' ``m + log(l)``
  gives: the row's O is NaN, and an LSE of +inf would pass for a real number in a
  later merge;
* a -inf score gives that key weight 0; a row whose every visible score is -inf gives
  ``0 / 0`` = NaN in O with LSE = log(0) = -inf;
* a row that sees no key at all (the mask) outputs zeros and LSE = -inf: the project's
  convention, kept apart from "saw a NaN".

The only thing a case may not do is put a NaN in v at a key some row cannot see: the
kernels multiply that row's probability 0 by the NaN inside the P @ V MMA, so it can
reach other rows of the same tile (docs/reliability.md).  Batch entry 1 is always clean
and must stay finite: nothing leaks across sequences, pages or splits.

Paths: the dense forward kernel, varlen, a decode-shaped ``flash_attn_func`` call (the
split-KV kernel and its combine), ``flash_attn_with_kvcache`` contiguous (NaN garbage
past ``cache_seqlens``, which must never be read) and paged, ``merge_states`` of two
kernel halves, the backward (NaN where float64 autograd has NaN), and the reference.
CPU under TRITON_INTERPRET=1 (small shapes); the same tests on CUDA when present.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_inputs import paged_copy
from attnlab import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    last_impl,
    merge_state,
)
from attnlab.accuracy import reference_gradients
from attnlab.kernels.forward import kernel_is_interpreted
from ieee_reference import expected, mismatch

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
# Prefill-shaped paths run the dense kernel; decode-shaped ones a 300-key cache, split
# over several programs (32-key tiles under the interpreter) and combined.
PREFILL = (4, 40)
DECODE = (2, 300)
INF = math.inf

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not kernel_is_interpreted(), reason="CPU runs need TRITON_INTERPRET=1 at import")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


# ----- the cases: (where the bad value goes, causal, window) -----------------------------------
def _poison(name, q, k, v):
    """Put the case's bad values into batch entry 0, head 0 (kv head 0) of q, k, v."""
    seqlen_k = k.shape[1]
    middle = seqlen_k // 2
    if name == "nan_q_row":
        q[0, 0, 0, 0] = math.nan
    elif name == "all_nan_q":
        q[0] = math.nan
    elif name == "nan_k":
        k[0, middle, 0, 3] = math.nan
    elif name == "nan_k_hidden":      # causal: the last key, which only the last row sees
        k[0, seqlen_k - 1, 0, 3] = math.nan
    elif name == "nan_v":
        v[0, middle, 0, 5] = math.nan
    elif name == "pos_inf_k":         # +inf or -inf scores, by the sign of q[..., 2]
        k[0, middle, 0, 2] = INF
    elif name == "neg_inf_k":
        k[0, middle, 0, 2] = -INF
    elif name == "only_neg_inf_keys":  # window (0, 0): row 0 sees one key, scoring -inf
        diag = seqlen_k - q.shape[1]
        q[0, 0, 0] = q[0, 0, 0].abs() + 0.5
        k[0, diag, 0] = -INF
    else:
        raise AssertionError(name)


CASES = {  # name -> (causal, window)
    "nan_q_row": (False, (-1, -1)),
    "all_nan_q": (False, (-1, -1)),
    "nan_k": (False, (-1, -1)),
    "nan_k_hidden": (True, (-1, -1)),
    "nan_v": (False, (-1, -1)),
    "pos_inf_k": (False, (-1, -1)),
    "neg_inf_k": (False, (-1, -1)),
    "only_neg_inf_keys": (False, (0, 0)),
}


def inputs(case, seqlens, device, dtype=torch.float16):
    gen = torch.Generator().manual_seed(7)
    seqlen_q, seqlen_k = seqlens
    q = torch.randn(BATCH, seqlen_q, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, seqlen_k, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, seqlen_k, KV_HEADS, HEAD_DIM, generator=gen)
    _poison(case, q, k, v)
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def assert_matches(got, want, what):
    problem = mismatch(got, want, what)
    assert problem is None, problem


# ----- the paths: each returns (O bshd, LSE (batch, heads, seqlen_q)) ---------------------------
def run_dense(q, k, v, **options):
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, impl="triton", **options)
    assert last_impl() == "triton"
    return out, lse


def run_decode_route(q, k, v, **options):
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, impl="triton", **options)
    assert last_impl() == "triton-decode"
    return out, lse


def run_reference(q, k, v, **options):
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, impl="reference", **options)
    return out, lse


def run_varlen(q, k, v, **options):
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (BATCH + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (BATCH + 1) * seqlen_k, seqlen_k, dtype=torch.int32, device=q.device)
    out, lse, _ = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                         cu_q, cu_k, seqlen_q, seqlen_k, return_attn_probs=True,
                                         impl="triton", **options)
    return out.unflatten(0, (BATCH, seqlen_q)), lse.unflatten(1, (BATCH, seqlen_q)).transpose(0, 1)


SLACK = 16  # cache slots past the live keys, full of NaN that no call may read


def _cache(t):
    cache = torch.full((BATCH, t.shape[1] + SLACK, *t.shape[2:]), math.nan, dtype=t.dtype,
                       device=t.device)
    cache[:, :t.shape[1]] = t
    return cache


def run_kvcache(q, k, v, **options):
    seqlens = torch.full((BATCH,), k.shape[1], dtype=torch.int32, device=q.device)
    out, lse = flash_attn_with_kvcache(q, _cache(k), _cache(v), cache_seqlens=seqlens,
                                       return_softmax_lse=True, impl="triton", **options)
    assert last_impl() == "triton-decode"
    return out, lse


def run_paged(q, k, v, **options):
    """The contiguous cache (NaN slack included) over shuffled 16-row pages."""
    (k_pages, block_table), (v_pages, _) = (paged_copy(_cache(t), 16, seed=1) for t in (k, v))
    seqlens = torch.full((BATCH,), k.shape[1], dtype=torch.int32, device=q.device)
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                       block_table=block_table, return_softmax_lse=True,
                                       impl="triton", **options)
    return out, lse


def run_merge(q, k, v, **options):
    """Two kernel calls on the two halves of the keys, merged exactly."""
    if options["causal"] or options["window_size"] != (-1, -1):
        pytest.skip("halving the keys moves a bottom-right band; merge is tested unmasked")
    half = k.shape[1] // 2
    parts = [run_dense(q, k[:, keys], v[:, keys])
             for keys in (slice(0, half), slice(half, None))]
    # merge_state takes the dense call's own LSE layout, (batch, heads, seqlen).
    return merge_state(parts[0][0], parts[0][1], parts[1][0], parts[1][1])


PATHS = {
    "dense": (run_dense, PREFILL),
    "varlen": (run_varlen, PREFILL),
    "decode_route": (run_decode_route, DECODE),
    "kvcache": (run_kvcache, DECODE),
    "paged": (run_paged, DECODE),
    "merge": (run_merge, PREFILL),
    "reference": (run_reference, PREFILL),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_forward_paths_give_nan_exactly_where_the_float64_math_does(path, case, device):
    run, seqlens = PATHS[path]
    causal, window = CASES[case]
    q, k, v = inputs(case, seqlens, device)
    out, lse = run(q, k, v, causal=causal, window_size=window)
    want_out, want_lse = expected(q, k, v, causal=causal, window=window)
    assert not want_out[1].isnan().any()  # batch entry 1 is clean: it must stay so
    assert_matches(out, want_out, f"{path} O")
    assert_matches(lse, want_lse, f"{path} LSE")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_gives_nan_exactly_where_float64_autograd_does(case, device):
    causal, window = CASES[case]
    q, k, v = (t.requires_grad_() for t in inputs(case, PREFILL, device))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, impl="triton")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    to_bhsd = (lambda t: t.transpose(1, 2))
    wanted = reference_gradients(*(to_bhsd(t.detach()) for t in (q, k, v)), to_bhsd(dout),
                                 causal=causal, window=window)
    for name, grad, want in zip(("dq", "dk", "dv"), grads, wanted, strict=True):
        assert_matches(grad, to_bhsd(want).cpu(), name)


def test_the_expected_values_are_the_references_own():
    """The reference (tiled, float64) agrees with ``expected`` on every case, so the grid
    holds the kernels to the same answer the oracle gives."""
    for case, (causal, window) in CASES.items():
        q, k, v = inputs(case, PREFILL, "cpu", dtype=torch.float64)
        out, lse = run_reference(q, k, v, causal=causal, window_size=window)
        want_out, want_lse = expected(q, k, v, causal=causal, window=window)
        assert_matches(out, want_out, f"{case} O")
        assert_matches(lse, want_lse, f"{case} LSE")
