"""Parsing and printing shared by the `attnlab` verbs (one definition each).

Every option value is parsed here, so a bad value is always one line naming the
option and what it accepts (the CLI turns the ValueError into exit code 2); every
verb prints through :func:`new_console`; every verb that writes files checks its
output folder with :func:`prepare_out_dir` before doing any work.
"""

from __future__ import annotations

import json
import math
import sys
from decimal import Decimal, InvalidOperation

from rich.console import Console

from attnlab.checks import check_float, check_window, quote
from attnlab.dtypes import canonical_dtype

# Lengths the exact models answer for: closed forms, exact integers, up to 2^40 tokens.
MAX_TOKENS = 2**40
CONSOLE_WIDTH = 120


def parse_int(text: str, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An int option in [minimum, maximum], or a ValueError naming the option and the range."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        value = _integral(str(text))
        if value is None:
            raise ValueError(f"{name} must be an int >= {minimum}, got {quote(text)}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {quote(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum:,}, got {quote(value)}")
    return value


def _integral(text: str) -> int | None:
    """'4096', '4_096' or '1e12' as an int (exactly, through Decimal); None if not integral."""
    text = text.strip().replace("_", "")
    if len(text) > 64:  # no length worth typing is longer; bounds the Decimal work
        return None
    try:
        number = Decimal(text)
    except InvalidOperation:
        return None
    if not number.is_finite() or number != number.to_integral_value() or abs(number) > 10**30:
        return None
    return int(number)


def parse_length(text: str, name: str) -> int:
    """A sequence length option: an int in [1, 2^40]."""
    return parse_int(text, name, 1, MAX_TOKENS)


def parse_float(text: str | float, name: str, *, minimum: float | None = None,
                maximum: float | None = None, min_open: bool = False) -> float:
    """A finite float option within the bounds, or a ValueError naming the option."""
    allowed = _range_text(minimum, maximum, min_open)
    try:
        value = float(text) if isinstance(text, str) else check_float(name, text, finite=False)
    except ValueError:
        raise ValueError(f"{name} must be a number{allowed}, got {quote(text)}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{allowed}, got {quote(text)}")
    too_low = minimum is not None and (value <= minimum if min_open else value < minimum)
    if too_low or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be a number{allowed}, got {value:g}")
    return value


def _range_text(minimum, maximum, min_open) -> str:
    if minimum is not None and maximum is not None:
        return f" in {'(' if min_open else '['}{minimum:g}, {maximum:g}]"
    if minimum is not None:
        return f" {'>' if min_open else '>='} {minimum:g}"
    return f" <= {maximum:g}" if maximum is not None else ""


def parse_float_list(text: str, name: str, **bounds) -> list[float]:
    """Comma-separated floats; an empty item (``0.1,,0.2``) is an error, not skipped."""
    items = [item.strip() for item in str(text).split(",")]
    if any(not item for item in items):
        raise ValueError(f"{name} must be comma-separated numbers with no empty item, "
                         f"got {quote(text)}")
    return [parse_float(item, name, **bounds) for item in items]


def parse_int_list(text: str, name: str, minimum: int = 1,
                   maximum: int | None = None) -> list[int]:
    """Comma-separated ints; an empty item is an error, not skipped."""
    items = [item.strip() for item in str(text).split(",")]
    allowed = f">= {minimum}" + ("" if maximum is None else f" and <= {maximum:,}")
    if any(not item for item in items):
        raise ValueError(f"{name} must be comma-separated ints {allowed} with no empty item, "
                         f"got {quote(text)}")
    try:
        return [parse_int(item, name, minimum, maximum) for item in items]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated ints {allowed}, "
                         f"got {quote(text)}") from None


def parse_dtype(text: str, name: str = "--dtype") -> str:
    """A dtype option in any spelling of :mod:`attnlab.dtypes` (``bf16`` or ``bfloat16``),
    as attnlab's short name."""
    return canonical_dtype(text, name)


def parse_window(text: str | None, name: str = "--window") -> tuple[int, int]:
    """``LEFT,RIGHT`` as flash-attn's window_size (-1 = unbounded); None means (-1, -1)."""
    if text is None:
        return (-1, -1)
    parts = str(text).split(",")
    if len(parts) != 2:
        raise ValueError(f"{name} must be LEFT,RIGHT (ints >= -1, -1 = unbounded), "
                         f"got {quote(text)}")
    window = (parse_int(parts[0], f"{name} LEFT", -1, MAX_TOKENS),
              parse_int(parts[1], f"{name} RIGHT", -1, MAX_TOKENS))
    return check_window(window, name=name)


def new_console(width: int = CONSOLE_WIDTH) -> Console:
    """The one console every verb prints through (fixed width when not a terminal)."""
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


def ranges(numbers) -> str:
    """[1, 2, 3, 5] -> '1-3, 5' (empty -> 'none'); a list of ``range`` objects works too."""
    spans = []
    for item in numbers:
        first, last = (item.start, item.stop - 1) if isinstance(item, range) else (item, item)
        if isinstance(item, range) and not len(item):
            continue
        if spans and first == spans[-1][1] + 1:
            spans[-1][1] = last
        else:
            spans.append([first, last])
    if not spans:
        return "none"
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


