"""model/l2.py: the LRU replay of the Gluon dK/dV launches' row reads, by hand on small
cases, and the cache model's dK/dV prediction for the seed's layer against Nsight
Compute's committed bytes (session 17 run 3, an H100 SXM)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from attnlab.measure import ncu
from attnlab.measure.compare import GOAL_RELATIVE_ERROR, compare_cases
from attnlab.model import cache as cm
from attnlab.model import hardware
from attnlab.model.l2 import KeyBlockOrder, key_block_programs, lru_misses, tile_rows
from attnlab.shapes import AttentionShape

S17_NCU = (Path(__file__).parents[1] / "bench" / "results" / "runs" / "2026-12-07-s17-run3"
           / "ncu-new" / "ncu_backward" / "ncu_kernels.csv")


def total_misses(programs, **cache) -> int:
    return sum(lru_misses(programs, **cache).values())


# ----- the replay, by hand ---------------------------------------------------------------
def test_an_l2_that_holds_everything_reads_every_item_once():
    programs = [["a", "b", "c"], ["c", "b", "a"], ["b"], ["a", "c"]]
    assert lru_misses(programs, capacity=3, slots=2) == {"a": 1, "b": 1, "c": 1}


def test_an_l2_of_one_tile_reads_every_row_every_time():
    # One slot, consecutive reads always of another tile: every read misses.
    shape = AttentionShape(query_heads=4, kv_heads=2, seqlen_q=256, seqlen_k=256,
                           head_dim=64, dtype="bf16", causal=True)
    programs = key_block_programs(shape, KeyBlockOrder(128, 64))
    assert total_misses(programs, capacity=1, slots=1) == sum(len(p) for p in programs)


def test_programs_in_step_share_a_tile_and_a_late_one_reads_it_again():
    # Two programs read the same tiles at the same steps: the second hits what the first
    # just brought in, even in a one-tile cache.  A third, started when a slot frees up,
    # comes after the tiles were dropped: it reads them again.
    reads = ["x", "y", "z"]
    assert total_misses([reads, list(reads)], capacity=1, slots=2) == 3
    assert total_misses([reads, list(reads), list(reads)], capacity=1, slots=2) == 6


def test_a_program_starts_after_the_running_ones_at_the_next_step():
    # Step 0: a (miss), c (miss, a dropped); the one-read program is done, [a] starts.
    # Step 1: b (miss), then the started program's a (miss: dropped at step 0).
    assert lru_misses([["a", "b"], ["c"], ["a"]], capacity=1, slots=2) == \
        {"a": 2, "b": 1, "c": 1}
    # A program with no reads holds its slot for one step: here [a] then starts at step
    # 1, after a and b were read, and finds a dropped (capacity 1).
    assert lru_misses([["a", "b"], [], ["a"]], capacity=1, slots=2) == {"a": 2, "b": 1}


# ----- the launch's layout ---------------------------------------------------------------
SMALL = AttentionShape(query_heads=4, kv_heads=2, seqlen_q=256, seqlen_k=256, head_dim=64,
                       dtype="bf16", causal=True)


def test_programs_follow_the_kernels_order_and_read_the_last_tile_first():
    # 2 key blocks of 128 keys, 4 query tiles of 64 rows per head; tiles are named
    # head x 4 + tile.  Causally block 0 sees tiles 0-3, block 1 tiles 2-3.
    head_major = key_block_programs(SMALL, KeyBlockOrder(128, 64))
    # Head by head (KV head 0's blocks, then KV head 1's), the tiles last first with the
    # group's two heads inner.
    assert head_major == [[3, 7, 2, 6, 1, 5, 0, 4], [3, 7, 2, 6],
                          [11, 15, 10, 14, 9, 13, 8, 12], [11, 15, 10, 14]]
    split = key_block_programs(SMALL, KeyBlockOrder(128, 64, block_major=True, head_split=2))
    # Block-major (every KV head's block 0, then block 1), each unit's two programs
    # adjacent, one query head each.
    assert split == [[3, 2, 1, 0], [7, 6, 5, 4], [11, 10, 9, 8], [15, 14, 13, 12],
                     [3, 2], [7, 6], [11, 10], [15, 14]]
    unmasked = key_block_programs(SMALL.replace(causal=False), KeyBlockOrder(128, 64))
    assert [len(p) for p in unmasked] == [8] * 4


def test_bottom_right_causal_and_a_short_last_tile():
    # 200 queries against 256 keys: row i sees keys up to i + 56, so block 1 (keys
    # 128-255) is first seen by row 72, in tile 1; the last tile holds 200 - 192 rows.
    shape = SMALL.replace(query_heads=2, kv_heads=2, seqlen_q=200)
    order = KeyBlockOrder(128, 64)
    assert key_block_programs(shape, order)[:2] == [[3, 2, 1, 0], [3, 2, 1]]
    assert [tile_rows(shape, order, t) for t in (3, 2, 7)] == [8, 64, 8]


def test_the_layout_refuses_what_the_kernel_never_runs():
    with pytest.raises(ValueError, match="not a window"):
        key_block_programs(SMALL.replace(window=(64, 0)), KeyBlockOrder(128, 64))
    with pytest.raises(ValueError, match="must divide the GQA group"):
        key_block_programs(SMALL.replace(query_heads=6, kv_heads=2),
                           KeyBlockOrder(128, 64, head_split=2))


# ----- the seed's layer against ncu -------------------------------------------------------
def s17_comparison(hw: cm.CacheHardware):
    """Session 17 run 3's one fwd+bwd case (the seed's layer at 4k), compared on ``hw``."""
    (comparison,) = compare_cases(ncu.parse_csv(S17_NCU), hw)
    return comparison


def dkdv_pairs(comparison):
    return [p for p in comparison.pairs if p.role == "backward_dkdv"]


def test_the_seed_layers_dkdv_launches_within_15_percent_of_ncu_at_the_fitted_l2():
    from attnlab.kernels.backward_sm90 import ONE_GRADIENT_PER_LAUNCH

    comparison = s17_comparison(cm.H100_SXM)  # the run's GPU
    assert comparison.shape.head_dim in ONE_GRADIENT_PER_LAUNCH
    assert cm.H100_SXM.l2_lru_fit_bytes == hardware.GH100_L2_LRU_FIT_BYTES
    dv, dk = dkdv_pairs(comparison)
    assert "dV launch" in dv.predicted.label and "dK launch" in dk.predicted.label
    for pair in (dv, dk):
        assert pair.measured is not None
        assert abs(pair.relative_error) <= GOAL_RELATIVE_ERROR, pair.as_row()
    # The rows are read ~3x over, not once: at an L2 that holds them all the replay reads
    # each once, and the launches fall far below what ncu measured.
    roomy = dataclasses.replace(cm.H100_SXM, l2_lru_fit_bytes=10**12)
    for pair in dkdv_pairs(s17_comparison(roomy)):
        assert pair.relative_error < -0.5


def test_the_fitted_capacity_is_not_the_physical_l2():
    # The prediction moves steeply with the capacity (the fit is a fit): at the 50 MiB
    # the chip has, the launches are predicted at well under half of what ncu measured.
    physical = dataclasses.replace(cm.H100_SXM, l2_lru_fit_bytes=cm.H100_SXM.l2_bytes)
    assert cm.H100_SXM.l2_bytes > hardware.GH100_L2_LRU_FIT_BYTES
    for pair in dkdv_pairs(s17_comparison(physical)):
        assert pair.relative_error < -GOAL_RELATIVE_ERROR


def test_a_gpu_without_a_fitted_capacity_is_refused():
    a100 = cm.cache_hardware("A100")
    assert a100.l2_lru_fit_bytes is None
    launch = cm.GluonDkdvLaunch(True, True, KeyBlockOrder(128, 64),
                                cm.Launch(384, 168, 100_000))
    with pytest.raises(ValueError, match="fitted for A100"):
        cm.predict_gluon_dkdv(SMALL, a100, launches=[launch])
