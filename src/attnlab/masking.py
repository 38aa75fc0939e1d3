"""Which keys a query sees, which tiles a query tile loads, how the keys split: one definition.

Pure Python (no torch): the reference, the exact models, the cache model, the
providers and the kernels' launchers all take visibility from here, so they cannot
disagree.  All indices are 0-based.

**The band.**  With ``offset = seqlen_k - seqlen_q`` (flash-attn's bottom-right
alignment), query row i sees key j iff ``0 <= j < seqlen_k`` and
``lowest <= j - i <= highest`` where

* ``highest = offset + right``, unbounded when right = -1; causal means right = 0
  (flash-attn: causal with a window is that window with right = 0);
* ``lowest = offset - left``, unbounded when left = -1.

The causal clamp is derived here, in :func:`visible_band`, and nowhere else.

**Tiles.**  A tile is a rectangle of rows x columns, so ``j - i`` over it takes every
integer between ``first_col - last_row`` and ``last_col - first_row``; comparing
those two numbers with the band classifies the whole tile (skipped, full, masked)
without looking at its elements.  Along the KV tiles of one query tile both numbers
grow, so the loaded tiles and the full tiles are each one contiguous run: a query
tile's plan is four integers, and whole-plan totals are sums of floor-linear
functions of the query-tile index, summed in closed form.  Every answer here costs
time bounded independently of the sequence lengths (2^40 tokens answer at once).

**Splits.**  Flash-Decoding gives each of ``num_splits`` splits
``ceil(kv_tiles / num_splits)`` consecutive KV tiles; trailing splits may be empty
(flash-attn's rule, used by the reference's ``split_kv``, the decode kernel and the
traffic model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from attnlab.checks import check_instance, check_int
from attnlab.shapes import AttentionShape

SKIPPED = "skipped"  # no visible element: the skip bound drops it, never loaded
FULL = "full"  # every element visible: loaded, no element mask
MASKED = "masked"  # some visible, some not: loaded, element mask before max and sum
TILE_CLASSES = (SKIPPED, FULL, MASKED)

# How much of a KV tile one query row sees (used to describe row segments).
ALL_VISIBLE = "all visible"
PARTLY_VISIBLE = "partly visible"
NONE_VISIBLE = "none visible"

# Flash-Decoding splits a model or API call may ask for (flash-attn caps itself at 128).
MAX_SPLITS = 4096


# ----- the band --------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyBand:
    """The visible diagonal band: key j is visible to query i iff lowest <= j - i <= highest.

    ``None`` means unbounded on that side.  Keys outside ``[0, seqlen_k)`` never exist.
    """

    seqlen_q: int
    seqlen_k: int
    lowest: int | None
    highest: int | None

    def visible_key_range(self, row: int) -> tuple[int, int]:
        """Inclusive (first, last) visible key of query ``row``; first > last when none."""
        first = 0 if self.lowest is None else max(0, row + self.lowest)
        last = self.seqlen_k - 1 if self.highest is None else min(self.seqlen_k - 1,
                                                                  row + self.highest)
        return first, last

    def key_interval(self, row: int) -> tuple[int, int]:
        """Keys ``[first, stop)`` query ``row`` sees (``first == stop`` when none)."""
        first, last = self.visible_key_range(row)
        return first, max(first, last + 1)

    def keys_seen(self, row: int) -> int:
        first, stop = self.key_interval(row)
        return stop - first

    def rows_key_interval(self, row_start: int, row_stop: int) -> tuple[int, int]:
        """Keys ``[first, stop)`` seen by at least one of rows ``[row_start, row_stop)``.

        Exact because consecutive rows' intervals (before clipping) overlap or touch;
        ``(0, 0)`` when no row sees a key.
        """
        if row_stop <= row_start:
            return 0, 0
        first = 0 if self.lowest is None else max(0, row_start + self.lowest)
        stop = self.seqlen_k if self.highest is None else min(self.seqlen_k,
                                                              row_stop - 1 + self.highest + 1)
        return (first, stop) if first < stop else (0, 0)

    def visible_pairs(self) -> int:
        """Exact number of (query row, key) pairs the band lets through, one head.

        Between the rows where a bound starts or stops being clipped the per-row count
        is linear, so each piece is an arithmetic series.
        """
        n_q, n_k = self.seqlen_q, self.seqlen_k
        cuts = {0, n_q}
        if self.lowest is not None:
            cuts.update((-self.lowest, n_k - self.lowest))      # lower bound reaches 0 / passes the end
        if self.highest is not None:
            cuts.update((n_k - 1 - self.highest, -self.highest))  # upper bound reaches the end / key 0
        points = sorted(c for c in cuts if 0 <= c <= n_q)
        total = 0
        for start, stop in zip(points[:-1], points[1:], strict=True):
            if stop > start:
                # keys_seen is linear on [start, stop - 1] (the zero region starts and
                # ends at a cut), so the sum is (first + last) * count / 2.
                total += (self.keys_seen(start) + self.keys_seen(stop - 1)) * (stop - start) // 2
        return total


def effective_window(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """(left, right) window sizes after the causal clamp (-1 = unbounded): flash-attn's
    causal with a window is that window with right = 0.  The kernels' launchers and
    :func:`visible_band` take the clamp from here."""
    left, right = window
    return (left, 0) if causal else (left, right)


def reach_window(window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """The same band with each bounded side cut to ``seqlen_q + seqlen_k``: a side that
    long already reaches every key, so (2**70, 0) sees what (seqlen_q + seqlen_k, 0)
    sees, and the cut keeps the kernels' and the reference's integer arithmetic small
    (a window past 2**63 was an OverflowError).  -1 (unbounded) stays -1."""
    reach = seqlen_q + seqlen_k
    return tuple(side if side < reach else reach for side in window)


def visible_band(seqlen_q: int, seqlen_k: int, *, causal: bool = False,
                 window: tuple[int, int] = (-1, -1)) -> KeyBand:
    """The one definition of which keys a query row may see (flash-attn's semantics)."""
    left, right = reach_window(effective_window(causal, window), seqlen_q, seqlen_k)
    offset = seqlen_k - seqlen_q  # bottom-right alignment of the last query with the last key
    return KeyBand(
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        lowest=None if left < 0 else offset - left,
        highest=None if right < 0 else offset + right,
    )


def shape_band(shape: AttentionShape) -> KeyBand:
    """The band of an :class:`AttentionShape` (its lengths, causal flag and window)."""
    check_instance("shape", shape, AttentionShape)
    return visible_band(shape.seqlen_q, shape.seqlen_k, causal=shape.causal, window=shape.window)


def visible_pairs(shape: AttentionShape) -> int:
    """Number of (query, key) pairs the mask permits, for one (batch, head)."""
    return shape_band(shape).visible_pairs()


def classify_tile(band: KeyBand, rows: range, cols: range) -> str:
    """SKIPPED, FULL or MASKED for the tile ``rows x cols`` (real rows only, never padding)."""
    smallest_diagonal = cols.start - (rows.stop - 1)
    largest_diagonal = (cols.stop - 1) - rows.start
    below = band.lowest is not None and largest_diagonal < band.lowest
    above = band.highest is not None and smallest_diagonal > band.highest
    if below or above:
        return SKIPPED
    inside_low = band.lowest is None or smallest_diagonal >= band.lowest
    inside_high = band.highest is None or largest_diagonal <= band.highest
    return FULL if inside_low and inside_high else MASKED


# ----- one query tile ---------------------------------------------------------------------
@dataclass(frozen=True)
class QueryTilePlan:
    """The KV tiles one query tile meets: a run of loaded tiles, inside it a run of full ones.

    Tiles ``[kv_first, kv_stop)`` are loaded; of those, ``[full_first, full_stop)`` need no
    element mask (an empty run has ``full_first == full_stop``); the rest of the loaded
    ones are masked, and every other tile is skipped.
    """

    query_tile: int
    rows: range  # real query rows of this tile (the last tile may be ragged)
    kv_tiles: int
    kv_first: int
    kv_stop: int
    full_first: int
    full_stop: int

    @property
    def kv_tiles_loaded(self) -> int:
        return self.kv_stop - self.kv_first

    @property
    def full_tiles(self) -> int:
        return self.full_stop - self.full_first

    @property
    def masked_tiles(self) -> int:
        return self.kv_tiles_loaded - self.full_tiles

    def tile_class(self, kv_tile: int) -> str:
        if self.full_first <= kv_tile < self.full_stop:
            return FULL
        if self.kv_first <= kv_tile < self.kv_stop:
            return MASKED
        return SKIPPED

    @property
    def tile_classes(self) -> Sequence[str]:
        """One class per KV tile, in KV-tile order (computed on access, never stored)."""
        return _LazySequence(self.kv_tiles, self.tile_class)

    @property
    def loaded_range(self) -> range:
        return range(self.kv_first, self.kv_stop)

    @property
    def full_range(self) -> range:
        return range(self.full_first, self.full_stop)

    @property
    def masked_ranges(self) -> tuple[range, ...]:
        """The masked tiles as at most two runs: before and after the full run."""
        if self.full_first == self.full_stop:
            runs = (range(self.kv_first, self.kv_stop),)
        else:
            runs = (range(self.kv_first, self.full_first), range(self.full_stop, self.kv_stop))
        return tuple(run for run in runs if len(run))

    @property
    def skipped_ranges(self) -> tuple[range, ...]:
        runs = (range(0, self.kv_first), range(self.kv_stop, self.kv_tiles))
        return tuple(run for run in runs if len(run))

    # Tuples of tile indices: fine for the lesson's sizes; use the ranges for huge ones.
    @property
    def loaded(self) -> tuple[int, ...]:
        return tuple(self.loaded_range)

    @property
    def full(self) -> tuple[int, ...]:
        """Loaded tiles every row of which sees every column: no mask needed."""
        return tuple(self.full_range)

    @property
    def masked(self) -> tuple[int, ...]:
        """Loaded tiles that need the element mask (a subset of ``loaded``)."""
        return tuple(j for run in self.masked_ranges for j in run)

    @property
    def skipped(self) -> tuple[int, ...]:
        return tuple(j for run in self.skipped_ranges for j in run)


class _LazySequence(Sequence):
    """A read-only sequence whose items are computed on access (plans of 2^40 tokens)."""

    def __init__(self, length: int, item: Callable[[int], object]) -> None:
        self._length, self._item = length, item

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(self._length))]
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range [0, {self._length})")
        return self._item(index)

    def __iter__(self) -> Iterator:
        return (self._item(i) for i in range(self._length))

    def count(self, value) -> int:
        """Occurrences of ``value`` (walks the sequence: use TilePlan.count for totals)."""
        return sum(1 for item in self if item == value)


@dataclass(frozen=True)
class RowSegment:
    """Consecutive query rows that see the same share of one KV tile."""

    first_row: int
    last_row: int  # inclusive
    visibility: str  # ALL_VISIBLE, PARTLY_VISIBLE or NONE_VISIBLE


# ----- the plan of a whole shape ----------------------------------------------------------------
@dataclass(frozen=True)
class TilePlan:
    """Per query tile (0-based), the class of every KV tile, for one shape (one head)."""

    shape: AttentionShape
    band: KeyBand

    @property
    def kv_tiles(self) -> int:
        return self.shape.kv_tiles

    @property
    def query_tile_count(self) -> int:
        return self.shape.query_tiles

    @property
    def query_tiles(self) -> Sequence[QueryTilePlan]:
        """Every query tile's plan, computed on access."""
        return _LazySequence(self.shape.query_tiles, self._plan_of)

    def query_tile(self, query_tile: int) -> QueryTilePlan:
        check_int("query_tile", query_tile, minimum=0, maximum=self.shape.query_tiles - 1)
        return self._plan_of(query_tile)

    def query_rows(self, query_tile: int) -> range:
        return self.query_tile(query_tile).rows

    def key_rows(self, kv_tile: int) -> range:
        """Real key rows of KV tile ``kv_tile`` (the last tile may be ragged)."""
        check_int("kv_tile", kv_tile, minimum=0, maximum=self.kv_tiles - 1)
        start = kv_tile * self.shape.block_n
        return range(start, min(start + self.shape.block_n, self.shape.seqlen_k))

    def tile_class(self, query_tile: int, kv_tile: int) -> str:
        self.key_rows(kv_tile)  # validates kv_tile
        return self.query_tile(query_tile).tile_class(kv_tile)

    def loaded_kv_rows(self, query_tile: int) -> int:
        """Key rows query tile ``query_tile`` actually loads (ragged last tile: real rows)."""
        plan = self.query_tile(query_tile)
        return self._kv_rows(plan.kv_first, plan.kv_stop)

    def row_segments(self, query_tile: int, kv_tile: int) -> tuple[RowSegment, ...]:
        """The rows of a query tile grouped by how much of one KV tile they see.

        At most five segments, found from the rows where a band edge crosses the
        tile's first or last column (no row-by-row walk).
        """
        cols = self.key_rows(kv_tile)
        rows = self.query_rows(query_tile)
        first_col, last_col = cols.start, cols.stop - 1
        band = self.band
        cuts = {rows.start, rows.stop}
        for edge in (band.lowest, band.highest):
            if edge is not None:
                # rows where r + edge crosses first_col or last_col
                cuts.update((first_col - edge, first_col - edge + 1,
                             last_col - edge, last_col - edge + 1))
        starts = sorted(c for c in cuts if rows.start <= c < rows.stop)
        segments: list[RowSegment] = []
        for index, start in enumerate(starts):
            stop = starts[index + 1] if index + 1 < len(starts) else rows.stop
            first, last = band.visible_key_range(start)
            first, last = max(first, first_col), min(last, last_col)
            if first > last:
                visibility = NONE_VISIBLE
            elif first == first_col and last == last_col:
                visibility = ALL_VISIBLE
            else:
                visibility = PARTLY_VISIBLE
            if segments and segments[-1].visibility == visibility:
                segments[-1] = RowSegment(segments[-1].first_row, stop - 1, visibility)
            else:
                segments.append(RowSegment(start, stop - 1, visibility))
        return tuple(segments)

    # ----- whole-plan totals (closed form) ------------------------------------------------
    def count(self, tile_class: str) -> int:
        """Number of (query tile, KV tile) pairs of one class over the whole plan."""
        if tile_class not in TILE_CLASSES:
            raise ValueError(f"tile_class must be one of {TILE_CLASSES}, got {tile_class!r}")
        loaded = self.tiles_loaded()
        if tile_class == SKIPPED:
            return self.shape.query_tiles * self.kv_tiles - loaded
        full = self._sums(self._bound("full_stop"), self._bound("full_first"))[0]
        return full if tile_class == FULL else loaded - full

    def tiles_loaded(self) -> int:
        """(query tile, KV tile) pairs loaded over the whole plan."""
        return self._sums(self._bound("kv_stop"), self._bound("kv_first"))[0]

    def kv_rows_loaded(self, first_tile: int = 0, stop_tile: int | None = None) -> int:
        """Key rows loaded, summed over every query tile (one head), of the KV tiles
        ``[first_tile, stop_tile)`` (default: all): K (or V) traffic in rows."""
        stop_tile = self.kv_tiles if stop_tile is None else stop_tile
        if stop_tile <= first_tile:
            return 0
        upper, lower = self._split_bounds(first_tile, stop_tile)
        tiles = self._sums(upper, lower)[0]
        ragged = self.kv_tiles * self.shape.block_n - self.shape.seqlen_k
        if not ragged or stop_tile < self.kv_tiles:
            return tiles * self.shape.block_n
        # Every loaded tile holds block_n rows except the ragged last one.
        with_last = self._sums(upper, lower.at_least(self.kv_tiles - 1))[1]
        return tiles * self.shape.block_n - ragged * with_last

    def query_tiles_loading(self, first_tile: int = 0, stop_tile: int | None = None) -> int:
        """Query tiles that load at least one KV tile of ``[first_tile, stop_tile)``."""
        stop_tile = self.kv_tiles if stop_tile is None else stop_tile
        if stop_tile <= first_tile:
            return 0
        return self._sums(*self._split_bounds(first_tile, stop_tile))[1]

    def query_rows_loading(self, first_tile: int = 0, stop_tile: int | None = None) -> int:
        """Real query rows of the query tiles that load a KV tile of ``[first_tile, stop_tile)``."""
        stop_tile = self.kv_tiles if stop_tile is None else stop_tile
        if stop_tile <= first_tile:
            return 0
        upper, lower = self._split_bounds(first_tile, stop_tile)
        tiles = self._sums(upper, lower)[1]
        last = self.shape.query_tiles - 1
        short = self.shape.query_tiles * self.shape.block_m - self.shape.seqlen_q
        return tiles * self.shape.block_m - (short if upper.value(last) > lower.value(last) else 0)

    def query_rows_times_tiles(self) -> int:
        """Sum over query tiles of (real rows x KV tiles loaded): the Q rows a KV-outer
        pass reads (each KV tile reads the rows of every query tile that loads it)."""
        upper, lower = self._bound("kv_stop"), self._bound("kv_first")
        tiles = self._sums(upper, lower)[0]
        last = self.shape.query_tiles - 1
        short = self.shape.query_tiles * self.shape.block_m - self.shape.seqlen_q
        return tiles * self.shape.block_m - short * max(0, upper.value(last) - lower.value(last))

    def visible_pairs(self) -> int:
        """Exact number of (query row, key row) pairs the mask lets through, one head."""
        return self.band.visible_pairs()

    # ----- the four integers of a query tile ------------------------------------------------
    def _plan_of(self, query_tile: int) -> QueryTilePlan:
        first_row = query_tile * self.shape.block_m
        last_row = min(first_row + self.shape.block_m, self.shape.seqlen_q) - 1
        kv_first, kv_stop = self._bound("kv_first").value(query_tile), \
            self._bound("kv_stop").value(query_tile)
        if kv_stop <= kv_first:
            kv_first = kv_stop = 0
        full_first = max(self._bound("full_first").value(query_tile), kv_first)
        full_stop = min(self._bound("full_stop").value(query_tile), kv_stop)
        if full_stop <= full_first:
            full_first = full_stop = kv_first
        return QueryTilePlan(query_tile, range(first_row, last_row + 1), self.kv_tiles,
                             kv_first, kv_stop, full_first, full_stop)

    def _bound(self, which: str) -> _TileBound:
        """One of the four integers of query tile i, as a function of i.

        * ``kv_first``: tiles whose last key is below the band for the first row;
        * ``kv_stop``: tiles whose first key is at or below the band's top for the last row;
        * ``full_first``: tiles whose first key is below the band for the last row;
        * ``full_stop``: tiles whose last key is inside the band's top for the first row.
        """
        s, band = self.shape, self.band
        first_row_key, last_row_key = 0, s.block_m - 1  # + block_m * i
        unbounded = {"kv_first": 0, "full_first": 0, "kv_stop": self.kv_tiles,
                     "full_stop": self.kv_tiles}
        edge = band.lowest if which in ("kv_first", "full_first") else band.highest
        if edge is None:
            return _TileBound.constant(unbounded[which], s)
        if which == "kv_first":
            return _TileBound.tiles_ending_by(first_row_key + edge - 1, s, last_row=False)
        if which == "kv_stop":
            return _TileBound.tiles_starting_by(last_row_key + edge, s, last_row=True)
        if which == "full_first":
            return _TileBound.tiles_starting_by(last_row_key + edge - 1, s, last_row=True)
        return _TileBound.tiles_ending_by(first_row_key + edge, s, last_row=False)

    def _split_bounds(self, first_tile: int, stop_tile: int) -> tuple[_TileBound, _TileBound]:
        return (self._bound("kv_stop").at_most(stop_tile),
                self._bound("kv_first").at_least(first_tile))

    def _kv_rows(self, kv_first: int, kv_stop: int) -> int:
        if kv_stop <= kv_first:
            return 0
        return min(self.shape.seqlen_k, kv_stop * self.shape.block_n) - kv_first * self.shape.block_n

    def _sums(self, upper: _TileBound, lower: _TileBound) -> tuple[int, int]:
        """(sum of max(0, upper - lower), count where upper > lower) over every query tile."""
        return _positive_sums(upper, lower, self.shape.query_tiles)


def tile_plan(shape: AttentionShape) -> TilePlan:
    """Classify every (query tile, KV tile) pair of ``shape`` as skipped, full or masked."""
    return TilePlan(shape=shape, band=shape_band(shape))


# ----- closed-form sums over the query-tile index ----------------------------------------------
@dataclass(frozen=True)
class _TileBound:
    """A count of KV tiles as a function of the query-tile index i:

    ``clamp(floor((block_m * i + key0 + shift) / block_n) + plus, low, high)`` while
    ``block_m * i + key0 < jump_key``, and ``jump_value`` from there on.  ``key0`` is the
    band edge's key for row ``block_m * i`` of the tile (first or last row).  The
    ragged last query tile has a shorter last row: :meth:`value` evaluates it exactly.
    """

    shape: AttentionShape
    key0: int
    shift: int
    plus: int
    low: int
    high: int
    jump_key: int | None = None
    jump_value: int | None = None
    uses_last_row: bool = False

    @classmethod
    def constant(cls, value: int, shape: AttentionShape) -> _TileBound:
        return cls(shape, 0, 0, 0, value, value)

    @classmethod
    def tiles_starting_by(cls, key0: int, shape: AttentionShape, *,
                          last_row: bool) -> _TileBound:
        """KV tiles whose first key is <= key (a prefix): clamp(key // block_n + 1, 0, kv_tiles)."""
        return cls(shape, key0, 0, 1, 0, shape.kv_tiles, uses_last_row=last_row)

    @classmethod
    def tiles_ending_by(cls, key0: int, shape: AttentionShape, *, last_row: bool) -> _TileBound:
        """KV tiles whose last real key is <= key (a prefix; the last tile may be ragged)."""
        return cls(shape, key0, 1, 0, 0, shape.kv_tiles - 1, shape.seqlen_k - 1, shape.kv_tiles,
                   uses_last_row=last_row)

    def key(self, i: int) -> int:
        key = self.shape.block_m * i + self.key0
        if self.uses_last_row and i == self.shape.query_tiles - 1:
            key -= self.shape.query_tiles * self.shape.block_m - self.shape.seqlen_q
        return key

    def value(self, i: int) -> int:
        if self.low == self.high and self.jump_key is None:
            return self.low
        key = self.key(i)
        if self.jump_key is not None and key >= self.jump_key:
            return self.jump_value
        return min(max((key + self.shift) // self.shape.block_n + self.plus, self.low), self.high)

    def linear_sum(self, first: int, stop: int) -> int:
        """sum of the unclamped floor-linear form over i in [first, stop) (full tiles only)."""
        count = stop - first
        return (_floor_sum(count, self.shape.block_n, self.shape.block_m,
                           self.shape.block_m * first + self.key0 + self.shift)
                + self.plus * count)

    def sum(self, first: int, stop: int) -> int:
        """sum of value(i) over [first, stop), on a piece where it is constant or unclamped."""
        if stop <= first:
            return 0
        if self.value(first) == self.value(stop - 1):
            return self.value(first) * (stop - first)
        return self.linear_sum(first, stop)

    def at_most(self, cap: int) -> _TileBound:
        return dataclasses.replace(
            self, low=min(self.low, cap), high=min(self.high, cap),
            jump_value=None if self.jump_value is None else min(self.jump_value, cap))

    def at_least(self, floor: int) -> _TileBound:
        return dataclasses.replace(
            self, low=max(self.low, floor), high=max(self.high, floor),
            jump_value=None if self.jump_value is None else max(self.jump_value, floor))


def _first_where(predicate: Callable[[int], bool], low: int, high: int) -> int:
    """Smallest i in [low, high) with predicate(i), for a predicate false-then-true; else high."""
    while low < high:
        middle = (low + high) // 2
        if predicate(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum_{i=0}^{n-1} floor((a*i + b) / m) for integers a, b and m > 0 (the classic algorithm)."""
    total = 0
    if n <= 0:
        return 0
    quotient, a = divmod(a, m)
    total += quotient * n * (n - 1) // 2
    quotient, b = divmod(b, m)
    total += quotient * n
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def _pieces(bounds: Sequence[_TileBound], end: int) -> list[tuple[int, int]]:
    """Split [0, end) into pieces on which every bound is constant or unclamped linear.

    A bound is nondecreasing in i and leaves its starting value once and reaches its
    final value once; between those two points it is strictly inside its clamps, i.e.
    floor-linear.  Both points are found by bisection: O(log end) evaluations.
    """
    cuts = {0, end}
    for bound in bounds:
        start_value, end_value = bound.value(0), bound.value(end - 1)
        if start_value != end_value:
            cuts.add(_first_where(lambda i, b=bound, v=start_value: b.value(i) > v, 0, end))
            cuts.add(_first_where(lambda i, b=bound, v=end_value: b.value(i) >= v, 0, end))
    points = sorted(cuts)
    return [(a, b) for a, b in zip(points[:-1], points[1:], strict=True) if b > a]


def _positive_sums(upper: _TileBound, lower: _TileBound, count: int) -> tuple[int, int]:
    """(sum of max(0, upper(i) - lower(i)), #{i: upper(i) > lower(i)}) over i in [0, count)."""
    if count <= 64:  # small plans: count directly (also the oracle of the closed form's tests)
        differences = [upper.value(i) - lower.value(i) for i in range(count)]
        return sum(d for d in differences if d > 0), sum(1 for d in differences if d > 0)
    last = count - 1  # the ragged last query tile, evaluated exactly
    tail = upper.value(last) - lower.value(last)
    total, positives = max(0, tail), int(tail > 0)
    for first, stop in _pieces((upper, lower), last):
        piece_sum, piece_count = _piece_positive_sums(upper, lower, first, stop)
        total += piece_sum
        positives += piece_count
    return total, positives


def _piece_positive_sums(upper: _TileBound, lower: _TileBound, first: int,
                         stop: int) -> tuple[int, int]:
    """:func:`_positive_sums` on one piece: each side constant or floor-linear (same slope)."""
    def difference(i: int) -> int:
        return upper.value(i) - lower.value(i)

    upper_moves = upper.value(first) != upper.value(stop - 1)
    lower_moves = lower.value(first) != lower.value(stop - 1)
    if upper_moves == lower_moves:
        # Both constant, or both floor((block_m i + c) / block_n) + d with the same slope:
        # the difference then takes one or two adjacent values, {K, K + 1}.
        count = stop - first
        total = upper.sum(first, stop) - lower.sum(first, stop)
        level = total // count  # K (or K + 1 when every value is K + 1)
        if level >= 1:
            return total, count
        if level == 0:
            return total, total  # values in {0, 1}: the ones are the positives
        return 0, 0  # values in {K, K + 1} <= 0
    # One side moves: the difference is monotone, positive on a prefix or a suffix.
    if upper_moves:  # increasing: positive on a suffix
        start, end = _first_where(lambda i: difference(i) > 0, first, stop), stop
    else:  # decreasing: positive on a prefix
        start, end = first, _first_where(lambda i: difference(i) <= 0, first, stop)
    if end <= start:
        return 0, 0
    return upper.sum(start, end) - lower.sum(start, end), end - start


# ----- Flash-Decoding split plans ----------------------------------------------------------------
def split_plan(kv_tiles: int, num_splits: int) -> tuple[range, ...]:
    """KV tiles of each split: ``ceil(kv_tiles / num_splits)`` consecutive tiles each,
    trailing splits empty when there are more splits than that covers (flash-attn's rule)."""
    kv_tiles = check_int("kv_tiles", kv_tiles, minimum=0)
    num_splits = check_int("num_splits", num_splits, minimum=1, maximum=MAX_SPLITS)
    tiles_per_split = -(-kv_tiles // num_splits)
    splits = []
    for split in range(num_splits):
        first = min(split * tiles_per_split, kv_tiles)
        splits.append(range(first, min(first + tiles_per_split, kv_tiles)))
    return tuple(splits)
