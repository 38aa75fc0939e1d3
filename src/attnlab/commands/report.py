"""`attnlab report`: a one-page latency attribution report (the lesson's exit task).

Inputs: a workload FILE (YAML/JSON, schema in docs/report.md) or the built-in
Document QA trace; ``--trace`` splits the proposal's segment by a torch.profiler
Chrome trace; ``--records`` takes the kernel speedup from bench records;
``--measure`` (CUDA) profiles a real prefill and checks the projection against it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from attnlab.commands.cli_support import new_console
from attnlab.measure.outputs import add_force_argument, prepare_out_dir

DEMO_FOLDER = "report"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="latency attribution: Amdahl's law across measurement boundaries",
        description="Attribute one request's client TTFT to its serial segments and project a "
                    "proposed kernel speedup through Amdahl's law inside its boundary and at "
                    "the client; print the tables, and with --out DIR also write the "
                    "one-page report (HTML, Markdown, JSON). With no FILE: the lesson's "
                    "Document QA trace.")
    parser.add_argument("file", nargs="?", type=Path, metavar="FILE",
                        help="workload file, YAML or JSON (schema: docs/report.md)")
    parser.add_argument("--trace", type=Path, metavar="CHROME_TRACE",
                        help="torch.profiler Chrome trace of the prefill: its attention time "
                             "share splits the proposal's segment")
    parser.add_argument("--records", type=Path, metavar="PATH",
                        help="bench/results JSONL file or folder: the kernel speedup measured "
                             "for the workload's shape")
    parser.add_argument("--kernel-speedup", type=float, metavar="S",
                        help="kernel speedup to project instead of the file's")
    parser.add_argument("--out", metavar="DIR",
                        help="also write report.html, report.md, report.json, waterfall.svg "
                             "and workload.yaml into this folder (without it nothing is "
                             "written)")
    add_force_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--measure", action="store_true",
                        help="CUDA only: profile a small random-weight decoder's prefill, "
                             "project the speedup of attnlab's kernel, then measure it")
    parser.set_defaults(run=run)


def build(args: argparse.Namespace, trace_dir: Path | None = None) -> dict:
    """The report dict for the parsed arguments (no printing)."""
    from attnlab.report.assemble import assemble_report

    return assemble_report(args.file, trace_file=args.trace, records_path=args.records,
                           kernel_speedup=args.kernel_speedup, measure=args.measure,
                           trace_dir=trace_dir)


def run(args: argparse.Namespace) -> int:
    from attnlab.report.render import render_json, write_report

    # Checked before any work: '' or a file is refused, a user's folder is not written into.
    out = None if args.out is None else prepare_out_dir(args.out, "--out", force=args.force)
    with out if out is not None else contextlib.nullcontext() as staging:
        report = build(args, trace_dir=staging)
        paths = {} if staging is None else write_report(report, staging)
    for warning in report["warnings"]:
        print(f"attnlab report: warning: {warning}", file=sys.stderr)
    if args.json:
        sys.stdout.write(render_json(report))
    else:
        print_summary(report)
        if paths:
            print(f"\nwritten: {', '.join(str(out.final(p)) for p in paths.values())}")
    return 0


def print_summary(report: dict) -> None:
    """The report's numbers as readable tables on stdout."""
    from rich.table import Table

    from attnlab.report.render import ms, narrative, pct, speedup, times

    console = new_console(100)
    console.print(f"[bold]{report['title']}[/bold]  (input: {report['origin']})")
    segments = Table(title="Trace timings (this trace, serial critical path)", title_justify="left")
    for column, justify in (("segment", "left"), ("source", "left"), ("ms", "right"),
                            ("share of TTFT", "right"), ("parts", "left")):
        segments.add_column(column, justify=justify)
    for s in report["segments"]:
        parts = ", ".join(f"{p['name']} {ms(p['ms'])} ({pct(p['share_of_segment'])})"
                          for p in s["parts"])
        segments.add_row(s["name"], s["source"] or "not stated", ms(s["ms"]),
                         pct(s["share_of_ttft"]), parts)
    segments.add_row("[bold]client TTFT[/bold]", "sum of segments",
                     f"[bold]{ms(report['ttft']['segments_sum_ms'])}[/bold]", "100.0%", "")
    console.print(segments)

    seg, cli = report["segment_boundary"], report["client_boundary"]
    proposal = report["proposal"]
    amdahl = Table(title=f"Amdahl's law: S_kernel = {speedup(proposal['kernel_speedup'])} on "
                         f"{proposal['affected']}", title_justify="left")
    for column in ("boundary", "time share f", "before", "after", "speedup", "reduction"):
        amdahl.add_column(column, justify="left" if column == "boundary" else "right")
    amdahl.add_row(f"{seg['name']} (inside)", f"{seg['time_share']:.4f}", ms(seg["before_ms"]),
                   ms(seg["after_ms"]), times(seg["speedup"]), pct(seg["reduction"], 2))
    amdahl.add_row("client TTFT (this trace)", f"{cli['time_share']:.4f}", ms(cli["before_ms"]),
                   ms(cli["after_ms"]), times(cli["speedup"]), pct(cli["reduction"], 2))
    console.print(amdahl)

    text = narrative(report)
    console.print("[bold]Observations[/bold]")
    for line in text["observations"]:
        console.print(f"  - {line}")
    console.print("[bold]Boundary errors[/bold]")
    for item in text["errors"]:
        console.print(f"  - {item['title']}: {item['text']}")
    if text["measurement"]:
        console.print("[bold]Predicted vs measured[/bold]")
        for line in text["measurement"]:
            console.print(f"  - {line}")


def demo(out_dir: Path, records_dir: Path | None = None) -> None:  # no records needed
    """The lesson's Document QA report, written to out_dir/report/."""
    from attnlab.report.attribution import build_report
    from attnlab.report.render import ms, pct, times, write_report
    from attnlab.report.workload import default_workload

    report = build_report(default_workload())
    paths = write_report(report, out_dir / DEMO_FOLDER)
    seg, cli = report["segment_boundary"], report["client_boundary"]
    wrong = report["boundary_errors"]["kernel_speedup_on_ttft"]["wrong_ttft_ms"]
    flop = report["boundary_errors"]["flop_share_for_time_share"]
    print("\n== report: latency attribution (the lesson's Document QA trace) ==")
    print(f"prefill  {ms(seg['before_ms'])} -> {ms(seg['after_ms'])}  {times(seg['speedup'])}  "
          f"({pct(seg['reduction'], 2)} less)")
    print(f"TTFT     {ms(cli['before_ms'])} -> {ms(cli['after_ms'])}  {times(cli['speedup'])}  "
          f"({pct(cli['reduction'], 2)} less)")
    print(f"errors   kernel speedup on TTFT would claim {ms(wrong)}; FLOP share "
          f"{pct(flop['flop_share'])} vs time share {pct(flop['time_share'])}")
    print(f"page     {paths['report.html'].relative_to(out_dir).as_posix()}")
