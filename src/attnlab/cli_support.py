"""Parsing and printing shared by the `attnlab` verbs (one definition each)."""

from __future__ import annotations

import json
import math
import sys

from rich.console import Console


def parse_int(text: str, name: str, minimum: int = 1) -> int:
    """An int option >= minimum, or a ValueError naming the option and the range."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def parse_window(text: str) -> tuple[int, int]:
    """``LEFT,RIGHT`` as flash-attn's window_size (-1 = unbounded)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--window must be LEFT,RIGHT (ints >= -1, -1 = unbounded), got {text!r}")
    return (parse_int(parts[0], "--window LEFT", -1), parse_int(parts[1], "--window RIGHT", -1))


def new_console(width: int = 120) -> Console:
    # Looked up at call time so redirected or captured stdout is honoured.
    return Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else width)


def json_safe(value):
    """JSON has no infinities (an online-softmax walk starts at m = -inf): write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def dumps(report: dict) -> str:
    return json.dumps(json_safe(report), indent=2, allow_nan=False)


def ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5' (empty -> 'none')."""
    if not numbers:
        return "none"
    spans, start, prev = [], numbers[0], numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(spans)
