"""Which K/V tiles each query tile loads, skips, or has to mask element by element.

Pure Python (no torch): the plan is integer bookkeeping, so the exact models can
use the same definition of visibility as the reference and the kernels.

Visibility is a band around the diagonal.  With ``offset = seqlen_k - seqlen_q``
(flash-attn's bottom-right alignment), query row i sees key j iff ``0 <= j < seqlen_k``
and ``lowest <= j - i <= highest`` where

* ``highest = offset + right`` (``offset`` when causal: causal means right = 0),
  unbounded when right = -1 and not causal;
* ``lowest = offset - left``, unbounded when left = -1.

Because a tile is a rectangle of rows x columns, ``j - i`` over the tile takes every
integer between ``first_col - last_row`` and ``last_col - first_row``; comparing those
two numbers with the band classifies the whole tile without looking at its elements.
All indices here are 0-based; the CLI adds one when it speaks the lesson's language.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.shapes import AttentionShape

SKIPPED = "skipped"  # no visible element: the skip bound drops it, never loaded
FULL = "full"  # every element visible: loaded, no element mask
MASKED = "masked"  # some visible, some not: loaded, element mask before max and sum
TILE_CLASSES = (SKIPPED, FULL, MASKED)

# How much of a KV tile one query row sees (used to describe row segments).
ALL_VISIBLE = "all visible"
PARTLY_VISIBLE = "partly visible"
NONE_VISIBLE = "none visible"


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
        last = self.seqlen_k - 1 if self.highest is None else min(self.seqlen_k - 1, row + self.highest)
        return first, last


def visible_band(seqlen_q: int, seqlen_k: int, *, causal: bool = False,
                 window: tuple[int, int] = (-1, -1)) -> KeyBand:
    """The one definition of which keys a query row may see (flash-attn's semantics)."""
    left, right = window
    if causal:
        right = 0  # flash-attn: causal with a window is the window with right = 0
    offset = seqlen_k - seqlen_q  # bottom-right alignment of the last query with the last key
    return KeyBand(
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        lowest=None if left < 0 else offset - left,
        highest=None if right < 0 else offset + right,
    )


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


@dataclass(frozen=True)
class RowSegment:
    """Consecutive query rows that see the same share of one KV tile."""

    first_row: int
    last_row: int  # inclusive
    visibility: str  # ALL_VISIBLE, PARTLY_VISIBLE or NONE_VISIBLE


@dataclass(frozen=True)
class QueryTilePlan:
    """The KV tiles one query tile meets, each in exactly one of loaded/skipped."""

    query_tile: int
    rows: range  # real query rows of this tile (the last tile may be ragged)
    tile_classes: tuple[str, ...]  # one class per KV tile, in KV-tile order

    @property
    def loaded(self) -> tuple[int, ...]:
        return tuple(j for j, c in enumerate(self.tile_classes) if c != SKIPPED)

    @property
    def skipped(self) -> tuple[int, ...]:
        return tuple(j for j, c in enumerate(self.tile_classes) if c == SKIPPED)

    @property
    def masked(self) -> tuple[int, ...]:
        """Loaded tiles that need the element mask (a subset of ``loaded``)."""
        return tuple(j for j, c in enumerate(self.tile_classes) if c == MASKED)

    @property
    def full(self) -> tuple[int, ...]:
        """Loaded tiles every row of which sees every column: no mask needed."""
        return tuple(j for j, c in enumerate(self.tile_classes) if c == FULL)


@dataclass(frozen=True)
class TilePlan:
    """Per query tile (0-based), the class of every KV tile, for one shape."""

    shape: AttentionShape
    band: KeyBand
    query_tiles: tuple[QueryTilePlan, ...]

    @property
    def kv_tiles(self) -> int:
        return self.shape.kv_tiles

    def query_tile(self, query_tile: int) -> QueryTilePlan:
        self._check_query_tile(query_tile)
        return self.query_tiles[query_tile]

    def query_rows(self, query_tile: int) -> range:
        return self.query_tile(query_tile).rows

    def key_rows(self, kv_tile: int) -> range:
        """Real key rows of KV tile ``kv_tile`` (the last tile may be ragged)."""
        if isinstance(kv_tile, bool) or not isinstance(kv_tile, int) or not 0 <= kv_tile < self.kv_tiles:
            raise ValueError(f"kv_tile must be an int in [0, {self.kv_tiles}), got {kv_tile!r}")
        start = kv_tile * self.shape.block_n
        return range(start, min(start + self.shape.block_n, self.shape.seqlen_k))

    def tile_class(self, query_tile: int, kv_tile: int) -> str:
        self.key_rows(kv_tile)  # validates kv_tile
        return self.query_tile(query_tile).tile_classes[kv_tile]

    def loaded_kv_rows(self, query_tile: int) -> int:
        """Key rows query tile ``query_tile`` actually loads (ragged last tile: real rows)."""
        return sum(len(self.key_rows(j)) for j in self.query_tile(query_tile).loaded)

    def row_segments(self, query_tile: int, kv_tile: int) -> tuple[RowSegment, ...]:
        """The rows of a query tile grouped by how much of one KV tile they see."""
        cols = self.key_rows(kv_tile)
        segments: list[RowSegment] = []
        for row in self.query_rows(query_tile):
            first, last = self.band.visible_key_range(row)
            first, last = max(first, cols.start), min(last, cols.stop - 1)
            if first > last:
                visibility = NONE_VISIBLE
            elif first == cols.start and last == cols.stop - 1:
                visibility = ALL_VISIBLE
            else:
                visibility = PARTLY_VISIBLE
            if segments and segments[-1].visibility == visibility:
                segments[-1] = RowSegment(segments[-1].first_row, row, visibility)
            else:
                segments.append(RowSegment(row, row, visibility))
        return tuple(segments)

    # ----- whole-plan totals -------------------------------------------------
    def count(self, tile_class: str) -> int:
        """Number of (query tile, KV tile) pairs of one class over the whole plan."""
        if tile_class not in TILE_CLASSES:
            raise ValueError(f"tile_class must be one of {TILE_CLASSES}, got {tile_class!r}")
        return sum(q.tile_classes.count(tile_class) for q in self.query_tiles)

    def visible_pairs(self) -> int:
        """Exact number of (query row, key row) pairs the mask lets through, one head."""
        total = 0
        for row in range(self.shape.seqlen_q):
            first, last = self.band.visible_key_range(row)
            total += max(0, last - first + 1)
        return total

    def _check_query_tile(self, query_tile: int) -> None:
        count = len(self.query_tiles)
        if isinstance(query_tile, bool) or not isinstance(query_tile, int) or not 0 <= query_tile < count:
            raise ValueError(f"query_tile must be an int in [0, {count}), got {query_tile!r}")


def tile_plan(shape: AttentionShape) -> TilePlan:
    """Classify every (query tile, KV tile) pair of ``shape`` as skipped, full or masked."""
    if not isinstance(shape, AttentionShape):
        raise TypeError(f"shape must be an AttentionShape, got {type(shape).__name__}")
    band = visible_band(shape.seqlen_q, shape.seqlen_k, causal=shape.causal, window=shape.window)
    kv_cols = [range(j * shape.block_n, min((j + 1) * shape.block_n, shape.seqlen_k))
               for j in range(shape.kv_tiles)]
    query_plans = []
    for i in range(shape.query_tiles):
        rows = range(i * shape.block_m, min((i + 1) * shape.block_m, shape.seqlen_q))
        classes = tuple(classify_tile(band, rows, cols) for cols in kv_cols)
        query_plans.append(QueryTilePlan(query_tile=i, rows=rows, tile_classes=classes))
    return TilePlan(shape=shape, band=band, query_tiles=tuple(query_plans))
