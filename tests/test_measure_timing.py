"""Timing: percentiles, repeat choice, the CPU path, option checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnlab.measure.timing import Timing, choose_repeats, percentile, time_call


@given(st.lists(st.floats(0, 1e3), min_size=1, max_size=50), st.sampled_from([0, 20, 50, 80, 100]))
def test_percentile_matches_numpy(samples, q):
    assert percentile(samples, q) == pytest.approx(np.percentile(samples, q), abs=1e-9)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 120)


def test_choose_repeats_fills_the_target_within_bounds():
    assert choose_repeats(2.0, target_ms=100, min_repeats=5, max_repeats=200) == 50
    assert choose_repeats(50.0, target_ms=100, min_repeats=5, max_repeats=200) == 5
    assert choose_repeats(0.001, target_ms=100, min_repeats=5, max_repeats=200) == 200


def test_cpu_timing_cycles_inputs_and_orders_percentiles():
    calls = []
    result = time_call(lambda x: calls.append(x), [(0,), (1,), (2,)], device="cpu",
                       warmup=2, repeats=9, flush="rotate")
    assert isinstance(result, Timing)
    assert result.repeats == 9 and result.method == "perf-counter"
    assert calls == [0, 1] + [i % 3 for i in range(9)]  # warm-up, then rotation
    assert result.p20 <= result.p50 <= result.p80


def test_cpu_timing_measures_real_time():
    import time

    result = time_call(lambda: time.sleep(0.002), [()], device="cpu", repeats=5)
    assert 1.5 <= result.p50 <= 50.0  # milliseconds: a 2 ms sleep, generous for a busy CI


def test_automatic_repeats_respect_bounds():
    result = time_call(lambda: None, [()], device="cpu", target_ms=1.0, min_repeats=3,
                       max_repeats=7)
    assert 3 <= result.repeats <= 7


@pytest.mark.parametrize("options, message", [
    ({"flush": "l2"}, "needs CUDA"),
    ({"flush": "l2_clean"}, "needs CUDA"),
    ({"cuda_graph": True}, "needs CUDA"),
    ({"flush": "sometimes"}, "flush must be one of"),
    ({"flush": "rotate"}, "at least 2 input sets"),
    ({"warmup": 0}, "warmup"),
    ({"repeats": 0}, "repeats"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        time_call(lambda: None, [()], device="cpu", **options)


def test_device_must_be_named():
    with pytest.raises(ValueError, match="device"):
        time_call(lambda: None, [()], device="tpu")


def test_cuda_graph_must_be_a_tri_state():
    with pytest.raises(ValueError, match="cuda_graph must be None"):
        time_call(lambda: None, [()], device="cpu", cuda_graph="yes")


def test_context_is_entered_once_around_all_calls_never_inside_one():
    import contextlib

    events = []

    @contextlib.contextmanager
    def pin():
        events.append("enter")
        yield
        events.append("exit")

    result = time_call(lambda: events.append("call"), [()], device="cpu", warmup=2, repeats=4,
                       context=pin)
    assert events == ["enter"] + ["call"] * 6 + ["exit"]
    assert result.describe_method() == "perf-counter, flush=none, warmup=2"


def test_context_must_be_callable():
    with pytest.raises(TypeError, match="context"):
        time_call(lambda: None, [()], device="cpu", context=object())


def test_a_method_note_is_part_of_the_description():
    timing = Timing((1.0, 2.0), "cuda-event", "l2", 3, note="capture failed: X")
    assert timing.describe_method() == "cuda-event, flush=l2, warmup=3 (capture failed: X)"
    assert "capture failed: X" in timing.describe()


# ----- the GPU ----------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                                reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_short_calls_are_graph_timed_and_long_ones_are_not():
    import torch

    small = torch.randn(64, 64, device="cuda")
    short = time_call(torch.matmul, [(small, small)], device="cuda", repeats=20)
    assert short.method == "cuda-graph" and short.note is None
    big = torch.randn(8192, 8192, device="cuda")
    long = time_call(torch.matmul, [(big, big)], device="cuda", repeats=5)
    assert long.method == "cuda-event"
    forced = time_call(torch.matmul, [(small, small)], device="cuda", repeats=5, cuda_graph=False)
    assert forced.method == "cuda-event"


@pytest.mark.gpu
@needs_cuda
def test_gpu_an_uncapturable_short_call_says_so():
    import torch

    x = torch.randn(16, device="cuda")
    result = time_call(lambda: x.sum().item(), [()], device="cuda", repeats=5)  # .item() syncs
    assert result.method == "cuda-event" and "capture failed" in result.note
    with pytest.raises(Exception):  # noqa: B017 -- whatever capture raises, asked for: raised
        time_call(lambda: x.sum().item(), [()], device="cuda", repeats=5, cuda_graph=True)

