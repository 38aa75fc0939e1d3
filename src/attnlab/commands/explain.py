"""`attnlab explain`: write the interactive explainer page (one offline HTML file).

The page's numbers come from attnlab's models and reference and from measured records
(the committed H200 results, or ``--records DIR``); this verb builds them, renders the
page into ``--out`` (:func:`attnlab.commands.cli_support.prepare_out_dir`'s rule) and prints what
it wrote.  It never launches a kernel.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from attnlab.measure.outputs import add_force_argument, prepare_out_dir

DEFAULT_OUT = Path("attnlab-explain")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="write the interactive explainer page (offline HTML)",
        description="Write a self-contained page (index.html) explaining where FlashAttention's "
                    "speed comes from, with every number from attnlab's models and the "
                    "measured records.")
    parser.add_argument("--out", default=str(DEFAULT_OUT),  # a str: Path("") would be "."
                        help=f"output folder (default: ./{DEFAULT_OUT})")
    add_force_argument(parser)
    add_records_argument(parser)
    parser.add_argument("--json", action="store_true",
                        help="print the summary as JSON instead of a table")
    parser.set_defaults(run=run)


def add_records_argument(parser: argparse.ArgumentParser) -> None:
    """``--records DIR``: the measurements to show (explain and demo read it the same way)."""
    parser.add_argument("--records", default=None, metavar="DIR",  # a str: Path("") is "."
                        help="results folder of measured records, *.jsonl, with its ncu/ "
                             "CSVs and kernels.json (default: the committed H200 results "
                             "shipped with attnlab)")


def results_folder(records: str | Path | None) -> Path:
    """``--records`` (must be an existing folder) or the committed H200 results."""
    from attnlab.measure.records import committed_results

    if records is None:
        return committed_results()
    if not str(records).strip():
        raise ValueError("--records must name a results folder, got an empty path")
    records = Path(records)
    if not records.is_dir():
        what = "is not a folder" if records.exists() else "does not exist"
        raise ValueError(f"--records {str(records)!r} {what}: pass a results folder of "
                         f"*.jsonl records (or leave it out for the committed H200 results)")
    return records


def build_and_write(out_dir: Path, results_dir: Path,
                    name: str = "index.html") -> tuple[Path, dict]:
    """Build the page data, write the page into ``out_dir``; returns its path and a summary."""
    from attnlab.explain.data import build_page_data
    from attnlab.explain.page import write_page

    data = build_page_data(results_dir)
    path = write_page(out_dir, data, name)
    return path, summarise(path, data)


def summarise(path: Path, data: dict) -> dict:
    """The headline number of every section, with its scope, for the table and --json."""
    memory = data["memory"]
    preset = next(p for p in memory["presets"] if p["name"] == memory["default_preset"])
    stop = memory["stops"][memory["default_stop"]]
    values = preset["values"][memory["default_stop"]]
    walk = data["online_walk"]
    exercise = data["block_walk"]["exercise"]
    exercise_plan = data["block_walk"]["plans"][
        f"{exercise['block_m']},{exercise['block_n']},{exercise['seqlen']}"]
    exercise_row = exercise_plan["rows"][exercise["query_tile_index"]]
    measured = data["measured"]
    amdahl = data["amdahl"]
    defaults = amdahl["defaults"]
    return {
        "page": str(path),
        "page_bytes": path.stat().st_size,
        "sections": [
            {"section": "1 how", "value": f"{values['s_text']} vs {preset['tile']['text']}",
             "scope": f"{preset['label']}, {stop['label']} tokens: whole S of one layer vs "
                      f"one score tile"},
            {"section": "2 tile walk", "value": f"o = {walk['output_text']}",
             "scope": f"one query, scores {', '.join(walk['score_texts'])}, values "
                      f"{', '.join(walk['value_texts'])}; full-row softmax "
                      f"{walk['full_row_text']}"},
            {"section": "2 causal grid", "value": exercise_row["counts"].split(" (")[0],
             "scope": exercise["button"]},
            {"section": "3 bytes",
             "value": ", ".join(f"{r['text']}{'' if r['valid'] else ' (invalid)'}"
                                for r in data["traffic"]["ratios"]),
             "scope": data["traffic"]["scope_short"]},
            {"section": "4 how much", "value": f"{measured['record_count']} records",
             "scope": measured["summary"]},
            *({"section": f"4 {block['phase']}", "value": "headline", "scope": block["headline"]}
              for block in measured["phases"] if block["headline"]),
            {"section": "5 profiler",
             "value": (f"{len(data['profiler']['kernel_lists'])} kernel lists, "
                       f"{len(data['profiler']['workloads'])} profiled workloads"),
             "scope": "; ".join(data["profiler"]["missing"]) or "Nsight Compute per kernel"},
            {"section": "6 amdahl",
             "value": (f"f = {amdahl['time_share_stops'][defaults['time_share_index']]['label']}, "
                       f"S = {amdahl['kernel_speedup_stops'][defaults['kernel_speedup_index']]['label']}"),
             "scope": "sliders; layer and end-to-end speedup computed in the page"},
        ],
    }


def print_summary(summary: dict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    table = Table(title=f"attnlab explain: {summary['page']} ({summary['page_bytes']:,} bytes)")
    table.add_column("section")
    table.add_column("shows", justify="right")
    table.add_column("scope / source")
    for row in summary["sections"]:
        table.add_row(row["section"], row["value"], row["scope"])
    Console().print(table)
    print("Open it in a browser; it works offline and loads nothing.")


def run(args: argparse.Namespace) -> int:
    results = results_folder(args.records)
    out = prepare_out_dir(args.out, "--out", force=args.force)
    with out as staging:
        path, summary = build_and_write(staging, results)
    summary["page"] = str(out.final(path))
    print_summary(summary, as_json=args.json)
    return 0


def demo(out_dir: Path, records_dir: Path | None = None) -> None:
    """`attnlab demo`: the page, as out_dir/explain.html, from ``records_dir`` (the
    demo's ``--records``) or the committed results."""
    print("\n== explain: the interactive page ==")
    path, summary = build_and_write(out_dir, results_folder(records_dir), "explain.html")
    summary["page"] = path.name  # in the demo's folder (which is still being written)
    print_summary(summary, as_json=False)
