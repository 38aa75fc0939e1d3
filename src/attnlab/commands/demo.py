"""`attnlab demo`: everything attnlab can do, on the lesson's default workload.

Each command module's ``demo(out_dir)`` adds its section (reference trace, models,
report, explainer page, and on a CUDA machine measurements); this verb then leaves what
an engineer looks at first: PNG plots of the records (the fresh ones when the demo
measured, else ``--records`` or the committed H200 results), the records as CSV, and an
``index.html`` linking every file this run wrote, its plots as captioned thumbnails.
Everything is written into a staging folder and moved into ``--out`` when the demo
succeeds (:func:`attnlab.measure.outputs.prepare_out_dir`).  ``--json`` prints one JSON
document instead of the tables.
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
PHASE_NAMES = {"prefill": "prefill forward", "decode": "decode", "fwdbwd": "forward + backward"}
SUFFIX_DESCRIPTIONS = {
    "_latency.png": "latency vs length per provider (p20-p80 bands)",
    "_throughput.png": "throughput against the measured ceiling",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    from attnlab.commands.explain import add_records_argument
    from attnlab.measure.outputs import add_force_argument

    parser = subparsers.add_parser(
        "demo", help="analyse the lesson's default workload end to end",
        description="Run every section (reference trace, tile plan, models, report, page, "
                    "and on a CUDA machine the measurements), then write plots, a CSV of the "
                    "records and an index page to --out.")
    parser.add_argument("--out", default=str(DEFAULT_OUT),  # a str: Path("") would be "."
                        help=f"output folder (default: ./{DEFAULT_OUT})")
    add_force_argument(parser)
    add_records_argument(parser)
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
    from attnlab.commands.explain import results_folder
    from attnlab.measure.outputs import prepare_out_dir

    records_dir = None if args.records is None else results_folder(args.records)
    out = prepare_out_dir(args.out, "--out", force=args.force)
    captured = io.StringIO()
    quiet = contextlib.redirect_stdout(captured) if args.json else contextlib.nullcontext()
    # A failed section leaves nothing behind; success replaces --out whole.
    with quiet, out as staging:
        fresh: list[dict] = []
        for _section, demo_section in DEMO_SECTIONS:
            fresh += demo_section(staging, records_dir) or []
        summary = write_artefacts(staging, fresh, records_dir)
    summary["out"] = str(out.path)
    summary["index"] = str(out.final(summary["index"]))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0


# ----- artefacts ---------------------------------------------------------------------------------
def demo_records(fresh: list[dict], records_dir: Path | None = None) -> tuple[list[dict], str]:
    """The records to plot: this run's measurements when there are any (with the ceilings
    of the results folder, so the roofs are drawn), else the results folder's records
    (``--records``, or the committed H200 results).  Never read from the output folder."""
    from attnlab.measure import plots
    from attnlab.measure.records import committed_results, load_records, source_label

    folder = committed_results() if records_dir is None else Path(records_dir)
    if any(plots.is_latency(r) for r in fresh):
        gpus = {r["gpu"] for r in fresh}
        ceilings = [r for r in load_records(folder)
                    if r["provider"] == plots.CEILING_PROVIDER and r["gpu"] in gpus]
        return fresh + ceilings, f"this run's measurements ({FRESH_RECORDS})"
    return load_records(folder), source_label(folder)


def write_artefacts(out_dir: Path, fresh: list[dict] | None = None,
                    records_dir: Path | None = None) -> dict:
    """Plots, the CSV and the index page in ``out_dir`` (a folder holding only this run's
    files); returns what was written and the key numbers."""
    from attnlab.explain.measured import phase_block
    from attnlab.measure import plots
    from attnlab.measure.records import write_csv

    records, source = demo_records(fresh or [], records_dir)
    plot_dir = out_dir / PLOTS_FOLDER
    written = plots.plot_records(records, plot_dir) if any(plots.is_latency(r)
                                                           for r in records) else []
    captions = {f"{plots.family_slug(f)}_{kind}.png":
                f"{PHASE_NAMES.get(f['phase'], f['phase'])}, {plots.family_title(f)}: {what}"
                for f in plots.workload_families(records)
                for kind, what in (("latency", SUFFIX_DESCRIPTIONS["_latency.png"]),
                                   ("throughput", SUFFIX_DESCRIPTIONS["_throughput.png"]))}
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
    index = write_index(out_dir, source, headlines, captions)
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return {
        "out": str(out_dir),
        "index": str(index),
        "records": {"source": source, "count": len(records),
                    "csv": str(csv_file.relative_to(out_dir))},
        "plots": [str(p.relative_to(out_dir)) for p in written],
        "headlines": headlines,
        "files": [{"path": str(p.relative_to(out_dir)), "bytes": p.stat().st_size,
                   "what": describe(p, captions)} for p in files],
    }


def describe(path: Path, captions: dict[str, str] | None = None) -> str:
    if captions and path.name in captions:
        return captions[path.name]
    if path.name in DESCRIPTIONS:
        return DESCRIPTIONS[path.name]
    for suffix, text in SUFFIX_DESCRIPTIONS.items():
        if path.name.endswith(suffix):
            return f"{text}: {path.name[:-len(suffix)].replace('_', ' ')}"
    if path.parent.name == "report":
        return "the latency-attribution report"
    return ""


def write_index(out_dir: Path, source: str, headlines: dict,
                captions: dict[str, str] | None = None) -> Path:
    """``index.html``: the files this run wrote into ``out_dir`` as a table of links, and
    its plots as a gallery of thumbnails (each a link to the full figure) with captions."""
    index = out_dir / INDEX_NAME
    files = sorted(p for p in out_dir.rglob("*") if p.is_file() and p != index)
    rows, figures = [], []
    for path in files:
        relative = path.relative_to(out_dir).as_posix()
        link = html.escape(relative, quote=True)
        caption = describe(path, captions)
        if path.suffix == ".png":
            figures.append(f"<figure><a href=\"{link}\"><img src=\"{link}\" alt=\""
                           f"{html.escape(caption or relative, quote=True)}\" loading=\"lazy\">"
                           f"</a><figcaption>{html.escape(caption or relative)}<br>"
                           f"<code>{html.escape(relative)}</code></figcaption></figure>")
            continue
        rows.append(f"<tr><td><a href=\"{link}\">{html.escape(relative)}</a></td>"
                    f"<td>{path.stat().st_size:,}</td><td>{html.escape(caption)}</td></tr>")
    findings = "".join(f"<li><strong>{html.escape(phase)}</strong> ({html.escape(h['workload'])}):"
                       f" {html.escape(h['sentence'])}</li>" for phase, h in headlines.items())
    index.write_text(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>attnlab demo</title><link rel=\"icon\" href=\"data:,\"><style>"
        "body{font-family:system-ui,sans-serif;max-width:1200px;margin:24px auto;padding:0 16px;"
        "color:#1d2330}table{border-collapse:collapse}td,th{border-bottom:1px solid #d8dce5;"
        "padding:3px 10px;text-align:left}.gallery{display:grid;gap:14px;"
        "grid-template-columns:repeat(auto-fill,minmax(260px,1fr))}"
        "figure{margin:0;border:1px solid #d8dce5;border-radius:4px;padding:6px}"
        "img{width:100%;height:auto}figcaption{font-size:13px;line-height:1.35}"
        "code{font-size:11px;color:#5b6475}</style></head><body>\n"
        "<h1>attnlab demo</h1>\n"
        f"<p>Records: {html.escape(source)}. Open <a href=\"explain.html\">explain.html</a> for "
        "the interactive page.</p>\n"
        + (f"<h2>Key numbers</h2><ul>{findings}</ul>\n" if findings else "")
        + (f"<h2>Plots ({len(figures)})</h2><p>Click a plot for the full-size figure.</p>\n"
           f"<div class=\"gallery\">{''.join(figures)}</div>\n" if figures else "")
        + "<h2>Files</h2><table><thead><tr><th>file</th><th>bytes</th><th>what</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>\n</body></html>\n", encoding="utf-8")
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
