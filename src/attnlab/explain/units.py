"""How the page prints numbers: binary byte units, ratios, token counts (from ``attnlab.shapes``).

The models return exact integers; these helpers only decide how to show them, so
the page and the tests agree on one string for every value.
"""

from __future__ import annotations

import math

# Token counts are written where plots (measure/, below this room) can reach them too.
from attnlab.shapes import format_tokens as format_tokens  # re-exported for the page

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _check_bytes(num_bytes: int) -> int:
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"num_bytes must be an int >= 0, got {num_bytes!r}")
    return num_bytes


def format_bytes(num_bytes: int, decimals: int | None = None) -> str:
    """``402653184`` -> ``"384 MiB"``; ``decimals=2`` -> ``"384.00 MiB"``.

    The unit is the largest binary unit the value reaches.  With ``decimals=None`` a
    value that is a whole number of that unit prints without decimals and any other
    value with two, so an exact power-of-two size never looks approximate.
    """
    _check_bytes(num_bytes)
    unit = 0
    while unit + 1 < len(_BINARY_UNITS) and num_bytes >= 1024 ** (unit + 1):
        unit += 1
    if unit == 0:
        return f"{num_bytes} B"
    value = num_bytes / 1024 ** unit
    if decimals is None:
        whole = num_bytes % 1024 ** unit == 0
        return f"{value:.0f} {_BINARY_UNITS[unit]}" if whole else f"{value:.2f} {_BINARY_UNITS[unit]}"
    return f"{value:.{decimals}f} {_BINARY_UNITS[unit]}"


def format_exact_bytes(num_bytes: int) -> str:
    """``402653184`` -> ``"402,653,184 bytes"``."""
    return f"{_check_bytes(num_bytes):,} bytes"


def format_mib(num_bytes: int) -> str:
    """Always in MiB with two decimals, as the lesson's traffic table: ``"132.00 MiB"``."""
    return f"{_check_bytes(num_bytes) / 1024 ** 2:,.2f} MiB"


def format_ratio(value: float, decimals: int = 2) -> str:
    """``2.0`` -> ``"2.00×"``."""
    if not math.isfinite(value):
        raise ValueError(f"value must be finite, got {value!r}")
    return f"{value:,.{decimals}f}\u00d7"


def format_percent(fraction: float, decimals: int = 2) -> str:
    """``0.0325`` -> ``"3.25%"``."""
    if not math.isfinite(fraction):
        raise ValueError(f"fraction must be finite, got {fraction!r}")
    return f"{fraction * 100:.{decimals}f}%"


def format_number(value: float, decimals: int = 4) -> str:
    """A walk state value: whole numbers bare (``"3"``), others to ``decimals`` places,
    and -inf as ``"−∞"`` (the running max before any score arrived)."""
    if value == -math.inf:
        return "\u2212\u221e"
    if not math.isfinite(value):
        raise ValueError(f"value must be finite or -inf, got {value!r}")
    if float(value).is_integer():
        return f"{int(value)}"
    return f"{value:.{decimals}f}"


def format_index_ranges(indices: list[int] | tuple[int, ...], *, base: int = 1) -> str:
    """0-based ``[0, 1, 2, 4]`` -> ``"1–3, 5"`` (1-based by default, as the lesson counts)."""
    if not indices:
        return "none"
    ordered = sorted(indices)
    parts = []
    start = previous = ordered[0]
    for index in ordered[1:] + [None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        if start == previous:
            parts.append(f"{start + base}")
        elif previous == start + 1:
            parts.append(f"{start + base}, {previous + base}")
        else:
            parts.append(f"{start + base}\u2013{previous + base}")
        if index is not None:
            start = previous = index
    return ", ".join(parts)


def format_ms(milliseconds: float) -> str:
    """Three significant digits, as the post quotes times: ``0.35007`` -> ``"0.350 ms"``,
    ``2.8115`` -> ``"2.81 ms"``, ``1005.1`` -> ``"1,005 ms"``."""
    if not math.isfinite(milliseconds) or milliseconds < 0:
        raise ValueError(f"milliseconds must be finite and >= 0, got {milliseconds!r}")
    if milliseconds >= 100:
        return f"{milliseconds:,.0f} ms"
    return f"{milliseconds:#.3g} ms"


def format_us(microseconds: float) -> str:
    """Kernel times: ``9.38`` -> ``"9.4 µs"`` below 100 µs, milliseconds above."""
    if not math.isfinite(microseconds) or microseconds < 0:
        raise ValueError(f"microseconds must be finite and >= 0, got {microseconds!r}")
    if microseconds < 100:
        return f"{microseconds:.1f} \u00b5s"
    return format_ms(microseconds / 1e3)
