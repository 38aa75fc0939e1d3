"""Timing one call: CUDA events on a GPU, ``time.perf_counter`` on the CPU.

What a number means here (and is recorded with it):

* **warm-up first**: compilation, autotuning, allocator growth and lazy library
  initialisation happen before the first timed call;
* **cold L2 per call** (``flush="l2"``, the default on CUDA): a buffer twice the
  size of L2 is zeroed before every timed call, outside the timed interval, so a
  decode kernel cannot read last iteration's K/V from cache; or ``flush="rotate"``:
  successive calls cycle through several independent input sets;
* **per-call samples**: one pair of events around each call, reported as p20 / p50
  / p80 (the median is the statistic; the spread says how much to trust it);
* **optional CUDA-graph replay** (``cuda_graph=True``): the call is captured once
  and replayed, so Python and launch overhead leave the measurement — the number
  a serving engine with graphs would see.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

FLUSH_MODES = ("l2", "rotate", "none")


@dataclass(frozen=True)
class Timing:
    """Per-call times of one measurement, in milliseconds."""

    samples_ms: tuple[float, ...]
    method: str     # "cuda-event", "cuda-graph" or "perf-counter"
    flush: str      # one of FLUSH_MODES
    warmup: int

    @property
    def repeats(self) -> int:
        return len(self.samples_ms)

    @property
    def p20(self) -> float:
        return percentile(self.samples_ms, 20)

    @property
    def p50(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def p80(self) -> float:
        return percentile(self.samples_ms, 80)

    def describe(self) -> str:
        return (f"median {self.p50:.4f} ms (p20 {self.p20:.4f}, p80 {self.p80:.4f}; "
                f"{self.repeats} calls, {self.method}, flush={self.flush})")


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's)."""
    if not samples:
        raise ValueError("samples must not be empty")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def choose_repeats(estimate_ms: float, *, target_ms: float, min_repeats: int,
                   max_repeats: int) -> int:
    """Enough calls to fill ``target_ms``, clamped to [min_repeats, max_repeats]."""
    if estimate_ms <= 0:
        return max_repeats
    return max(min_repeats, min(max_repeats, math.ceil(target_ms / estimate_ms)))


def _check_options(inputs, warmup, repeats, flush, min_repeats, max_repeats) -> None:
    if not isinstance(inputs, Sequence) or not inputs:
        raise ValueError("inputs must be a non-empty sequence of argument tuples")
    if flush not in FLUSH_MODES:
        raise ValueError(f"flush must be one of {list(FLUSH_MODES)}, got {flush!r}")
    if flush == "rotate" and len(inputs) < 2:
        raise ValueError("flush='rotate' needs at least 2 input sets to rotate through")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
    if repeats is not None and (isinstance(repeats, bool) or not isinstance(repeats, int)
                                or repeats < 1):
        raise ValueError(f"repeats must be an int >= 1 or None (automatic), got {repeats!r}")
    if not 1 <= min_repeats <= max_repeats:
        raise ValueError(f"need 1 <= min_repeats <= max_repeats, got {min_repeats}, {max_repeats}")


def time_call(fn: Callable, inputs: Sequence[tuple], *, device: str = "cuda", warmup: int = 3,
              repeats: int | None = None, target_ms: float = 100.0, min_repeats: int = 5,
              max_repeats: int = 200, flush: str | None = None,
              cuda_graph: bool = False) -> Timing:
    """Time ``fn(*inputs[i % len(inputs)])`` call by call.

    ``device`` is "cuda" (events, L2 flush by default) or "cpu" (perf_counter, no
    flush: there is no cache we can portably evict).  ``repeats=None`` picks enough
    calls for ``target_ms`` of timed work from the warm-up's duration.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if flush is None:
        flush = "l2" if device == "cuda" else "none"
    _check_options(inputs, warmup, repeats, flush, min_repeats, max_repeats)
    if device == "cpu":
        if flush == "l2":
            raise ValueError("flush='l2' needs CUDA; on the CPU use flush='none' or 'rotate'")
        if cuda_graph:
            raise ValueError("cuda_graph=True needs CUDA")
        return _time_cpu(fn, inputs, warmup, repeats, target_ms, min_repeats, max_repeats,
                         flush)
    return _time_cuda(fn, inputs, warmup, repeats, target_ms, min_repeats, max_repeats, flush,
                      cuda_graph)


def _time_cpu(fn, inputs, warmup, repeats, target_ms, min_repeats, max_repeats,
              flush) -> Timing:
    start = time.perf_counter()
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    estimate_ms = (time.perf_counter() - start) * 1e3 / warmup
    if repeats is None:
        repeats = choose_repeats(estimate_ms, target_ms=target_ms, min_repeats=min_repeats,
                                 max_repeats=max_repeats)
    samples = []
    for i in range(repeats):
        args = inputs[i % len(inputs)]
        begin = time.perf_counter()
        fn(*args)
        samples.append((time.perf_counter() - begin) * 1e3)
    return Timing(tuple(samples), "perf-counter", flush, warmup)


class L2Flusher:
    """Zeroes a buffer twice the size of L2: whatever the last call left there is gone."""

    def __init__(self, device_index: int | None = None) -> None:
        import torch

        props = torch.cuda.get_device_properties(
            torch.cuda.current_device() if device_index is None else device_index)
        self.l2_bytes = int(props.L2_cache_size)
        self.buffer = torch.empty(2 * self.l2_bytes // 4, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        self.buffer.zero_()


def _capture_graphs(fn, inputs):
    import torch

    # Graph capture needs the call warmed up on a side stream first (allocator state).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for args in inputs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        graphs.append(graph)
    torch.cuda.synchronize()
    return [graph.replay for graph in graphs]


def _time_cuda(fn, inputs, warmup, repeats, target_ms, min_repeats, max_repeats, flush,
               cuda_graph) -> Timing:
    import torch

    flusher = L2Flusher() if flush == "l2" else None
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    if cuda_graph:
        replays = _capture_graphs(fn, inputs)
        calls = [(replay, ()) for replay in replays]
    else:
        calls = [(fn, args) for args in inputs]

    def timed(count: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        for i in range(count):
            call, args = calls[i % len(calls)]
            if flusher is not None:
                flusher()
            starts[i].record()
            call(*args)
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]

    if repeats is None:
        estimate_ms = percentile(timed(min(3, min_repeats)), 50)
        repeats = choose_repeats(estimate_ms, target_ms=target_ms, min_repeats=min_repeats,
                                 max_repeats=max_repeats)
    samples = timed(repeats)
    return Timing(tuple(samples), "cuda-graph" if cuda_graph else "cuda-event", flush, warmup)
