"""Amdahl's law across measurement boundaries: kernel -> layer -> prefill -> client TTFT.

The input is always a *time* share (what fraction of the wall-clock at a boundary the
improved part occupies), never a FLOP share: softmax, masking and memory stalls take
time without taking FLOPs, so the two differ by an order of magnitude for attention
(the lesson: ~3.2% of prefill FLOPs at 2k tokens, 15-40% of layer time in profiles).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from attnlab.checks import check_float, check_int

# The lesson's sensitivity table: one 3.5x kernel under three measured attention shares.
LESSON_TIME_SHARES: tuple[float, ...] = (0.15, 0.40, 0.65)
LESSON_KERNEL_SPEEDUP = 3.5
# "Lesson 2's count": attention is 3.2% of prefill FLOPs at P = 2,048 (an input the lesson
# quotes; attnlab.model.flops.attention_flop_share recomputes it as 3.25%).
LESSON_FLOP_SHARE = 0.032


def _check_time_share(time_share: float, name: str = "time_share") -> float:
    """A fraction of time in [0, 1]."""
    value = check_float(name, time_share, minimum=0.0, maximum=1.0, finite=False) \
        if _is_nan(time_share) else check_float(name, time_share)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (a fraction of time), got {value}")
    return value


def _is_nan(value) -> bool:
    return isinstance(value, float) and value != value


def _check_speedup(kernel_speedup: float, name: str = "kernel_speedup") -> float:
    return check_float(name, kernel_speedup, minimum=0.0, min_open=True)


def _check_time(value: float, name: str) -> float:
    """A finite time >= 0 (any unit, the same at every boundary)."""
    return check_float(name, value, minimum=0.0)


def amdahl_speedup(time_share: float, kernel_speedup: float) -> float:
    """Whole-boundary speedup when a part taking ``time_share`` of it gets ``kernel_speedup``x faster.

    ``1 / ((1 - f) + f / S)``.  ``time_share`` in [0, 1]; ``kernel_speedup`` > 0 (below 1
    is a slowdown).  Example: ``amdahl_speedup(0.15, 3.5)`` -> 1.12.
    """
    f = _check_time_share(time_share)
    s = _check_speedup(kernel_speedup)
    return 1.0 / ((1.0 - f) + f / s)


def latency_reduction(time_share: float, kernel_speedup: float) -> float:
    """Fraction of the boundary's time removed: ``1 - 1/speedup`` = ``f * (1 - 1/S)``."""
    f = _check_time_share(time_share)
    s = _check_speedup(kernel_speedup)
    return f * (1.0 - 1.0 / s)


def time_share(part_time: float, total_time: float) -> float:
    """The share ``part_time / total_time`` with both measured at the same boundary."""
    part = _check_time(part_time, "part_time")
    total = _check_time(total_time, "total_time")
    if total == 0.0:
        raise ValueError("total_time must be > 0")
    if part > total:
        raise ValueError(f"part_time ({part}) must not exceed total_time ({total})")
    return part / total


@dataclass(frozen=True)
class SensitivityRow:
    time_share: float
    kernel_speedup: float
    speedup: float
    latency_reduction: float

    def as_dict(self) -> dict:
        return asdict(self)


def sensitivity_table(time_shares: Sequence[float] = LESSON_TIME_SHARES,
                      kernel_speedup: float = LESSON_KERNEL_SPEEDUP) -> list[SensitivityRow]:
    """One row per time share, same kernel speedup (the lesson: 1.120x / 1.400x / 1.867x)."""
    if len(time_shares) == 0:
        raise ValueError("time_shares must hold at least one share in [0, 1]")
    return [SensitivityRow(float(f), float(kernel_speedup), amdahl_speedup(f, kernel_speedup),
                           latency_reduction(f, kernel_speedup)) for f in time_shares]


@dataclass(frozen=True)
class FlopShareTrap:
    """The same kernel speedup pushed through a time share and through a FLOP share."""

    kernel_speedup: float
    time_share: float
    time_share_speedup: float
    flop_share: float
    flop_share_speedup: float

    def as_dict(self) -> dict:
        return asdict(self)


def flop_share_trap(time_share: float, flop_share: float,
                    kernel_speedup: float) -> FlopShareTrap:
    """Side by side: the valid projection (time share) and the invalid one (FLOP share)."""
    return FlopShareTrap(
        kernel_speedup=_check_speedup(kernel_speedup),
        time_share=_check_time_share(time_share),
        time_share_speedup=amdahl_speedup(time_share, kernel_speedup),
        flop_share=_check_time_share(flop_share, "flop_share"),
        flop_share_speedup=amdahl_speedup(flop_share, kernel_speedup),
    )


@dataclass(frozen=True)
class Boundary:
    """One enclosing measurement boundary.

    Its time is ``repeats * (inner boundary's time) + other_time``: ``repeats`` is how
    many times the inner span occurs in it (e.g. 32 layers in a prefill) and
    ``other_time`` is the time the change does not touch (MLP, queueing, network...).
    """

    name: str
    other_time: float
    repeats: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Boundary name must be a non-empty string, got {self.name!r}")
        _check_time(self.other_time, f"other_time of boundary {self.name!r}")
        check_int(f"repeats of boundary {self.name!r}", self.repeats, minimum=1)


@dataclass(frozen=True)
class BoundaryResult:
    name: str
    time_before: float
    time_after: float
    time_share: float  # share of time_before spent in the part that got faster
    speedup: float
    latency_reduction: float

    def as_dict(self) -> dict:
        return asdict(self)


def boundary_chain(kernel_time: float, kernel_speedup: float,
                   boundaries: Sequence[Boundary], *,
                   kernel_name: str = "kernel") -> list[BoundaryResult]:
    """Propagate one kernel speedup outward through nested boundaries.

    Each enclosing boundary holds everything inside it fixed except the kernel, so the
    speedup shrinks at every step by exactly Amdahl's law with that boundary's own time
    share.  Returns one row per boundary, the kernel first.  Assumes a serial,
    non-overlapping critical path (the lesson's exit-task assumption).
    """
    time = _check_time(kernel_time, "kernel_time")
    if time == 0.0:
        raise ValueError("kernel_time must be > 0")
    s = _check_speedup(kernel_speedup)
    before, after = time, time / s
    rows = [BoundaryResult(kernel_name, before, after, 1.0, s, 1.0 - 1.0 / s)]
    kernel_before = time  # total kernel time inside the current boundary
    for boundary in boundaries:
        if not isinstance(boundary, Boundary):
            raise TypeError(f"boundaries must hold Boundary objects, got {boundary!r}")
        before = boundary.repeats * before + boundary.other_time
        after = boundary.repeats * after + boundary.other_time
        kernel_before *= boundary.repeats
        share = kernel_before / before
        rows.append(BoundaryResult(boundary.name, before, after, share,
                                   amdahl_speedup(share, s), 1.0 - after / before))
    return rows


# The lesson's exit task (all timings synthetic): a 290 ms prefill of 32 layers with
# attention 116 ms (40%), 15 ms network + 65 ms queue + 10 ms serialisation outside it,
# and an assumed 3.00x attention kernel.
EXIT_TASK_LAYERS = 32
EXIT_TASK_ATTENTION_MS = 116.0
EXIT_TASK_PREFILL_MS = 290.0
EXIT_TASK_OUTSIDE_PREFILL_MS = 15.0 + 65.0 + 10.0
EXIT_TASK_KERNEL_SPEEDUP = 3.0


def prefill_chain(attention_time: float = EXIT_TASK_ATTENTION_MS,
                  prefill_time: float = EXIT_TASK_PREFILL_MS,
                  outside_prefill_time: float = EXIT_TASK_OUTSIDE_PREFILL_MS,
                  kernel_speedup: float = EXIT_TASK_KERNEL_SPEEDUP,
                  layers: int = EXIT_TASK_LAYERS) -> list[BoundaryResult]:
    """kernel -> layer -> prefill -> client TTFT from a profile's totals.

    ``attention_time`` and ``prefill_time`` are summed over all layers; layers are
    assumed identical, so one layer holds 1/layers of each.  Defaults: the exit task,
    which gives 1.3636x at the prefill and 1.2555x at the client (302.67 ms).
    """
    attention = _check_time(attention_time, "attention_time")
    prefill = _check_time(prefill_time, "prefill_time")
    if attention == 0.0:
        raise ValueError("attention_time must be > 0")
    if attention > prefill:
        raise ValueError(f"attention_time ({attention}) must not exceed prefill_time ({prefill})")
    check_int("layers", layers, minimum=1)
    return boundary_chain(
        attention / layers, kernel_speedup,
        [Boundary("layer", (prefill - attention) / layers),
         Boundary("prefill", 0.0, repeats=layers),
         Boundary("client TTFT", _check_time(outside_prefill_time, "outside_prefill_time"))],
        kernel_name="attention kernel (per layer)",
    )
