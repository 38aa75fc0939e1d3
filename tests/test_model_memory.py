"""Memory footprints by scope: the lesson's and the post's values, exactly."""

from __future__ import annotations

import pytest

from attnlab.model import memory
from attnlab.shapes import LESSON_SHAPE, preset

KiB, MiB, GiB = 2**10, 2**20, 2**30


def test_lesson_scopes():
    assert memory.scores_and_probs_per_head_bytes(LESSON_SHAPE) == 64 * MiB == 67_108_864
    assert memory.transient_peak_bytes(LESSON_SHAPE) == 2 * GiB  # 32 heads in parallel
    assert memory.training_retention_bytes(LESSON_SHAPE, layers=32) == 64 * GiB
    assert memory.transient_peak_bytes(LESSON_SHAPE, heads_in_parallel=1) == 64 * MiB
    assert memory.score_matrix_bytes(LESSON_SHAPE, "fp16") == 1 * GiB  # S alone, 32 heads


def test_statistics_scopes():
    assert memory.running_stats_bytes(LESSON_SHAPE) == 32 * KiB == 2 * 4096 * 4
    assert memory.cta_live_state_bytes(128, 128) == {"statistics": 1 * KiB,
                                                     "accumulator": 64 * KiB}
    assert memory.lse_bytes(LESSON_SHAPE) == 16 * KiB
    # a narrower accumulator, as real kernels sometimes keep it
    assert memory.cta_live_state_bytes(128, 128, accumulator_dtype="bf16")["accumulator"] == 32 * KiB


def test_tile_buffers():
    assert memory.tile_buffer_bytes(LESSON_SHAPE) == {"Q tile": 32 * KiB, "K tile": 16 * KiB,
                                                      "V tile": 16 * KiB, "score tile": 16 * KiB}
    assert memory.score_tile_bytes(128, 64, "fp16") == 16 * KiB
    assert memory.score_tile_bytes(64, 128, "fp32") == 32 * KiB == 32_768  # the post's tile


def test_post_values_are_binary_units():
    """The post says '384 MB' at 2k and '6 GB' at 8k: exactly 384 MiB and 6 GiB."""
    qwen = preset("qwen-gqa")
    at_2k = memory.score_matrix_bytes(qwen.shape(2048), qwen.score_dtype)
    at_8k = memory.score_matrix_bytes(qwen.shape(8192), qwen.score_dtype)
    assert at_2k == 384 * MiB == 402_653_184  # 402.65 decimal MB
    assert at_8k == 6 * GiB == 6_442_450_944  # 6.44 decimal GB
    assert qwen.score_dtype == "fp32" and qwen.query_heads == 24


def test_score_matrix_is_full_even_when_causal_and_scales_with_batch():
    causal = LESSON_SHAPE.replace(causal=True, batch=3)
    assert memory.score_matrix_bytes(causal) == 3 * 32 * 4096 * 4096 * 2


def test_score_dtype_defaults_to_input_dtype():
    fp32 = LESSON_SHAPE.replace(dtype="fp32")
    assert memory.scores_and_probs_per_head_bytes(fp32) == 128 * MiB
    assert memory.scores_and_probs_per_head_bytes(fp32, "fp16") == 64 * MiB


def test_footprint_lists_every_scope():
    items = {(i.name, i.scope): i for i in memory.memory_footprint(LESSON_SHAPE, layers=32)}
    assert items[("S + P", "per head")].bytes == 64 * MiB
    assert items[("S + P, transient peak", "per layer")].bytes == 2 * GiB
    assert items[("S + P, training retention", "per model (32 attention layers)")].bytes == 64 * GiB
    assert items[("LSE (exported)", "per head")].bytes == 16 * KiB
    assert all(i.assumption for i in items.values())
    assert all(isinstance(i.as_dict()["bytes"], int) for i in items.values())


@pytest.mark.parametrize("call, match", [
    (lambda: memory.transient_peak_bytes(LESSON_SHAPE, heads_in_parallel=0), r"\[1, 32\]"),
    (lambda: memory.transient_peak_bytes(LESSON_SHAPE, heads_in_parallel=33), r"\[1, 32\]"),
    (lambda: memory.training_retention_bytes(LESSON_SHAPE, layers=0), "layers must be"),
    (lambda: memory.score_tile_bytes(0, 64, "fp16"), "block_m must be"),
    (lambda: memory.score_tile_bytes(64, -1, "fp16"), "block_n must be"),
    (lambda: memory.score_tile_bytes(64, 64, "int4"), "dtype must be one of"),
    (lambda: memory.score_matrix_bytes(LESSON_SHAPE, "fp8"), "dtype must be one of"),
    (lambda: memory.cta_live_state_bytes(128, 0), "head_dim must be"),
    (lambda: memory.memory_footprint(LESSON_SHAPE, layers=-2), "layers must be"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_not_a_shape():
    with pytest.raises(TypeError, match="AttentionShape"):
        memory.score_matrix_bytes({"seqlen_q": 4})
