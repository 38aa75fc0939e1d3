"""The Triton backward kernels against float64 autograd, by the gradient rule.

``max|dX - dX_ref64| <= 3 * max|dX_torch_same_dtype - dX_ref64| + floor``
(``attnlab.accuracy.check_gradients``) on fresh random inputs.  On the CPU the
kernels run in Triton's interpreter with small shapes; the GPU tests at the bottom
repeat the grid at real sizes and check memory and 64-bit addressing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

import attnlab
from attnlab.accuracy import check_accuracy, check_gradients, reference_gradients
from attnlab.kernels._primitives import _kv_band_bounds, _q_band_bounds
from attnlab.kernels.autograd import attention_forward, flash_bwd_op, flash_fwd_op
from attnlab.kernels.backward import flash_backward
from attnlab.kernels.configs import BackwardConfig
from attnlab.kernels.forward import flash_forward, kernel_is_interpreted
from attnlab.reference import FULL, SKIPPED, tile_plan
from attnlab.shapes import AttentionShape

on_gpu = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not on_gpu and not kernel_is_interpreted(),
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (the README's test command)")
DEVICE = "cuda" if on_gpu else "cpu"

MASK_OPTIONS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (19, 7)},
    "softcap": {"softcap": 5.0, "causal": True},
    "causal-window": {"causal": True, "window": (24, -1)},
}


def make_inputs(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, layout="bshd",
                seed=0, magnitude=1.0):
    """q, k, v and dO drawn from N(0, magnitude^2) in ``layout``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(h, n):
        dims = (batch, n, h, head_dim) if layout == "bshd" else (batch, h, n, head_dim)
        return (magnitude * torch.randn(dims, generator=gen)).to(dtype).to(DEVICE)

    return rand(heads, seqlen_q), rand(kv_heads, seqlen_k), rand(kv_heads, seqlen_k), \
        rand(heads, seqlen_q)


def kernel_gradients(q, k, v, dout, *, layout="bshd", config=None, deterministic=False,
                     **options):
    scale = options.pop("scale", 1.0 / math.sqrt(q.shape[-1]))
    out, lse = flash_forward(q, k, v, layout=layout, scale=scale, **options)
    return flash_backward(dout, q, k, v, out, lse, layout=layout, scale=scale, config=config,
                          deterministic=deterministic, **options)


def run_and_check(q, k, v, dout, *, layout="bshd", config=None, **options):
    grads = kernel_gradients(q, k, v, dout, layout=layout, config=config, **options)
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, v), strict=True):
        assert grad.shape == like.shape and grad.dtype == like.dtype, name
    checks = check_gradients(grads, q, k, v, dout, layout=layout, **options)
    assert all(c.passed for c in checks), checks
    return grads


# Every head dim of the issue at least once, each with a different length pair, head
# layout (MHA, GQA 3:1, MQA) and mask; lengths stay small for the interpreter.
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
SEQLEN_PAIRS = [(37, 53), (70, 20), (113, 97), (64, 128), (1, 45), (45, 1), (96, 96)]
HEADS = [(2, 2), (6, 2), (3, 1)]


def interpreter_grid():
    masks = list(MASK_OPTIONS)
    return [(head_dim, SEQLEN_PAIRS[i % len(SEQLEN_PAIRS)], HEADS[i % len(HEADS)],
             masks[i % len(masks)]) for i, head_dim in enumerate(HEAD_DIMS)]


@pytest.mark.parametrize(("head_dim", "seqlens", "heads", "mask"), interpreter_grid(),
                         ids=lambda x: str(x).replace(" ", ""))
def test_gradient_grid(head_dim, seqlens, heads, mask):
    dtype = torch.bfloat16 if head_dim % 3 == 0 else torch.float16
    q, k, v, dout = make_inputs(1, *heads, *seqlens, head_dim, dtype, seed=head_dim)
    run_and_check(q, k, v, dout, **MASK_OPTIONS[mask])


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 239), (239, 1)])
def test_tiny_lengths_with_large_inputs_stay_finite(seqlens):
    q, k, v, dout = make_inputs(1, 2, 1, *seqlens, 64, torch.bfloat16, seed=sum(seqlens),
                                magnitude=5.0)
    for options in ({}, {"causal": True}):
        grads = run_and_check(q, k, v, dout, **options)
        assert all(torch.isfinite(g).all() for g in grads)


def test_large_logits_stay_finite():
    q, k, v, dout = make_inputs(1, 2, 2, 65, 130, 64, torch.bfloat16, seed=4)
    q = (q.float() * 30).to(torch.bfloat16)
    grads = run_and_check(q, k, v, dout, scale=1.0, causal=True)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(("layout", "tiles"), [("bshd", (16, 64, 64, 16)),
                                               ("bhsd", (64, 16, 16, 64))])
def test_both_layouts_and_tile_shapes(layout, tiles):
    # B_c > B_r and B_r > B_c in each kernel; a window cutting tiles on both sides.
    q, k, v, dout = make_inputs(2, 2, 1, 97, 75, 32, torch.float16, layout=layout, seed=1)
    config = BackwardConfig(*tiles, num_warps=4, num_stages=1)
    run_and_check(q, k, v, dout, layout=layout, config=config, causal=True, window=(30, 5))


SPLIT_DKDV = BackwardConfig(16, 32, 32, 16, num_warps=4, num_stages=1, dkdv_split=True)


@pytest.mark.parametrize("mask", ["none", "causal-window", "softcap"])
def test_split_dkdv_programs_give_the_unsplit_gradients(mask):
    # One program per output (dkdv_split): the same MMAs in the same order for each of
    # dK and dV, so the same bits as one program forming both; both pass the rule.
    q, k, v, dout = make_inputs(1, 6, 2, 70, 53, 40, torch.bfloat16, seed=11)
    split = run_and_check(q, k, v, dout, config=SPLIT_DKDV, **MASK_OPTIONS[mask])
    whole = kernel_gradients(q, k, v, dout, config=dataclasses.replace(
        SPLIT_DKDV, dkdv_split=False), **MASK_OPTIONS[mask])
    for name, got, want in zip(("dq", "dk", "dv"), split, whole, strict=True):
        assert torch.equal(got, want), name
        assert got.abs().max() > 0, name


def test_split_dkdv_programs_on_varlen_sequences():
    lengths = [9, 70, 33]
    gen = torch.Generator().manual_seed(17)
    q, k, v, dout = (torch.randn(sum(lengths), h, 24, generator=gen).to(torch.float16).to(DEVICE)
                     for h in (4, 2, 2, 4))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                  max_seqlen_k=max(lengths), causal=True)
    out, lse = flash_forward(q, k, v, layout="thd", scale=0.3, **varlen)
    split, whole = (flash_backward(dout, q, k, v, out, lse, layout="thd", scale=0.3,
                                   config=config, **varlen)
                    for config in (SPLIT_DKDV, dataclasses.replace(SPLIT_DKDV, dkdv_split=False)))
    for got, want in zip(split, whole, strict=True):
        assert torch.equal(got, want)


def test_dkdv_split_must_be_a_bool():
    with pytest.raises(TypeError, match="dkdv_split must be a bool"):
        BackwardConfig(16, 32, 32, 16, 4, 1, dkdv_split=1)


def test_gqa_gradients_equal_expanded_kv_summed_over_the_group():
    q, k, v, dout = make_inputs(1, 6, 2, 50, 70, 32, torch.float16, seed=2)
    dq, dk, dv = kernel_gradients(q, k, v, dout, causal=True)
    k_wide, v_wide = (t.repeat_interleave(3, dim=2) for t in (k, v))
    dq_wide, dk_wide, dv_wide = kernel_gradients(q, k_wide, v_wide, dout, causal=True)
    assert torch.equal(dq, dq_wide)
    for grouped, wide in ((dk, dk_wide), (dv, dv_wide)):
        summed = wide.float().view(*wide.shape[:2], 2, 3, wide.shape[-1]).sum(dim=3)
        assert (grouped.float() - summed).abs().max() <= 2e-3 * summed.abs().max()


def test_rows_without_keys_get_zero_dq_and_unseen_keys_zero_dk_dv():
    # Bottom-right causal with seqlen_q > seqlen_k: the first 50 rows see no key.
    q, k, v, dout = make_inputs(1, 2, 2, 70, 20, 32, torch.float16, seed=3)
    dq, dk, dv = run_and_check(q, k, v, dout, causal=True)
    assert torch.all(dq[:, :50] == 0) and dq[:, 50:].abs().max() > 0
    # A window (2, 0) with seqlen_q 8 < seqlen_k 40: keys 0..29 are seen by no query.
    q, k, v, dout = make_inputs(1, 2, 2, 8, 40, 32, torch.float16, seed=4)
    dq, dk, dv = run_and_check(q, k, v, dout, window=(2, 0))
    assert torch.all(dk[:, :29] == 0) and torch.all(dv[:, :29] == 0)
    assert dk[:, 30:].abs().max() > 0


def test_deterministic_is_bit_identical_across_runs():
    q, k, v, dout = make_inputs(1, 2, 1, 70, 90, 32, torch.bfloat16, seed=6)
    first = kernel_gradients(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(2):
        again = kernel_gradients(q, k, v, dout, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    default = kernel_gradients(q, k, v, dout, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, default, strict=True))


def test_dout_with_zero_strides_and_non_contiguous_dout():
    q, k, v, dout = make_inputs(1, 2, 2, 40, 50, 32, torch.float16, seed=7)
    contiguous = kernel_gradients(q, k, v, dout.contiguous(), causal=True)
    # A transposed copy viewed back: same values, other strides, last stride 1.
    strided = dout.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(
        contiguous, kernel_gradients(q, k, v, strided, causal=True), strict=True))
    # One dO row broadcast over batch, sequence and heads: strides (0, 0, 0, 1).
    row = dout[0, 0, 0]
    expanded = row.expand_as(dout)
    assert expanded.stride() == (0, 0, 0, 1)
    run_and_check(q, k, v, expanded, causal=True)
    # out.sum().backward(): autograd hands the backward a dO with every stride 0.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attnlab.flash_attn_func(*leaves, causal=True, impl="triton").sum().backward()
    ones = torch.ones_like(dout)
    expected = kernel_gradients(q, k, v, ones, causal=True)
    assert all(torch.equal(leaf.grad, e) for leaf, e in zip(leaves, expected, strict=True))


def test_lse_output_is_differentiable_too():
    q, k, v, dout = make_inputs(1, 2, 1, 30, 45, 32, torch.float16, seed=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = attnlab.flash_attn_func(*leaves, causal=True, return_attn_probs=True,
                                          impl="triton")
    weights = torch.randn(lse.shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ((out.float() * dout.float()).sum() + (lse * weights).sum()).backward()
    refs = [t.detach().transpose(1, 2).double().requires_grad_() for t in (q, k, v)]
    scores = attnlab.reference.naive(*refs, causal=True, return_scores=True)[1]
    out64 = attnlab.reference.naive(*refs, causal=True)
    loss = (out64 * dout.transpose(1, 2).double()).sum() \
        + (torch.logsumexp(scores, -1) * weights.double()).sum()
    expected = torch.autograd.grad(loss, refs)
    for leaf, ref in zip(leaves, expected, strict=True):
        error = (leaf.grad.transpose(1, 2).double() - ref).abs().max()
        assert error <= 1e-2 * ref.abs().max(), error


def test_bad_dout_and_double_backward_are_clear_errors():
    q, k, v, dout = make_inputs(1, 2, 2, 20, 20, 32, torch.float16, seed=9)
    out, lse = flash_forward(q, k, v, layout="bshd", scale=0.2)
    with pytest.raises(ValueError, match="dout must have the output's shape"):
        flash_backward(dout[:, :10], q, k, v, out, lse, layout="bshd", scale=0.2)
    with pytest.raises(TypeError, match="dout must have the output's dtype"):
        flash_backward(dout.float(), q, k, v, out, lse, layout="bshd", scale=0.2)
    with pytest.raises(ValueError, match="layout must be one of"):
        flash_backward(dout, q, k, v, out, lse, layout="sbhd", scale=0.2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnlab.flash_attn_func(*leaves, impl="triton")
    with pytest.raises(RuntimeError, match="shape"):  # autograd's own check, before ours
        out.backward(dout[:, :10])
    (dq,) = torch.autograd.grad(out, leaves[0], dout, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()


def test_packed_calls_match_separate_tensors():
    q, k, v, dout = make_inputs(1, 4, 4, 33, 33, 32, torch.float16, seed=10)
    qkv = torch.stack((q, k, v), dim=2).requires_grad_()
    out = attnlab.flash_attn_qkvpacked_func(qkv, causal=True, impl="triton")
    out.backward(dout)
    expected = kernel_gradients(q, k, v, dout, causal=True)
    assert torch.equal(qkv.grad, torch.stack(expected, dim=2))
    q_leaf, kv = q.clone().requires_grad_(), torch.stack((k, v), dim=2).requires_grad_()
    attnlab.flash_attn_kvpacked_func(q_leaf, kv, causal=True, impl="triton").backward(dout)
    assert torch.equal(q_leaf.grad, expected[0])
    assert torch.equal(kv.grad, torch.stack(expected[1:], dim=2))


def test_attention_sdpa_layout_gradients():
    q, k, v, dout = make_inputs(1, 4, 2, 40, 40, 32, torch.float16, layout="bhsd", seed=11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attnlab.attention(*leaves, causal=True, enable_gqa=True, impl="triton",
                      deterministic=True).backward(dout)
    checks = check_gradients([t.grad for t in leaves], q, k, v, dout, causal=True)
    assert all(c.passed for c in checks), checks


def test_reference_impl_gradients_come_back_in_the_input_dtype():
    q, k, v, dout = (t.cpu() for t in make_inputs(1, 2, 2, 16, 16, 16, torch.float16, seed=12))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attnlab.flash_attn_func(*leaves, causal=True, impl="reference").backward(dout)
    expected = reference_gradients(*(t.transpose(1, 2) for t in (q, k, v, dout)), causal=True)
    for leaf, ref in zip(leaves, expected, strict=True):
        assert leaf.grad.dtype == torch.float16
        assert (leaf.grad.transpose(1, 2).double() - ref).abs().max() < 1e-2


def test_varlen_backward_equals_each_sequence_alone():
    lengths_q, lengths_k = [5, 40, 17], [30, 40, 3]
    heads, kv_heads, head_dim = 4, 2, 32
    gen = torch.Generator().manual_seed(13)

    def rand(total, h):
        return torch.randn(total, h, head_dim, generator=gen).to(torch.float16).to(DEVICE)

    q, k, v = rand(sum(lengths_q), heads), rand(sum(lengths_k), kv_heads), rand(sum(lengths_k),
                                                                               kv_heads)
    dout = rand(sum(lengths_q), heads)

    def cumulative(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                            device=DEVICE)

    varlen = dict(cu_seqlens_q=cumulative(lengths_q), cu_seqlens_k=cumulative(lengths_k),
                  max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    options = dict(scale=0.2, causal=True, window=(12, -1))
    out, lse = flash_forward(q, k, v, layout="thd", **options, **varlen)
    dq, dk, dv = flash_backward(dout, q, k, v, out, lse, layout="thd", **options, **varlen)
    q_at = k_at = 0
    for length_q, length_k in zip(lengths_q, lengths_k, strict=True):
        rows, keys = slice(q_at, q_at + length_q), slice(k_at, k_at + length_k)
        alone = kernel_gradients(q[None, rows], k[None, keys], v[None, keys], dout[None, rows],
                                 **options)
        for got, want in zip((dq[rows], dk[keys], dv[keys]), alone, strict=True):
            assert torch.equal(got, want[0])
        q_at, k_at = q_at + length_q, k_at + length_k


def test_custom_ops_pass_opcheck():
    q, k, v, dout = make_inputs(1, 2, 1, 9, 12, 16, torch.float16, seed=14)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    options = ("bshd", 0.25, True, -1, -1, 0.0, False, None, None, None, None)
    torch.library.opcheck(flash_fwd_op, (q, k, v, *options))
    out, lse = flash_fwd_op(q, k, v, *options)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    # Inputs without grad: the backward op's own backward is a deliberate error.
    for grad_lse in (None, dlse):
        torch.library.opcheck(flash_bwd_op, (dout, grad_lse, q.detach(), k.detach(), v.detach(),
                                             out.detach(), lse.detach(), *options))


def test_torch_compile_traces_forward_and_backward():
    q, k, v, dout = make_inputs(1, 2, 2, 24, 24, 16, torch.float16, seed=15)

    def step(q, k, v):
        out, _ = attention_forward(q, k, v, layout="bshd", scale=0.25, causal=True,
                                   window=(-1, -1), softcap=0.0)
        return out * 2.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward(dout)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    step(*eager).backward(dout)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, eager, strict=True))


@triton.jit
def _bounds_probe(OUT, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, KV_VIEW: tl.constexpr, HAS_LEFT: tl.constexpr,
                  HAS_RIGHT: tl.constexpr):
    block = tl.program_id(0)
    diag_offset = seqlen_k - seqlen_q
    if KV_VIEW:  # the dK/dV kernel: which query rows see key block `block`
        lo, full_lo, full_hi, hi = _q_band_bounds(
            block * BLOCK_N, block * BLOCK_N + BLOCK_N - 1, seqlen_q, diag_offset, window_left,
            window_right, BLOCK_M, HAS_LEFT, HAS_RIGHT)
    else:  # the forward and dQ kernels: which keys query block `block` sees
        lo, full_lo, full_hi, hi = _kv_band_bounds(
            block * BLOCK_M, block * BLOCK_M + BLOCK_M - 1, seqlen_k, diag_offset, window_left,
            window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    tl.store(OUT + block * 4, lo)
    tl.store(OUT + block * 4 + 1, full_lo)
    tl.store(OUT + block * 4 + 2, full_hi)
    tl.store(OUT + block * 4 + 3, hi)


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (40, 9)}, {"window": (-1, 20)},
                                     {"causal": True, "window": (70, -1)}, {}], ids=str)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(128, 256), (256, 128), (192, 192)])
def test_kernel_band_bounds_match_the_tile_plan(options, seqlen_q, seqlen_k):
    # Lengths that are tile multiples: the kernels' bounds are then exactly the plan's.
    block_m, block_n = 32, 64
    shape = AttentionShape(seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_m=block_m,
                           block_n=block_n, **options)
    plan = tile_plan(shape)
    left, right = shape.window
    if shape.causal:
        right = 0 if right < 0 else min(right, 0)
    for kv_view, blocks, step in ((True, plan.kv_tiles, block_m),
                                  (False, len(plan.query_tiles), block_n)):
        bounds = torch.zeros(blocks * 4, dtype=torch.int32, device=DEVICE)
        _bounds_probe[(blocks,)](bounds, seqlen_q, seqlen_k, max(left, 0), max(right, 0),
                                 block_m, block_n, kv_view, left >= 0, right >= 0)
        for block, (lo, full_lo, full_hi, hi) in enumerate(bounds.view(-1, 4).tolist()):
            if kv_view:
                classes = [plan.tile_class(i, block) for i in range(len(plan.query_tiles))]
            else:
                classes = list(plan.query_tiles[block].tile_classes)
            loaded = [t for t, c in enumerate(classes) if c != SKIPPED]
            full = [t for t, c in enumerate(classes) if c == FULL]
            assert list(range(lo // step, -(-hi // step))) == loaded, (block, kv_view)
            assert list(range(full_lo // step, full_hi // step)) == full, (block, kv_view)


# ---------------------------------------------------------------------------
# GPU: the grid at real sizes, determinism, O(N * d) memory, 64-bit offsets.

gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")
GPU_SEQLEN_PAIRS = [(1, 1), (1, 239), (239, 1), (113, 203), (128, 217), (1023, 1024), (512, 512)]


def gpu_grid():
    """Each head dim with two masks, one per dtype: every (head dim, mask) compile costs
    seconds, and the length pairs and head layouts inside each case are cheap."""
    masks = list(MASK_OPTIONS)
    return [(head_dim, masks[(i + shift) % len(masks)], dtype)
            for i, head_dim in enumerate(HEAD_DIMS)
            for shift, dtype in ((0, torch.float16), (2, torch.bfloat16))]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("head_dim", "mask", "dtype"), gpu_grid(), ids=str)
def test_gpu_gradient_grid(head_dim, mask, dtype):
    for (seqlen_q, seqlen_k), heads in itertools.product(GPU_SEQLEN_PAIRS, HEADS):
        q, k, v, dout = make_inputs(2, *heads, seqlen_q, seqlen_k, head_dim, dtype,
                                    seed=seqlen_q + head_dim)
        run_and_check(q, k, v, dout, **MASK_OPTIONS[mask])


# The split dK/dV tiles bench/backward_h200.py times first at head_dim 256.
GPU_SPLIT_CONFIGS = [BackwardConfig(16, 128, 128, 32, 8, 2, dkdv_split=True),
                     BackwardConfig(32, 128, 128, 32, 8, 2, dkdv_split=True)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", GPU_SPLIT_CONFIGS, ids=str)
def test_gpu_split_dkdv_at_head_dim_256(config):
    for (seqlen_q, seqlen_k), mask in itertools.product(
            [(1, 239), (239, 1), (1023, 1024), (512, 512)], ["none", "causal", "softcap"]):
        q, k, v, dout = make_inputs(2, 6, 2, seqlen_q, seqlen_k, 256, torch.bfloat16,
                                    seed=seqlen_q)
        run_and_check(q, k, v, dout, config=config, **MASK_OPTIONS[mask])


@pytest.mark.gpu
@gpu
def test_gpu_deterministic_50_repeats():
    q, k, v, dout = make_inputs(2, 24, 4, 2048, 2048, 128, torch.bfloat16, seed=16)
    first = kernel_gradients(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(49):
        again = kernel_gradients(q, k, v, dout, causal=True, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.gpu
@gpu
def test_gpu_backward_memory_is_linear_in_seqlen():
    seqlen, heads, head_dim = 32768, 8, 128
    q, k, v, dout = make_inputs(1, heads, heads, seqlen, seqlen, head_dim, torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = attnlab.flash_attn_func(*leaves, causal=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    tensor_bytes = q.numel() * q.element_size()
    # dQ, dK, dV and D (fp32, one per row): O(N * d).  S alone would be 16 GiB here.
    assert extra <= 3 * tensor_bytes + heads * seqlen * 4 + (8 << 20), extra


def _chunked_reference(q, k, v, dout, scale, key_rows, chunk=16384):
    """fp32 O, LSE, dQ (all rows) and dK, dV (``key_rows`` only) for one very long K/V,
    bshd with batch 1, computed chunk by chunk over the keys."""
    qf, dof = q[0].float().transpose(0, 1), dout[0].float().transpose(0, 1)  # (h, m, d)
    seqlen_k = k.shape[1]
    m = torch.full(qf.shape[:2], float("-inf"), device=q.device)
    l_sum = torch.zeros(qf.shape[:2], device=q.device)
    acc = torch.zeros_like(qf)
    for start in range(0, seqlen_k, chunk):
        kc = k[0, start:start + chunk].float().transpose(0, 1)
        vc = v[0, start:start + chunk].float().transpose(0, 1)
        s = torch.matmul(qf, kc.transpose(1, 2)) * scale
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vc)
        m = m_new
    out = acc / l_sum[..., None]
    lse = m + torch.log(l_sum)
    delta = (out * dof).sum(-1)
    dq = torch.zeros_like(qf)
    for start in range(0, seqlen_k, chunk):
        kc = k[0, start:start + chunk].float().transpose(0, 1)
        vc = v[0, start:start + chunk].float().transpose(0, 1)
        p = torch.exp(torch.matmul(qf, kc.transpose(1, 2)) * scale - lse[..., None])
        ds = p * (torch.matmul(dof, vc.transpose(1, 2)) - delta[..., None])
        dq += scale * torch.matmul(ds, kc)
    kr = k[0, key_rows].float().transpose(0, 1)
    vr = v[0, key_rows].float().transpose(0, 1)
    p = torch.exp(torch.matmul(qf, kr.transpose(1, 2)) * scale - lse[..., None])
    dv = torch.matmul(p.transpose(1, 2), dof)
    ds = p * (torch.matmul(dof, vr.transpose(1, 2)) - delta[..., None])
    dk = scale * torch.matmul(ds.transpose(1, 2), qf)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


def _big_gradients(seqlen_q, seqlen_k, *, tensors_needed, seed):
    """(q, k, v, dout, scale, dq, dk, dv) at 32 heads x d 128, bf16, bshd batch 1; skips
    when the GPU lacks the memory for ``tensors_needed`` tensors of the longer side."""
    heads, head_dim = 32, 128
    needed = tensors_needed * max(seqlen_q, seqlen_k) * heads * head_dim * 2 + (6 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < needed:
        pytest.skip(f"needs about {needed / 2**30:.0f} GiB of free GPU memory, "
                    f"{free / 2**30:.0f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(n):
        return torch.randn(1, n, heads, head_dim, generator=gen, device="cuda",
                           dtype=torch.bfloat16)

    q, dout = rand(seqlen_q), rand(seqlen_q)
    k, v = rand(seqlen_k), rand(seqlen_k)
    assert max(q.numel(), k.numel()) > 2**31
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = flash_forward(q, k, v, layout="bshd", scale=scale)
    return (q, k, v, dout, scale,
            *flash_backward(dout, q, k, v, out, lse, layout="bshd", scale=scale))


def _assert_close_to(pairs):
    for got, want in pairs:
        assert torch.isfinite(got).all()
        error = (got.float() - want).abs().max().item()
        assert error <= 2e-2 * want.abs().max().item() + 1e-6, error


@pytest.mark.gpu
@gpu
def test_gpu_tensors_past_2_31_elements():
    # K and V: 600k tokens x 32 heads x 128 = 2.46e9 elements each (4.9 GB in bf16), so
    # row offsets in the last tiles pass 2^31; dK and dV are as large again.
    seqlen_k = 600_000
    q, k, v, dout, scale, dq, dk, dv = _big_gradients(128, seqlen_k, tensors_needed=4, seed=17)
    key_rows = torch.tensor([0, 1, 300_000, seqlen_k - 130, seqlen_k - 2, seqlen_k - 1],
                            device="cuda")
    ref_dq, ref_dk, ref_dv = _chunked_reference(q, k, v, dout, scale, key_rows)
    _assert_close_to(((dq[0], ref_dq), (dk[0, key_rows], ref_dk), (dv[0, key_rows], ref_dv)))


def _query_chunked_reference(q, k, v, dout, scale, query_rows, chunk=16384):
    """fp32 dQ (``query_rows`` only) and dK, dV (all rows) for one very long Q against a
    short K/V, bshd with batch 1, computed chunk by chunk over the queries."""
    kf, vf = k[0].float().transpose(0, 1), v[0].float().transpose(0, 1)  # (h, n, d)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)

    def chunk_grads(rows):
        qc = q[0, rows].float().transpose(0, 1)
        doc = dout[0, rows].float().transpose(0, 1)
        p = torch.softmax(torch.matmul(qc, kf.transpose(1, 2)) * scale, dim=-1)
        out = torch.matmul(p, vf)
        ds = p * (torch.matmul(doc, vf.transpose(1, 2)) - (out * doc).sum(-1, keepdim=True))
        return qc, doc, p, ds

    for start in range(0, q.shape[1], chunk):
        qc, doc, p, ds = chunk_grads(slice(start, start + chunk))
        dv += torch.matmul(p.transpose(1, 2), doc)
        dk += scale * torch.matmul(ds.transpose(1, 2), qc)
    _, _, _, ds = chunk_grads(query_rows)
    dq = scale * torch.matmul(ds, kf)
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


@pytest.mark.gpu
@gpu
def test_gpu_query_side_tensors_past_2_31_elements():
    # Q, O, dO and dQ: 600k tokens x 32 heads x 128 = 2.46e9 elements each; the last
    # query tiles' row offsets pass 2^31.
    seqlen_q = 600_000
    q, k, v, dout, scale, dq, dk, dv = _big_gradients(seqlen_q, 256, tensors_needed=7, seed=19)
    query_rows = torch.cat([torch.arange(0, 64), torch.arange(seqlen_q - 4096, seqlen_q)]).cuda()
    ref_dq, ref_dk, ref_dv = _query_chunked_reference(q, k, v, dout, scale, query_rows)
    _assert_close_to(((dq[0, query_rows], ref_dq), (dk[0], ref_dk), (dv[0], ref_dv)))


# ---------------------------------------------------------------------------
# GPU: torch.compile sees the Triton kernels themselves (triton_op, issue #15).

KERNEL_NAMES = ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")


def _compiled_and_eager(q, k, v, dout, **compile_options):
    """(O, LSE, (dQ, dK, dV)) through ``torch.compile(fullgraph=True)`` (Inductor) and
    eagerly, and the code Inductor generated for the forward and the backward."""
    from torch._inductor.utils import run_and_get_code

    def step(q, k, v):
        return attention_forward(q, k, v, layout="bshd", scale=0.25, causal=True,
                                 window=(-1, -1), softcap=0.0)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        out.backward(dout)
        return out.detach(), lse.detach(), tuple(t.grad for t in leaves)

    torch._dynamo.reset()
    compiled, codes = run_and_get_code(run, torch.compile(step, fullgraph=True,
                                                          **compile_options))
    return compiled, run(step), "\n".join(codes)


@pytest.mark.gpu
@gpu
def test_gpu_compile_inlines_the_triton_kernels():
    # d = 32: outside both sm_90 dispatch tables, so eager runs the same Triton kernels.
    q, k, v, dout = make_inputs(2, 4, 2, 96, 160, 32, torch.float16, seed=21)
    (out, lse, grads), (eager_out, eager_lse, eager_grads), code = _compiled_and_eager(
        q, k, v, dout)
    for name in KERNEL_NAMES:
        assert name in code, name
    assert "attnlab.flash_fwd" not in code and "attnlab.flash_bwd" not in code
    assert check_accuracy(out, lse, q, k, v, causal=True, scale=0.25, layout="bshd").passed
    checks = check_gradients(grads, q, k, v, dout, causal=True, scale=0.25, layout="bshd")
    assert all(c.passed for c in checks), checks
    # The same kernels with the same tiles as the eager path: the same bits.
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))


@pytest.mark.gpu
@gpu
def test_gpu_compile_with_dynamic_shapes_keeps_the_ops_opaque():
    # Symbolic sizes cannot pick tiles, so the ops stay single nodes (as a custom_op).
    q, k, v, dout = make_inputs(1, 2, 2, 80, 80, 32, torch.bfloat16, seed=22)
    (out, lse, grads), (eager_out, eager_lse, eager_grads), code = _compiled_and_eager(
        q, k, v, dout, dynamic=True)
    assert "attnlab.flash_fwd" in code and "attnlab.flash_bwd" in code
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))


def test_the_launchers_name_their_triton_kernels(json_from_fresh_python):
    # torch finds a triton_op's kernels by reading its launchers' source for
    # wrap_triton(<kernel>) (AOTAutograd's cache key hashes them); under the interpreter
    # the kernels are no JITFunctions, so this reads them in a fresh Python without it.
    found = json_from_fresh_python(
        "import json; from torch._library.triton import get_inner_triton_kernels\n"
        "from attnlab.kernels.backward import flash_backward\n"
        "from attnlab.kernels.forward import flash_forward\n"
        "print(json.dumps([sorted(k.fn.__name__ for k in get_inner_triton_kernels(f))\n"
        "                  for f in (flash_forward, flash_backward)]))")
    assert found == [["_attn_fwd"], sorted(KERNEL_NAMES[1:])]


@pytest.mark.gpu
@gpu
def test_gpu_ops_name_their_triton_kernels():
    # AOTAutograd's cache key hashes these kernels' sources (found through wrap_triton).
    from torch._library.triton import get_triton_kernels_for_op

    def names(op):
        return {kernel.fn.__name__ for kernel in get_triton_kernels_for_op(op)}

    assert names("attnlab::flash_fwd") == {"_attn_fwd"}
    assert names("attnlab::flash_bwd") == set(KERNEL_NAMES[1:])


@pytest.mark.gpu
@gpu
def test_gpu_compile_takes_the_triton_kernel_where_eager_takes_sm90():
    # d = 256, causal, N = 4k: a bucket of the committed sm_90 table (eager runs the Gluon
    # kernel there on an H200 with Triton 3.6); traced, the forward takes the Triton one.
    from torch._inductor.utils import run_and_get_code

    q, k, v, _ = make_inputs(1, 2, 2, 4096, 4096, 256, torch.bfloat16, seed=23)
    options = dict(layout="bshd", scale=0.0625, causal=True, window=(-1, -1), softcap=0.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention_forward(q, k, v, **options),
                             fullgraph=True)
    (out, lse), codes = run_and_get_code(compiled, q, k, v)
    code = "\n".join(codes)
    assert "_attn_fwd" in code and "_attn_fwd_sm90" not in code
    assert "attnlab.flash_fwd" not in code
    assert check_accuracy(out, lse, q, k, v, causal=True, scale=0.0625, layout="bshd").passed


@pytest.mark.gpu
@gpu
def test_gpu_compile_takes_the_triton_dkdv_where_eager_takes_sm90():
    # d = 128 causal: every bucket is in the committed backward table (eager computes dK,
    # dV with the Gluon kernel on an H200 with Triton 3.6); traced, the Triton one runs.
    q, k, v, dout = make_inputs(2, 4, 2, 1024, 1024, 128, torch.bfloat16, seed=25)
    (out, lse, grads), _, code = _compiled_and_eager(q, k, v, dout)
    assert "_attn_bwd_dkdv" in code and "_attn_bwd_dkdv_sm90" not in code
    checks = check_gradients(grads, q, k, v, dout, causal=True, scale=0.25, layout="bshd")
    assert all(c.passed for c in checks), checks


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layout", ["bhsd", "thd"])
def test_gpu_triton_ops_pass_opcheck(layout):
    # opcheck's static AOT test traces the decomposition (wrap_triton launches), its
    # dynamic one the opaque op; the bshd case is test_custom_ops_pass_opcheck above.
    q, k, v, dout = make_inputs(2, 4, 2, 24, 40, 32, torch.bfloat16, layout="bhsd", seed=24)
    varlen = (None, None, None, None)
    if layout == "thd":
        q, dout = (t.transpose(1, 2).reshape(48, 4, 32) for t in (q, dout))
        k, v = (t.transpose(1, 2).reshape(80, 2, 32) for t in (k, v))
        cu_q = torch.tensor([0, 17, 48], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 30, 80], dtype=torch.int32, device="cuda")
        varlen = (cu_q, cu_k, 31, 50)
    options = (layout, 0.25, True, 9, -1, 0.0, False, *varlen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(flash_fwd_op, (q, k, v, *options))
    out, lse = flash_fwd_op(q, k, v, *options)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(2)).cuda()
    for grad_lse in (None, dlse):
        torch.library.opcheck(flash_bwd_op, (dout, grad_lse, q.detach(), k.detach(), v.detach(),
                                             out.detach(), lse.detach(), *options))


# Variants whose dQ kernel Triton 3.6.0's ptxas could not build with the old two-stage
# tiles at head dims 16/32 (SIGSEGV; bench/ptxas_configs.py): the chosen tiles must build.
# The every-head-dim grid's wait, compiles included: ~60-120 s expected on the H200 host.
GRID_SECONDS = 180


@pytest.mark.gpu
@gpu
def test_gpu_gradient_grid_every_head_dim():
    # Every head dim 8..256 (step 8, and 59, 111) x bf16/fp16 x causal/full x MHA/GQA/MQA at
    # lengths 1/77/199, one head dim per spawned process (tests/gradient_grid.py: the
    # compiles are what take the time).  With $OUT set, one JSON line per case lands in
    # $OUT/gpu_gradient_grid.jsonl as each head dim finishes.
    import json
    import multiprocessing
    import os
    import time
    from concurrent.futures import ProcessPoolExecutor, TimeoutError, as_completed
    from pathlib import Path

    import gradient_grid

    out = Path(os.environ["OUT"]) / "gpu_gradient_grid.jsonl" if os.environ.get("OUT") else None
    workers = max(1, min(15, (os.cpu_count() or 2) - 1, len(gradient_grid.HEAD_DIMS)))
    start, rows, unfinished = time.monotonic(), [], set(gradient_grid.HEAD_DIMS)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {pool.submit(gradient_grid.check_head_dim, i): d
               for i, d in enumerate(gradient_grid.HEAD_DIMS)}
    try:
        for done in as_completed(futures, timeout=GRID_SECONDS):
            head_rows = done.result()
            unfinished.discard(futures[done])
            rows += head_rows
            if out is not None:
                with out.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in head_rows)
            print(f"d={futures[done]}: {sum(r['passed'] for r in head_rows)}/{len(head_rows)} "
                  f"at {time.monotonic() - start:.0f} s", flush=True)
    except TimeoutError:
        pass
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    failed = [r for r in rows if not r["passed"]]
    assert not unfinished, f"head dims not finished in time: {sorted(unfinished)}"
    assert not failed, failed[:5]
    assert len(rows) == 2 * 4 * 3 * len(gradient_grid.HEAD_DIMS)
    print(f"{len(rows)} cases, {workers} processes, {time.monotonic() - start:.0f} s")


PTXAS_CRASHED = [  # head_dim, causal, dtype, softcap, varlen
    (16, False, "bf16", True, False), (16, True, "bf16", False, False),
    (16, True, "fp16", False, True), (32, False, "fp16", True, True),
    (32, True, "bf16", False, False), (32, True, "fp16", True, True),
]


@pytest.mark.slow
def test_the_chosen_tiles_build_for_sm90_where_ptxas_crashed(json_from_fresh_python):
    # A fresh Python without TRITON_INTERPRET: the compiler needs the jitted kernels.
    built = json_from_fresh_python(
        "import json; from attnlab.kernels.backward import compile_for_sm90; "
        "from attnlab.kernels.configs import backward_config; "
        "from attnlab.shapes import AttentionShape; built = []\n"
        f"for d, causal, dtype, softcap, varlen in {PTXAS_CRASHED!r}:\n"
        "    shape = AttentionShape(head_dim=d, causal=causal, seqlen_q=4096, seqlen_k=4096)\n"
        "    kernels = compile_for_sm90(d, backward_config(shape), dtype=dtype, causal=causal,"
        " softcap=softcap, varlen=varlen)\n"
        "    built.append(all(bool(k.asm['cubin']) for k in kernels))\n"
        "print(json.dumps(built))")
    assert built == [True] * len(PTXAS_CRASHED)
