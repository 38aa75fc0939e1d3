"""The tile plan under its historical name: :mod:`attnlab.masking` is where it lives.

``attnlab.reference`` re-exports these names (``tile_plan``, ``KeyBand``...), and
code written against ``attnlab.reference.tiles`` keeps working; new code imports
:mod:`attnlab.masking`, the one torch-free definition of visibility.
"""

from attnlab.masking import (
    ALL_VISIBLE,
    FULL,
    MASKED,
    NONE_VISIBLE,
    PARTLY_VISIBLE,
    SKIPPED,
    TILE_CLASSES,
    KeyBand,
    QueryTilePlan,
    RowSegment,
    TilePlan,
    classify_tile,
    tile_plan,
    visible_band,
)

__all__ = [
    "ALL_VISIBLE",
    "FULL",
    "MASKED",
    "NONE_VISIBLE",
    "PARTLY_VISIBLE",
    "SKIPPED",
    "TILE_CLASSES",
    "KeyBand",
    "QueryTilePlan",
    "RowSegment",
    "TilePlan",
    "classify_tile",
    "tile_plan",
    "visible_band",
]
