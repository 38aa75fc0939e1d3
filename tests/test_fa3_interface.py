"""attnlab.flash_attn_interface: FA3's signatures and returns on attnlab's calls, its
refusals by name, seqused, varlen queries against a (paged) cache, and the combine."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
import attnlab.flash_attn_interface as fa3
from attention_inputs import make_qkv
from attnlab.accuracy import check_accuracy
from attnlab.kernels.forward import kernel_is_interpreted
from attnlab.reference import naive
from attnlab.reference.decode import apply_rotary, positions_from

needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or kernel_is_interpreted()),
                                  reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["reference", pytest.param("triton", marks=needs_triton)]


def bshd(seqlen_q=9, seqlen_k=21, *, batch=2, heads=4, kv_heads=2, head_dim=32,
         dtype=torch.float16, seed=0):
    return make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, layout="bshd",
                    seed=seed, device=DEVICE)


def on(impl, *tensors):
    """The tensors where ``impl`` runs: CPU for the reference, DEVICE for the kernels."""
    return tuple(t.cpu() if impl == "reference" else t.to(DEVICE) for t in tensors)


# ----- flash_attn_func -------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_positional_call_is_fa3s_order_and_return(impl):
    q, k, v = on(impl, *bshd())
    out = fa3.flash_attn_func(q, k, v, 0.5, True, impl=impl)  # softmax_scale=0.5, causal=True
    assert isinstance(out, torch.Tensor)
    ours = attnlab.flash_attn_func(q, k, v, softmax_scale=0.5, causal=True, impl=impl)
    assert torch.equal(out, ours)
    out2, lse = fa3.flash_attn_func(q, k, v, 0.5, True, return_attn_probs=True, impl=impl)
    assert torch.equal(out2, out) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert check_accuracy(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), causal=True,
                          scale=0.5, layout="bshd").passed
    # Hints are accepted and change nothing.
    hinted = fa3.flash_attn_func(q, k, v, 0.5, True, num_splits=3, pack_gqa=True, sm_margin=4,
                                 deterministic=True, impl=impl)
    assert torch.equal(hinted, out)


@needs_triton
def test_fa3_flash_attn_func_is_differentiable():
    q, k, v = (t.requires_grad_() for t in bshd(seed=1))
    out = fa3.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), softcap=20.0,
                              impl="triton")
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attnlab.flash_attn_func(q, k, v, causal=True, window_size=(5, 0), softcap=20.0,
                            impl="triton").sum().backward()
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v), strict=True))


# FP8's descales are taken where attnlab has an FP8 kernel (tests/test_fp8.py) and refused by
# name where it has none: varlen, and q_descale on the decode path.
REFUSED = [("qv", {"qv": "TENSOR"}), ("attention_chunk", {"attention_chunk": 4})]
NO_FP8_KERNEL = [("flash_attn_varlen_func", name) for name in ("q_descale", "k_descale",
                                                              "v_descale")]
NO_FP8_KERNEL.append(("flash_attn_with_kvcache", "q_descale"))


def _calls():
    """Each FA3 call on small CPU inputs, taking extra keyword arguments."""
    q, k, v = (t.cpu() for t in bshd(seqlen_q=3, seqlen_k=16))
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 16, 32], dtype=torch.int32)
    return {
        "flash_attn_func": lambda **kw: fa3.flash_attn_func(q, k, v, **kw),
        "flash_attn_varlen_func": lambda **kw: fa3.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k, 3, 16, **kw),
        "flash_attn_with_kvcache": lambda **kw: fa3.flash_attn_with_kvcache(q, k, v, **kw),
    }


@pytest.mark.parametrize("call", ["flash_attn_func", "flash_attn_varlen_func",
                                  "flash_attn_with_kvcache"])
@pytest.mark.parametrize(("name", "kwargs"), REFUSED)
def test_what_attnlab_cannot_honour_is_refused_by_name(call, name, kwargs):
    kwargs = {key: torch.ones(2, 4) if value == "TENSOR" else value
              for key, value in kwargs.items()}
    with pytest.raises(NotImplementedError, match=name):
        _calls()[call](**kwargs)


@pytest.mark.parametrize(("call", "name"), NO_FP8_KERNEL)
def test_descales_without_an_fp8_kernel_are_refused_by_name(call, name):
    with pytest.raises(NotImplementedError, match=f"{name} must be None here"):
        _calls()[call](**{name: torch.ones(1)})


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"pack_gqa": "yes"}, TypeError, "pack_gqa"),
    ({"sm_margin": -1}, ValueError, "sm_margin"),
    ({"num_splits": -1}, ValueError, "num_splits"),
    ({"return_attn_probs": 1.5}, TypeError, "return_attn_probs"),
    ({"dropout_p": 0.0}, TypeError, "dropout_p"),  # FA3 has no dropout_p
])
def test_hints_are_checked_like_any_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        _calls()["flash_attn_func"](**kwargs)


def test_kvcache_refusals_and_bounds_are_named():
    calls = _calls()
    with pytest.raises(NotImplementedError, match="scheduler_metadata"):
        calls["flash_attn_with_kvcache"](scheduler_metadata=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        calls["flash_attn_with_kvcache"](max_seqlen_q=3)
    # get_scheduler_metadata's answer is what flash_attn_with_kvcache takes.
    metadata = fa3.get_scheduler_metadata(2, 3, 16, 4, 2, 32, torch.full((2,), 16))
    assert metadata is None
    calls["flash_attn_with_kvcache"](scheduler_metadata=metadata)


# ----- flash_attn_varlen_func with seqused ---------------------------------------------------------
def _varlen_with_unused_tails(seed, *, dtype=torch.float16):
    """Packed q, k, v of 3 sequences with unused rows after each used part: (q, k, v,
    cu_q, cu_k, seqused_q, seqused_k, (used rows of q), (used rows of k))."""
    lengths_q, used_q = [5, 7, 4], [3, 7, 0]
    lengths_k, used_k = [9, 6, 11], [9, 2, 5]
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(n), h, 16, generator=generator).to(dtype)
               for n, h in ((lengths_q, 4), (lengths_k, 2), (lengths_k, 2)))
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
          for n in (lengths_q, lengths_k)]
    rows = [torch.cat([torch.arange(start, start + u) for start, u in
                       zip(c[:-1].tolist(), used, strict=True)])
            for c, used in ((cu[0], used_q), (cu[1], used_k))]
    seqused = [torch.tensor(u, dtype=torch.int32) for u in (used_q, used_k)]
    compact_cu = [torch.tensor([0, *torch.tensor(u).cumsum(0).tolist()], dtype=torch.int32)
                  for u in (used_q, used_k)]
    return q, k, v, cu, seqused, rows, compact_cu


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_runs_only_the_used_rows_and_zeroes_the_rest(impl, causal):
    q, k, v, cu, seqused, rows, compact_cu = _varlen_with_unused_tails(2)
    q, k, v, *cu, seqused_q, seqused_k = on(impl, q, k, v, *cu, *seqused)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu[0], cu[1], 7, 9, seqused_q, seqused_k,
                                          causal=causal, return_attn_probs=True, impl=impl)
    rows_q, rows_k = (r.to(q.device) for r in rows)
    compact = attnlab.flash_attn_varlen_func(
        q[rows_q], k[rows_k], v[rows_k], *on(impl, *compact_cu), 7, 9, causal=causal,
        return_attn_probs=True, impl=impl)
    assert torch.equal(out[rows_q], compact[0]) and torch.equal(lse[:, rows_q], compact[1])
    unused = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    unused[rows_q] = False
    assert torch.all(out[unused] == 0) and torch.isneginf(lse[:, unused]).all()
    assert not torch.isnan(out).any()


@needs_triton
def test_seqused_gradients_leave_unused_rows_at_zero():
    q, k, v, cu, seqused, rows, compact_cu = _varlen_with_unused_tails(3)
    q, k, v, *cu, seqused_q, seqused_k = (t.to(DEVICE) for t in (q, k, v, *cu, *seqused))
    rows_q, rows_k = (r.to(DEVICE) for r in rows)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa3.flash_attn_varlen_func(*leaves, cu[0], cu[1], 7, 9, seqused_q, seqused_k,
                                     causal=True, impl="triton")
    dout = torch.randn_like(out)
    out.backward(dout)
    compact = [t[r].clone().requires_grad_() for t, r in ((q, rows_q), (k, rows_k), (v, rows_k))]
    attnlab.flash_attn_varlen_func(*compact, *(c.to(DEVICE) for c in compact_cu), 7, 9,
                                   causal=True, impl="triton").backward(dout[rows_q])
    for leaf, small, r in zip(leaves, compact, (rows_q, rows_k, rows_k), strict=True):
        assert torch.equal(leaf.grad[r], small.grad)
        unused = torch.ones(leaf.shape[0], dtype=torch.bool, device=DEVICE)
        unused[r] = False
        assert torch.all(leaf.grad[unused] == 0)


def test_bad_seqused_is_named():
    q, k, v, cu, seqused, _, _ = _varlen_with_unused_tails(4)
    too_many = torch.tensor([6, 7, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqused_q\[0\] = 6"):
        fa3.flash_attn_varlen_func(q, k, v, cu[0], cu[1], 7, 11, too_many, impl="reference")
    with pytest.raises(TypeError, match="seqused_k"):
        fa3.flash_attn_varlen_func(q, k, v, cu[0], cu[1], 7, 11, None, seqused[1].long(),
                                   impl="reference")
    with pytest.raises(ValueError, match="max_seqlen_k"):
        fa3.flash_attn_varlen_func(q, k, v, cu[0], cu[1], 7, 8, None, seqused[1],
                                   impl="reference")


# ----- flash_attn_with_kvcache -------------------------------------------------------------------
def _paged_cache(seed, *, pages=8, page_size=16, kv_heads=2, head_dim=32):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(pages, page_size, kv_heads, head_dim, generator=generator)
                 .half().to(DEVICE) for _ in range(2))


def _sequence_keys(cache, table_row, length):
    """One sequence's first ``length`` cache rows, gathered from its pages (bshd, batch 1)."""
    return cache[table_row.long()].flatten(0, 1)[:length][None]


@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_queries_against_a_paged_cache(impl):
    """cu_seqlens_q + cu_seqlens_k_new + page_table + cache_batch_idx, against attention
    over each sequence's live keys computed from scratch (float64 naive)."""
    k_cache, v_cache = _paged_cache(5)
    page_table = torch.tensor([[3, 0], [7, 1], [2, 6], [5, 4]], dtype=torch.int32)
    cache_batch_idx = torch.tensor([2, 0, 3], dtype=torch.int32)  # rows of page_table
    cache_seqlens = torch.tensor([5, 20, 0], dtype=torch.int32)
    lengths_q, lengths_new = [1, 4, 3], [1, 2, 3]
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(sum(lengths_q), 4, 32, generator=generator).half()
    k_new, v_new = (torch.randn(sum(lengths_new), 2, 32, generator=generator).half()
                    for _ in range(2))
    cu_q, cu_new = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                    for n in (lengths_q, lengths_new))
    k_cache, v_cache, q, k_new, v_new, page_table, cache_batch_idx, cache_seqlens, cu_q, cu_new = \
        on(impl, k_cache, v_cache, q, k_new, v_new, page_table, cache_batch_idx, cache_seqlens,
           cu_q, cu_new)
    before = k_cache.clone(), v_cache.clone()
    out, lse = fa3.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, page_table=page_table, cu_seqlens_q=cu_q,
        cu_seqlens_k_new=cu_new, max_seqlen_q=4, causal=True, return_softmax_lse=True,
        impl=impl)
    assert out.shape == q.shape and lse.shape == (4, sum(lengths_q))
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for b in range(3):
        table_row = page_table[cache_batch_idx[b]]
        start, new = int(cache_seqlens[b]), lengths_new[b]
        q_rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        new_rows = slice(int(cu_new[b]), int(cu_new[b + 1]))
        # The new keys landed at cache positions start .. start + new of this sequence.
        assert torch.equal(_sequence_keys(k_cache, table_row, start + new)[0, start:], k_new[new_rows])
        assert torch.equal(_sequence_keys(v_cache, table_row, start + new)[0, start:], v_new[new_rows])
        positions = torch.arange(start, start + new, device=k_cache.device)
        written[table_row.long()[positions // 16], positions % 16] = True
        keys, values = (_sequence_keys(c, table_row, start + new).transpose(1, 2).double()
                        for c in (k_cache, v_cache))
        exact = naive(q[q_rows][None].transpose(1, 2).double(), keys, values, causal=True)
        assert (out[q_rows].double() - exact[0].transpose(0, 1)).abs().max() < 2e-3
    # Nothing else in the cache was written.
    assert torch.equal(k_cache[~written], before[0][~written])
    assert torch.equal(v_cache[~written], before[1][~written])


@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_queries_of_equal_length_match_the_batched_call(impl):
    q, k, v = on(impl, *bshd(seqlen_q=3, seqlen_k=40, seed=7))
    cu = on(impl, torch.tensor([0, 3, 6], dtype=torch.int32))[0]
    seqlens = on(impl, torch.tensor([31, 17], dtype=torch.int32))[0]
    batched, lse = fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True,
                                               return_softmax_lse=True, impl=impl)
    packed, packed_lse = fa3.flash_attn_with_kvcache(
        q.flatten(0, 1), k, v, cache_seqlens=seqlens, cu_seqlens_q=cu, max_seqlen_q=3,
        causal=True, return_softmax_lse=True, impl=impl)
    assert torch.allclose(packed.unflatten(0, (2, 3)).float(), batched.float(), atol=2e-3)
    assert torch.allclose(packed_lse, lse.transpose(0, 1).flatten(1), atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_rotary_seqlens_moves_the_rotary_start(impl):
    q, k_new, v_new = on(impl, *bshd(seqlen_q=2, seqlen_k=2, seed=8))
    k_cache, v_cache = on(impl, *bshd(seqlen_q=2, seqlen_k=32, seed=9))[1:]
    generator = torch.Generator().manual_seed(10)
    angle = torch.rand(32, 8, generator=generator) * 2 * math.pi
    cos, sin = on(impl, torch.cos(angle).half(), torch.sin(angle).half())
    seqlens, rotary_seqlens = on(impl, torch.tensor([4, 9], dtype=torch.int32),
                                 torch.tensor([1, 20], dtype=torch.int32))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    rotated = fa3.flash_attn_with_kvcache(q, *caches[0], k_new, v_new, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=seqlens,
                                          rotary_seqlens=rotary_seqlens, causal=True, impl=impl)
    # The same call with q and k pre-rotated at rotary_seqlens + i and no rotary.
    positions = positions_from(rotary_seqlens, 2)
    by_hand = fa3.flash_attn_with_kvcache(
        apply_rotary(q, cos, sin, positions, interleaved=True), *caches[1],
        apply_rotary(k_new, cos, sin, positions, interleaved=True), v_new,
        cache_seqlens=seqlens, causal=True, impl=impl)
    assert torch.equal(rotated, by_hand) and torch.equal(caches[0][0], caches[1][0])
    with pytest.raises(ValueError, match="rotary_seqlens"):
        # The reference reads the positions on the host; the kernels check them on the
        # device (a NaN output, then the record).
        out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=seqlens, impl=impl,
                                          rotary_seqlens=rotary_seqlens - 5)
        assert torch.isnan(out[0]).all() and not torch.isnan(out[1]).any()
        attnlab.check_kvcache_indices(q.device)


def test_per_sequence_path_refuses_what_it_cannot_map():
    q, k, v = (t.cpu() for t in bshd(seqlen_q=2, seqlen_k=32))
    cu_q = torch.tensor([0, 0, 2], dtype=torch.int32)  # sequence 0 has no queries
    cu_new = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="cu_seqlens_q: sequence 0"):
        fa3.flash_attn_with_kvcache(q[0], k.clone(), v.clone(), k[0, :2], v[0, :2],
                                    cache_seqlens=torch.tensor([3, 3], dtype=torch.int32),
                                    cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=2)
    with pytest.raises(ValueError, match="max_seqlen_q must be given"):
        fa3.flash_attn_with_kvcache(q[0], k, v, cu_seqlens_q=torch.tensor([0, 1, 2],
                                                                          dtype=torch.int32))


# ----- flash_attn_combine -------------------------------------------------------------------------
def test_combine_is_fa3s_split_merge():
    generator = torch.Generator().manual_seed(11)
    out_partial = torch.randn(5, 2, 7, 3, 16, generator=generator)
    lse_partial = torch.randn(5, 2, 7, 3, generator=generator)
    lse_partial[2:, :1] = float("-inf")
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    # FA3's own reference formula, in float64.
    exact_lse = torch.logsumexp(lse_partial.double(), dim=0)
    weights = torch.exp(lse_partial.double() - exact_lse)
    exact = (weights.unsqueeze(-1) * out_partial.double()).sum(0)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 7, 3)
    assert torch.allclose(lse.double(), exact_lse, atol=1e-5)
    assert torch.allclose(out.double(), exact, atol=1e-2)
    with pytest.raises(NotImplementedError, match="out must be None"):
        fa3.flash_attn_combine(out_partial, lse_partial, out=torch.empty(2, 7, 3, 16))


# ----- flash_attn_func -> merge_state, as the README shows it -------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_fa3_lse_chains_into_merge_state(impl):
    q, k, v = on(impl, *bshd(seqlen_q=6, seqlen_k=40, seed=12))
    out_a, lse_a = fa3.flash_attn_func(q, k[:, :25], v[:, :25], return_attn_probs=True,
                                       impl=impl)
    out_b, lse_b = fa3.flash_attn_func(q, k[:, 25:], v[:, 25:], return_attn_probs=True,
                                       impl=impl)
    out, lse = attnlab.merge_state(out_a, lse_a, out_b, lse_b)
    whole, whole_lse = fa3.flash_attn_func(q, k, v, return_attn_probs=True, impl=impl)
    assert lse.shape == whole_lse.shape and torch.allclose(lse, whole_lse, atol=1e-5)
    assert (out.float() - whole.float()).abs().max() < 2e-3
