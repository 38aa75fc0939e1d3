"""Which (query, key) pairs a mask lets through, counted exactly and in O(1) per query tile.

Conventions (flash-attn's, see AttentionShape): causal and the sliding window are
aligned bottom-right, so query row ``r`` (0-based) sees key ``c`` iff
``r + offset - left <= c <= r + offset + right`` with ``offset = seqlen_k - seqlen_q``;
an unbounded side is -1, and causal caps ``right`` at 0.

Both bounds grow by exactly one per row, so the keys seen by a run of consecutive
rows form one contiguous interval: a query tile's key range is fixed by its first
and last row.  That is what makes every count below exact without visiting rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.shapes import AttentionShape


def check_shape(shape: object, name: str = "shape") -> AttentionShape:
    if not isinstance(shape, AttentionShape):
        raise TypeError(f"{name} must be an attnlab.AttentionShape, got {type(shape).__name__}")
    return shape


def _band(shape: AttentionShape) -> tuple[int | None, int | None]:
    """(left, right) reach of the band around the aligned diagonal; None = unbounded."""
    left, right = shape.window
    left_reach = None if left < 0 else left
    right_reach = None if right < 0 else right
    if shape.causal:
        right_reach = 0 if right_reach is None else min(right_reach, 0)
    return left_reach, right_reach


def key_interval(shape: AttentionShape, row: int) -> tuple[int, int]:
    """Keys ``[first, stop)`` that query ``row`` sees, clipped to the sequence (may be empty)."""
    offset = shape.seqlen_k - shape.seqlen_q
    left, right = _band(shape)
    first = 0 if left is None else max(0, row + offset - left)
    stop = shape.seqlen_k if right is None else min(shape.seqlen_k, row + offset + right + 1)
    return first, max(first, stop)


def keys_seen(shape: AttentionShape, row: int) -> int:
    first, stop = key_interval(shape, row)
    return stop - first


def rows_key_interval(shape: AttentionShape, row_start: int, row_stop: int) -> tuple[int, int]:
    """Keys ``[first, stop)`` seen by at least one of rows ``[row_start, row_stop)``.

    Exact because consecutive rows' intervals (before clipping) overlap or touch.
    """
    if row_stop <= row_start:
        return 0, 0
    offset = shape.seqlen_k - shape.seqlen_q
    left, right = _band(shape)
    first = 0 if left is None else max(0, row_start + offset - left)
    stop = shape.seqlen_k if right is None else min(shape.seqlen_k, row_stop - 1 + offset + right + 1)
    if stop <= first:
        return 0, 0
    return first, stop


def visible_pairs(shape: AttentionShape) -> int:
    """Number of (query, key) pairs the mask permits, for one (batch, head).

    Summed piecewise: between the rows where a bound starts or stops being clipped the
    per-row count is linear, so each piece is an arithmetic series.
    """
    check_shape(shape)
    n_q, n_k = shape.seqlen_q, shape.seqlen_k
    offset = n_k - n_q
    left, right = _band(shape)
    cuts = {0, n_q}
    if left is not None:
        cuts.add(left - offset)           # lower bound reaches 0
        cuts.add(left - offset + n_k)     # lower bound passes the last key
    if right is not None:
        cuts.add(n_k - 1 - offset - right)  # upper bound reaches the last key
        cuts.add(-offset - right)           # upper bound reaches key 0
    points = sorted(c for c in cuts if 0 <= c <= n_q)
    total = 0
    for start, stop in zip(points[:-1], points[1:], strict=True):
        if stop <= start:
            continue
        # keys_seen is linear on [start, stop - 1] (clamp to 0 included: the zero
        # region starts and ends at a cut), so the sum is (first + last) * count / 2.
        first_count, last_count = keys_seen(shape, start), keys_seen(shape, stop - 1)
        total += (first_count + last_count) * (stop - start) // 2
    return total


@dataclass(frozen=True)
class QueryTile:
    """What one query tile of a fused forward kernel touches (0-based indices)."""

    index: int
    rows: int            # query rows actually present (the last tile may be ragged)
    kv_first: int        # first KV tile loaded
    kv_stop: int         # one past the last KV tile loaded (kv_first == kv_stop: none)
    kv_rows_loaded: int  # key rows in the loaded tiles, ragged last tile by its real rows
    masked_tiles: tuple[int, ...]  # loaded tiles where some (row, key) pair is masked out

    @property
    def kv_tiles_loaded(self) -> int:
        return self.kv_stop - self.kv_first

    @property
    def loaded(self) -> tuple[int, ...]:
        return tuple(range(self.kv_first, self.kv_stop))


def _masked_tiles(shape: AttentionShape, row_start: int, row_stop: int,
                  kv_first: int, kv_stop: int) -> tuple[int, ...]:
    """Loaded tiles in which some (row, key) pair of the tile is masked out.

    The band's lower edge is highest on the last row and its upper edge lowest on the
    first row, so a tile is fully visible iff it lies inside [lower edge of the last
    row, upper edge of the first row]; only tiles crossing either edge need a mask.
    """
    first_row_keys = key_interval(shape, row_start)
    last_row_keys = key_interval(shape, row_stop - 1)
    if first_row_keys[0] == first_row_keys[1] or last_row_keys[0] == last_row_keys[1]:
        return tuple(range(kv_first, kv_stop))  # some row sees no key: every tile masks it
    lower_edge, upper_edge = last_row_keys[0], first_row_keys[1]
    masked = set(range(kv_first, min(kv_stop, -(-lower_edge // shape.block_n))))
    if upper_edge < shape.seqlen_k:
        masked.update(range(max(kv_first, upper_edge // shape.block_n), kv_stop))
    return tuple(sorted(masked))


def query_tile(shape: AttentionShape, index: int) -> QueryTile:
    """The KV tiles query tile ``index`` loads: every tile holding a key some row sees."""
    check_shape(shape)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < shape.query_tiles:
        raise ValueError(f"index must be an int in [0, {shape.query_tiles - 1}], got {index!r}")
    row_start = index * shape.block_m
    row_stop = min(shape.seqlen_q, row_start + shape.block_m)
    first_key, stop_key = rows_key_interval(shape, row_start, row_stop)
    if stop_key <= first_key:
        return QueryTile(index, row_stop - row_start, 0, 0, 0, ())
    kv_first = first_key // shape.block_n
    kv_stop = -(-stop_key // shape.block_n)
    kv_rows = min(shape.seqlen_k, kv_stop * shape.block_n) - kv_first * shape.block_n
    masked = _masked_tiles(shape, row_start, row_stop, kv_first, kv_stop)
    return QueryTile(index, row_stop - row_start, kv_first, kv_stop, kv_rows, masked)


def query_tiles(shape: AttentionShape) -> list[QueryTile]:
    return [query_tile(shape, i) for i in range(shape.query_tiles)]
