"""The tiled float64 backward (FA-2 Algorithm 2) against torch autograd and gradcheck."""

from __future__ import annotations

import pytest
import torch

from attnlab.accuracy import reference_gradients
from attnlab.reference import FULL, MASKED, SKIPPED, naive, tile_plan, tiled, tiled_backward
from attnlab.reference.inputs import check_attention_inputs


def inputs(batch=1, heads=4, kv_heads=2, seqlen_q=23, seqlen_k=31, head_dim=8,
           dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h, n):
        return torch.randn(batch, h, n, head_dim, generator=gen, dtype=torch.float64).to(dtype)

    return rand(heads, seqlen_q), rand(kv_heads, seqlen_k), rand(kv_heads, seqlen_k), \
        rand(heads, seqlen_q)


CASES = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (5, 3)},
    "softcap": {"softcap": 2.0, "causal": True},
    "left-only": {"window": (4, -1)},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(23, 31), (31, 9), (1, 17), (16, 16)])
def test_tiled_backward_equals_autograd_through_naive(case, seqlen_q, seqlen_k):
    q, k, v, dout = inputs(seqlen_q=seqlen_q, seqlen_k=seqlen_k, seed=seqlen_q)
    options = CASES[case]
    got = tiled_backward(q, k, v, dout, block_m=8, block_n=4, **options)
    expected = reference_gradients(q, k, v, dout, **options)
    for name, a, b in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert not torch.isnan(a).any(), name
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-10), (name, (a - b).abs().max())


class _TiledAttention(torch.autograd.Function):
    """The reference's forward and its tiled backward, as one autograd node."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse = tiled(q, k, v, block_m=4, block_n=4, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = tiled_backward(q, k, v, dout, out=out, lse=lse, block_m=4, block_n=4,
                               **ctx.options)
        return (*grads, None)


@pytest.mark.parametrize("case", ["none", "causal", "softcap", "window"])
def test_gradcheck_on_tiny_cases(case):
    q, k, v, _ = inputs(heads=2, kv_heads=1, seqlen_q=6, seqlen_k=9, head_dim=3, seed=1)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: _TiledAttention.apply(q, k, v, CASES[case]), leaves)


def test_trace_follows_the_tile_plan_and_p_rows_sum_to_one():
    q, k, v, dout = inputs(seqlen_q=20, seqlen_k=28, seed=2)
    options = {"causal": True, "window": (12, -1)}
    *_, steps = tiled_backward(q, k, v, dout, block_m=4, block_n=4, trace=True, **options)
    shape = check_attention_inputs(q, k, v, block_m=4, block_n=4, **options)
    plan = tile_plan(shape)
    # K/V tiles outside, query tiles inside: Algorithm 2's order, every pair once.
    expected = [(j, i, plan.tile_class(i, j)) for j in range(plan.kv_tiles)
                for i in range(len(plan.query_tiles))]
    assert [(s.kv_tile, s.query_tile, s.tile_class) for s in steps] == expected
    assert {s.tile_class for s in steps} == {SKIPPED, FULL, MASKED}
    _, scores, probabilities = naive(q, k, v, return_scores=True, **options)
    row_sums = torch.zeros(q.shape[:3], dtype=torch.float64)
    ds_sums = torch.zeros(q.shape[:3], dtype=torch.float64)
    for step in steps:
        rows, cols = step.query_rows, step.key_rows
        block = probabilities[:, :, rows.start:rows.stop, cols.start:cols.stop]
        if step.tile_class == SKIPPED:
            assert step.p is None and torch.all(block == 0)  # skipping is exact
            continue
        assert torch.allclose(step.p, block, atol=1e-14)  # recomputed P == the forward's
        row_sums[:, :, rows.start:rows.stop] += step.p.sum(-1)
        ds_sums[:, :, rows.start:rows.stop] += step.ds.sum(-1)
    has_keys = torch.isfinite(scores).any(-1)
    assert torch.allclose(row_sums[has_keys], torch.ones_like(row_sums[has_keys]))
    # sum_j P_ij (dP_ij - D_i) = D_i - D_i = 0 for every row.
    assert ds_sums.abs().max() < 1e-12


def test_rows_without_keys_and_keys_without_queries_get_zero_gradients():
    q, k, v, dout = inputs(seqlen_q=30, seqlen_k=10, seed=3)
    dq, dk, dv = tiled_backward(q, k, v, dout, causal=True, block_m=8, block_n=4)
    assert torch.all(dq[:, :, :20] == 0) and dq[:, :, 20:].abs().max() > 0
    q, k, v, dout = inputs(seqlen_q=6, seqlen_k=30, seed=4)
    dq, dk, dv = tiled_backward(q, k, v, dout, window=(2, 0), block_m=8, block_n=4)
    assert torch.all(dk[:, :, :22] == 0) and torch.all(dv[:, :, :22] == 0)
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))


def test_low_precision_inputs_get_gradients_in_their_dtype():
    q, k, v, dout = inputs(dtype=torch.bfloat16, seed=5)
    grads = tiled_backward(q, k, v, dout, causal=True, block_m=8, block_n=8)
    assert all(g.dtype == torch.bfloat16 for g in grads)
    expected = reference_gradients(q, k, v, dout, causal=True)
    for g, e in zip(grads, expected, strict=True):
        assert (g.double() - e).abs().max() < 5e-2 * e.abs().max()


def test_bad_dout_is_named():
    q, k, v, dout = inputs()
    with pytest.raises(ValueError, match="dout must have the output's shape"):
        tiled_backward(q, k, v, dout[:, :, :5])
