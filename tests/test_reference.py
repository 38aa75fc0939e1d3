"""The CPU reference: tiled == naive, LSE, split-KV, empty rows, large scores, the trace."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_inputs import make_qkv as shared_make_qkv
from attnlab.reference import (
    FULL,
    MASKED,
    SKIPPED,
    combine_splits,
    mask,
    merge_states,
    naive,
    online_softmax_walk,
    split_kv,
    tile_plan,
    tiled,
)
from attnlab.shapes import AttentionShape

# float64 on both sides: the only differences are summation order.
RTOL, ATOL = 1e-9, 1e-11

LENGTHS = [1, 2, 5, 16, 31, 64, 97, 113]
BLOCKS = [8, 16, 32, 48, 64, 128]  # includes B_r != B_c both ways and non-powers of two


@st.composite
def attention_cases(draw):
    """Random small inputs and options; sizes kept small so each example takes milliseconds."""
    kv_heads = draw(st.sampled_from([1, 2]))
    case = {
        "batch": draw(st.sampled_from([1, 2])),
        "kv_heads": kv_heads,
        "query_heads": kv_heads * draw(st.sampled_from([1, 2, 3])),  # MHA and GQA
        "seqlen_q": draw(st.sampled_from(LENGTHS)),
        "seqlen_k": draw(st.sampled_from(LENGTHS)),
        "head_dim": draw(st.sampled_from([1, 3, 8])),
        "value_dim": draw(st.sampled_from([1, 4, 8])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    options = {
        "causal": draw(st.booleans()),
        "window": draw(st.one_of(st.just((-1, -1)),
                                 st.tuples(st.integers(-1, 40), st.integers(-1, 40)))),
        "softcap": draw(st.sampled_from([0.0, 0.0, 0.5, 20.0])),
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
    }
    blocks = {"block_m": draw(st.sampled_from(BLOCKS)), "block_n": draw(st.sampled_from(BLOCKS))}
    return case, options, blocks


def make_qkv(batch, query_heads, kv_heads, seqlen_q, seqlen_k, head_dim, value_dim, seed,
             dtype=torch.float64, magnitude=1.0):
    """The tests' one input maker, in the reference's positional order."""
    return shared_make_qkv(batch, query_heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype,
                           seed=seed, value_dim=value_dim, magnitude=magnitude)


# ----- tiled == naive, and the LSE -----------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(attention_cases())
def test_tiled_equals_naive_and_lse_is_logsumexp_of_masked_scores(case):
    shape_args, options, blocks = case
    q, k, v = make_qkv(**shape_args)
    expected, scores, probabilities = naive(q, k, v, return_scores=True, **options)
    out, lse = tiled(q, k, v, **options, **blocks)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    # LSE == logsumexp of the masked (scaled, soft-capped) scores; -inf where no key is seen.
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=RTOL, atol=ATOL)
    empty_rows = ~mask(q.shape[2], k.shape[2], causal=options["causal"],
                       window=options["window"]).any(dim=-1)
    assert torch.equal(torch.isneginf(lse), empty_rows.expand_as(lse))
    assert (out[:, :, empty_rows] == 0).all()
    assert (probabilities[:, :, empty_rows] == 0).all()


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "causal", "window", "block_m", "block_n"), [
    (1025, 1025, True, (-1, -1), 128, 64),
    (1025, 97, False, (-1, -1), 64, 128),
    (113, 1025, True, (200, -1), 64, 64),
    (1, 1025, True, (-1, -1), 128, 64),  # decode: one query sees every key
])
def test_long_ragged_lengths(seqlen_q, seqlen_k, causal, window, block_m, block_n):
    q, k, v = make_qkv(1, 2, 1, seqlen_q, seqlen_k, 16, 16, seed=seqlen_q + seqlen_k)
    expected = naive(q, k, v, causal=causal, window=window)
    out, _ = tiled(q, k, v, causal=causal, window=window, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


@settings(max_examples=25, deadline=None)
@given(attention_cases())
def test_naive_matches_torch_sdpa_on_rows_that_see_a_key(case):
    """An independent yardstick for naive's scale, softmax and GQA (SDPA's math path)."""
    shape_args, options, _ = case
    options = {**options, "softcap": 0.0}  # SDPA has no softcap
    q, k, v = make_qkv(**shape_args)
    visible = mask(q.shape[2], k.shape[2], causal=options["causal"], window=options["window"])
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=options["scale"],
                                              enable_gqa=True)
    rows = visible.any(dim=-1)
    out = naive(q, k, v, **options)
    torch.testing.assert_close(out[:, :, rows], expected[:, :, rows], rtol=RTOL, atol=ATOL)


def test_softcap_is_c_tanh_of_scaled_scores_before_the_mask():
    """flash-attn's softcap, written out here independently of attnlab.reference.scores."""
    q, k, v = make_qkv(1, 2, 2, 9, 13, 8, 8, seed=12, magnitude=3.0)
    cap, scale = 5.0, 0.3
    raw = scale * torch.einsum("bhqd,bhkd->bhqk", q, k)
    assert raw.abs().max() > 2 * cap  # the cap binds on this input
    capped = cap * torch.tanh(raw / cap)
    future = torch.ones(9, 13, dtype=torch.bool).triu(diagonal=13 - 9 + 1)
    expected = torch.softmax(capped.masked_fill(future, -math.inf), dim=-1) @ v
    torch.testing.assert_close(naive(q, k, v, causal=True, scale=scale, softcap=cap), expected,
                               rtol=RTOL, atol=ATOL)
    out, _ = tiled(q, k, v, causal=True, scale=scale, softcap=cap, block_m=4, block_n=8)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


def test_batch_composition_does_not_matter():
    q, k, v = make_qkv(3, 4, 2, 37, 53, 8, 8, seed=7)
    out, lse = tiled(q, k, v, causal=True, block_m=16, block_n=32)
    for b in range(3):
        one, one_lse = tiled(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True, block_m=16,
                             block_n=32)
        torch.testing.assert_close(out[b:b + 1], one, rtol=0, atol=0)
        torch.testing.assert_close(lse[b:b + 1], one_lse, rtol=0, atol=0)


def test_gqa_query_head_uses_kv_head_h_over_group():
    q, k, v = make_qkv(1, 6, 2, 9, 11, 4, 4, seed=3)
    out, _ = tiled(q, k, v, block_m=4, block_n=4)
    for h in range(6):  # group = 3: heads 0-2 use KV head 0, heads 3-5 use KV head 1
        kv = h // 3
        one, _ = tiled(q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], block_m=4, block_n=4)
        torch.testing.assert_close(out[:, h:h + 1], one, rtol=0, atol=0)


def test_low_precision_inputs_accumulate_in_fp32():
    q, k, v = make_qkv(1, 2, 2, 70, 70, 32, 32, seed=1)
    expected = naive(q, k, v, causal=True)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out, lse = tiled(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, block_m=32,
                         block_n=16)
        assert out.dtype == dtype and lse.dtype == torch.float32
        tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
        torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


# ----- rows that see no key, and large scores -------------------------------------------
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "causal", "window"), [
    (40, 8, True, (-1, -1)),  # bottom-right: the top 32 rows see nothing
    (30, 10, False, (0, 0)),  # window on the shifted diagonal: rows 0..19 see nothing
    (12, 12, False, (-1, -1)),  # control: every row sees every key
])
def test_rows_with_no_visible_key_give_zero_and_minus_inf(seqlen_q, seqlen_k, causal, window):
    q, k, v = make_qkv(2, 2, 1, seqlen_q, seqlen_k, 8, 8, seed=11)
    empty = ~mask(seqlen_q, seqlen_k, causal=causal, window=window).any(dim=-1)
    assert int(empty.sum()) == {40: 32, 30: 20, 12: 0}[seqlen_q]
    out, lse = tiled(q, k, v, causal=causal, window=window, block_m=16, block_n=4)
    expected = naive(q, k, v, causal=causal, window=window)
    split_out, split_lse = combine_splits(split_kv(q, k, v, num_splits=3, causal=causal,
                                                   window=window, block_m=16, block_n=4))
    for o in (out, expected, split_out):
        assert not o.isnan().any()
        assert (o[:, :, empty] == 0).all()
        assert (o[:, :, ~empty] != 0).any()
    for row_lse in (lse, split_lse):
        assert torch.isneginf(row_lse[..., empty]).all()
        assert torch.isfinite(row_lse[..., ~empty]).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scores_of_magnitude_1e4_stay_finite(dtype):
    # d=1, scale=1: scores are q*k, with |q|, |k| ~ 100 -> |score| up to ~1e4.
    q, k, v = make_qkv(1, 1, 1, 33, 47, 1, 4, seed=5, magnitude=100.0)
    scores = (q @ k.transpose(-2, -1))
    assert scores.abs().max() > 1e4
    expected = naive(q.double(), k.double(), v.double(), causal=True, scale=1.0)
    out, lse = tiled(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, scale=1.0,
                     block_m=8, block_n=8)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


# ----- split-KV and the merge ------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(attention_cases(), st.integers(1, 8))
def test_k_splits_equal_one_split(case, num_splits):
    shape_args, options, blocks = case
    q, k, v = make_qkv(**shape_args)
    states = split_kv(q, k, v, num_splits=num_splits, **options, **blocks)
    assert len(states) == num_splits
    covered = [tile for state in states for tile in state.kv_tiles]
    assert covered == list(range(-(-k.shape[2] // blocks["block_n"])))
    out, lse = combine_splits(states)
    whole_out, whole_lse = combine_splits(split_kv(q, k, v, num_splits=1, **options, **blocks))
    torch.testing.assert_close(out, whole_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, whole_lse, rtol=RTOL, atol=ATOL)
    tiled_out, tiled_lse = tiled(q, k, v, **options, **blocks)
    torch.testing.assert_close(out, tiled_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, tiled_lse, rtol=RTOL, atol=ATOL)


def test_more_splits_than_tiles_leaves_empty_splits_harmless():
    q, k, v = make_qkv(1, 1, 1, 1, 10, 4, 4, seed=2)
    states = split_kv(q, k, v, num_splits=6, block_n=4)  # 3 tiles, 6 splits
    assert [len(s.kv_tiles) for s in states] == [1, 1, 1, 0, 0, 0]
    assert torch.isneginf(states[-1].lse).all() and (states[-1].out == 0).all()
    out, _ = combine_splits(states)
    torch.testing.assert_close(out, naive(q, k, v), rtol=RTOL, atol=ATOL)


def test_merge_states_edge_cases():
    o = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    lse = torch.tensor([0.5, -1.0], dtype=torch.float64)
    empty_o, empty_lse = torch.zeros_like(o), torch.full_like(lse, -math.inf)
    # Merging with an empty partial returns the other side unchanged, both ways round.
    for merged in (merge_states(o, lse, empty_o, empty_lse), merge_states(empty_o, empty_lse, o, lse)):
        torch.testing.assert_close(merged[0], o, rtol=0, atol=0)
        torch.testing.assert_close(merged[1], lse, rtol=0, atol=0)
    both_o, both_lse = merge_states(empty_o, empty_lse, empty_o, empty_lse)
    assert (both_o == 0).all() and torch.isneginf(both_lse).all()
    # Two equal halves: the same output, log 2 more mass.
    same_o, same_lse = merge_states(o, lse, o, lse)
    torch.testing.assert_close(same_o, o)
    torch.testing.assert_close(same_lse, lse + math.log(2))
    with pytest.raises(ValueError, match="o_a"):
        merge_states(o, lse, o[:1], lse[:1])



def test_a_nan_partial_poisons_the_merge_and_an_empty_one_never_does():
    o = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    lse = torch.tensor([0.5, -1.0], dtype=torch.float64)
    nan_o = o.clone()
    nan_o[0, 1] = math.nan
    nan_lse = lse.clone()
    nan_lse[1] = math.nan
    # A live partial carrying NaN makes what it feeds NaN, as PyTorch's attention would:
    # a NaN in o its element, a NaN lse its whole row; the rest stays finite.
    for merged in (merge_states(o, lse, nan_o, lse), merge_states(nan_o, lse, o, lse)):
        assert torch.isnan(merged[0][0, 1]) and torch.isfinite(merged[0][0, 0])
        assert torch.isfinite(merged[0][1]).all() and torch.isfinite(merged[1]).all()
    merged_o, merged_lse = merge_states(o, lse, o, nan_lse)
    assert torch.isnan(merged_o[1]).all() and torch.isnan(merged_lse[1])
    assert torch.isfinite(merged_o[0]).all() and torch.isfinite(merged_lse[0])
    # A partial that saw no key (lse = -inf) adds exactly nothing, whatever its o holds.
    empty_lse = torch.full_like(lse, -math.inf)
    for garbage in (torch.full_like(o, math.nan), torch.full_like(o, math.inf)):
        kept_o, kept_lse = merge_states(o, lse, garbage, empty_lse)
        assert torch.equal(kept_o, o) and torch.equal(kept_lse, lse)
        none_o, none_lse = merge_states(garbage, empty_lse, garbage, empty_lse)
        assert (none_o == 0).all() and torch.isneginf(none_lse).all()

def test_split_kv_rejects_bad_num_splits():
    q, k, v = make_qkv(1, 1, 1, 4, 4, 2, 2, seed=0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_splits"):
            split_kv(q, k, v, num_splits=bad)
    with pytest.raises(ValueError, match="states"):
        combine_splits([])


# ----- the skip bound and the mask are different operations ------------------------------
def test_dropping_the_mask_changes_causal_but_not_unmasked_results():
    q, k, v = make_qkv(1, 1, 1, 24, 24, 8, 8, seed=4)
    expected = naive(q, k, v, causal=True)
    no_mask, _ = tiled(q, k, v, causal=True, block_m=8, block_n=4, apply_element_mask=False)
    assert (no_mask - expected).abs().max() > 1e-3
    # The first row of every query tile sees a future key in its diagonal tile.
    plain = naive(q, k, v)
    plain_no_mask, _ = tiled(q, k, v, block_m=8, block_n=4, apply_element_mask=False)
    torch.testing.assert_close(plain_no_mask, plain, rtol=RTOL, atol=ATOL)


# ----- the state trace -------------------------------------------------------------------
LESSON_SCORES = [8.0, 6.0, 10.0, 7.0]
LESSON_VALUES = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]


def lesson_row_as_tensors():
    """One query row whose scores with scale 1 are exactly the lesson's 8, 6 | 10, 7."""
    q = torch.tensor([1.0, 0.0], dtype=torch.float64).view(1, 1, 1, 2)
    k = torch.tensor([[s, 0.0] for s in LESSON_SCORES], dtype=torch.float64).view(1, 1, 4, 2)
    v = torch.tensor(LESSON_VALUES, dtype=torch.float64).view(1, 1, 4, 2)
    return q, k, v


def test_two_tile_trace_matches_the_lesson():
    q, k, v = lesson_row_as_tensors()
    out, lse, steps = tiled(q, k, v, scale=1.0, block_m=1, block_n=2, trace=True)
    assert [s.tile_class for s in steps] == [FULL, FULL]
    first, second = steps
    assert first.m_new.item() == 8.0
    assert round(first.l.item(), 4) == 1.1353
    assert [round(x, 4) for x in first.a.flatten().tolist()] == [1.4060, 2.5413]
    assert second.m_old.item() == 8.0 and second.m_new.item() == 10.0
    assert round(second.alpha.item(), 4) == 0.1353
    assert round(second.l.item(), 4) == 1.2034
    assert [round(x, 4) for x in second.a.flatten().tolist()] == [5.5388, 6.7422]
    assert [round(x, 4) for x in out.flatten().tolist()] == [4.6025, 5.6025]
    assert lse.item() == pytest.approx(math.log(sum(math.exp(s) for s in LESSON_SCORES)))

    walk = online_softmax_walk(LESSON_SCORES, LESSON_VALUES, 2)
    assert [round(s.alpha, 4) for s in walk.steps] == [0.0, 0.1353]
    assert [round(s.l, 4) for s in walk.steps] == [1.1353, 1.2034]
    assert [round(x, 4) for x in walk.output] == [4.6025, 5.6025]
    assert [round(x, 4) for x in walk.softmax_weights] == [0.1125, 0.0152, 0.8310, 0.0414]
    assert walk.matches()


def test_the_posts_one_query_four_keys_walk():
    walk = online_softmax_walk([1, 3, 0, 2], [10, 20, 30, 40], 1)
    assert len(walk.steps) == 4
    assert round(walk.output[0], 1) == 24.2
    assert walk.matches()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-50, 50), min_size=1, max_size=12), st.integers(1, 5), st.data())
def test_walk_agrees_with_the_tiled_trace(scores, tile, data):
    values = data.draw(st.lists(st.floats(-10, 10), min_size=len(scores), max_size=len(scores)))
    walk = online_softmax_walk(scores, values, tile)
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor(scores, dtype=torch.float64).view(1, 1, -1, 1)
    v = torch.tensor(values, dtype=torch.float64).view(1, 1, -1, 1)
    out, _, steps = tiled(q, k, v, scale=1.0, block_m=1, block_n=tile, trace=True)
    assert len(steps) == len(walk.steps)
    for step, walked in zip(steps, walk.steps, strict=True):
        assert step.m_new.item() == walked.m_new
        assert step.alpha.item() == pytest.approx(walked.alpha, rel=1e-12, abs=1e-300)
        assert step.l.item() == pytest.approx(walked.l, rel=1e-12)
        assert step.a.item() == pytest.approx(walked.a[0], rel=1e-9, abs=1e-9)
    assert out.item() == pytest.approx(walk.output[0], rel=1e-9, abs=1e-9)
    assert walk.matches()


def test_trace_covers_every_tile_pair_with_the_plan_classes():
    q, k, v = make_qkv(1, 2, 1, 20, 20, 4, 4, seed=9)
    out, lse, steps = tiled(q, k, v, causal=True, block_m=8, block_n=4, trace=True)
    plan = tile_plan(AttentionShape(query_heads=2, seqlen_q=20, seqlen_k=20, head_dim=4,
                                    dtype="fp64", causal=True, block_m=8, block_n=4))
    assert [(s.query_tile, s.kv_tile) for s in steps] == [
        (i, j) for i in range(plan.shape.query_tiles) for j in range(plan.kv_tiles)]
    assert [s.tile_class for s in steps] == [plan.tile_class(s.query_tile, s.kv_tile) for s in steps]
    assert {s.tile_class for s in steps} == {SKIPPED, FULL, MASKED}
    for step in steps:
        if step.tile_class == SKIPPED:
            assert step.m_old is None and step.alpha is None and step.l is None
    # The last loaded step of each query tile holds a and l: O = a / l, LSE = m + log l.
    for i in range(plan.shape.query_tiles):
        last = [s for s in steps if s.query_tile == i and s.tile_class != SKIPPED][-1]
        rows = last.query_rows
        torch.testing.assert_close(out[:, :, rows.start:rows.stop],
                                   last.a / last.l.unsqueeze(-1), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(lse[:, :, rows.start:rows.stop],
                                   last.m_new + torch.log(last.l), rtol=RTOL, atol=ATOL)


# ----- input validation ------------------------------------------------------------------
def test_bad_inputs_raise_errors_naming_the_argument():
    q, k, v = make_qkv(1, 4, 2, 8, 8, 4, 4, seed=0)
    cases = [
        (ValueError, "q must be 4-D", lambda: tiled(q[0], k, v)),
        (TypeError, "k must be a torch.Tensor", lambda: naive(q, k.tolist(), v)),
        (TypeError, "share one dtype", lambda: tiled(q, k.float(), v)),
        (TypeError, "dtype must be one of", lambda: naive(q.int(), k.int(), v.int())),
        (ValueError, "divide", lambda: tiled(q[:, :3], k, v)),
        (ValueError, "head dim", lambda: naive(q, k[..., :3], v)),
        (ValueError, "batch", lambda: tiled(torch.cat([q, q]), k, v)),
        (ValueError, "seqlen_k", lambda: tiled(q, k[:, :, :0], v[:, :, :0])),
        (ValueError, "k and v", lambda: naive(q, k, v[:, :, :5])),
        (ValueError, "scale", lambda: tiled(q, k, v, scale=0.0)),
        (ValueError, "scale", lambda: naive(q, k, v, scale=float("nan"))),
        (ValueError, "softcap", lambda: tiled(q, k, v, softcap=-1.0)),
        (ValueError, "window", lambda: naive(q, k, v, window=(-2, 3))),
        (ValueError, "block_m", lambda: tiled(q, k, v, block_m=0)),
        (ValueError, "block_n", lambda: tiled(q, k, v, block_n=-4)),
        (ValueError, "causal", lambda: naive(q, k, v, causal="yes")),
        (ValueError, "tile", lambda: online_softmax_walk([1.0], [1.0], 0)),
        (ValueError, "one row per score", lambda: online_softmax_walk([1.0, 2.0], [1.0], 1)),
        (ValueError, "same positive width",
         lambda: online_softmax_walk([1.0, 2.0], [[1.0], [1.0, 2.0]], 1)),
        (ValueError, "finite or -inf", lambda: online_softmax_walk([float("nan")], [1.0], 1)),
        (ValueError, "at least one", lambda: online_softmax_walk([], [], 1)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
