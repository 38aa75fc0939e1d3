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
    (lambda a: {**a, "block_table": torch.zeros(2, 1, dtype=torch.int32)}, NotImplementedError,
     "block_table"),
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
