"""The project's one timer: CUDA events (or CUDA-graph replays) on a GPU,
``time.perf_counter`` on the CPU.

What a number means here (and is recorded with it, :meth:`Timing.describe_method`):

* **warm-up first**: compilation, autotuning, allocator growth and lazy library
  initialisation happen before the first timed call;
* **pins outside the timed region**: ``context`` (e.g. the ``sdpa_kernel`` backend
  pin of a provider) is entered once around warm-up, capture and timing, never per
  call — entering ``sdpa_kernel`` costs ~0.1 ms of Python, as much as a short kernel;
* **short calls under CUDA-graph replay** (``cuda_graph=None``, the default): a call
  whose first event-timed estimate is under :data:`GRAPH_PROBE_MS` is captured once
  (inside ``context``, so the graph holds the pinned kernel); if a replay takes under
  :data:`SHORT_CALL_MS`, the replays are timed, so Python and launch overhead leave
  the number — the time a serving engine with graphs would see.  ``cuda_graph=True``/``False`` forces either way.  A short
  call that cannot be captured is timed with events and the Timing says why
  (``note``); it never changes method silently;
* **cold L2 per call** (``flush="l2"``, the default on CUDA): a buffer twice the
  size of L2 is zeroed before every timed call, outside the timed interval, so a
  decode kernel cannot read last iteration's K/V from cache.  Zeroing leaves L2 full of
  dirty lines that the timed call then writes back (up to 2 x 50 MB of extra DRAM traffic
  on an H200, whatever the kernel); ``flush="l2_clean"`` *reads* the buffer instead, so
  L2 holds only clean lines, as after a model's weight reads.  Or ``flush="rotate"``:
  successive calls cycle through several independent input sets;
* **per-call samples**: one pair of events around each call, reported as p20 / p50
  / p80 (the median is the statistic; the spread says how much to trust it).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

FLUSH_MODES = ("l2", "l2_clean", "rotate", "none")
L2_FLUSHES = ("l2", "l2_clean")  # the modes that need a GPU's L2Flusher
# Below this first estimate a call is timed under CUDA-graph replay: there, launch and
# Python overhead (10-40 us per call) is a visible share of the kernel's own time.
SHORT_CALL_MS = 0.1
# Event-timed calls behind the first estimate (which picks graph replay or not).
ESTIMATE_CALLS = 3
# An event-timed estimate under this is probed with a graph capture: events around a
# call also count the GPU's wait for a slow host, so a 50 us kernel behind 200 us of
# Python looks long (the H200's d = 256 forward at N = 1k read 88 TFLOP/s event-timed
# against 124 in an earlier run).  The graph replay's own time then decides.
GRAPH_PROBE_MS = 1.0


@dataclass(frozen=True)
class Timing:
    """Per-call times of one measurement, in milliseconds."""

    samples_ms: tuple[float, ...]
    method: str     # "cuda-event", "cuda-graph" or "perf-counter"
    flush: str      # one of FLUSH_MODES
    warmup: int
    note: str | None = None   # why a short call was not graph-timed, when it was not

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

    def describe_method(self) -> str:
        """How the samples were taken, in one line (records keep it as ``timing``)."""
        text = f"{self.method}, flush={self.flush}, warmup={self.warmup}"
        return f"{text} ({self.note})" if self.note else text

    def describe(self) -> str:
        return (f"median {self.p50:.4f} ms (p20 {self.p20:.4f}, p80 {self.p80:.4f}; "
                f"{self.repeats} calls, {self.describe_method()})")


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


def _check_options(inputs, warmup, repeats, flush, min_repeats, max_repeats, cuda_graph,
                   context) -> None:
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
    if cuda_graph not in (None, True, False):
        raise ValueError(f"cuda_graph must be None (automatic: graphs for calls under "
                         f"{SHORT_CALL_MS} ms), True or False, got {cuda_graph!r}")
    if context is not None and not callable(context):
        raise TypeError(f"context must be a callable returning a context manager (e.g. a "
                        f"provider's pin), got {type(context).__name__}")


def time_call(fn: Callable, inputs: Sequence[tuple], *, device: str = "cuda", warmup: int = 3,
              repeats: int | None = None, target_ms: float = 100.0, min_repeats: int = 5,
              max_repeats: int = 200, flush: str | None = None,
              cuda_graph: bool | None = None, context: Callable | None = None) -> Timing:
    """Time ``fn(*inputs[i % len(inputs)])`` call by call.

    ``device`` is "cuda" (events, L2 flush by default) or "cpu" (perf_counter, no
    flush: there is no cache we can portably evict).  ``repeats=None`` picks enough
    calls for ``target_ms`` of timed work from a first estimate.  ``cuda_graph``: None
    times calls under :data:`SHORT_CALL_MS` as graph replays, True/False force it.
    ``context``: a callable returning a context manager entered once around it all.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if flush is None:
        flush = "l2" if device == "cuda" else "none"
    _check_options(inputs, warmup, repeats, flush, min_repeats, max_repeats, cuda_graph,
                   context)
    if device == "cpu":
        if flush in L2_FLUSHES:
            raise ValueError(f"flush={flush!r} needs CUDA; on the CPU use flush='none' or "
                             "'rotate'")
        if cuda_graph:
            raise ValueError("cuda_graph=True needs CUDA")
    with context() if context is not None else contextlib.nullcontext():
        if device == "cpu":
            return _time_cpu(fn, inputs, warmup, repeats, target_ms, min_repeats, max_repeats,
                             flush)
        return _time_cuda(fn, inputs, warmup, repeats, target_ms, min_repeats, max_repeats,
                          flush, cuda_graph)


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
    """Zeroes (or, ``clean``, reads) a buffer twice the size of L2: whatever the last call
    left there is gone."""

    def __init__(self, device_index: int | None = None, *, clean: bool = False) -> None:
        import torch

        self.clean = clean
        props = torch.cuda.get_device_properties(
            torch.cuda.current_device() if device_index is None else device_index)
        self.l2_bytes = int(props.L2_cache_size)
        self.buffer = torch.empty(2 * self.l2_bytes // 4, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        if self.clean:
            self.buffer.amax()  # the result is not wanted: the reads are
        else:
            self.buffer.zero_()


def capture_graphs(fn: Callable, inputs: Sequence[tuple]) -> list[Callable]:
    """One CUDA graph per input set of ``fn``; returns their replay functions."""
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


def _event_times(calls: Sequence[tuple[Callable, tuple]], count: int,
                 flusher: L2Flusher | None) -> list[float]:
    import torch

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


def _time_cuda(fn, inputs, warmup, repeats, target_ms, min_repeats, max_repeats, flush,
               cuda_graph) -> Timing:
    import torch

    flusher = L2Flusher(clean=flush == "l2_clean") if flush in L2_FLUSHES else None
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    calls = [(fn, args) for args in inputs]
    estimate_ms = None
    if cuda_graph is None or repeats is None:
        estimate_ms = percentile(_event_times(calls, min(ESTIMATE_CALLS, min_repeats), flusher),
                                 50)
    use_graph = cuda_graph if cuda_graph is not None else estimate_ms < GRAPH_PROBE_MS
    method, note = "cuda-event", None
    if use_graph:
        try:
            replays = capture_graphs(fn, inputs)
        except Exception as error:
            if cuda_graph:  # asked for explicitly: the caller hears why it failed
                raise
            torch.cuda.synchronize()
            message = " ".join(str(error).split())[:200]
            note = (f"a {estimate_ms:.4f} ms call, but CUDA-graph capture failed: "
                    f"{type(error).__name__}: {message}; launch overhead included")
        else:
            graph_calls = [(replay, ()) for replay in replays]
            replay_ms = percentile(_event_times(graph_calls, min(ESTIMATE_CALLS, min_repeats),
                                                flusher), 50)
            if cuda_graph or replay_ms < SHORT_CALL_MS:
                calls, method, estimate_ms = graph_calls, "cuda-graph", replay_ms
    if repeats is None:
        repeats = choose_repeats(estimate_ms, target_ms=target_ms, min_repeats=min_repeats,
                                 max_repeats=max_repeats)
    samples = _event_times(calls, repeats, flusher)
    return Timing(tuple(samples), method, flush, warmup, note)
