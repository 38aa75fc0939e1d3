"""The reference's reports: the dicts `attnlab trace | tiles | verify` print.

``trace`` walks one row's online softmax (:mod:`attnlab.reference.walk`), ``tiles``
reads :mod:`attnlab.masking`'s tile plan (bounded output for any length), and
``verify`` runs the float64 reference on a small causal case, refusing sizes past
``MAX_VERIFY_ELEMENTS`` before it allocates anything.  Numbering is 1-based, as in
the lesson; the library numbers from 0.
"""

from __future__ import annotations

# `verify`: tiled == direct within rounding; a dropped mask moves outputs by O(1).
EQUAL_TOLERANCE = 1e-10  # float64: tiled and direct differ by rounding only (~1e-16)
DIFFERENT_THRESHOLD = 1e-6  # a dropped mask moves outputs by O(1) on random inputs
# verify's float64 tensors (S and P of one head, q, k, v): 2^24 elements = 128 MiB each.
MAX_VERIFY_ELEMENTS = 2**24
# `tiles`: per-tile rows printed at most, and the longest tile list written out.
TILES_TABLE_ROWS = 16
LIST_LIMIT = 4096


def trace_report(scores: list[float], values: list[list[float]], tile: int) -> dict:
    from attnlab.reference.walk import online_softmax_walk

    walk = online_softmax_walk(scores, values, tile)
    return {
        "scope": "one query row",
        "scores": scores,
        "values": values,
        "tile": tile,
        "steps": [
            {"tile": step.tile + 1, "scores": list(step.scores), "m_old": step.m_old,
             "m_new": step.m_new, "alpha": step.alpha, "weights": list(step.weights),
             "l": step.l, "a": list(step.a)}
            for step in walk.steps
        ],
        "output": list(walk.output),
        "full_row_softmax": {"weights": list(walk.softmax_weights),
                             "output": list(walk.softmax_output)},
        "max_abs_difference": walk.max_abs_difference,
        "matches": walk.matches(),
    }


def tiles_report(shape, query_tile: int, *, table_rows: int = TILES_TABLE_ROWS) -> dict:
    """The plan of one query tile (``query_tile`` 1-based) plus whole-plan totals.

    Bounded whatever the shape: the loaded tiles are listed as 1-based runs, and the
    per-tile rows (``loaded_tiles``) are the first and last ``table_rows / 2`` loaded
    tiles when there are more (``loaded_tiles_omitted`` says how many were left out).
    The lists ``loaded``/``full``/``masked``/``skipped`` hold every tile up to
    ``LIST_LIMIT`` entries, else None (the runs say the same).
    """
    from attnlab.masking import FULL, MASKED, SKIPPED, tile_plan

    plan = tile_plan(shape)
    query_tiles = plan.query_tile_count
    if not 1 <= query_tile <= query_tiles:
        raise ValueError(f"--query-tile must be in 1..{query_tiles} for this shape, "
                         f"got {query_tile}")
    index = query_tile - 1
    tile = plan.query_tile(index)
    loaded = tile.loaded_range
    if len(loaded) > table_rows:
        half = table_rows // 2
        shown = [*loaded[:half], *loaded[-half:]]
    else:
        shown = list(loaded)
    kv_tiles = []
    for j in shown:
        cols = plan.key_rows(j)
        kv_tiles.append({
            "kv_tile": j + 1,
            "columns": [cols.start + 1, cols.stop],
            "class": tile.tile_class(j),
            "row_segments": [
                {"rows": [seg.first_row + 1, seg.last_row + 1], "visibility": seg.visibility}
                for seg in plan.row_segments(index, j)
            ],
        })

    def one_based(runs) -> list[list[int]]:
        return [[run.start + 1, run.stop] for run in runs if len(run)]

    def listed(runs) -> list[int] | None:
        total = sum(len(run) for run in runs)
        return [j + 1 for run in runs for j in run] if total <= LIST_LIMIT else None

    runs = {"loaded": (tile.loaded_range,), "full": (tile.full_range,),
            "masked": tile.masked_ranges, "skipped": tile.skipped_ranges}
    return {
        "numbering": "1-based (tiles, rows, columns), as the lesson",
        "shape": shape.as_dict(),
        "query_tile": query_tile,
        "rows": [tile.rows.start + 1, tile.rows.stop],
        "kv_tiles_total": plan.kv_tiles,
        **{name: listed(r) for name, r in runs.items()},
        "runs": {name: one_based(r) for name, r in runs.items()},
        "loaded_count": len(loaded),
        "loaded_kv_rows": plan.loaded_kv_rows(index),
        "loaded_tiles": kv_tiles,
        "loaded_tiles_omitted": len(loaded) - len(shown),
        "whole_plan": {
            "query_tiles": query_tiles,
            "tile_pairs": query_tiles * plan.kv_tiles,
            "loaded_full": plan.count(FULL),
            "loaded_masked": plan.count(MASKED),
            "skipped": plan.count(SKIPPED),
            "visible_score_pairs_per_head": plan.visible_pairs(),
        },
    }


def verify_report(seqlen_q: int, seqlen_k: int, head_dim: int, block_m: int, block_n: int,
                  seed: int) -> dict:
    import torch

    from attnlab.masking import MASKED, tile_plan
    from attnlab.reference import naive, tiled
    from attnlab.shapes import AttentionShape

    shape = AttentionShape(seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim,
                           dtype="fp64", causal=True, block_m=block_m, block_n=block_n)
    elements = seqlen_q * seqlen_k + (seqlen_q + 2 * seqlen_k) * head_dim
    if elements > MAX_VERIFY_ELEMENTS:
        raise ValueError(f"verify materialises the {seqlen_q:,} x {seqlen_k:,} score matrix "
                         f"and q, k, v in float64: {elements:,} elements, more than its bound "
                         f"of {MAX_VERIFY_ELEMENTS:,} ({MAX_VERIFY_ELEMENTS * 8 // 2**20} MiB); "
                         f"use shorter --seqlen-q/--seqlen-k or --head-dim")
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, n, head_dim, generator=generator, dtype=torch.float64)
               for n in (seqlen_q, seqlen_k, seqlen_k))
    direct = naive(q, k, v, causal=True)
    with_mask, _ = tiled(q, k, v, causal=True, block_m=block_m, block_n=block_n)
    without_mask, _ = tiled(q, k, v, causal=True, block_m=block_m, block_n=block_n,
                            apply_element_mask=False)
    masked_difference = (with_mask - direct).abs().amax(dim=-1)[0, 0]  # per query row
    unmasked_difference = (without_mask - direct).abs().amax(dim=-1)[0, 0]
    tiled_equals_direct = bool(masked_difference.max() <= EQUAL_TOLERANCE)
    unmasked_differs = bool(unmasked_difference.max() > DIFFERENT_THRESHOLD)
    plan = tile_plan(shape)
    return {
        "scope": "one head, float64, random normal q, k, v",
        "shape": shape.as_dict(),
        "seed": seed,
        "masked_tile_pairs": plan.count(MASKED),
        "tiled_vs_direct_max_abs_difference": float(masked_difference.max()),
        "tiled_equals_direct": tiled_equals_direct,
        "equal_tolerance": EQUAL_TOLERANCE,
        "no_mask_vs_direct_max_abs_difference": float(unmasked_difference.max()),
        "no_mask_rows_wrong": int((unmasked_difference > DIFFERENT_THRESHOLD).sum()),
        "no_mask_differs": unmasked_differs,
        "different_threshold": DIFFERENT_THRESHOLD,
        "passed": tiled_equals_direct and unmasked_differs,
    }
