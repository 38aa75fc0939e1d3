"""Variable-length batches: the forward kernel on packed (total_tokens, heads, head_dim)
tensors, and the public ``flash_attn_varlen_func`` family.

The invariance that defines varlen: a packed batch gives, sequence by sequence, what
a dense call on that sequence alone gives (bit for bit with the same tiles), and each
sequence meets the accuracy rule against the float64 reference.  On the CPU the
kernel runs in Triton's interpreter; shapes stay small.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    last_impl,
)
from attnlab.accuracy import check_accuracy, check_gradients
from attnlab.kernels import forward as forward_module
from attnlab.kernels._launch import PlanCache
from attnlab.kernels.configs import INTERPRETER_CONFIG, ForwardConfig
from attnlab.kernels.forward import flash_forward, kernel_is_interpreted

on_gpu = torch.cuda.is_available()
triton_runs_here = on_gpu or kernel_is_interpreted()
needs_triton = pytest.mark.skipif(not triton_runs_here,
                                  reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if on_gpu else "cpu"
# One tiling for the varlen call and the dense calls it is compared with: then the
# two run the same arithmetic and must agree bit for bit.
CONFIG = INTERPRETER_CONFIG if not on_gpu else ForwardConfig(64, 64, 4, 2)


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def packed(lengths_q, lengths_k, heads=4, kv_heads=2, head_dim=32, dtype=torch.float16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(total, h):
        return torch.randn(total, h, head_dim, generator=gen).to(dtype).to(DEVICE)

    q = rand(sum(lengths_q), heads)
    k, v = rand(sum(lengths_k), kv_heads), rand(sum(lengths_k), kv_heads)
    return q, k, v, cumulative(lengths_q), cumulative(lengths_k)


def run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, config=CONFIG, **options):
    scale = options.pop("scale", 1.0 / math.sqrt(q.shape[-1]))
    return flash_forward(q, k, v, layout="thd", scale=scale, config=config, cu_seqlens_q=cu_q,
                         cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                         max_seqlen_k=max(lengths_k), **options)


def sequences(lengths_q, lengths_k):
    """(index, query rows, key rows) of each sequence in the packed tensors."""
    q_start = k_start = 0
    for i, (length_q, length_k) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        yield i, slice(q_start, q_start + length_q), slice(k_start, k_start + length_k)
        q_start += length_q
        k_start += length_k


def check_each_sequence(out, lse, q, k, v, lengths_q, lengths_k, *, compare_dense=True,
                        **options):
    """Each sequence: the accuracy rule against float64, and the dense kernel's exact bits."""
    scale = options.pop("scale", 1.0 / math.sqrt(q.shape[-1]))
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for i, rows, keys in sequences(lengths_q, lengths_k):
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:  # no keys at all: zeros and -inf
            assert torch.all(out[rows] == 0) and torch.all(torch.isneginf(lse[:, rows])), i
            continue
        one = [t[None] for t in (q[rows], k[keys], v[keys])]
        result = check_accuracy(out[None, rows], lse[None, :, rows], *one, scale=scale,
                                layout="bshd", **options)
        assert result.passed, (i, result)
        if compare_dense:
            dense_out, dense_lse = flash_forward(*one, layout="bshd", scale=scale, config=CONFIG,
                                                 **options)
            assert torch.equal(dense_out[0], out[rows]), i
            assert torch.equal(dense_lse[0], lse[:, rows]), i


# ---------------------------------------------------------------------------
# The kernel

MIXED_Q = [5, 0, 70, 1, 33, 64]
MIXED_K = [9, 3, 70, 0, 20, 64]  # a sequence without queries, one without keys, q != k
MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (11, 4)},
    "softcap": {"softcap": 4.0, "causal": True},
}


@needs_triton
@pytest.mark.parametrize("mask", list(MASKS))
def test_varlen_equals_each_sequence_alone(mask):
    q, k, v, cu_q, cu_k = packed(MIXED_Q, MIXED_K, seed=1)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, MIXED_Q, MIXED_K, **MASKS[mask])
    check_each_sequence(out, lse, q, k, v, MIXED_Q, MIXED_K, **MASKS[mask])


@needs_triton
def test_one_sequence_is_the_dense_call():
    q, k, v, cu_q, cu_k = packed([97], [113], heads=3, kv_heads=1, head_dim=59,
                                 dtype=torch.bfloat16, seed=2)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, [97], [113], causal=True)
    check_each_sequence(out, lse, q, k, v, [97], [113], causal=True)


@needs_triton
def test_causal_rows_without_keys_in_a_sequence():
    # seqlen_q > seqlen_k in one sequence: its first rows see nothing (bottom-right).
    lengths_q, lengths_k = [3, 40], [8, 10]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, seed=3)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, causal=True)
    assert torch.all(out[3:33] == 0) and torch.all(torch.isneginf(lse[:, 3:33]))
    assert torch.isfinite(lse[:, 33:]).all() and torch.isfinite(lse[:, :3]).all()
    check_each_sequence(out, lse, q, k, v, lengths_q, lengths_k, causal=True)


@needs_triton
def test_thousand_sequences_of_length_one():
    # One key per sequence: softmax is exactly 1, so O = V bit for bit and LSE = the score.
    # A row reading any other sequence's key would break both.
    count = 1000
    ones = [1] * count
    q, k, v, cu_q, cu_k = packed(ones, ones, heads=1, kv_heads=1, head_dim=16, seed=4)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, ones, ones, scale=0.25)
    assert torch.equal(out, v)
    score = (q.double() * k.double()).sum(-1).T * 0.25
    assert torch.allclose(lse.double(), score, rtol=1e-5, atol=1e-5)


@needs_triton
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.tuples(st.integers(0, 45), st.integers(0, 45)), min_size=1,
                        max_size=4).filter(lambda pairs: sum(q for q, _ in pairs) > 0),
       mask=st.sampled_from(list(MASKS)), heads=st.sampled_from([(2, 2), (4, 1)]))
def test_random_length_mixes(lengths, mask, heads):
    lengths_q = [q for q, _ in lengths]
    lengths_k = [k for _, k in lengths]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, *heads, head_dim=16, seed=len(lengths))
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, **MASKS[mask])
    check_each_sequence(out, lse, q, k, v, lengths_q, lengths_k, compare_dense=False,
                        **MASKS[mask])


# ---------------------------------------------------------------------------
# The public call

@needs_triton
def test_varlen_api_matches_its_reference_and_returns_flash_attn_layout():
    lengths_q, lengths_k = [17, 0, 30], [20, 5, 30]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, seed=5)
    args = (q, k, v, cu_q, cu_k, 30, 30)
    out, lse, probs = flash_attn_varlen_func(*args, causal=True, window_size=(9, -1),
                                             return_attn_probs=True, impl="triton")
    assert last_impl() == "triton" and probs is None
    assert out.shape == q.shape and lse.shape == (4, 47) and lse.dtype == torch.float32
    ref_out, ref_lse, _ = flash_attn_varlen_func(*(t.cpu() for t in args[:5]), 30, 30,
                                                 causal=True, window_size=(9, -1),
                                                 return_attn_probs=True, impl="reference")
    assert last_impl() == "reference"
    assert (out.cpu().float() - ref_out.float()).abs().max() < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert torch.allclose(lse.cpu()[finite], ref_lse[finite], rtol=1e-5)
    check_each_sequence(out, lse, q, k, v, lengths_q, lengths_k, compare_dense=False,
                        causal=True, window=(9, -1))


@needs_triton
def test_packed_variants_are_views_of_the_same_call():
    lengths = [12, 31]
    qkv = torch.randn(43, 3, 2, 32, generator=torch.Generator().manual_seed(6)).half().to(DEVICE)
    cu = cumulative(lengths)
    expected = flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 31, 31, causal=True,
                                      impl="triton")
    assert torch.equal(flash_attn_varlen_qkvpacked_func(qkv, cu, 31, causal=True, impl="triton"),
                       expected)
    assert torch.equal(flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 31, 31,
                                                       causal=True, impl="triton"), expected)


def test_reference_impl_is_differentiable_per_sequence():
    lengths_q, lengths_k = [6, 0, 9], [4, 3, 0]
    q, k, v, cu_q, cu_k = (t.cpu() for t in packed(lengths_q, lengths_k, heads=2, kv_heads=2,
                                                   head_dim=8, dtype=torch.float64, seed=7))
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu_q.cpu(), cu_k.cpu(), 9, 4, causal=True,
                                 impl="reference")
    out.sum().backward()
    assert torch.all(q.grad[6:] == 0)  # the last sequence has no keys
    single = q[:6].detach().clone().requires_grad_()
    attnlab.flash_attn_func(single[None], k[None, :4], v[None, :4], causal=True,
                            impl="reference").sum().backward()
    assert torch.allclose(q.grad[:6], single.grad)


@needs_triton
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_varlen_gradients_meet_the_backward_rule_per_sequence(mask):
    lengths_q, lengths_k = [23, 0, 40, 9], [30, 6, 40, 0]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, seed=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    options = MASKS[mask]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, 40, 40, impl="triton",
                                 causal=options.get("causal", False),
                                 window_size=options.get("window", (-1, -1)))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype)
    out.backward(dout.to(DEVICE))
    dq, dk, dv = (t.grad for t in leaves)
    for i, rows, keys in sequences(lengths_q, lengths_k):
        if rows.stop == rows.start or keys.stop == keys.start:
            # Nothing attends here: every gradient of these rows is exactly zero.
            assert torch.all(dq[rows] == 0) and torch.all(dk[keys] == 0) \
                and torch.all(dv[keys] == 0), i
            continue
        checks = check_gradients(
            (dq[None, rows], dk[None, keys], dv[None, keys]),
            q[None, rows], k[None, keys], v[None, keys], dout[None, rows.start:rows.stop].to(DEVICE),
            layout="bshd", **options)
        assert all(c.passed for c in checks), (i, checks)


def _cpu_args(lengths_q=(3, 4), lengths_k=(5, 2)):
    q = torch.randn(sum(lengths_q), 2, 8, dtype=torch.float16)
    k = torch.randn(sum(lengths_k), 2, 8, dtype=torch.float16)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, k.clone(), cu_q, cu_k


PAGES = torch.randn(4, 16, 2, 8).half()  # a paged cache's pool for the refusals below


@pytest.mark.parametrize(("change", "error", "match"), [
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, TypeError,
     "cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    (lambda a: {**a, "cu_seqlens_k": [0, 5, 7]}, TypeError, "cu_seqlens_k must be a torch.int32"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"][None]}, ValueError, "1-D"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 5, 3, 7], dtype=torch.int32),
                "cu_seqlens_k": torch.tensor([0, 2, 5, 7], dtype=torch.int32)},
     ValueError, r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[2\] = 3"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([1, 3, 7], dtype=torch.int32)},
     ValueError, r"cu_seqlens_q\[0\] must be 0, got 1"),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([0, 5, 6], dtype=torch.int32)},
     ValueError, r"cu_seqlens_k\[-1\] must equal k's total tokens 7"),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([0, 5], dtype=torch.int32)},
     ValueError, "same batch . 1 entries, got 3 and 2"),
    (lambda a: {**a, "max_seqlen_q": 3}, ValueError,
     r"max_seqlen_q \(3\) is smaller than sequence 1's length 4"),
    (lambda a: {**a, "max_seqlen_k": 5.0}, TypeError, "max_seqlen_k must be an int"),
    (lambda a: {**a, "q": a["q"][None]}, ValueError, r"q must be 3-D \(total_tokens"),
    (lambda a: {**a, "block_table": torch.zeros(2, 1, dtype=torch.int32)}, ValueError,
     r"k must be a paged cache \(num_pages, page_size"),
    (lambda a: {**a, "k": PAGES, "v": PAGES,
                "block_table": torch.zeros(2, 1, dtype=torch.int32, device="cpu"),
                "cu_seqlens_k": torch.tensor([0, 5, 40], dtype=torch.int32)}, ValueError,
     "sequence 1 35 keys, more than its block_table row holds"),
    (lambda a: {**a, "k": PAGES[:, :8], "v": PAGES[:, :8],
                "block_table": torch.zeros(2, 1, dtype=torch.int32)}, ValueError,
     "multiple of 16"),
    (lambda a: {**a, "cu_seqlens_k": None, "block_table": torch.zeros(2, 1, dtype=torch.int32),
                "k": PAGES, "v": PAGES},
     ValueError, "cu_seqlens_k may be None only when seqused_k"),
    (lambda a: {**a, "seqused_k": torch.tensor([1, 2, 3], dtype=torch.int32)}, ValueError,
     r"seqused_k must have shape \(batch,\) = \(2,\)"),
    (lambda a: {**a, "q": a["q"].requires_grad_(), "seqused_k": torch.tensor(
        [1, 2], dtype=torch.int32)}, NotImplementedError, "forward only"),
    (lambda a: {**a, "dropout_p": 0.1}, NotImplementedError, "dropout_p"),
    (lambda a: {**a, "causal": 1}, TypeError, "causal"),
    (lambda a: {**a, "window_size": (-3, 0)}, ValueError, "window_size"),
])
def test_bad_varlen_arguments_are_named(change, error, match):
    q, k, v, cu_q, cu_k = _cpu_args()
    args = change(dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                       max_seqlen_k=5))
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(**args)


def test_cu_seqlens_on_another_device_is_refused_before_any_kernel():
    q, k, v, cu_q, cu_k = _cpu_args()
    meta = [t.to("meta") for t in (q, k, v)]  # tensors that no kernel could ever read
    with pytest.raises(ValueError, match="cu_seqlens_q must be on q's device meta, got cpu"):
        flash_attn_varlen_func(*meta, cu_q, cu_k, 4, 5)


def test_varlen_exports():
    assert {"flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
            "flash_attn_varlen_kvpacked_func"} <= set(attnlab.__all__)


# ---------------------------------------------------------------------------
# Paged keys (chunked prefill): varlen queries against a paged KV cache

def paged_keys(lengths_k, page_size, kv_heads=2, head_dim=32, dtype=torch.float16, seed=0,
               spare_columns=1):
    """(k, v packed (thd), k_pages, v_pages, block_table): sequence b's keys written into
    its shuffled pages, the rest of the pool random (what the call must never read)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths_k)
    per_seq = max(-(-n // page_size) for n in lengths_k) + spare_columns
    num_pages = batch * per_seq + 3
    table = torch.randperm(num_pages, generator=gen)[:batch * per_seq].view(batch, per_seq)
    pools, packs = [], []
    for _ in range(2):
        pool = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen).to(dtype)
        pack = torch.randn(sum(lengths_k), kv_heads, head_dim, generator=gen).to(dtype)
        start = 0
        for b, n in enumerate(lengths_k):
            flat = pool[table[b]].flatten(0, 1)
            flat[:n] = pack[start:start + n]
            pool[table[b]] = flat.view(per_seq, page_size, kv_heads, head_dim)
            start += n
        pools.append(pool.to(DEVICE))
        packs.append(pack.to(DEVICE))
    return (*packs, *pools, table.to(torch.int32).to(DEVICE))


PAGED_CASES = [  # lengths_q, lengths_k, page size, options
    ([3, 1, 0, 6], [40, 17, 5, 6], 16, dict(causal=True)),
    ([5, 1, 2], [0, 33, 50], 48, dict(causal=True)),
    ([4, 7], [70, 3], 16, dict(causal=False)),
    ([6, 2], [45, 21], 48, dict(causal=True, window_size=(9, 0))),
    ([9, 3], [9, 31], 16, dict(causal=True, softcap=5.0)),
]


@needs_triton
@pytest.mark.parametrize(("lengths_q", "lengths_k", "page_size", "options"), PAGED_CASES)
def test_paged_varlen_equals_packed_keys_and_the_reference(lengths_q, lengths_k, page_size,
                                                           options):
    """Chunked prefill: each sequence's queries against its keys read through the block
    table give the packed call's bits (same tiles) and pass the accuracy rule against
    float64; GQA (4 query heads on 2); page 48 is not a power of two (tiles cross pages)."""
    q, _, _, cu_q, cu_k = packed(lengths_q, lengths_k, seed=sum(lengths_k))
    k, v, k_pages, v_pages, table = paged_keys(lengths_k, page_size, seed=len(lengths_q))
    call = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                max_seqlen_k=max(lengths_k), return_attn_probs=True, **options)
    out, lse, _ = flash_attn_varlen_func(q, k_pages, v_pages, block_table=table, impl="triton",
                                         **call)
    assert last_impl() == "triton" and not torch.isnan(out).any()
    ref, ref_lse, _ = flash_attn_varlen_func(q.cpu(), k_pages.cpu(), v_pages.cpu(),
                                             block_table=table.cpu(), impl="reference",
                                             **{n: (t.cpu() if isinstance(t, torch.Tensor) else t)
                                                for n, t in call.items()})
    window = options.get("window_size", (-1, -1))
    scale = 1.0 / math.sqrt(q.shape[-1])
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths_q)):
        rows = slice(starts_q[b], starts_q[b + 1])
        keys = slice(starts_k[b], starts_k[b + 1])
        if lengths_q[b] == 0:
            continue
        if lengths_k[b] == 0:  # no keys: zeros and -inf, as the packed call
            assert torch.all(out[rows] == 0) and torch.isneginf(lse[:, rows]).all()
            continue
        result = check_accuracy(out[rows][None].cpu(), lse[:, rows][None].cpu(),
                                q[rows][None].cpu(), k[keys][None].cpu(), v[keys][None].cpu(),
                                layout="bshd", causal=options["causal"], window=window,
                                softcap=options.get("softcap", 0.0), scale=scale)
        assert result.passed, (b, result)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=3e-3, rtol=0)
    contiguous = flash_attn_varlen_func(q, k, v, impl="triton", **call)
    assert torch.equal(out, contiguous[0]) and torch.equal(lse, contiguous[1])


@needs_triton
@pytest.mark.parametrize("paged", [True, False])
def test_seqused_k_uses_the_first_keys_of_each_sequence(paged):
    """seqused_k (FA3's and flash-attn's paged argument): sequence b attends to its first
    seqused_k[b] keys; paged, cu_seqlens_k may be None."""
    lengths_q, lengths_k, used = [2, 3, 1], [30, 20, 9], [30, 7, 0]
    q, _, _, cu_q, cu_k = packed(lengths_q, lengths_k, seed=5)
    k, v, k_pages, v_pages, table = paged_keys(lengths_k, 16, seed=6)
    seqused = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    if paged:
        got = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, None, 3, 30, causal=True,
                                     block_table=table, seqused_k=seqused, impl="triton")
    else:
        got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 30, causal=True,
                                     seqused_k=seqused, impl="triton")
    cut = [torch.cat([t[s:s + n] for s, n in zip(cu_k.tolist(), used, strict=False)])
           for t in (k, v)]
    expected = flash_attn_varlen_func(q, *cut, cu_q, cumulative(used), 3, 30, causal=True,
                                      impl="triton")
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize(("case", "change", "words"), [
    ("a page outside the pool", lambda o: o["block_table"].__setitem__((1, 0), 999),
     r"block_table\[1, 0\] = 999"),
    ("seqused_k past the capacity", lambda o: o.update(seqused_k=torch.tensor(
        [20, 10_000], dtype=torch.int32, device=DEVICE)), r"seqused_k\[1\] = 10000"),
])
def test_a_bad_page_or_seqused_k_is_flagged_and_its_sequence_is_nan(case, change, words):
    lengths_q, lengths_k = [3, 4], [20, 40]
    q, _, _, cu_q, cu_k = packed(lengths_q, lengths_k, seed=7)
    _, _, k_pages, v_pages, table = paged_keys(lengths_k, 16, seed=8)
    options = dict(block_table=table, causal=True, impl="triton")
    attnlab.check_kvcache_indices(DEVICE)
    good = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 4, 40, **options)
    change(options)
    out = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 4, 40, **options)
    assert torch.isnan(out[3:]).all() and torch.equal(out[:3], good[:3])
    with pytest.raises(ValueError, match=words):
        attnlab.check_kvcache_indices(DEVICE)


def test_the_reference_reads_paged_indices_on_the_host_and_refuses_at_once():
    q, _, _, cu_q, cu_k = (t.cpu() for t in packed([2, 2], [20, 20], seed=9))
    _, _, k_pages, v_pages, table = (t.cpu() for t in paged_keys([20, 20], 16, seed=9))
    table[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1 must be a page index"):
        flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 2, 20, block_table=table,
                               impl="reference")


# ---------------------------------------------------------------------------
# 64-bit offsets in the varlen layout

@needs_triton
def test_forced_64_bit_offsets_give_the_same_bits(monkeypatch):
    lengths_q, lengths_k = [33, 0, 70], [40, 2, 65]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, seed=10)
    fast = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, causal=True)
    monkeypatch.setattr(forward_module, "offsets_need_int64", lambda *args: True)
    monkeypatch.setattr(forward_module, "_PLANS", PlanCache())  # re-plan with the patch
    wide = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, causal=True)
    assert torch.equal(fast[0], wide[0]) and torch.equal(fast[1], wide[1])


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 59, 128, 256])
@pytest.mark.parametrize("mask", list(MASKS))
def test_gpu_varlen_grid(dtype, head_dim, mask):
    # Real lengths with the default (tuned) tiles: the accuracy rule per sequence.
    lengths_q, lengths_k = [1, 1023, 0, 2049, 300, 128], [7, 1023, 64, 2049, 0, 1000]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, heads=6, kv_heads=2, head_dim=head_dim,
                                 dtype=dtype, seed=head_dim)
    out, lse = run_varlen(q, k, v, cu_q, cu_k, lengths_q, lengths_k, config=None, **MASKS[mask])
    check_each_sequence(out, lse, q, k, v, lengths_q, lengths_k, compare_dense=False,
                        **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [256, 512])
@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(1, 239), (113, 203), (1023, 1024)])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_paged_varlen_as_flash_attns_own_test(page_size, local, seqlen_q, seqlen_k,
                                                  head_dim):
    """flash-attn's test_flash_attn_varlen_causal with paged_kv_block_size (its setup:
    batch 8, 9 heads, a shuffled pool 3x the pages needed, prefix key lengths drawn in
    [seqlen_k - 20, seqlen_k], window_size a tensor drawn in [0, seqlen_k)), judged by
    the accuracy rule per sequence."""
    torch.random.manual_seed(0)
    batch, heads = 8, 9
    window = (-1, -1) if not local else torch.randint(0, seqlen_k, (2,))
    per_seq = -(-seqlen_k // page_size) * 3
    pages = [torch.randn(batch * per_seq, page_size, heads, head_dim, device="cuda",
                         dtype=torch.bfloat16) for _ in range(2)]
    table = torch.randperm(batch * per_seq, dtype=torch.int32, device="cuda").view(batch, -1)
    dense = [p[table.long()].flatten(1, 2)[:, :seqlen_k] for p in pages]
    lengths_q = torch.randint(max(1, seqlen_q - 20), seqlen_q + 1, (batch,)).tolist()
    lengths_k = torch.randint(max(1, seqlen_k - 20), seqlen_k + 1, (batch,)).tolist()
    q = torch.randn(sum(lengths_q), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out, lse, _ = flash_attn_varlen_func(q, *pages, cumulative(lengths_q), cumulative(lengths_k),
                                         max(lengths_q), max(lengths_k), 0.0, causal=True,
                                         window_size=window, block_table=table,
                                         return_attn_probs=True)
    start = 0
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        rows = slice(start, start + n_q)
        result = check_accuracy(out[None, rows], lse[None, :, rows], q[None, rows],
                                dense[0][b:b + 1, :n_k], dense[1][b:b + 1, :n_k], layout="bshd",
                                causal=True, window=tuple(int(w) for w in window))
        assert result.passed, (b, result)
        start += n_q


def _free_gpu_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if on_gpu else 0


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths_q", [
    [100_000, 1, 499_999],  # each sequence's rows fit 32 bits; its first token is past 2^31
    [7, 599_993],           # one sequence whose own rows pass 2^31: the 64-bit row path
])
def test_gpu_varlen_past_2_31_elements(lengths_q):
    # 600k packed query tokens x 32 heads x 128 = 2.46e9 elements (4.9 GB in bf16 each for q, O).
    need = 2 * 600_000 * 32 * 128 * 2 + (4 << 30)
    if _free_gpu_bytes() < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, "
                    f"{_free_gpu_bytes() / 2**30:.0f} free")
    lengths_k = [256 + 37 * i for i in range(len(lengths_q))]
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(sum(lengths_q), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(sum(lengths_k), 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cumulative(lengths_q), cumulative(lengths_k),
                                         max(lengths_q), max(lengths_k), return_attn_probs=True)
    # Non-causal, so any rows of a sequence can be judged alone against all its keys: the
    # last 2,048 rows of each (the largest offsets) for the first and the last head.
    for _, rows, keys in sequences(lengths_q, lengths_k):
        tail = slice(max(rows.start, rows.stop - 2048), rows.stop)
        for head in (0, 31):
            kv_head = slice(head // 4, head // 4 + 1)
            result = check_accuracy(out[None, tail, head:head + 1], lse[None, head:head + 1, tail],
                                    q[None, tail, head:head + 1], k[None, keys, kv_head],
                                    v[None, keys, kv_head], layout="bshd")
            assert result.passed, (rows, head, result)
