"""The online-softmax walk for one query row, in plain Python floats.

``attnlab trace`` prints it: the scores arrive ``tile`` at a time, and after each
tile the row's running max m, rescale factor alpha, running sum l and unnormalised
accumulator a are recorded.  The final ``O = a / l`` is checked against the softmax
of the whole row computed at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from attnlab.checks import as_scalar, check_float, check_int

NEG_INF = float("-inf")


@dataclass(frozen=True)
class WalkStep:
    """The row's state after one tile of scores (tile numbers are 0-based)."""

    tile: int
    scores: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]
    m_old: float
    m_new: float
    alpha: float  # exp(m_old - m_new): what the old l and a were multiplied by
    weights: tuple[float, ...]  # exp(score - m_new) of this tile's scores
    l: float  # noqa: E741 -- the lesson's name for the running sum
    a: tuple[float, ...]


@dataclass(frozen=True)
class WalkResult:
    steps: tuple[WalkStep, ...]
    output: tuple[float, ...]  # a / l after the last tile (zeros if no finite score)
    softmax_weights: tuple[float, ...]  # full-row softmax, all scores at once
    softmax_output: tuple[float, ...]  # softmax_weights @ values

    @property
    def max_abs_difference(self) -> float:
        return max(abs(x - y) for x, y in zip(self.output, self.softmax_output, strict=True))

    def matches(self, tolerance: float = 1e-9) -> bool:
        """Whether the walk and the full-row softmax agree to ``tolerance`` (relative)."""
        scale = max(1.0, *(abs(x) for x in self.softmax_output))
        return self.max_abs_difference <= tolerance * scale


def online_softmax_walk(scores: Sequence[float], values: Sequence, tile: int) -> WalkResult:
    """Walk ``scores`` (one per key) ``tile`` keys at a time; ``values`` one row per key.

    A value row is a sequence of floats (or one float, meaning a 1-wide row).  Scores
    may be -inf (a hidden key) but not NaN or +inf.
    """
    score_list, value_rows = _check_walk_inputs(scores, values, tile)
    width = len(value_rows[0])
    m, total, accumulator = NEG_INF, 0.0, [0.0] * width
    steps = []
    for start in range(0, len(score_list), tile):
        tile_scores = score_list[start:start + tile]
        tile_values = value_rows[start:start + tile]
        m_new = max(m, *tile_scores)
        # With every score so far -inf, measure from 0 so exp(-inf) = 0, not NaN.
        base = 0.0 if m_new == NEG_INF else m_new
        alpha = math.exp(m - base)
        weights = tuple(math.exp(s - base) for s in tile_scores)
        total = alpha * total + sum(weights)
        accumulator = [alpha * acc + sum(w * row[c] for w, row in zip(weights, tile_values, strict=True))
                       for c, acc in enumerate(accumulator)]
        steps.append(WalkStep(tile=start // tile, scores=tuple(tile_scores),
                              values=tuple(tile_values), m_old=m, m_new=m_new, alpha=alpha,
                              weights=weights, l=total, a=tuple(accumulator)))
        m = m_new
    output = tuple(acc / total for acc in accumulator) if total > 0 else (0.0,) * width
    softmax_weights, softmax_output = _full_row_softmax(score_list, value_rows)
    return WalkResult(steps=tuple(steps), output=output, softmax_weights=softmax_weights,
                      softmax_output=softmax_output)


def _full_row_softmax(scores: list[float], values: list[tuple[float, ...]]):
    """The textbook softmax with the whole row in hand: the walk's check."""
    row_max = max(scores)
    width = len(values[0])
    if row_max == NEG_INF:
        return (0.0,) * len(scores), (0.0,) * width
    exps = [math.exp(s - row_max) for s in scores]
    total = sum(exps)
    weights = tuple(e / total for e in exps)
    output = tuple(sum(w * row[c] for w, row in zip(weights, values, strict=True))
                   for c in range(width))
    return weights, output


def _check_walk_inputs(scores, values, tile):
    tile = check_int("tile", tile, minimum=1)
    score_list = [_as_float(s, "scores") for s in scores]
    if not score_list:
        raise ValueError("scores must hold at least one score, got none")
    if any(math.isnan(s) or s == math.inf for s in score_list):
        raise ValueError(f"scores must be finite or -inf, got {score_list}")
    value_rows = [_as_row(row) for row in values]
    if len(value_rows) != len(score_list):
        raise ValueError(f"values must have one row per score ({len(score_list)}), "
                         f"got {len(value_rows)}")
    widths = {len(row) for row in value_rows}
    if len(widths) != 1 or 0 in widths:
        raise ValueError(f"values rows must all have the same positive width, got widths "
                         f"{[len(row) for row in value_rows]}")
    if not all(math.isfinite(x) for row in value_rows for x in row):
        raise ValueError("values must be finite")
    return score_list, value_rows


def _as_row(row) -> tuple[float, ...]:
    if isinstance(as_scalar(row), (int, float)) and not isinstance(as_scalar(row), bool):
        return (float(as_scalar(row)),)
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise ValueError(f"values must be numbers or sequences of numbers, got {row!r}")
    return tuple(_as_float(x, "values") for x in row)


def _as_float(x, name: str) -> float:
    x = as_scalar(x)
    if isinstance(x, float) and math.isnan(x):
        return x  # refused by the caller, with the whole list in the message
    return check_float(f"{name} (each item)", x, finite=False)
