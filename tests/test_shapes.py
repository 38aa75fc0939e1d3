"""AttentionShape validation, derived sizes, and the named presets."""

from __future__ import annotations

import math

import pytest

from attnlab.shapes import (
    DTYPE_BYTES,
    LESSON_SHAPE,
    PRESETS,
    AttentionShape,
    dtype_bytes,
    preset,
)

# (field, bad value) -> every one must raise ValueError whose message names the field.
INVALID_FIELDS = [
    ("batch", 0),
    ("batch", -1),
    ("batch", 1.5),
    ("batch", True),
    ("query_heads", 0),
    ("kv_heads", 0),
    ("kv_heads", 3),  # does not divide query_heads=4 (set below)
    ("seqlen_q", 0),
    ("seqlen_q", "128"),
    ("seqlen_k", -5),
    ("head_dim", 0),
    ("head_dim", 64.0),
    ("block_m", 0),
    ("block_n", -64),
    ("dtype", "fp8"),
    ("dtype", "float8"),
    ("dtype", 16),
    ("causal", 1),
    ("causal", "yes"),
    ("window", (-2, 0)),
    ("window", (0, -3)),
    ("window", (1, 2, 3)),
    ("window", (1.0, 2)),
    ("window", (True, 0)),
]


@pytest.mark.parametrize(("field", "value"), INVALID_FIELDS)
def test_each_invalid_field_raises_value_error_naming_it(field, value):
    base = {"query_heads": 4} if field == "kv_heads" else {}
    with pytest.raises(ValueError, match=field):
        AttentionShape(**{**base, field: value})


def test_query_heads_not_divisible_by_kv_heads_names_both():
    with pytest.raises(ValueError, match="kv_heads") as error:
        AttentionShape(query_heads=24, kv_heads=5)
    assert "query_heads" in str(error.value)


def test_valid_shape_derived_sizes():
    shape = AttentionShape(batch=2, query_heads=24, kv_heads=4, seqlen_q=1000, seqlen_k=1025,
                           head_dim=256, dtype="bf16", causal=True, window=[8, -1],
                           block_m=128, block_n=64)
    assert shape.window == (8, -1)  # normalised to a tuple
    assert shape.group_size == 6
    assert shape.element_bytes == 2
    assert shape.query_tiles == 8  # ceil(1000 / 128): the last tile is ragged
    assert shape.kv_tiles == 17  # ceil(1025 / 64)
    assert math.isclose(shape.softmax_scale, 1 / 16)
    assert shape.has_window
    assert "window=(8, -1)" in shape.describe()


def test_replace_revalidates_and_dict_round_trip():
    shape = AttentionShape(seqlen_q=97, seqlen_k=113, causal=True, window=(4, 0))
    assert AttentionShape.from_dict(shape.as_dict()) == shape
    assert shape.replace(seqlen_q=1).seqlen_q == 1
    with pytest.raises(ValueError, match="seqlen_q"):
        shape.replace(seqlen_q=0)
    with pytest.raises(ValueError, match="unknown AttentionShape fields"):
        AttentionShape.from_dict({**shape.as_dict(), "heads": 3})


def test_dtype_bytes():
    assert DTYPE_BYTES == {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
    assert dtype_bytes("fp32") == 4
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("int8")


def test_presets_match_the_sources():
    lesson = preset("lesson-8b")
    assert (lesson.layers, lesson.attention_layers, lesson.query_heads, lesson.kv_heads,
            lesson.head_dim, lesson.dtype) == (32, 32, 32, 32, 128, "fp16")
    qwen = preset("qwen-gqa")
    assert (qwen.layers, qwen.attention_layers, qwen.query_heads, qwen.kv_heads,
            qwen.head_dim) == (64, 16, 24, 4, 256)
    shape = qwen.shape(4096)
    assert shape.causal and shape.group_size == 6 and shape.seqlen_k == 4096
    assert set(PRESETS) == {"lesson-8b", "qwen-gqa"}
    with pytest.raises(ValueError, match="preset"):
        preset("gpt-5")


def test_lesson_shape_is_the_lesson_default():
    assert (LESSON_SHAPE.seqlen_q, LESSON_SHAPE.head_dim, LESSON_SHAPE.query_heads,
            LESSON_SHAPE.block_m, LESSON_SHAPE.block_n, LESSON_SHAPE.dtype) == (
        4096, 128, 32, 128, 64, "fp16")
    assert LESSON_SHAPE.query_tiles == 32 and LESSON_SHAPE.kv_tiles == 64
