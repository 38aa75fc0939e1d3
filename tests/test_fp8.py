"""FP8 (float8_e4m3fn): the KV cache's decode and append, the FP8 prefill, their refusals.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1).  Triton 3.7.1's
interpreter loads and converts e4m3 exactly except its NaN code (read as 480), and its
fp32 -> fp8 cast truncates bit patterns; the FP8 forward therefore rounds P itself there
(``_to_e4m3``'s EMULATE path, checked bit for bit against torch below).  What only the
GPU covers: the hardware's cvt.rn.satfinite rounding of P, the fp8 wgmma and its
accumulator (the bound's score and P V terms), NaN in an fp8 cache, CUDA-graph capture
of the fp8 append and decode, real sizes.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import triton
import triton.language as tl

import attnlab
import attnlab.flash_attn_interface as fa3
from attention_inputs import make_qkv, paged_copy
from attnlab.accuracy import check_fp8_accuracy, check_fp8_cache_accuracy
from attnlab.kernels._primitives import _to_e4m3, kernel_is_interpreted
from attnlab.reference.fp8 import (
    E4M3_MAX,
    dequantize,
    descale_per_head,
    e4m3_half_step,
    per_head,
    quantize_e4m3,
    quantize_per_head,
)
from sm90_marks import sm90

on_gpu = torch.cuda.is_available()
runs_kernels = pytest.mark.skipif(not on_gpu and not kernel_is_interpreted(),
                                  reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")
DEVICE = "cuda" if on_gpu else "cpu"
FP8 = torch.float8_e4m3fn


def descales(batch, kv_heads, per_tensor, seed):
    """A descale per (batch, kv_head), or one per tensor (shape (1,))."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand((1,) if per_tensor else (batch, kv_heads), generator=gen) * 0.02 + 0.005
    return values.to(DEVICE)


def as_view(descale, batch, kv_heads):
    return descale.reshape(1, 1).expand(batch, kv_heads) if descale.numel() == 1 else descale


def fp8_cache(batch, seqlen, kv_heads, dim, descale, seed):
    """Real values N(0, 1) stored as e4m3 with ``descale`` (as an append stores them)."""
    real = make_qkv(batch, 1, kv_heads, 1, seqlen, dim, torch.float32, layout="bshd",
                    seed=seed, device=DEVICE)[1]
    return quantize_e4m3(real, per_head(as_view(descale, batch, kv_heads)))


def paged_fp8(cache, page_size, seed=0):
    """paged_copy of an fp8 cache, through its bytes (index_put on uint8 works everywhere)."""
    pages, table = paged_copy(cache.view(torch.uint8), page_size, seed=seed)
    return pages.view(FP8), table


# ----- quantising ------------------------------------------------------------------------------
def test_quantize_rounds_to_nearest_even_and_saturates():
    # Ties: 1.0625 lies between 1.0 and 1.125 (to even: 1.0); 1.1875 between 1.125 and 1.25.
    x = torch.tensor([1.0625, 1.1875, -1.0625, 17.0, 500.0, -1e9, float("inf"), 2.0**-10,
                      3 * 2.0**-11, 0.0, float("nan")])
    got = quantize_e4m3(x, torch.tensor(1.0)).float()
    expected = torch.tensor([1.0, 1.25, -1.0, 16.0, E4M3_MAX, -E4M3_MAX, E4M3_MAX, 0.0,
                             2.0**-9, 0.0, float("nan")])
    assert torch.equal(got[:-1], expected[:-1]) and got[-1].isnan()
    # The descale divides (real = stored x descale); every rounding within half a step.
    real = torch.randn(4096, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    stored = quantize_e4m3(real, torch.tensor(0.01))
    error = (dequantize(stored, torch.tensor(0.01)) - real).abs()
    assert torch.all(error <= 0.01 * e4m3_half_step(real / 0.01) * (1 + 1e-6))



def test_per_head_descales_use_each_heads_whole_range():
    real = torch.randn(2, 64, 3, 16, generator=torch.Generator().manual_seed(4)) * 5
    real[1, :, 2] = 0.0  # a head of zeros
    stored, descale = quantize_per_head(real)
    assert stored.dtype == FP8 and descale.shape == (2, 3) and descale.dtype == torch.float32
    # Each (batch, head)'s largest magnitude lands on 448 exactly; the zero head stays zero.
    peak = stored.float().abs().amax(dim=(1, 3))
    assert torch.equal(peak[0], torch.full((3,), E4M3_MAX)) and peak[1, 2] == 0
    assert descale[1, 2] == 1e-12 and torch.equal(descale, descale_per_head(real))
    error = (dequantize(stored, per_head(descale)) - real).abs()
    allowed = per_head(descale).double() * e4m3_half_step(real.double() / per_head(descale))
    assert torch.all(error <= allowed * (1 + 1e-6))


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr, EMULATE: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, _to_e4m3(tl.load(X + offsets), EMULATE))


@runs_kernels
def test_the_kernels_rounding_of_p_is_torchs_round_to_nearest_even():
    # Every e4m3 value and every midpoint between neighbours (the ties), plus random p.
    grid = torch.arange(127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, no NaN
    ties = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(2)
    p = torch.cat([grid, ties, torch.rand(2048, generator=gen),
                   torch.rand(1024, generator=gen) * 2.0**-6])
    p = torch.cat([p, torch.zeros(4096 - p.numel())]).to(DEVICE)
    out = torch.empty(4096, dtype=FP8, device=DEVICE)
    _round_kernel[(1,)](p, out, N=4096, EMULATE=kernel_is_interpreted())
    assert torch.equal(out.view(torch.uint8), p.to(FP8).view(torch.uint8))


# ----- the fp8 KV cache -------------------------------------------------------------------------
@runs_kernels
@pytest.mark.parametrize(("paged", "per_tensor", "dtype", "seqlen_q", "num_splits"), [
    (False, False, torch.bfloat16, 1, 3), (False, True, torch.float16, 2, 1),
    (True, False, torch.bfloat16, 1, 0), (True, True, torch.bfloat16, 3, 2),
])
def test_fp8_cache_decode_meets_the_accuracy_rule(paged, per_tensor, dtype, seqlen_q, num_splits):
    batch, heads, kv_heads, dim, capacity = 2, 8, 2, 32, 150
    k_descale = descales(batch, kv_heads, per_tensor, seed=1)
    v_descale = descales(batch, kv_heads, per_tensor, seed=2)
    k_cache, v_cache = (fp8_cache(batch, capacity, kv_heads, dim, d, seed=s)
                        for d, s in ((k_descale, 3), (v_descale, 4)))
    q = make_qkv(batch, heads, kv_heads, seqlen_q, 1, dim, dtype, layout="bshd", seed=5,
                 device=DEVICE)[0]
    lengths = torch.tensor([150, 77], dtype=torch.int32, device=DEVICE)
    extra = {}
    if paged:
        k_pages, table = paged_fp8(k_cache, 16, seed=6)
        v_pages, _ = paged_fp8(v_cache, 16, seed=6)
        extra = {"block_table": table}
    options = dict(cache_seqlens=lengths, causal=True, return_softmax_lse=True,
                   k_descale=k_descale, v_descale=v_descale, num_splits=num_splits)
    caches = (k_pages, v_pages) if paged else (k_cache, v_cache)
    out, lse = attnlab.flash_attn_with_kvcache(q, *caches, impl="triton", **extra, **options)
    assert attnlab.last_impl() == "triton-decode" and out.dtype == dtype
    ref, ref_lse = attnlab.flash_attn_with_kvcache(q.cpu(), k_cache.cpu(), v_cache.cpu(),
                                                   impl="reference",
                                                   **{**options, "cache_seqlens": lengths.cpu(),
                                                      "k_descale": k_descale.cpu(),
                                                      "v_descale": v_descale.cpu()})
    for b, n in enumerate(lengths.tolist()):
        views = [as_view(d, batch, kv_heads)[b:b + 1] for d in (k_descale, v_descale)]
        for result, result_lse in ((out, lse), (ref, ref_lse)):
            check = check_fp8_cache_accuracy(
                result[b:b + 1].cpu(), result_lse[b:b + 1].cpu(), q[b:b + 1].cpu(),
                k_cache[b:b + 1, :n].cpu(), v_cache[b:b + 1, :n].cpu(),
                *(v.cpu() for v in views), causal=True)
            assert check.passed, (b, check)


@runs_kernels
def test_fp8_cache_decode_takes_bf16_q_rows_outside_fp16s_range():
    # The kernel meets an fp8 cache with fp16 MMAs: each bf16 q row is scaled by a power
    # of two into fp16's range.  Rows of one KV group far above fp16's 65504 and far
    # below its smallest subnormal, beside ordinary ones, a zero row, and a NaN that
    # must stay in its own row.
    batch, heads, kv_heads, dim, capacity = 1, 8, 2, 32, 70
    k_descale, v_descale = (torch.tensor([0.02], device=DEVICE), torch.tensor([0.01], device=DEVICE))
    k_cache, v_cache = (fp8_cache(batch, capacity, kv_heads, dim, d, seed=s)
                        for d, s in ((k_descale, 8), (v_descale, 9)))
    q = make_qkv(batch, heads, kv_heads, 1, 1, dim, torch.float32, layout="bshd", seed=10,
                 device=DEVICE)[0]
    q[0, 0, 0] *= 3e4     # max |q| ~1e5: no fp16
    q[0, 0, 1] *= 1e-30   # below fp16's subnormals
    q[0, 0, 2] = 0.0
    q[0, 0, 5, 3] = float("nan")
    q[0, 0, 6, :dim // 2] *= 2.0**-20   # one row spanning 2^20 (exact in fp16 once scaled)
    q = q.to(torch.bfloat16)
    options = dict(causal=True, return_softmax_lse=True, k_descale=k_descale, v_descale=v_descale)
    out, lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, impl="triton", **options)
    assert attnlab.last_impl() == "triton-decode"
    assert out[0, 0, 5].isnan().all() and lse[0, 5].isnan().all()
    finite = [h for h in range(heads) if h != 5]
    assert not out[0, 0, finite].isnan().any()
    real_k = dequantize(k_cache, per_head(as_view(k_descale, batch, kv_heads))).double()
    real_v = dequantize(v_cache, per_head(as_view(v_descale, batch, kv_heads))).double()
    group = heads // kv_heads
    for h in finite:
        kk, vv = real_k[0, :, h // group], real_v[0, :, h // group]
        scores = (q[0, 0, h].double().cpu() @ kk.cpu().T) / math.sqrt(dim)
        ref = torch.softmax(scores, 0) @ vv.cpu()
        # The kernel's own error budget: P in fp16 and fp32 accumulation (bf16 round-off of
        # the output dominates), measured against the output's scale.
        error = (out[0, 0, h].double().cpu() - ref).abs().max().item()
        assert error <= 2.0**-7 * max(ref.abs().max().item(), 1e-3), (h, error)
        assert abs(lse[0, h].item() - torch.logsumexp(scores, 0).item()) <= 1e-3 * max(
            1.0, abs(torch.logsumexp(scores, 0).item())), h


@runs_kernels
def test_the_cache_rule_fails_a_decode_that_drops_v_descale():
    batch, heads, kv_heads, dim, capacity = 1, 4, 1, 32, 96
    k_descale, v_descale = (torch.tensor([0.01], device=DEVICE), torch.tensor([0.03], device=DEVICE))
    k_cache = fp8_cache(batch, capacity, kv_heads, dim, k_descale, seed=7)
    v_cache = fp8_cache(batch, capacity, kv_heads, dim, v_descale, seed=8)
    q = make_qkv(batch, heads, kv_heads, 1, 1, dim, torch.bfloat16, layout="bshd", seed=9,
                 device=DEVICE)[0]
    out, lse = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=k_descale,
                                               v_descale=torch.ones(1, device=DEVICE),
                                               return_softmax_lse=True, impl="triton")
    views = [as_view(d, batch, kv_heads).cpu() for d in (k_descale, v_descale)]
    check = check_fp8_cache_accuracy(out.cpu(), lse.cpu(), q.cpu(), k_cache.cpu(),
                                     v_cache.cpu(), *views)
    assert not check.passed


@runs_kernels
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_append_stores_the_quantised_rows_and_attends_to_them(paged):
    batch, heads, kv_heads, dim, capacity, seqlen_new = 3, 4, 2, 32, 96, 2
    k_descale = descales(batch, kv_heads, False, seed=10)
    v_descale = descales(batch, kv_heads, True, seed=11)
    k_cache = fp8_cache(batch, capacity, kv_heads, dim, k_descale, seed=12)
    v_cache = fp8_cache(batch, capacity, kv_heads, dim, v_descale, seed=13)
    q, k_new, v_new = make_qkv(batch, heads, kv_heads, seqlen_new, seqlen_new, dim,
                               torch.bfloat16, layout="bshd", seed=14, device=DEVICE)
    lengths = torch.tensor([0, 40, 94], dtype=torch.int32, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    stored_k = quantize_e4m3(k_new, per_head(k_descale))
    stored_v = quantize_e4m3(v_new, per_head(as_view(v_descale, batch, kv_heads)))
    for b, n in enumerate(lengths.tolist()):
        expected_k.view(torch.uint8)[b, n:n + seqlen_new] = stored_k.view(torch.uint8)[b]
        expected_v.view(torch.uint8)[b, n:n + seqlen_new] = stored_v.view(torch.uint8)[b]
    extra = {}
    if paged:
        k_cache, table = paged_fp8(k_cache, 32, seed=15)
        v_cache, _ = paged_fp8(v_cache, 32, seed=15)
        extra = {"block_table": table}
    out, lse = attnlab.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
        return_softmax_lse=True, k_descale=k_descale, v_descale=v_descale, impl="triton", **extra)
    if paged:
        rows = table.long()
        k_cache = k_cache.view(torch.uint8)[rows].flatten(1, 2)[:, :capacity].view(FP8)
        v_cache = v_cache.view(torch.uint8)[rows].flatten(1, 2)[:, :capacity].view(FP8)
    for b, n in enumerate(lengths.tolist()):
        end = n + seqlen_new
        # Bit for bit: the new rows are k / k_descale rounded to e4m3; the rest untouched.
        assert torch.equal(k_cache[b, :end].view(torch.uint8), expected_k[b, :end].view(torch.uint8))
        assert torch.equal(v_cache[b, :end].view(torch.uint8), expected_v[b, :end].view(torch.uint8))
        views = [as_view(d, batch, kv_heads)[b:b + 1].cpu() for d in (k_descale, v_descale)]
        check = check_fp8_cache_accuracy(out[b:b + 1].cpu(), lse[b:b + 1].cpu(),
                                         q[b:b + 1].cpu(), expected_k[b:b + 1, :end].cpu(),
                                         expected_v[b:b + 1, :end].cpu(), *views, causal=True)
        assert check.passed, (b, check)
    if not paged:
        assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))


def _rotary_append_call(paged: bool):
    """An fp8 decode step with append and rotary: (q, caches, options); one new key
    saturates (1000 over a descale near 0.01), one new value is +inf (stored as 448)."""
    batch, heads, kv_heads, dim, capacity, seqlen_new = 2, 4, 2, 32, 64, 3
    k_descale = descales(batch, kv_heads, False, seed=20)
    v_descale = descales(batch, kv_heads, True, seed=21)
    k_cache = fp8_cache(batch, capacity, kv_heads, dim, k_descale, seed=22)
    v_cache = fp8_cache(batch, capacity, kv_heads, dim, v_descale, seed=23)
    q, k_new, v_new = make_qkv(batch, heads, kv_heads, 1, seqlen_new, dim, torch.bfloat16,
                               layout="bshd", seed=24, device=DEVICE)
    k_new[0, 1, 0, 3] = 1000.0
    v_new[1, 2, 1, 5] = float("inf")
    angle = torch.rand(capacity, 8, generator=torch.Generator().manual_seed(25)) * 6.3
    options = dict(k=k_new, v=v_new, rotary_cos=angle.cos().to(DEVICE),
                   rotary_sin=angle.sin().to(DEVICE),
                   cache_seqlens=torch.tensor([3, 50], dtype=torch.int32, device=DEVICE),
                   causal=True, return_softmax_lse=True, k_descale=k_descale,
                   v_descale=v_descale)
    if paged:
        k_cache, table = paged_fp8(k_cache, 16, seed=26)
        v_cache, _ = paged_fp8(v_cache, 16, seed=26)
        options["block_table"] = table
    return q, k_cache, v_cache, options


@runs_kernels
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_append_with_rotary_stores_the_references_bytes(paged):
    """The append kernel rotates, then quantises (saturating): byte for byte what the
    float64 reference path stores, and the two outputs agree."""
    q, k_cache, v_cache, options = _rotary_append_call(paged)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    outs = [attnlab.flash_attn_with_kvcache(q, kc, vc, impl=impl, **options)
            for (kc, vc), impl in zip(caches, ("triton", "reference"), strict=True)]
    (kt, vt), (kr, vr) = caches
    assert torch.equal(kt.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vt.view(torch.uint8), vr.view(torch.uint8))
    assert not torch.equal(kt.view(torch.uint8), k_cache.view(torch.uint8))  # it appended
    # The +inf value saturated to 448 (no new NaN; a page pool's unused pages may hold some).
    assert (vt.float() == E4M3_MAX).any()
    assert vt.float().isnan().sum() == v_cache.float().isnan().sum()
    assert (kt.float().abs() == E4M3_MAX).any()
    # The attention itself (on the same bytes) is the accuracy rule's business (above);
    # here the two paths agree to bf16's rounding of the rotated q.
    torch.testing.assert_close(outs[0][0].float(), outs[1][0].float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=2e-2, rtol=0)


@runs_kernels
@pytest.mark.parametrize("paged", [False, True])
def test_an_fp8_call_reads_no_tensor_value_on_the_host(no_value_reads, paged):
    """Planning and a repeated call with an fp8 cache, append, rotary and descales: no
    host read of any tensor (the descales included); three launches."""
    q, k_cache, v_cache, options = _rotary_append_call(paged)
    for _ in range(2):
        with no_value_reads() as launched:
            attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=3, impl="triton",
                                            **options)
        assert launched == ["_rotary_append", "_split_kv_decode", "_combine_partials"]
        launched.clear()


@runs_kernels
def test_fa3_interface_takes_the_caches_descales():
    batch, heads, kv_heads, dim, capacity = 2, 4, 2, 32, 64
    k_descale = descales(batch, kv_heads, False, seed=16)
    v_descale = descales(batch, kv_heads, False, seed=17)
    k_cache = fp8_cache(batch, capacity, kv_heads, dim, k_descale, seed=18)
    v_cache = fp8_cache(batch, capacity, kv_heads, dim, v_descale, seed=19)
    q = make_qkv(batch, heads, kv_heads, 1, 1, dim, torch.bfloat16, layout="bshd", seed=20,
                 device=DEVICE)[0]
    ours = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=k_descale,
                                           v_descale=v_descale, impl="triton")
    theirs = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=k_descale,
                                         v_descale=v_descale, impl="triton")
    assert torch.equal(ours, theirs)
    # Varlen queries run one call per sequence: each takes its own descale row.
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    packed = fa3.flash_attn_with_kvcache(q.flatten(0, 1), k_cache, v_cache, cu_seqlens_q=cu,
                                         max_seqlen_q=1, k_descale=k_descale,
                                         v_descale=v_descale, impl="triton")
    torch.testing.assert_close(packed, ours.flatten(0, 1), atol=2e-2, rtol=0)
    with pytest.raises(NotImplementedError, match="q_descale must be None"):
        fa3.flash_attn_with_kvcache(q, k_cache, v_cache, q_descale=k_descale,
                                    k_descale=k_descale, v_descale=v_descale)


def _cache_refusals():
    q = torch.zeros(2, 1, 4, 32, dtype=torch.bfloat16)
    one = torch.ones(1)
    f = attnlab.flash_attn_with_kvcache
    return [
        ("fp8 q", lambda kc, vc: f(q.to(FP8), kc, vc, k_descale=one, v_descale=one), TypeError,
         "takes no fp8 queries"),
        ("missing k_descale", lambda kc, vc: f(q, kc, vc, v_descale=one), ValueError,
         "k_descale must be given with a float8_e4m3fn cache"),
        ("descale with bf16 cache", lambda kc, vc: f(q, kc.bfloat16(), vc.bfloat16(),
                                                     k_descale=one, v_descale=one),
         ValueError, "k_descale is for a float8_e4m3fn cache"),
        ("e5m2 cache", lambda kc, vc: f(q, kc.to(torch.float8_e5m2), vc.to(torch.float8_e5m2),
                                        k_descale=one, v_descale=one),
         TypeError, "k_cache.dtype must be torch.float8_e4m3fn"),
        ("fnuz cache", lambda kc, vc: f(q, kc.to(torch.float8_e4m3fnuz), vc,
                                        k_descale=one, v_descale=one),
         TypeError, "e5m2 and the fnuz variants"),
        ("mixed caches", lambda kc, vc: f(q, kc, vc.bfloat16(), k_descale=one, v_descale=one),
         TypeError, "must share a dtype"),
        ("descale shape", lambda kc, vc: f(q, kc, vc, k_descale=torch.ones(3), v_descale=one),
         ValueError, r"k_descale must have shape \(\), \(1,\) or \(batch, kv_heads\) = \(2, 2\)"),
        ("descale dtype", lambda kc, vc: f(q, kc, vc, k_descale=one, v_descale=one.half()),
         TypeError, "v_descale must have dtype torch.float32"),
        ("descale type", lambda kc, vc: f(q, kc, vc, k_descale=0.5, v_descale=one),
         TypeError, "k_descale must be a torch.float32 tensor"),
        ("fp8 new keys", lambda kc, vc: f(q, kc, vc, kc[:, :1], vc[:, :1], cache_seqlens=1,
                                          k_descale=one, v_descale=one),
         TypeError, "k.dtype must equal q.dtype"),
    ]


@pytest.mark.parametrize(("case", "call", "error", "match"), _cache_refusals(),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_fp8_cache_refusals_name_the_argument(case, call, error, match):
    k_cache, v_cache = torch.ones(2, 64, 2, 32, dtype=FP8), torch.ones(2, 64, 2, 32, dtype=FP8)
    before = k_cache.clone()
    with pytest.raises(error, match=match):
        call(k_cache, v_cache)
    assert torch.equal(k_cache.view(torch.uint8), before.view(torch.uint8))


# ----- the FP8 prefill ------------------------------------------------------------------------------
def fp8_inputs(batch, heads, kv_heads, seqlen_q, seqlen_k, dim, *, per_tensor=False, seed=0,
               device=DEVICE):
    """q, k, v float8_e4m3fn (real values N(0, 1)) and their (given) descales."""
    real = make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, dim, torch.float32,
                    layout="bshd", seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (1,) if per_tensor else (batch, kv_heads)
    scales = [(torch.rand(shape, generator=gen) * 0.01 + 0.01).to(device) for _ in range(3)]
    group = heads // kv_heads
    stored = []
    for t, d, expand in zip(real, scales, (group, 1, 1), strict=True):
        view = d.reshape(1, 1).expand(batch, kv_heads) if per_tensor else d
        stored.append(quantize_e4m3(t, per_head(view.repeat_interleave(expand, dim=1))))
    return (*stored, *scales)


def views(scales, batch, kv_heads):
    return [as_view(d, batch, kv_heads) for d in scales]


@runs_kernels
@pytest.mark.parametrize(("options", "shape", "per_tensor"), [
    ({}, (2, 4, 2, 70, 130, 32), False),
    ({"causal": True}, (1, 4, 1, 130, 130, 64), True),
    ({"causal": True, "window_size": (40, 0), "softcap": 8.0}, (1, 2, 2, 96, 150, 32), False),
])
def test_fp8_forward_stays_within_its_bound(options, shape, per_tensor):
    q, k, v, *scales = fp8_inputs(*shape, per_tensor=per_tensor, seed=21)
    out, lse = fa3.flash_attn_func(q, k, v, *(), q_descale=scales[0], k_descale=scales[1],
                                   v_descale=scales[2], return_attn_probs=True, impl="triton",
                                   **options)
    assert out.dtype == torch.bfloat16 and attnlab.last_impl() == "triton"
    check = check_fp8_accuracy(out, lse, q, k, v, *views(scales, shape[0], shape[2]),
                               causal=options.get("causal", False),
                               window=options.get("window_size", (-1, -1)),
                               softcap=options.get("softcap", 0.0))
    assert check.passed, check
    # The float64 oracle (only bf16's rounding) sits far inside the same bound.
    ref, ref_lse = fa3.flash_attn_func(q.cpu(), k.cpu(), v.cpu(), q_descale=scales[0].cpu(),
                                       k_descale=scales[1].cpu(), v_descale=scales[2].cpu(),
                                       return_attn_probs=True, impl="reference", **options)
    ref_check = check_fp8_accuracy(ref, ref_lse, q.cpu(), k.cpu(), v.cpu(),
                                   *(s.cpu() for s in views(scales, shape[0], shape[2])),
                                   causal=options.get("causal", False),
                                   window=options.get("window_size", (-1, -1)),
                                   softcap=options.get("softcap", 0.0))
    assert ref_check.passed and ref_check.bound_ratio < 0.5, ref_check


def test_the_fp8_bound_fails_outputs_it_should():
    q, k, v, *scales = fp8_inputs(1, 2, 1, 40, 200, 32, seed=22, device="cpu")
    out, lse = fa3.flash_attn_func(q, k, v, q_descale=scales[0], k_descale=scales[1],
                                   v_descale=scales[2], return_attn_probs=True,
                                   impl="reference")
    scale_views = views(scales, 1, 1)
    assert check_fp8_accuracy(out, lse, q, k, v, *scale_views).passed
    # e4m3's P costs a few % of |O| itself, so the bound sits there: a 25% wrong descale
    # and a shift by 5% of the largest output fail it (10% would not: ratio 0.65).
    wrong_v = [scale_views[0], scale_views[1], scale_views[2] * 1.25]
    assert not check_fp8_accuracy(out, lse, q, k, v, *wrong_v).passed
    shifted = out + 0.05 * out.abs().max()
    assert not check_fp8_accuracy(shifted, lse, q, k, v, *scale_views).passed
    nan = out.clone()
    nan[0, 3, 1, 7] = float("nan")
    assert not check_fp8_accuracy(nan, lse, q, k, v, *scale_views).passed
    assert not check_fp8_accuracy(out, lse + 1e-3, q, k, v, *scale_views).passed


def _prefill_refusals():
    q, k, v, *scales = fp8_inputs(1, 2, 1, 8, 8, 32, seed=23, device="cpu")
    f = fa3.flash_attn_func
    d = dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    return [
        ("missing q_descale", lambda: f(q, k, v, k_descale=d["k_descale"],
                                        v_descale=d["v_descale"]),
         ValueError, "q_descale must be given with fp8 inputs"),
        ("bf16 with descales", lambda: f(q.bfloat16(), k.bfloat16(), v.bfloat16(), **d),
         TypeError, "q.dtype must be torch.float8_e4m3fn for the FP8 forward"),
        ("e5m2", lambda: f(q, k.to(torch.float8_e5m2), v, **d), TypeError,
         "q, k, v must share a dtype"),
        ("all e5m2", lambda: f(*(t.to(torch.float8_e5m2) for t in (q, k, v)), **d), TypeError,
         "q.dtype must be torch.float8_e4m3fn for fp8"),
        ("descale shape", lambda: f(q, k, v, **{**d, "v_descale": torch.ones(1, 2)}),
         ValueError, r"v_descale must have shape"),
        ("head dim 16", lambda: f(*fp8_inputs(1, 2, 1, 8, 8, 16, device="cpu")[:3], **d),
         ValueError, "head_dim must be in"),
        ("varlen", lambda: fa3.flash_attn_varlen_func(
            q[0], k[0], v[0], torch.tensor([0, 8], dtype=torch.int32),
            torch.tensor([0, 8], dtype=torch.int32), 8, 8, **d),
         NotImplementedError, "q_descale must be None here: attnlab's FP8 forward takes dense"),
    ]


@pytest.mark.parametrize(("case", "call", "error", "match"), _prefill_refusals(),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_fp8_prefill_refusals_name_the_argument(case, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_fp8_prefill_has_no_backward():
    q, k, v, *scales = fp8_inputs(1, 2, 1, 8, 8, 32, seed=24, device="cpu")
    q = q.float().requires_grad_().to(FP8)  # a graph-attached fp8 tensor
    with pytest.raises(NotImplementedError, match="no backward"):
        fa3.flash_attn_func(q, k, v, q_descale=scales[0], k_descale=scales[1],
                            v_descale=scales[2])


# ----- what the sm_90a compiler makes of it (no GPU needed) ---------------------------------------
COMPILE_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnlab.kernels.configs import decode_config, fp8_forward_config
from attnlab.kernels.decode import _split_kv_decode
from attnlab.kernels.forward import _attn_fwd

SCALARS = ("qk_scale", "softcap_log2", "softcap_inv")

def build(kernel, pointers, constants, config):
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = (pointers.get(name, "*fp32") if name.isupper() else
                           "fp32" if name in SCALARS else "i32")
        if name.isupper() or name.startswith("stride"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps,
                                       "num_stages": config.num_stages})
    ptx = compiled.asm["ptx"]
    return {"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.\S+", ptx))),
            "mma": sorted(set(re.findall(r"mma\.sync\.\S+", ptx))),
            "async_copies": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "e4m3_to_f16": ptx.count("cvt.rn.f16x2.e4m3x2"),
            "f16_to_f32": ptx.count("cvt.f32.f16"),
            "shared": compiled.metadata.shared}

config = fp8_forward_config(128, False)
forward = dict(stride_vn=1, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=config.block_m,
               BLOCK_N=config.block_n, HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False,
               REVERSE_M=False, UPCAST_DOT=False, IS_VARLEN=False, OFFSETS_64=False, FP8=True,
               EMULATE_FP8=False, PAGE_SIZE=0, HAS_SEQUSED=False)
fp8 = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv", "O": "*bf16",
       "CU_SEQLENS_Q": "*i32", "CU_SEQLENS_K": "*i32", "BLOCK_TABLE": "*i32",
       "SEQUSED_K": "*i32", "ERRORS": "*i64"}
keys_contiguous = build(_attn_fwd, fp8, forward, config)
d_contiguous = build(_attn_fwd, fp8, {**{k: v for k, v in forward.items() if k != "stride_vn"},
                                      "stride_vd": 1}, config)
decode = decode_config(128, fp8_cache=True)
cache = build(_split_kv_decode, {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "OUT": "*bf16",
                                 "CACHE_SEQLENS": "*i32", "CACHE_BATCH_IDX": "*i32",
                                 "CACHE_LEFTPAD": "*i32", "BLOCK_TABLE": "*i32",
                                 "ERRORS": "*i64"},
              dict(HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_M=16, BLOCK_N=decode.block_n,
                   PAGE_SIZE=0, HAS_SEQLENS=True, HAS_BATCH_IDX=False, HAS_LEFTPAD=False,
                   HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, WRITE_PARTIAL=True,
                   UPCAST_DOT=False, PER_PAGE=False, DESCALED=True, ROW_SCALED_Q=True,
                   WRITE_LSE=False), decode)
print(json.dumps({"keys_contiguous": keys_contiguous, "d_contiguous": d_contiguous,
                  "decode": cache}))
"""


@pytest.mark.slow
def test_sm90a_code_runs_both_fp8_products_on_wgmma_with_v_pipelined(json_from_fresh_python):
    built = json_from_fresh_python(COMPILE_SCRIPT)
    fp8_wgmma = ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"]
    assert built["keys_contiguous"]["wgmma"] == fp8_wgmma and not built["keys_contiguous"]["mma"]
    # V with its keys contiguous joins K in the cp.async pipeline; with d contiguous Triton
    # stages it through registers (fewer async copies): why keys_contiguous() transposes V.
    assert built["keys_contiguous"]["async_copies"] > built["d_contiguous"]["async_copies"]
    # The fp8 cache: e4m3 tiles converted to fp16 (one packed conversion per two values,
    # none through fp32) for fp16 MMAs with a bf16 q, in half bf16's shared memory.
    assert built["decode"]["mma"] == ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"]
    assert built["decode"]["e4m3_to_f16"] > 0 and built["decode"]["f16_to_f32"] == 0
    assert built["decode"]["shared"] < 100 * 1024


# ----- GPU: real sizes, CUDA graphs, NaN --------------------------------------------------------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("batch", "seqlen_k", "heads", "kv_heads", "dim", "paged"), [
    (1, 32768, 32, 8, 128, False), (4, 32768, 32, 8, 128, True), (2, 8192, 24, 4, 256, False),
])
def test_gpu_fp8_cache_real_sizes(batch, seqlen_k, heads, kv_heads, dim, paged):
    k_descale = descales(batch, kv_heads, False, seed=30)
    v_descale = descales(batch, kv_heads, True, seed=31)
    k_cache = fp8_cache(batch, seqlen_k, kv_heads, dim, k_descale, seed=32)
    v_cache = fp8_cache(batch, seqlen_k, kv_heads, dim, v_descale, seed=33)
    q = make_qkv(batch, heads, kv_heads, 1, 1, dim, torch.bfloat16, layout="bshd", seed=34,
                 device="cuda")[0]
    extra, caches = {}, (k_cache, v_cache)
    if paged:
        k_pages, table = paged_fp8(k_cache, 256, seed=35)
        v_pages, _ = paged_fp8(v_cache, 256, seed=35)
        extra, caches = {"block_table": table}, (k_pages, v_pages)
    out, lse = attnlab.flash_attn_with_kvcache(q, *caches, causal=True, return_softmax_lse=True,
                                               k_descale=k_descale, v_descale=v_descale, **extra)
    for b in sorted({0, batch - 1}):
        views_b = [as_view(d, batch, kv_heads)[b:b + 1] for d in (k_descale, v_descale)]
        check = check_fp8_cache_accuracy(out[b:b + 1], lse[b:b + 1], q[b:b + 1],
                                         k_cache[b:b + 1], v_cache[b:b + 1], *views_b,
                                         causal=True)
        assert check.passed, (b, check)


@pytest.mark.gpu
@gpu
def test_gpu_fp8_cache_append_under_cuda_graph_capture(captured_replay):
    batch, heads, kv_heads, dim, capacity = 4, 32, 8, 128, 4096
    k_descale, v_descale = descales(batch, kv_heads, False, 36), descales(batch, kv_heads, False, 37)
    k_cache = fp8_cache(batch, capacity, kv_heads, dim, k_descale, seed=38)
    v_cache = fp8_cache(batch, capacity, kv_heads, dim, v_descale, seed=39)
    q, k_new, v_new = make_qkv(batch, heads, kv_heads, 1, 1, dim, torch.bfloat16,
                               layout="bshd", seed=40, device="cuda")
    lengths = torch.tensor([100, 2000, 4000, 1], dtype=torch.int32, device="cuda")
    options = dict(cache_seqlens=lengths, causal=True, max_seqlen_k=capacity,
                   k_descale=k_descale, v_descale=v_descale)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    eager = attnlab.flash_attn_with_kvcache(q, eager_k, eager_v, k_new, v_new, **options)
    # Warm-up (compiles) on copies, then one capture and one replay on the caches.
    warm = [(k_cache.clone(), v_cache.clone()), (k_cache, v_cache)]
    captured = captured_replay(
        lambda: attnlab.flash_attn_with_kvcache(q, *warm.pop(0), k_new, v_new, **options))
    assert torch.equal(captured, eager)
    assert torch.equal(k_cache.view(torch.uint8), eager_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), eager_v.view(torch.uint8))


@pytest.mark.gpu
@gpu
def test_gpu_nan_in_an_fp8_cache_reaches_the_output():
    # The interpreter reads e4m3's NaN code as 480: this one runs on the GPU only.
    batch, heads, kv_heads, dim, capacity = 1, 8, 2, 128, 4096
    one = torch.ones(1, device="cuda")
    k_cache = fp8_cache(batch, capacity, kv_heads, dim, one, seed=41)
    v_cache = fp8_cache(batch, capacity, kv_heads, dim, one, seed=42)
    v_cache.view(torch.uint8)[0, 1234, 1, 5] = 0x7F  # e4m3fn's NaN
    q = make_qkv(batch, heads, kv_heads, 1, 1, dim, torch.bfloat16, layout="bshd", seed=43,
                 device="cuda")[0]
    out = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=one, v_descale=one)
    group = heads // kv_heads
    assert out[0, 0, group:2 * group, 5].isnan().all()
    assert not out[0, 0, :group].isnan().any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("seqlen", "causal", "per_tensor"), [(4096, False, False),
                                                              (4096, True, True),
                                                              (1000, True, False)])
def test_gpu_fp8_forward_stays_within_its_bound(seqlen, causal, per_tensor):
    batch, heads, kv_heads, dim = 1, 8, 2, 128
    q, k, v, *scales = fp8_inputs(batch, heads, kv_heads, seqlen, seqlen, dim,
                                  per_tensor=per_tensor, seed=44, device="cuda")
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, q_descale=scales[0],
                                   k_descale=scales[1], v_descale=scales[2],
                                   return_attn_probs=True)
    check = check_fp8_accuracy(out, lse, q, k, v, *views(scales, batch, kv_heads),
                               causal=causal)
    print(json.dumps({"seqlen": seqlen, "causal": causal, "error": check.error,
                      "bound_ratio": check.bound_ratio, "lse_ratio": check.lse_ratio}))
    assert check.passed, check
    assert math.isfinite(check.error)


# ----- the Gluon sm_90 FP8 forward (what the dispatcher runs on Hopper) -----------------------------

SM90_FP8_SHAPES = [(2, 8, 2, 1000, 1000), (1, 4, 4, 77, 300), (1, 6, 2, 300, 77),
                   (1, 8, 2, 4096, 4096)]


def fa3_fp8(causal, scales):
    def call(q, k, v):
        return fa3.flash_attn_func(q, k, v, causal=causal, q_descale=scales[0],
                                   k_descale=scales[1], v_descale=scales[2],
                                   return_attn_probs=True)
    return call


def sm90_fp8(causal, scales, batch, kv_heads, config=None):
    from attnlab.kernels.forward_sm90 import flash_forward_fp8_sm90

    def call(q, k, v):
        return flash_forward_fp8_sm90(q, k, v, *views(scales, batch, kv_heads),
                                      scale=q.shape[-1] ** -0.5, causal=causal, config=config)
    return call


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SM90_FP8_SHAPES)
def test_gpu_sm90_fp8_forward_stays_within_its_bound(dim, causal, shape):
    batch, heads, kv_heads, seqlen_q, seqlen_k = shape
    q, k, v, *scales = fp8_inputs(batch, heads, kv_heads, seqlen_q, seqlen_k, dim,
                                  per_tensor=seqlen_q == 77, seed=50, device="cuda")
    out, lse = sm90_fp8(causal, scales, batch, kv_heads)(q, k, v)
    check = check_fp8_accuracy(out, lse, q, k, v, *views(scales, batch, kv_heads),
                               causal=causal)
    print(json.dumps({"dim": dim, "causal": causal, "shape": shape,
                      "bound_ratio": check.bound_ratio, "lse_ratio": check.lse_ratio}))
    assert check.passed, check


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_every_sm90_fp8_config_that_fits_stays_within_the_bound(dim, causal):
    from attnlab.kernels.forward_sm90 import FP8_CANDIDATES, flash_forward_fp8_sm90, supports_fp8

    batch, heads, kv_heads = 1, 4, 2
    q, k, v, *scales = fp8_inputs(batch, heads, kv_heads, 700, 900, dim, seed=51,
                                  device="cuda")
    scales = views(scales, batch, kv_heads)
    ran = 0
    for config in FP8_CANDIDATES:
        if not supports_fp8(q, k, v, config=config)[0]:
            continue
        out, lse = flash_forward_fp8_sm90(q, k, v, *scales, scale=dim ** -0.5, causal=causal,
                                          config=config)
        check = check_fp8_accuracy(out, lse, q, k, v, *scales, causal=causal)
        assert check.passed, (config, check)
        ran += 1
    assert ran == len(FP8_CANDIDATES)  # every candidate fits in shared memory


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_dispatch_runs_the_kernel_its_table_names(causal):
    from attnlab.kernels.configs import length_bucket
    from attnlab.kernels.dispatch import FORWARD_FP8_SM90
    from attnlab.measure.dispatch import kernels_that_ran

    table = FORWARD_FP8_SM90.table()
    for dim, seqlen in [(128, 1024), (128, 4096), (64, 4096), (96, 1024)]:
        q, k, v, *scales = fp8_inputs(1, 4, 2, seqlen, seqlen, dim, seed=53, device="cuda")
        gluon = (dim, causal, length_bucket(seqlen)) in table
        names = kernels_that_ran(fa3_fp8(causal, scales), (q, k, v))
        assert any(n.startswith("_attn_fwd_sm90") for n in names) == gluon, (dim, seqlen, names)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dispatched", [False, True])
def test_gpu_nan_in_an_fp8_query_reaches_its_row_only(dispatched):
    q, k, v, *scales = fp8_inputs(1, 4, 2, 300, 300, 128, seed=52, device="cuda")
    q.view(torch.uint8)[0, 5, 1, 7] = 0x7F  # e4m3's NaN
    out, lse = (fa3_fp8(False, scales) if dispatched else sm90_fp8(False, scales, 1, 2))(q, k, v)
    assert out[0, 5, 1].isnan().all() and lse[0, 1, 5].isnan()
    others = torch.ones_like(out[..., 0], dtype=torch.bool)
    others[0, 5, 1] = False
    assert out[others].isfinite().all()


def test_the_fp8_dispatch_table_holds_only_measured_winners_it_can_run():
    import json
    from importlib.resources import files

    table = json.loads(files("attnlab.kernels").joinpath("sm90_fp8_dispatch.json").read_text())
    assert table["source"]["triton"] and table["min_gain"] >= 1.0
    for entry in table["entries"]:
        assert entry["sm90_vs_triton"] >= table["min_gain"], entry
        assert entry["measured"]["git_commit"] and entry["triton"], entry
        assert entry["config"]["rescale"] == "late" and entry["head_dim"] in (64, 128), entry


def test_sm90_fp8_refusals_name_their_reason():
    pytest.importorskip("triton.experimental.gluon")
    from attnlab.kernels._compat import gluon_refusal

    if gluon_refusal() is not None:
        pytest.skip(gluon_refusal())
    from attnlab.kernels.forward_sm90 import Sm90Config, fp8_refusal

    allowed = dict(capability=(9, 0), dtypes=(FP8,) * 3, head_dim=128, window=(-1, -1),
                   softcap=0.0, aligned=True)
    assert fp8_refusal(**allowed) is None
    for change, words in [({"head_dim": 256}, "head_dim must be one of (64, 128)"),
                          ({"dtypes": (torch.bfloat16,) * 3}, "float8_e4m3fn"),
                          ({"dtypes": (FP8, FP8, torch.bfloat16)}, "share one dtype"),
                          ({"window": (8, 0)}, "sliding windows"),
                          ({"capability": (10, 0)}, "sm_90 only"),
                          ({"aligned": False}, "TMA"),
                          ({"config": Sm90Config(128, 2, rescale="early")}, "rescale")]:
        assert words in fp8_refusal(**{**allowed, **change}), change


FP8_SM90_COMPILE = """
import json
from attnlab.kernels.forward_sm90 import *
out = {}
for d, config in FP8_CONFIGS.items():
    for causal in (False, True):
        k = compile_for_sm90(d, config, causal=causal, dtype="fp8")
        ptx = k.asm["ptx"]
        out[f"{d}-{causal}"] = {**overlap_evidence(k.asm), "shared": k.metadata.shared,
                                "estimate": shared_memory_bytes(d, config, fp8=True),
                                "fp8_wgmma": sorted(set(
                                    l.split()[0] for l in ptx.splitlines()
                                    if "wgmma.mma_async" in l and "e4m3" in l))}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90a_fp8_kernel_runs_both_products_on_fp8_wgmma_without_spills(json_from_fresh_python):
    pytest.importorskip("triton.experimental.gluon")
    from attnlab.kernels._compat import gluon_refusal

    if gluon_refusal() is not None:
        pytest.skip(gluon_refusal())
    built = json_from_fresh_python(FP8_SM90_COMPILE)
    for name, evidence in built.items():
        # S = Q K^T (B = K, n = BLOCK_N) and P V (A = P from shared memory, B = V^T).
        assert len(evidence["fp8_wgmma"]) >= 1, name
        assert 0 <= evidence["estimate"] - evidence["shared"] <= 1024, name
        assert evidence["barrier_threads"] == [128], name
        if "local_memory_ops" in evidence:
            assert evidence["local_memory_ops"] == 0, (name, "register spills")
            assert min(evidence["ex2_between_waits"]) > 0, name


def test_the_sm90_fp8_p_relabelling_matches_the_v_copys_key_order():
    """The Gluon FP8 kernel stores P's columns relabelled (``_p_operand``: reshape, split,
    permute; the same row-major semantics as torch's) and reads V from
    ``keys_contiguous_v``'s copy: the product must be P V for every tile width."""
    pytest.importorskip("triton.experimental.gluon")
    from attnlab.kernels._compat import gluon_refusal

    if gluon_refusal() is not None:
        pytest.skip(gluon_refusal())
    from attnlab.kernels.forward_sm90 import keys_contiguous_v

    gen = torch.Generator().manual_seed(54)
    seqlen, dim = 200, 16
    v = quantize_e4m3(torch.randn(2, seqlen, 3, dim, generator=gen), torch.tensor(0.01))
    v = v.to(DEVICE)[:, :, 1:]  # two KV heads, strided (the copy reads any strides)
    copy, parts = keys_contiguous_v(v, 64)
    assert copy.dtype == FP8 and parts[0] == [2, 2, dim, 224]  # padded to 32 keys
    copy, v = copy.cpu().double(), v.cpu().double()
    for block_n in (64, 128):
        p = torch.rand(4, block_n, generator=gen, dtype=torch.float64)
        words = block_n // 4
        e0, e1 = p.reshape(4, words // 4, 2, 4, 2).unbind(-1)      # gl.split
        k0, k2 = e0.permute(0, 1, 3, 2).unbind(-1)
        k1, k3 = e1.permute(0, 1, 3, 2).unbind(-1)
        stored = torch.stack([k.reshape(4, words) for k in (k0, k1, k2, k3)], -1)
        stored = stored.reshape(4, block_n)  # word j's bytes 0..3 at columns 4j..4j+3
        for start in range(0, copy.shape[-1] - block_n + 1, block_n):
            v_tile = copy[1, 1, :, start:start + block_n].T  # the kernel's B = V^T permuted
            keys = v[1, start:start + block_n, 1]
            keys = torch.cat([keys, keys.new_zeros(block_n - keys.shape[0], dim)])
            torch.testing.assert_close(stored @ v_tile, p @ keys, rtol=0, atol=1e-12)
