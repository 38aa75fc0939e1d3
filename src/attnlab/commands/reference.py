"""`attnlab trace`, `attnlab tiles`, `attnlab verify`: the algorithm on the CPU.

The defaults reproduce the lesson: the two-tile online-softmax trace (§3.2), the
causal tile plan of exercise 4, and the check that tiled attention equals direct
masked attention while dropping the mask (but keeping the skip bound) does not.
Tiles, rows and columns are numbered from 1 here, as in the lesson; the library
(:mod:`attnlab.reference`) numbers from 0.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rich.table import Table

from attnlab.checks import quote
from attnlab.commands.cli_support import (
    dumps,
    new_console,
    parse_int,
    parse_length,
    parse_window,
    ranges,
)
from attnlab.report.algorithm import tiles_report, trace_report, verify_report

# The lesson's two-tile trace (§3.2, exercise 2): one query row, d = 2.
LESSON_SCORES = "8,6,10,7"
LESSON_VALUES = "1,2;3,4;5,6;7,8"
LESSON_TILE = "2"

# Exercise 4: N = 4096, B_r = 128, B_c = 64, causal, query tile i = 5.
LESSON_SEQLEN = "4096"
LESSON_BLOCK_M = "128"
LESSON_BLOCK_N = "64"
LESSON_QUERY_TILE = "5"

# `verify`: a small causal case whose query tiles straddle the diagonal (B_r = 2 B_c,
# as in the lesson) and whose last tiles are ragged.
VERIFY_SEQLEN = "22"
VERIFY_HEAD_DIM = "8"
VERIFY_BLOCK_M = "8"
VERIFY_BLOCK_N = "4"


# ----- argument parsing: our own, so that a bad value is one line and exit 2 -----------

def _parse_floats(text: str, name: str) -> list[float]:
    """Comma-separated numbers; -inf is a hidden key's score, NaN is never a number here."""
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise ValueError(f"{name} must be comma-separated numbers with no empty item, "
                         f"got {quote(text)}")
    try:
        values = [float(item) for item in items]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {quote(text)}") from None
    if any(math.isnan(v) for v in values):
        raise ValueError(f"{name} must not contain nan, got {quote(text)}")
    return values


def _parse_values(text: str) -> list[list[float]]:
    """'1,2;3,4' is two rows of width 2; '10,20,30' (no ';') is three rows of width 1."""
    if ";" in text:
        return [_parse_floats(row, "--values") for row in text.split(";")]
    return [[v] for v in _parse_floats(text, "--values")]



# ----- output helpers --------------------------------------------------------------



def _fmt(x: float) -> str:
    return "-inf" if x == -math.inf else f"{x:.4f}"


def _fmt_vector(xs) -> str:
    return "[" + ", ".join(_fmt(x) for x in xs) + "]"



# ----- trace -----------------------------------------------------------------------
def print_trace(report: dict) -> None:
    console = new_console(110)
    console.print(f"Online softmax over one query row, {report['tile']} key(s) per tile; "
                  "l and a are the state after each tile, weights = exp(score - m_new)")
    table = Table()
    for column in ("tile", "scores", "m_old", "m_new", "alpha", "weights", "l", "a"):
        table.add_column(column, justify="right")
    for step in report["steps"]:
        table.add_row(str(step["tile"]), _fmt_vector(step["scores"]), _fmt(step["m_old"]),
                      _fmt(step["m_new"]), _fmt(step["alpha"]), _fmt_vector(step["weights"]),
                      _fmt(step["l"]), _fmt_vector(step["a"]))
    console.print(table)
    full = report["full_row_softmax"]
    console.print(f"O = a / l (one division, after the last tile): {_fmt_vector(report['output'])}")
    console.print(f"full-row softmax check: weights {_fmt_vector(full['weights'])}, "
                  f"O = {_fmt_vector(full['output'])}")
    verdict = "match" if report["matches"] else "MISMATCH"
    console.print(f"max |walk O - full-row O| = {report['max_abs_difference']:.2e} -> {verdict}")


def run_trace(args: argparse.Namespace) -> int:
    if (args.scores is None) != (args.values is None):
        raise ValueError("--scores and --values go together: give both or neither "
                         "(neither = the lesson's two-tile trace)")
    scores = _parse_floats(LESSON_SCORES if args.scores is None else args.scores, "--scores")
    values = _parse_values(LESSON_VALUES if args.values is None else args.values)
    tile = parse_int(args.tile, "--tile", 1)
    report = trace_report(scores, values, tile)
    if args.json:
        print(dumps(report))
    else:
        print_trace(report)
    return 0 if report["matches"] else 1


# ----- tiles -----------------------------------------------------------------------
def print_tiles(report: dict) -> None:
    console = new_console(110)
    shape = report["shape"]
    mask = "causal (bottom-right)" if shape["causal"] else "no causal mask"
    if tuple(shape["window"]) != (-1, -1):
        mask += f", window {tuple(shape['window'])}"
    rows = report["rows"]
    console.print(f"Nq={shape['seqlen_q']}, Nk={shape['seqlen_k']}, B_r={shape['block_m']}, "
                  f"B_c={shape['block_n']}, {mask}. Query tile {report['query_tile']} = rows "
                  f"{rows[0]}-{rows[1]}; tiles, rows and columns numbered from 1. Loaded KV tiles:")
    table = Table()
    for column in ("KV tile", "columns", "class", "query rows by visibility of this tile"):
        table.add_column(column, justify="left")
    half = len(report["loaded_tiles"]) // 2
    for position, tile in enumerate(report["loaded_tiles"]):
        if report["loaded_tiles_omitted"] and position == half:
            table.add_row("...", "", "", f"{report['loaded_tiles_omitted']:,} loaded tiles "
                                         "not shown")
        segments = "; ".join(f"{s['rows'][0]}-{s['rows'][1]} {s['visibility']}"
                             for s in tile["row_segments"])
        cols = tile["columns"]
        table.add_row(str(tile["kv_tile"]), f"{cols[0]}-{cols[1]}", tile["class"], segments)
    console.print(table)
    whole = report["whole_plan"]
    runs = {name: ranges(range(a, b + 1) for a, b in spans)
            for name, spans in report["runs"].items()}
    console.print(f"loads KV tiles {runs['loaded']} "
                  f"({report['loaded_count']:,} of {report['kv_tiles_total']:,}, "
                  f"{report['loaded_kv_rows']:,} key rows, this query tile); "
                  f"element mask on {runs['masked']}; "
                  f"skipped {runs['skipped']}")
    console.print(f"whole plan, one head: {whole['query_tiles']} query tiles x "
                  f"{report['kv_tiles_total']} KV tiles = {whole['tile_pairs']} pairs: "
                  f"{whole['loaded_full']} full, {whole['loaded_masked']} masked, "
                  f"{whole['skipped']} skipped; {whole['visible_score_pairs_per_head']:,} "
                  "visible (query, key) pairs")


def _tiles_shape(args: argparse.Namespace):
    from attnlab.shapes import AttentionShape

    seqlen = parse_length(args.seqlen, "--seqlen")
    seqlen_q = seqlen if args.seqlen_q is None else parse_length(args.seqlen_q, "--seqlen-q")
    seqlen_k = seqlen if args.seqlen_k is None else parse_length(args.seqlen_k, "--seqlen-k")
    return AttentionShape(seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=args.causal,
                          window=parse_window(args.window),
                          block_m=parse_length(args.block_m, "--block-m"),
                          block_n=parse_length(args.block_n, "--block-n"))


def run_tiles(args: argparse.Namespace) -> int:
    shape = _tiles_shape(args)
    report = tiles_report(shape, parse_length(args.query_tile, "--query-tile"))
    if args.json:
        print(dumps(report))
    else:
        print_tiles(report)
    return 0


# ----- verify ----------------------------------------------------------------------
def print_verify(report: dict) -> None:
    console = new_console(110)
    shape = report["shape"]
    console.print(f"Causal attention, Nq={shape['seqlen_q']}, Nk={shape['seqlen_k']}, "
                  f"d={shape['head_dim']}, B_r={shape['block_m']}, B_c={shape['block_n']}; "
                  f"{report['scope']}, seed {report['seed']}; "
                  f"{report['masked_tile_pairs']} tile pairs need the element mask")
    table = Table()
    for column, justify in (("check", "left"), ("max |O - direct O|, all rows", "right"),
                            ("expected", "left"), ("result", "left")):
        table.add_column(column, justify=justify)
    table.add_row("tiled (skip bound + element mask)",
                  f"{report['tiled_vs_direct_max_abs_difference']:.2e}",
                  f"<= {report['equal_tolerance']:.0e}",
                  "equal" if report["tiled_equals_direct"] else "NOT EQUAL")
    table.add_row("tiled, skip bound kept, mask left out",
                  f"{report['no_mask_vs_direct_max_abs_difference']:.2e}",
                  f"> {report['different_threshold']:.0e}",
                  (f"different ({report['no_mask_rows_wrong']} of {shape['seqlen_q']} rows "
                   "see future keys)") if report["no_mask_differs"] else "NOT DIFFERENT")
    console.print(table)
    if report["passed"]:
        console.print("verify: passed - tiling is exact, and the mask (not the skip bound) is "
                      "what keeps rows from attending to the future")
    else:
        console.print("verify: FAILED - see the table; a case with no masked tile cannot show "
                      "the mask's effect")


def run_verify(args: argparse.Namespace) -> int:
    seqlen_q = parse_int(args.seqlen_q, "--seqlen-q", 1)
    seqlen_k = seqlen_q if args.seqlen_k is None else parse_int(args.seqlen_k, "--seqlen-k", 1)
    report = verify_report(seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                           head_dim=parse_int(args.head_dim, "--head-dim", 1),
                           block_m=parse_int(args.block_m, "--block-m", 1),
                           block_n=parse_int(args.block_n, "--block-n", 1),
                           seed=parse_int(args.seed, "--seed", 0, 2**63 - 1))
    if args.json:
        print(dumps(report))
    else:
        print_verify(report)
    return 0 if report["passed"] else 1


# ----- registration and demo -------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser(
        "trace", help="the online-softmax walk for one query row",
        description="Walk one query row's scores tile by tile with FlashAttention-2's online "
                    "softmax (m, alpha, l, a after each tile), then check O = a / l against "
                    "the full-row softmax. With no arguments: the lesson's two-tile trace. "
                    "Negative first numbers need '=': --scores=-1,2.")
    trace.add_argument("--scores", help=f"comma-separated scores, one per key (default "
                                        f"{LESSON_SCORES}; needs --values)")
    trace.add_argument("--values", help="one row per key: '1,2;3,4' (rows split by ';') or "
                                        f"'10,20,30' (width 1) (default '{LESSON_VALUES}')")
    trace.add_argument("--tile", default=LESSON_TILE,
                       help=f"keys per tile, >= 1 (default {LESSON_TILE})")
    trace.add_argument("--json", action="store_true", help="print JSON instead of a table")
    trace.set_defaults(run=run_trace)

    tiles = subparsers.add_parser(
        "tiles", help="which KV tiles one query tile loads, skips or masks",
        description="The tile plan of one query tile (numbered from 1, as the lesson): KV "
                    "tiles loaded whole, loaded with an element mask, and skipped, with the "
                    "rows each loaded tile is visible to. Default: the lesson's exercise 4.")
    tiles.add_argument("--seqlen", default=LESSON_SEQLEN,
                       help=f"query and key length (default {LESSON_SEQLEN})")
    tiles.add_argument("--seqlen-q", help="query length (default --seqlen)")
    tiles.add_argument("--seqlen-k", help="key length (default --seqlen)")
    tiles.add_argument("--block-m", default=LESSON_BLOCK_M,
                       help=f"B_r, query rows per tile (default {LESSON_BLOCK_M})")
    tiles.add_argument("--block-n", default=LESSON_BLOCK_N,
                       help=f"B_c, key rows per tile (default {LESSON_BLOCK_N})")
    tiles.add_argument("--query-tile", default=LESSON_QUERY_TILE,
                       help=f"query tile, from 1 (default {LESSON_QUERY_TILE})")
    tiles.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                       help="bottom-right causal mask (default on)")
    tiles.add_argument("--window", default="-1,-1",
                       help="sliding window LEFT,RIGHT, -1 = unbounded (default -1,-1); "
                            "write --window=-1,8 when LEFT is negative")
    tiles.add_argument("--json", action="store_true", help="print JSON instead of a table")
    tiles.set_defaults(run=run_tiles)

    verify = subparsers.add_parser(
        "verify", help="tiled causal attention == direct masked attention; no mask != it",
        description="On a small causal case with diagonal tiles, check that the tiled "
                    "FlashAttention-2 loop equals direct masked attention, and that leaving "
                    "the element mask out while keeping the skip bound gives a different "
                    "answer. Exit code 0 only if both hold.")
    verify.add_argument("--seqlen-q", default=VERIFY_SEQLEN,
                        help=f"query length (default {VERIFY_SEQLEN})")
    verify.add_argument("--seqlen-k", help="key length (default --seqlen-q)")
    verify.add_argument("--head-dim", default=VERIFY_HEAD_DIM,
                        help=f"head dim (default {VERIFY_HEAD_DIM})")
    verify.add_argument("--block-m", default=VERIFY_BLOCK_M,
                        help=f"B_r (default {VERIFY_BLOCK_M})")
    verify.add_argument("--block-n", default=VERIFY_BLOCK_N,
                        help=f"B_c (default {VERIFY_BLOCK_N})")
    verify.add_argument("--seed", default="0", help="random seed for q, k, v (default 0)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of a table")
    verify.set_defaults(run=run_verify)


def demo(out_dir: Path, records_dir: Path | None = None) -> None:  # no records needed
    """The lesson's two-tile trace and exercise 4's tile plan, printed and saved as JSON."""
    from attnlab.shapes import AttentionShape

    console = new_console(110)
    console.rule("reference: the online-softmax trace (lesson section 3.2)")
    trace = trace_report(_parse_floats(LESSON_SCORES, "scores"), _parse_values(LESSON_VALUES),
                         int(LESSON_TILE))
    print_trace(trace)
    (out_dir / "reference_trace.json").write_text(dumps(trace) + "\n")

    console.rule("reference: the causal tile plan (lesson exercise 4)")
    shape = AttentionShape(seqlen_q=int(LESSON_SEQLEN), seqlen_k=int(LESSON_SEQLEN), causal=True,
                           block_m=int(LESSON_BLOCK_M), block_n=int(LESSON_BLOCK_N))
    tiles = tiles_report(shape, int(LESSON_QUERY_TILE))
    print_tiles(tiles)
    (out_dir / "tile_plan.json").write_text(dumps(tiles) + "\n")
    console.print("wrote reference_trace.json and tile_plan.json")
