"""`attnlab demo`: everything attnlab can do, on the lesson's default workload.

Each command module's ``demo(out_dir)`` adds its section (reference trace, models,
report, explainer page, and on a CUDA machine measurements); this verb then leaves what
an engineer looks at first: PNG plots of the records (the fresh ones when the demo
measured, else the committed H200 results), the records as CSV, and an ``index.html``
linking every file it wrote.  ``--json`` prints one JSON document instead of the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import io
import json
import shutil
from pathlib import Path

DEFAULT_OUT = Path("attnlab-demo")
PLOTS_FOLDER = "plots"
CSV_NAME = "records.csv"
INDEX_NAME = "index.html"
# The file the measure section writes when it ran on a GPU.
FRESH_RECORDS = "measure.jsonl"
# Tables are never wider than this, even on a wide terminal (they stay readable).
MAX_TABLE_WIDTH = 110
# What each file the demo leaves is, for the index page (by name, then by suffix).
DESCRIPTIONS = {
    INDEX_NAME: "this page",
    "explain.html": "the interactive explainer page (offline)",
    CSV_NAME: "every record used for the plots, one row each (pandas, spreadsheets)",
    FRESH_RECORDS: "records measured by this demo run (JSON lines)",
    "reference_trace.json": "the online-softmax trace of the lesson's two tiles",
    "tile_plan.json": "exercise 4's causal tile plan",
    "models-traffic.json": "logical HBM bytes per kernel",
    "models-memory.json": "memory footprints by scope",
    "models-amdahl.json": "Amdahl sensitivity and the FLOP-share trap",
    "forward_tflops.png": "prefill TFLOP/s of up to four workloads against the matrix roof",
}
SUFFIX_DESCRIPTIONS = {
    "_latency.png": "latency vs length per provider (p20-p80 bands)",
    "_throughput.png": "throughput against the measured ceiling",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="analyse the lesson's default workload end to end",
        description="Run every section (reference trace, tile plan, models, report, page, "
                    "and on a CUDA machine the measurements), then write plots, a CSV of the "
                    "records and an index page to --out.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default: ./{DEFAULT_OUT})")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document describing what was written")
    parser.set_defaults(run=run)


def table_width() -> int:
    """The terminal's width (80 when it cannot tell), capped at MAX_TABLE_WIDTH."""
    return min(shutil.get_terminal_size((80, 24)).columns, MAX_TABLE_WIDTH)


def _console():
    from rich.console import Console

    return Console(width=table_width(), highlight=False)


def run(args: argparse.Namespace) -> int:
    from attnlab.commands import DEMO_SECTIONS
    from attnlab.commands.cli_support import prepare_out_dir

    out_dir: Path = prepare_out_dir(args.out, "--out")
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured) if args.json else contextlib.nullcontext():
        for _section, demo_section in DEMO_SECTIONS:
            demo_section(out_dir)
        summary = write_artefacts(out_dir)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0


# ----- artefacts ---------------------------------------------------------------------------------
def demo_records(out_dir: Path) -> tuple[list[dict], str]:
    """The records to plot: this run's measurements when there are any (with the committed
    ceilings, so the roofs are drawn), else the committed H200 results."""
    from attnlab.measure import plots
    from attnlab.measure.records import committed_results, load_records

    committed = committed_results()
    fresh = out_dir / FRESH_RECORDS
    if fresh.is_file():
        records = load_records(fresh)
        if any(plots.is_latency(r) for r in records):
            gpus = {r["gpu"] for r in records}
            ceilings = [r for r in load_records(committed)
                        if r["provider"] == plots.CEILING_PROVIDER and r["gpu"] in gpus]
            return records + ceilings, str(fresh)
    return load_records(committed), str(committed)


def write_artefacts(out_dir: Path) -> dict:
    """Plots, the CSV and the index page; returns what was written and the key numbers."""
    from attnlab.explain.measured import phase_block
    from attnlab.measure import plots
    from attnlab.measure.records import write_csv

    records, source = demo_records(out_dir)
    plot_dir = out_dir / PLOTS_FOLDER
    written = plots.plot_records(records, plot_dir) if any(plots.is_latency(r)
                                                           for r in records) else []
    # No prefill sweep with two lengths means nothing for the grid to show.
    with contextlib.suppress(ValueError):
        written.append(plots.plot_tflops_grid(records, plot_dir / "forward_tflops.png"))
    csv_file = write_csv(records, out_dir / CSV_NAME)
    colours = plots.provider_colours({r["provider"] for r in records})
    headlines = {}
    for phase in sorted({r["phase"] for r in records if plots.is_latency(r)}):
        block = phase_block(records, phase, colours)
        if block["headline"]:
            headlines[phase] = {"workload": block["charts"][0]["title"],
                                "sentence": block["headline"]}
    index = write_index(out_dir, source, headlines)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {
        "out": str(out_dir.resolve()),
        "index": str(index),
        "records": {"source": source, "count": len(records), "csv": str(csv_file)},
        "plots": [str(p) for p in written],
        "headlines": headlines,
        "files": [{"path": str(p.relative_to(out_dir)), "bytes": p.stat().st_size,
                   "what": describe(p)} for p in files],
    }


def describe(path: Path) -> str:
    if path.name in DESCRIPTIONS:
        return DESCRIPTIONS[path.name]
    for suffix, text in SUFFIX_DESCRIPTIONS.items():
        if path.name.endswith(suffix):
            return f"{text}: {path.name[:-len(suffix)].replace('_', ' ')}"
    if path.parent.name == "report":
        return "the latency-attribution report"
    return ""


def write_index(out_dir: Path, source: str, headlines: dict) -> Path:
    """``index.html``: every file under ``out_dir`` as a link, the plots inline."""
    index = out_dir / INDEX_NAME
    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p != index)
    rows, images = [], []
    for path in files:
        relative = path.relative_to(out_dir).as_posix()
        link = html.escape(relative, quote=True)
        rows.append(f"<tr><td><a href=\"{link}\">{html.escape(relative)}</a></td>"
                    f"<td>{path.stat().st_size:,}</td><td>{html.escape(describe(path))}</td></tr>")
        if path.suffix == ".png":
            images.append(f"<figure><a href=\"{link}\"><img src=\"{link}\" alt=\""
                          f"{html.escape(describe(path) or relative, quote=True)}\" width=\"960\">"
                          f"</a><figcaption>{html.escape(relative)}</figcaption></figure>")
    findings = "".join(f"<li><strong>{html.escape(phase)}</strong> ({html.escape(h['workload'])}):"
                       f" {html.escape(h['sentence'])}</li>" for phase, h in headlines.items())
    index.write_text(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>attnlab demo</title><link rel=\"icon\" href=\"data:,\"><style>"
        "body{font-family:system-ui,sans-serif;max-width:1000px;margin:24px auto;padding:0 16px;"
        "color:#1d2330}table{border-collapse:collapse}td,th{border-bottom:1px solid #d8dce5;"
        "padding:3px 10px;text-align:left}img{max-width:100%;height:auto}"
        "figure{margin:18px 0}</style></head><body>\n"
        "<h1>attnlab demo</h1>\n"
        f"<p>Records: {html.escape(source)}. Open <a href=\"explain.html\">explain.html</a> for "
        "the interactive page.</p>\n"
        + (f"<h2>Key numbers</h2><ul>{findings}</ul>\n" if findings else "")
        + "<h2>Files</h2><table><thead><tr><th>file</th><th>bytes</th><th>what</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>\n<h2>Plots</h2>\n{''.join(images)}\n"
        "</body></html>\n", encoding="utf-8")
    return index


def print_summary(summary: dict) -> None:
    from rich.table import Table

    console = _console()
    console.rule("demo: plots, CSV and index")
    console.print(f"records: {summary['records']['source']} ({summary['records']['count']})")
    for phase, headline in summary["headlines"].items():
        console.print(f"[bold]{phase}[/bold] ({headline['workload']}): {headline['sentence']}")
    table = Table(title=f"written to {summary['out']}", expand=False)
    table.add_column("file", overflow="fold")
    table.add_column("bytes", justify="right")
    table.add_column("what", overflow="fold")
    for entry in summary["files"]:
        table.add_row(entry["path"], f"{entry['bytes']:,}", entry["what"])
    console.print(table)
    console.print(f"attnlab demo: open {summary['index']}")
