"""attnlab.masking: the closed-form plan equals element-by-element classification.

The plan of a query tile is four integers and the whole-plan totals are closed-form
sums; here every one is compared with the definition -- each (query tile, KV tile)
pair classified from its rows and columns, every row's visible keys counted -- on
ragged lengths, every block-size ratio, causal, windows and bottom-right offsets.
Plans with more than 64 query tiles take the closed form, so the shapes go past it.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import masking
from attnlab.masking import (
    ALL_VISIBLE,
    FULL,
    MASKED,
    NONE_VISIBLE,
    PARTLY_VISIBLE,
    SKIPPED,
    RowSegment,
    classify_tile,
    shape_band,
    split_plan,
    tile_plan,
)
from attnlab.shapes import AttentionShape


def brute_force(shape: AttentionShape):
    """Every pair classified from the definition; totals summed pair by pair."""
    band = shape_band(shape)
    classes, kv_rows, q_rows_times_tiles = [], 0, 0
    for i in range(shape.query_tiles):
        rows = range(i * shape.block_m, min((i + 1) * shape.block_m, shape.seqlen_q))
        row_classes = []
        for j in range(shape.kv_tiles):
            cols = range(j * shape.block_n, min((j + 1) * shape.block_n, shape.seqlen_k))
            found = classify_tile(band, rows, cols)
            row_classes.append(found)
            if found != SKIPPED:
                kv_rows += len(cols)
                q_rows_times_tiles += len(rows)
        classes.append(row_classes)
    return classes, kv_rows, q_rows_times_tiles


def visible_by_definition(shape: AttentionShape, i: int, j: int) -> bool:
    offset = shape.seqlen_k - shape.seqlen_q
    left, right = shape.window
    if shape.causal:
        right = 0
    return (left < 0 or j >= i + offset - left) and (right < 0 or j <= i + offset + right)


shapes = st.builds(
    AttentionShape,
    seqlen_q=st.integers(1, 1200), seqlen_k=st.integers(1, 1200),
    causal=st.booleans(),
    window=st.sampled_from([(-1, -1), (0, 0), (3, -1), (-1, 5), (50, 7), (300, 300), (1, 2000)]),
    block_m=st.sampled_from([1, 3, 8, 16, 64]), block_n=st.sampled_from([1, 5, 16, 64, 128]),
)


@settings(max_examples=120, deadline=None)
@given(shapes)
def test_closed_form_plan_equals_classification_pair_by_pair(shape):
    if shape.query_tiles * shape.kv_tiles > 60_000:
        shape = shape.replace(block_m=max(shape.block_m, 16), block_n=max(shape.block_n, 16))
    classes, kv_rows, q_rows_times_tiles = brute_force(shape)
    plan = tile_plan(shape)
    for tile_class in (SKIPPED, FULL, MASKED):
        assert plan.count(tile_class) == sum(row.count(tile_class) for row in classes)
    assert plan.kv_rows_loaded() == kv_rows
    assert plan.query_rows_times_tiles() == q_rows_times_tiles
    for i in {0, shape.query_tiles // 2, shape.query_tiles - 1}:
        assert list(plan.query_tiles[i].tile_classes) == classes[i]


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(1, 9))
def test_split_sums_equal_classification(shape, num_splits):
    if shape.query_tiles * shape.kv_tiles > 60_000:
        shape = shape.replace(block_m=max(shape.block_m, 16), block_n=max(shape.block_n, 16))
    classes, _, _ = brute_force(shape)
    plan = tile_plan(shape)
    for split in split_plan(shape.kv_tiles, num_splits):
        loading = [i for i in range(shape.query_tiles)
                   if any(classes[i][j] != SKIPPED for j in split)]
        rows = sum(len(plan.key_rows(j)) for i in range(shape.query_tiles) for j in split
                   if classes[i][j] != SKIPPED)
        assert plan.kv_rows_loaded(split.start, split.stop) == rows
        assert plan.query_tiles_loading(split.start, split.stop) == len(loading)
        assert plan.query_rows_loading(split.start, split.stop) == \
            sum(len(plan.query_rows(i)) for i in loading)


@settings(max_examples=80, deadline=None)
@given(shapes, st.data())
def test_row_segments_and_visible_pairs_follow_the_definition(shape, data):
    plan = tile_plan(shape)
    i = data.draw(st.integers(0, shape.query_tiles - 1))
    j = data.draw(st.integers(0, shape.kv_tiles - 1))
    cols = plan.key_rows(j)
    expected: list[RowSegment] = []
    for row in plan.query_rows(i):
        seen = [visible_by_definition(shape, row, c) for c in cols]
        kind = ALL_VISIBLE if all(seen) else PARTLY_VISIBLE if any(seen) else NONE_VISIBLE
        if expected and expected[-1].visibility == kind:
            expected[-1] = RowSegment(expected[-1].first_row, row, kind)
        else:
            expected.append(RowSegment(row, row, kind))
    assert plan.row_segments(i, j) == tuple(expected)
    if shape.seqlen_q * shape.seqlen_k <= 200_000:
        assert plan.visible_pairs() == sum(
            visible_by_definition(shape, r, c)
            for r in range(shape.seqlen_q) for c in range(shape.seqlen_k))


def test_the_causal_clamp_is_right_zero_whatever_the_window():
    for right in (-1, 0, 5):
        band = masking.visible_band(8, 12, causal=True, window=(3, right))
        assert (band.lowest, band.highest) == (12 - 8 - 3, 12 - 8)


def test_split_plan_is_flash_attns_ceil_rule():
    assert split_plan(10, 4) == (range(0, 3), range(3, 6), range(6, 9), range(9, 10))
    assert [len(r) for r in split_plan(3, 5)] == [1, 1, 1, 0, 0]  # trailing splits empty
    assert split_plan(0, 2) == (range(0, 0), range(0, 0))
    with pytest.raises(ValueError, match="num_splits"):
        split_plan(10, 0)
    with pytest.raises(ValueError, match="num_splits"):
        split_plan(10, masking.MAX_SPLITS + 1)


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (4096, 0)),
                                            (True, (12345, -1)), (False, (-1, -1))])
def test_a_2_to_the_40_token_plan_answers_at_once_with_exact_integers(causal, window):
    shape = AttentionShape(seqlen_q=2**40, seqlen_k=2**40 - 3, causal=causal, window=window,
                           block_m=128, block_n=64)
    started = time.perf_counter()
    plan = tile_plan(shape)
    totals = [plan.count(c) for c in (SKIPPED, FULL, MASKED)]
    loaded_rows = plan.kv_rows_loaded()
    assert sum(totals) == shape.query_tiles * shape.kv_tiles
    assert all(isinstance(t, int) for t in (*totals, loaded_rows, plan.visible_pairs()))
    middle = plan.query_tile(shape.query_tiles // 2)
    assert middle.kv_first <= middle.full_first <= middle.full_stop <= middle.kv_stop
    for split in split_plan(shape.kv_tiles, 16):
        plan.kv_rows_loaded(split.start, split.stop)
    assert time.perf_counter() - started < 2.0
    if causal and window == (-1, -1):
        # bottom-right: the first 3 rows see nothing, row r >= 3 sees r - 2 keys
        assert plan.visible_pairs() == shape.seqlen_k * (shape.seqlen_k + 1) // 2
