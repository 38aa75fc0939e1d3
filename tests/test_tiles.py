"""The visibility band, the mask, and the tile plan, checked element by element."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

from attnlab.reference import (
    FULL,
    MASKED,
    SKIPPED,
    mask,
    shape_mask,
    tile_plan,
)
from attnlab.reference.tiles import ALL_VISIBLE, NONE_VISIBLE, PARTLY_VISIBLE
from attnlab.shapes import AttentionShape


def visible_by_definition(i: int, j: int, seqlen_q: int, seqlen_k: int, causal: bool,
                          window: tuple[int, int]) -> bool:
    """flash-attn's rule, written independently of attnlab.reference.tiles."""
    left, right = window
    if causal:
        right = 0
    shifted = i + seqlen_k - seqlen_q
    if left >= 0 and j < shifted - left:
        return False
    return not (right >= 0 and j > shifted + right)


shapes = st.builds(
    AttentionShape,
    seqlen_q=st.integers(1, 40),
    seqlen_k=st.integers(1, 40),
    causal=st.booleans(),
    window=st.one_of(st.just((-1, -1)), st.tuples(st.integers(-1, 12), st.integers(-1, 12))),
    block_m=st.integers(1, 17),
    block_n=st.integers(1, 17),
)


# ----- the mask ----------------------------------------------------------------------
def test_flash_attn_docstring_examples():
    # flash_attn_func's docstring: seqlen_q=2, seqlen_k=5, and seqlen_q=5, seqlen_k=2.
    assert mask(2, 5, causal=True).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert mask(5, 2, causal=True).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(1, 1), (7, 7), (3, 11), (11, 3), (1, 9)])
def test_causal_matches_torch_lower_right_bias(seqlen_q, seqlen_k):
    expected = causal_lower_right(seqlen_q, seqlen_k)._materialize()
    assert torch.equal(mask(seqlen_q, seqlen_k, causal=True), expected)


def test_no_mask_at_all_is_all_visible_and_full_size():
    assert torch.equal(mask(3, 5), torch.ones(3, 5, dtype=torch.bool))
    assert mask(1, 1).shape == (1, 1)


def test_window_examples():
    # Square, window (1, 1): a tridiagonal band.
    assert mask(4, 4, window=(1, 1)).int().tolist() == [
        [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    # Causal with a window means right = 0, whatever right was given.
    assert torch.equal(mask(6, 9, causal=True, window=(2, 5)),
                       mask(6, 9, window=(2, 0)))
    assert torch.equal(mask(5, 5, causal=True, window=(-1, -1)), mask(5, 5, window=(-1, 0)))


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_mask_matches_the_definition(shape):
    visible = shape_mask(shape)
    assert visible.shape == (shape.seqlen_q, shape.seqlen_k)
    for i in range(shape.seqlen_q):
        for j in range(shape.seqlen_k):
            assert bool(visible[i, j]) == visible_by_definition(
                i, j, shape.seqlen_q, shape.seqlen_k, shape.causal, shape.window)


def test_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        mask(4, 4, window=(-2, 0))
    with pytest.raises(ValueError, match="seqlen_k"):
        mask(4, 0)


# ----- the plan ----------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(shapes)
def test_plan_classes_agree_with_the_mask_tile_by_tile(shape):
    plan = tile_plan(shape)
    visible = shape_mask(shape)
    assert len(plan.query_tiles) == shape.query_tiles
    for i, query_plan in enumerate(plan.query_tiles):
        rows = plan.query_rows(i)
        assert rows == range(i * shape.block_m, min((i + 1) * shape.block_m, shape.seqlen_q))
        assert sorted(query_plan.loaded + query_plan.skipped) == list(range(plan.kv_tiles))
        assert set(query_plan.masked) | set(query_plan.full) == set(query_plan.loaded)
        for j in range(plan.kv_tiles):
            cols = plan.key_rows(j)
            block = visible[rows.start:rows.stop, cols.start:cols.stop]
            expected = SKIPPED if not block.any() else FULL if block.all() else MASKED
            assert plan.tile_class(i, j) == expected, (i, j)
        assert plan.loaded_kv_rows(i) == sum(len(plan.key_rows(j)) for j in query_plan.loaded)
    assert plan.visible_pairs() == int(visible.sum())
    assert plan.count(FULL) + plan.count(MASKED) + plan.count(SKIPPED) == \
        shape.query_tiles * shape.kv_tiles


@settings(max_examples=40, deadline=None)
@given(shapes, st.data())
def test_row_segments_agree_with_the_mask(shape, data):
    plan = tile_plan(shape)
    visible = shape_mask(shape)
    i = data.draw(st.integers(0, shape.query_tiles - 1))
    j = data.draw(st.integers(0, shape.kv_tiles - 1))
    cols = plan.key_rows(j)
    covered = []
    for segment in plan.row_segments(i, j):
        for row in range(segment.first_row, segment.last_row + 1):
            seen = visible[row, cols.start:cols.stop]
            expected = (ALL_VISIBLE if seen.all() else NONE_VISIBLE if not seen.any()
                        else PARTLY_VISIBLE)
            assert segment.visibility == expected
            covered.append(row)
    assert covered == list(plan.query_rows(i))


def test_lesson_exercise_4():
    """N=4096, B_r=128, B_c=64, causal, query tile i=5 (1-based) = index 4."""
    plan = tile_plan(AttentionShape(seqlen_q=4096, seqlen_k=4096, causal=True))
    tile = plan.query_tile(4)
    assert tile.rows == range(512, 640)  # rows 513-640, 1-based
    assert tile.loaded == tuple(range(10))  # tiles 1-10
    assert tile.masked == (8, 9)  # tiles 9 and 10
    assert tile.full == tuple(range(8))
    assert plan.loaded_kv_rows(4) == 640
    # Tile 10 (columns 577-640) is entirely in the future of the upper half (rows 513-576).
    upper, *rest = plan.row_segments(4, 9)
    assert (upper.first_row, upper.last_row, upper.visibility) == (512, 575, NONE_VISIBLE)
    # Tile 9 is fully permitted for the lower half (rows 577-640).
    assert plan.row_segments(4, 8)[-1].visibility == ALL_VISIBLE
    assert plan.row_segments(4, 8)[-1].first_row <= 576


def test_skip_bound_is_2i_when_block_m_is_twice_block_n():
    plan = tile_plan(AttentionShape(seqlen_q=4096, seqlen_k=4096, causal=True))
    for i in range(1, 33):  # 1-based, as the lesson writes j <= 2i
        assert plan.query_tile(i - 1).loaded == tuple(range(2 * i))
        assert plan.query_tile(i - 1).masked == (2 * i - 2, 2 * i - 1)


def test_block_n_larger_than_block_m():
    # B_c = 3 B_r: one KV tile spans three query tiles' diagonals.
    plan = tile_plan(AttentionShape(seqlen_q=96, seqlen_k=96, causal=True, block_m=16,
                                    block_n=48))
    assert [q.loaded for q in plan.query_tiles] == [(0,)] * 3 + [(0, 1)] * 3
    assert [q.masked for q in plan.query_tiles] == [(0,)] * 3 + [(1,)] * 3


def test_ragged_last_tiles_count_real_rows():
    plan = tile_plan(AttentionShape(seqlen_q=97, seqlen_k=113, block_m=32, block_n=64))
    assert plan.query_rows(3) == range(96, 97)
    assert plan.key_rows(1) == range(64, 113)
    assert plan.loaded_kv_rows(3) == 113  # non-causal: every real key row, no padding
    assert plan.count(MASKED) == 0


def test_more_query_rows_than_keys_leaves_the_top_rows_empty():
    # Bottom-right causal with Nq > Nk: query rows 0..Nq-Nk-1 see nothing at all.
    plan = tile_plan(AttentionShape(seqlen_q=40, seqlen_k=8, causal=True, block_m=8,
                                    block_n=8))
    assert [q.loaded for q in plan.query_tiles] == [(), (), (), (), (0,)]


def test_plan_rejects_bad_indices_and_types():
    plan = tile_plan(AttentionShape(seqlen_q=10, seqlen_k=10, block_m=4, block_n=4))
    with pytest.raises(ValueError, match="query_tile"):
        plan.query_tile(3)
    with pytest.raises(ValueError, match="kv_tile"):
        plan.key_rows(-1)
    with pytest.raises(ValueError, match="tile_class"):
        plan.count("diagonal")
    with pytest.raises(TypeError, match="AttentionShape"):
        tile_plan({"seqlen_q": 10})
