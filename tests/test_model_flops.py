"""FLOPs counted from the real mask, arithmetic intensity, and the GPU ceilings table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.masking import shape_band, visible_pairs
from attnlab.model import flops, hardware, traffic
from attnlab.shapes import LESSON_SHAPE, AttentionShape, preset


def test_lesson_layer_flops():
    unmasked = LESSON_SHAPE.replace(causal=False)
    assert flops.attention_flops(unmasked) == 4 * 32 * 4096 * 4096 * 128 == 274_877_906_944
    causal = LESSON_SHAPE.replace(causal=True)
    # N (N + 1) / 2 permitted pairs, not N^2 / 2
    assert visible_pairs(causal) == 4096 * 4097 // 2
    assert flops.attention_flops(causal) == 4 * 32 * 128 * (4096 * 4097 // 2)
    assert flops.conventional_attention_flops(causal) == 274_877_906_944 // 2


def test_gqa_flops_count_query_heads():
    qwen = preset("qwen-gqa").shape(1024, causal=False)
    assert flops.attention_flops(qwen) == 4 * 24 * 1024 * 1024 * 256


def test_backward_is_two_and_a_half_forward():
    shape = LESSON_SHAPE.replace(causal=True)
    assert 2 * flops.backward_flops(shape) == 5 * flops.attention_flops(shape)


def test_flop_share_matches_lesson():
    assert round(flops.attention_flop_share("lesson-8b", 2048), 3) == 0.032  # 3.25%
    assert round(flops.attention_flop_share("lesson-8b", 4096), 2) == 0.06   # 6.29%
    model = preset("lesson-8b")
    attention = flops.prefill_attention_flops(model, 2048)
    assert attention == 32 * 4 * 32 * 128 * (2048 * 2049 // 2)
    assert flops.prefill_non_attention_flops(model, 2048) == 2 * 8_000_000_000 * 2048
    assert flops.attention_flop_share(model, 2048) == attention / (attention + 2 * 8e9 * 2048)


def test_flop_share_grows_with_prompt_length():
    shares = [flops.attention_flop_share("lesson-8b", n) for n in (512, 2048, 8192, 32768)]
    assert shares == sorted(shares) and shares[-1] > 0.3


def test_softmax_is_one_flop_per_byte_at_fp16():
    t = traffic.naive_traffic(LESSON_SHAPE.replace(causal=False))
    by_kernel = {row["kernel"]: row for row in flops.kernel_intensities(t)}
    assert by_kernel["softmax P = softmax(S)"]["flop_per_byte"] == 1.0
    # H100's ridge is ~295 FLOP/byte: two orders of magnitude above
    assert hardware.gpu("H100 SXM").bound(1.0) == "memory"
    four = traffic.naive_traffic(LESSON_SHAPE.replace(causal=False), kernels=4)
    scale = flops.kernel_intensities(four)[1]
    assert scale["flop_per_byte"] == 0.25


@settings(max_examples=300, deadline=None)
@given(n_q=st.integers(1, 60), n_k=st.integers(1, 60), causal=st.booleans(),
       left=st.integers(-1, 20), right=st.integers(-1, 20))
def test_visible_pairs_equal_brute_force(n_q, n_k, causal, left, right):
    shape = AttentionShape(seqlen_q=n_q, seqlen_k=n_k, causal=causal, window=(left, right))
    offset = n_k - n_q

    def visible(r, c):
        if causal and c > r + offset:
            return False
        if left >= 0 and c < r + offset - left:
            return False
        return not (right >= 0 and c > r + offset + right)

    brute = sum(visible(r, c) for r in range(n_q) for c in range(n_k))
    assert visible_pairs(shape) == brute
    for r in range(n_q):
        first, stop = shape_band(shape).key_interval(r)
        assert shape_band(shape).keys_seen(r) == sum(visible(r, c) for c in range(n_k))
        assert all(visible(r, c) for c in range(first, stop))


def test_bottom_right_causal_with_short_keys():
    # 10 queries, 4 keys: query r sees keys <= r - 6, so the first 6 rows see nothing
    shape = AttentionShape(seqlen_q=10, seqlen_k=4, causal=True)
    assert [shape_band(shape).keys_seen(r) for r in range(10)] == [0] * 6 + [1, 2, 3, 4]
    assert visible_pairs(shape) == 10


def test_intensity_helpers():
    assert flops.arithmetic_intensity(10, 4) == 2.5
    with pytest.raises(ValueError, match="bytes_moved must be > 0"):
        flops.arithmetic_intensity(10, 0)
    with pytest.raises(ValueError, match="flops must be an int"):
        flops.arithmetic_intensity(-1, 5)


# ----- hardware --------------------------------------------------------------------------
def test_datasheet_ridge_points():
    assert f"{hardware.ridge_point('H100 SXM'):.0f}" == "295"  # 989 / 3.35
    assert f"{hardware.ridge_point('A100'):.0f}" == "153"  # 312 / 2.039
    assert hardware.gpu("H200").hbm_tbps == 4.8 and hardware.gpu("B200").dense_tflops == 2250.0
    assert set(hardware.GPUS) == {"A100", "H100 SXM", "H200", "B200"}
    assert hardware.gpu("h100-sxm") is hardware.gpu("H100") is hardware.GPUS["H100 SXM"]


def test_roofline_arithmetic():
    h100 = hardware.gpu("H100 SXM")
    assert h100.attainable_tflops(1.0) == 3.35
    assert h100.attainable_tflops(1000.0) == 989.0
    assert h100.bound(295.0) == "memory" and h100.bound(296.0) == "compute"
    assert h100.min_time_s(989 * 10**12, 0) == 1.0
    assert h100.min_time_s(0, 335 * 10**10) == 1.0


def test_measured_ceilings():
    measured = hardware.measured_ceilings("H200", dense_tflops=701.5)
    assert measured.dense_tflops == 701.5 and measured.hbm_tbps == 4.8
    assert measured.source.startswith("measured")
    records = [{"kind": "peak", "what": "bf16_gemm_8192", "tflops": 701.5484661485352},
               {"kind": "peak", "what": "d2d_copy_2GiB", "tbps": 4.266704714867785},
               {"kind": "timing", "seconds": 0.8}]
    from_records = hardware.ceilings_from_records("H200", records)
    assert from_records.dense_tflops == 701.5484661485352
    assert from_records.hbm_tbps == 4.266704714867785
    assert 164 < from_records.ridge_point < 165


@pytest.mark.parametrize("call, error, match", [
    (lambda: hardware.gpu("V100"), ValueError, "known: A100, B200, H100 SXM, H200"),
    (lambda: hardware.gpu(100), TypeError, "gpu name must be a string"),
    (lambda: hardware.measured_ceilings("H200"), ValueError, "needs a value"),
    (lambda: hardware.measured_ceilings("H200", hbm_tbps=0.0), ValueError, "hbm_tbps must be"),
    (lambda: hardware.measured_ceilings("H200", dense_tflops=-5), ValueError, "dense_tflops"),
    (lambda: hardware.ceilings_from_records("H200", [{"kind": "timing"}]), ValueError, "no peak"),
    (lambda: hardware.gpu("H100").bound(-1), ValueError, "flop_per_byte"),
    (lambda: hardware.gpu("H100").attainable_tflops(float("nan")), ValueError, "flop_per_byte"),
])
def test_hardware_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("call, error, match", [
    (lambda: flops.attention_flops("x"), TypeError, "AttentionShape"),
    (lambda: flops.attention_flop_share("gpt-5", 2048), ValueError, "preset must be one of"),
    (lambda: flops.attention_flop_share("lesson-8b", 0), ValueError, "prompt_tokens must be"),
    (lambda: flops.attention_flop_share(3, 10), TypeError, "preset"),
    (lambda: flops.conventional_attention_flops(LESSON_SHAPE.replace(window=(4, 0))),
     ValueError, "window"),
])
def test_flops_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
