"""`attnlab bench`, `attnlab kernels`, `attnlab ncu`: measured, proven, comparable.

- ``bench``: prefill / decode / fwd+bwd sweeps over providers and lengths, run by the
  benchmark engine (:mod:`attnlab.measure.engine`, the one the ``bench/`` scripts are
  configurations of); every point checked against the reference, its kernels listed,
  timed with CUDA events (cold L2), upserted into ``--out``/bench.jsonl (default
  ``./attnlab-results/``), plotted.
- ``kernels``: the kernels one provider call actually launched, their time, and
  the share of time outside the matrix multiplies.
- ``ncu``: Nsight Compute counters per kernel (DRAM bytes, duration, speed of light,
  occupancy, registers, shared memory, instructions, warp stalls, grid vs SMs) and
  the cache-aware prediction beside them; ``--parse`` reads a saved CSV (no GPU).

Without a CUDA GPU (or without ncu for ``ncu``) the verbs say what they need and
exit 2; they never print numbers they did not measure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from pathlib import Path

from attnlab.commands.cli_support import (
    new_console,
    parse_dtype,
    parse_int_list,
    parse_window,
)
from attnlab.measure.outputs import check_out_dir

DEFAULT_RESULTS = Path("bench") / "results"
BENCH_RECORDS = "bench.jsonl"  # inside the bench verb's --out folder
DEFAULT_NCU_DIR = DEFAULT_RESULTS / "ncu"
DEFAULT_NCU_RECORDS = DEFAULT_RESULTS / "ncu.jsonl"
NCU_PROVIDERS = "eager,sdpa_flash,sdpa_cudnn,attnlab"
NEEDS_CUDA = ("measurements need a CUDA GPU (torch.cuda.is_available() is False here); "
              "committed results are in bench/results/")
NEEDS_NCU = "needs Nsight Compute's ncu on PATH (or $NCU); not found"
# Kernel-name tables are wide: one row per kernel with a dozen counters.
MEASURE_TABLE_WIDTH = 200


# ----- argument parsing (values checked here, so bad input is one line and exit 2) -------------
def _phases(text: str) -> list[str]:
    from attnlab.measure.records import PHASES

    phases = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in phases if p not in PHASES]
    if not phases or bad:
        raise ValueError(f"--phase must be comma-separated from {', '.join(PHASES)}, got {text!r}")
    return phases


def _add_shape_arguments(parser: argparse.ArgumentParser, *, causal_default: bool) -> None:
    group = parser.add_argument_group("shape (defaults: the preset's)")
    group.add_argument("--preset", default="lesson-8b",
                       help="model preset giving heads, head dim and dtype (default: lesson-8b)")
    group.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    group.add_argument("--kv-heads", type=int, default=None,
                       help="KV heads (default: the preset's; fewer than query heads = GQA)")
    group.add_argument("--head-dim", type=int, default=None, help="head dimension")
    group.add_argument("--dtype", default=None,
                       help="fp16, bf16, fp32 or fp64, or their torch names (bfloat16, ...)")
    group.add_argument("--causal", action=argparse.BooleanOptionalAction, default=causal_default,
                       help=f"bottom-right causal mask (default: {causal_default})")
    group.add_argument("--window", default=None, help="sliding window LEFT,RIGHT (-1 = unbounded)")


def _base_shape(args: argparse.Namespace, *, heads: int | None, seqlen: int = 4096):
    from attnlab.shapes import preset

    model = preset(args.preset)
    query_heads = heads if heads is not None else model.query_heads
    if args.kv_heads is not None:
        kv_heads = args.kv_heads
    else:
        kv_heads = model.kv_heads if heads is None else heads
    return model.shape(seqlen, batch=args.batch, causal=args.causal).replace(
        query_heads=query_heads, kv_heads=kv_heads,
        head_dim=args.head_dim or model.head_dim,
        dtype=model.dtype if args.dtype is None else parse_dtype(args.dtype, "--dtype"),
        window=parse_window(args.window))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _command_line(verb: str, argv_tail: list[str] | None = None) -> str:
    tail = sys.argv[2:] if argv_tail is None else argv_tail
    return shlex.join(["attnlab", verb, *tail])


def _print_json(payload) -> None:
    print(json.dumps(payload, indent=1, sort_keys=True, default=str))


# ----- tables ------------------------------------------------------------------------------------
def _kernel_summary(names: list[str]) -> str:
    from attnlab.measure.profile import short_name

    if not names:
        return "-"
    shown = ", ".join(short_name(n, 40) for n in names[:2])
    return shown + (f" (+{len(names) - 2} more)" if len(names) > 2 else "")


def _short_shape(shape: dict) -> str:
    mask = "causal" if shape.get("causal") else "full"
    window = list(shape.get("window", [-1, -1]))
    if window != [-1, -1]:
        mask += f" w{window[0]},{window[1]}"
    return (f"B{shape['batch']} H{shape['query_heads']}/{shape['kv_heads']} d{shape['head_dim']} "
            f"{shape['dtype']} {mask}")


# Record fields a table shows only when its rows differ in them (else they would make two
# rows look the same: two GPUs, two metrics, per-kernel rows of one call).
# (what tells two rows apart, its header): the same point measured by two runs (the
# seed comparison re-measures points of the fwd+bwd table) differs in when it ran.
_DISTINGUISHING = ((lambda r: r["gpu"], "GPU"), (lambda r: r["metric"], "metric"),
                   (lambda r: r["kernel"], "kernel"), (lambda r: r["timestamp"][:16], "measured"))


def records_table(records: list[dict], title: str):
    """One row per record, with every column that tells two rows apart: the shape and
    both lengths always (decode rows differ in seqlen_q: speculative queries), the GPU,
    metric, kernel and the time it was measured when they vary."""
    from rich.table import Table

    extra = [(value, header) for value, header in _DISTINGUISHING
             if len({value(r) for r in records}) > 1]
    table = Table(title=title, title_justify="left")
    for column in ("phase", "shape", "provider", "Nq", "Nk", *(h for _, h in extra),
                   "median ms (p20-p80)", "TFLOP/s", "TB/s",
                   "kernels that ran (or why not measured)"):
        table.add_column(column, justify="right" if column in ("Nq", "Nk", "TFLOP/s", "TB/s")
                         else "left")
    for r in records:
        head = [r["phase"], _short_shape(r["shape"]), r["provider"],
                str(r["shape"].get("seqlen_q", "")), str(r["shape"].get("seqlen_k", "")),
                *(str(value(r)) for value, _ in extra)]
        if r["metric"] == "skipped":
            table.add_row(*head, "-", "-", "-", r["reason"])
        else:
            table.add_row(*head, f"{r['p50']:.4f} ({r['p20']:.4f}-{r['p80']:.4f})",
                          f"{r['tflops']:.1f}" if r["tflops"] is not None else "-",
                          f"{r['tbps']:.2f}" if r["tbps"] is not None else "-",
                          _kernel_summary(r["kernel_names"]))
    return table


def _console():
    return new_console(MEASURE_TABLE_WIDTH)


# ----- bench -------------------------------------------------------------------------------------
def _bench_engine():
    """`attnlab bench` as a configuration of the benchmark engine: one phase per sweep phase."""
    from attnlab.measure.engine import DEFAULT_OUT, Bench

    bench = Bench("attnlab bench", command="attnlab bench", needs_cuda=NEEDS_CUDA,
                  out_default=DEFAULT_OUT)
    for phase in ("prefill", "decode", "fwdbwd"):
        bench.phase(phase, default=phase != "fwdbwd", plan=_sweep_plan)(_sweep_phase)
    bench.finish(_bench_report)
    return bench


def _sweep_plan(args: argparse.Namespace) -> list:
    """(provider, length) points, with every option checked (bad input: exit 2, no GPU used)."""
    from attnlab.measure.providers import parse_providers
    from attnlab.measure.timing import FLUSH_MODES

    if args.flush not in FLUSH_MODES:
        raise ValueError(f"--flush must be one of {', '.join(FLUSH_MODES)}, got {args.flush!r}")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats must be an int >= 1, got {args.repeats}")
    _base_shape(args, heads=args.heads)
    return list(itertools.product(parse_providers(args.providers),
                                  parse_int_list(args.seqlens, "--seqlens")))


def _sweep_phase(ctx) -> list[dict]:
    """One sweep phase: every provider over the lengths, checked, proven and timed."""
    from attnlab.measure.sweep import run_sweep

    args = ctx.args
    providers = list({p.name: p for p, _ in ctx.plan}.values())
    seqlens = list(dict.fromkeys(n for _, n in ctx.plan))
    timing = {"flush": args.flush, "cuda_graph": args.cuda_graph, "target_ms": args.target_ms,
              "repeats": args.repeats}
    results = run_sweep(providers, [ctx.phase], seqlens, _base_shape(args, heads=args.heads),
                        device="cuda", env=ctx.env, timing=timing,
                        out=ctx.path(BENCH_RECORDS), deadline=ctx.deadline,
                        progress=not args.json, flop_count=args.flop_count)
    return [r.record for r in results]


def _bench_report(ctx) -> None:
    from attnlab.measure import records as rec

    args = ctx.args
    records = [r for phase in ctx.phases for r in ctx.results.get(phase) or []]
    path = ctx.out_dir / BENCH_RECORDS
    plots = []
    if not args.no_plots and any(r["metric"] == "latency" for r in records):
        from attnlab.measure.plots import plot_records

        plots = plot_records(rec.load_records(path), _plots_dir(ctx.out_dir, args.plots))
    if args.json:
        _print_json({"records": records, "plots": [str(p) for p in plots]})
        return
    console = _console()
    base = _base_shape(args, heads=args.heads)
    console.print(records_table(records, f"attnlab bench — {base.describe()} (lengths swept); "
                                         f"{rec.describe_environment(ctx.env)}"))
    console.print(f"records upserted into {path}" + (f"; plots in {plots[0].parent}"
                                                       if plots else ""))


def _plots_dir(out_dir: Path, plots: str | None) -> Path:
    """--plots (default: --out's plots/), checked as --out is, then created: call it once
    there is something to plot, so a failed command creates nothing."""
    folder = check_out_dir(plots if plots is not None else out_dir / "plots", "--plots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_bench(args: argparse.Namespace) -> int:
    from attnlab.measure.engine import DEFAULT_OUT

    if args.replot:  # plots only read records: no GPU needed
        from attnlab.measure import records as rec
        from attnlab.measure.plots import plot_records, with_sibling_ceilings

        # Reading: --out may also name a records file (the committed measure.jsonl).
        if args.out is not None and not str(args.out).strip():
            raise ValueError("--out must name a folder of records or a .jsonl file, got an "
                             "empty path")
        given = Path(args.out or DEFAULT_OUT)
        path = given if given.is_file() else given / BENCH_RECORDS
        check_out_dir(args.plots if args.plots is not None else path.parent / "plots", "--plots")
        records = with_sibling_ceilings(rec.load_records(path), path)  # fails before any folder
        written = plot_records(records, _plots_dir(path.parent, args.plots))
        if args.json:
            _print_json({"plots": [str(p) for p in written]})
        else:
            print(f"{len(written)} plots from {path} written to {written[0].parent}")
        return 0
    if args.plots is not None and not args.no_plots:
        check_out_dir(args.plots, "--plots")  # refused now, not after the measurements
    return _bench_engine().run(args, sys.argv[2:])


# ----- kernels -----------------------------------------------------------------------------------
def run_kernels(args: argparse.Namespace) -> int:
    from attnlab.measure.dispatch import profile_call
    from attnlab.measure.profile import short_name
    from attnlab.measure.providers import ProviderUnavailable, prepare, provider
    from attnlab.measure.sweep import phase_shape

    chosen = provider(args.provider)
    phase = _phases(args.phase)
    if len(phase) != 1:
        raise ValueError(f"--phase takes one phase for `kernels`, got {args.phase!r}")
    if args.seqlen < 1:
        raise ValueError(f"--seqlen must be an int >= 1, got {args.seqlen}")
    shape = phase_shape(_base_shape(args, heads=args.heads), phase[0], args.seqlen)
    if not _cuda_available():
        print(f"attnlab kernels: {NEEDS_CUDA}", file=sys.stderr)
        return 2
    call = prepare(chosen, shape, phase[0], "cuda")
    inputs = call.inputs(seed=0)
    try:
        kernels = profile_call(call.call, inputs, trace_path=args.trace)
    except RuntimeError as error:  # a pinned backend that refuses the shape fails loudly
        raise ProviderUnavailable(f"{chosen.name} failed on {shape.describe()} ({phase[0]}): "
                                  f"{' '.join(str(error).split())[:500]}") from None
    if args.json:
        _print_json({"provider": chosen.name, "phase": phase[0], "shape": shape.as_dict(),
                     **kernels.as_dict()})
        return 0
    from rich.table import Table

    table = Table(title=f"kernels launched by one {chosen.name} call — {shape.describe()} "
                        f"({phase[0]})", title_justify="left")
    for column in ("#", "kernel", "calls", "total µs", "mean µs", "GEMM"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    for i, k in enumerate(kernels.kernels, start=1):
        table.add_row(str(i), short_name(k.name, 90), str(k.calls), f"{k.total_us:.1f}",
                      f"{k.mean_us:.1f}", "yes" if k.is_gemm else "")
    console = _console()
    console.print(table)
    console.print(f"{kernels.launches} launches, {len(kernels.kernels)} distinct kernels, "
                  f"{kernels.total_us:.1f} µs of GPU time (profiled call); "
                  f"{100 * kernels.outside_gemm_share:.1f}% of it outside matrix multiplies")
    return 0


# ----- ncu ---------------------------------------------------------------------------------------
def _case_name(label: str | None) -> str:
    from attnlab.measure.ncu import parse_case_label

    if not label:
        return "-"
    try:
        provider, phase, s = parse_case_label(label)
    except (ValueError, KeyError, StopIteration):
        return label
    mask = " causal" if s.causal else ""
    return (f"{provider} {phase} B{s.batch} H{s.query_heads}/{s.kv_heads} "
            f"N{s.seqlen_q}x{s.seqlen_k} d{s.head_dim}{mask}")


def _ncu_kernel_table(kernels, title: str):
    """One row per kernel; columns ncu reported for no kernel are left out."""
    from rich.table import Table

    from attnlab.measure.profile import short_name

    def scaled(value, factor):
        return None if value is None else value / factor

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    summaries = [k.summary() for k in kernels]
    columns = [  # (header, value of a summary, format)
        ("DRAM read MB", lambda s: scaled(s["dram_bytes_read"], 1e6), ",.2f"),
        ("DRAM write MB", lambda s: scaled(s["dram_bytes_write"], 1e6), ",.2f"),
        ("µs", lambda s: scaled(s["duration_ns"], 1e3), ",.1f"),
        ("SOL comp %", lambda s: s["sol_compute_pct"], ".1f"),
        ("SOL mem %", lambda s: s["sol_memory_pct"], ".1f"),
        ("occup. %", lambda s: s["achieved_occupancy_pct"], ".1f"),
        ("regs", lambda s: s["registers_per_thread"], "d"),
        ("smem KiB", lambda s: scaled(s["shared_bytes_per_block"], 1024), ".1f"),
        ("inst M", lambda s: scaled(s["instructions"], 1e6), ",.1f"),
    ]
    shown = [c for c in columns if any(c[1](s) is not None for s in summaries)]
    stalls = any(s["warp_stalls"] for s in summaries)
    table = Table(title=title, title_justify="left")
    table.add_column("case")
    table.add_column("kernel")
    table.add_column("CTAs / SMs", justify="right")
    for header, _, _ in shown:
        table.add_column(header, justify="right")
    if stalls:
        table.add_column("top stall (cycles/issue)")
    for k, s in zip(kernels, summaries, strict=True):
        row = [_case_name(k.case), short_name(k.name, 44),
               f"{fmt(s['grid_size'], 'd')} / {fmt(s['sms'], 'd')}"]
        row += [fmt(get(s), spec) for _, get, spec in shown]
        if stalls:
            top = next(iter(s["warp_stalls"].items()), None)
            row.append("-" if top is None else f"{top[0]} {top[1]:.2f}")
        table.add_row(*row)
    return table


def _print_ncu_results(kernels, comparisons, title: str, as_json: bool) -> None:
    from attnlab.measure.compare import kernel_markdown_table, markdown_table

    if as_json:
        _print_json({"kernels": [k.summary() for k in kernels],
                     "comparisons": [c.as_dict() for c in comparisons]})
        return
    console = _console()
    console.print(_ncu_kernel_table(kernels, title))
    if comparisons:
        console.print("\nDRAM bytes of one call (MB = 10^6 B): measured by ncu vs the "
                      "cache-aware and logical models")
        console.print(markdown_table(comparisons), markup=False)
        # A case's total can hide its kernels' errors (a fwd+bwd call: the forward, dQ and
        # the dK/dV launches), so each kernel beside the others.
        console.print("Per kernel (MB = 10^6 B, one launch):")
        console.print(kernel_markdown_table(comparisons), markup=False)


def run_ncu_verb(args: argparse.Namespace) -> int:
    from attnlab.measure import ncu as ncu_module
    from attnlab.measure.compare import compare_cases
    from attnlab.measure.providers import parse_providers
    from attnlab.measure.sweep import phase_shape

    if args.parse is not None:
        path = Path(args.parse)
        if not path.is_file():
            raise ValueError(f"--parse needs an ncu CSV file, got {args.parse!r}")
        kernels = ncu_module.parse_csv(path)
        _print_ncu_results(kernels, compare_cases(kernels), f"ncu counters from {path}",
                           args.json)
        return 0
    providers = parse_providers(args.providers)
    phase = _phases(args.phase)
    if len(phase) != 1:
        raise ValueError(f"--phase takes one phase for `ncu`, got {args.phase!r}")
    seqlens = parse_int_list(args.seqlens, "--seqlens")
    heads = parse_int_list(args.heads, "--heads")
    cases = [(p.name, phase[0], phase_shape(_base_shape(args, heads=h), phase[0], n))
             for p, h, n in itertools.product(providers, heads, seqlens)]
    if not _cuda_available():
        print(f"attnlab ncu: {NEEDS_CUDA} (and Nsight Compute's ncu)", file=sys.stderr)
        return 2
    ncu = ncu_module.find_ncu()
    if ncu is None:
        print(f"attnlab ncu: {NEEDS_NCU}", file=sys.stderr)
        return 2
    from attnlab.measure import records as rec
    from attnlab.measure.compare import comparison_markdown, ncu_records, predicted_kernel_count

    args.out = check_out_dir(args.out, "--out")
    args.out.mkdir(parents=True, exist_ok=True)
    run = ncu_module.run_ncu(cases, args.out, ncu=ncu, timeout_s=args.timeout,
                             kernel_counts=predicted_kernel_count)
    comparisons = compare_cases(run.kernels)
    env = rec.environment(_command_line("ncu"))
    rec.upsert_records(args.records, ncu_records(run.kernels, env))
    out = Path(args.out)
    (out / "ncu_summary.json").write_text(json.dumps(
        {"command": rec.portable_command(env["command"], out), "ncu_command": run.command, "metrics": run.metrics,
         "notes": run.notes, "failed_cases": run.failed_cases,
         "kernels": [k.summary() for k in run.kernels],
         "comparisons": [c.as_dict() for c in comparisons]}, indent=1, default=str))
    (out / "cache_model_vs_ncu.md").write_text(comparison_markdown(comparisons))
    _print_ncu_results(run.kernels, comparisons, f"ncu counters — {rec.describe_environment(env)}",
                       args.json)
    for label, reason in run.failed_cases.items():
        print(f"attnlab ncu: case {label} did not run: {reason}", file=sys.stderr)
    for note in run.notes:
        print(f"attnlab ncu: {note}", file=sys.stderr)
    if not args.json:
        print(f"raw CSV {run.raw_csv}; parsed {run.long_csv}; records in {args.records}")
    return 1 if run.failed_cases else 0


# ----- registration ------------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="time providers over sequence lengths (CUDA)",
        description="Sweep providers over lengths for prefill / decode / fwdbwd (the "
                    "benchmark engine's phases): check each against the reference, list the "
                    "kernels that ran, time with CUDA events (L2 flushed), upsert records "
                    "into --out/bench.jsonl and plot.")
    _bench_engine().add_arguments(bench, phases_aliases=("--phase",))
    bench.add_argument("--providers", default="all",
                       help="'all' or comma-separated provider names (see `attnlab kernels -h`)")
    bench.add_argument("--seqlens", default="1024,2048,4096,8192,16384",
                       help="sequence lengths (decode: KV lengths), comma-separated")
    bench.add_argument("--heads", type=int, default=None, help="query heads (default: preset)")
    _add_shape_arguments(bench, causal_default=True)
    bench.add_argument("--repeats", type=int, default=None,
                       help="timed calls per point (default: enough for --target-ms)")
    bench.add_argument("--target-ms", type=float, default=100.0,
                       help="timed work per point when --repeats is not given (default 100)")
    bench.add_argument("--flush", default="l2", help="l2 (default), l2_clean, rotate or none")
    bench.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                       help="time CUDA-graph replays (default: for calls under 0.1 ms only)")
    bench.add_argument("--flop-count", choices=("exact", "conventional"), default="exact",
                       help="TFLOP/s from the mask's exact pairs (default) or the "
                            "benchmarks' 4BHN^2d halved when causal (the README's tables)")
    bench.add_argument("--plots", default=None,
                       help="folder for PNG/SVG plots (default: --out's plots/)")
    bench.add_argument("--no-plots", action="store_true", help="do not write plots")
    bench.add_argument("--replot", action="store_true",
                       help="measure nothing: redraw the plots from the records in --out "
                            "(its bench.jsonl, or a records file; works without a GPU)")
    bench.add_argument("--json", action="store_true", help="print records as JSON")
    bench.set_defaults(run=run_bench)

    from attnlab.measure.providers import PROVIDERS

    kernels = subparsers.add_parser(
        "kernels", help="list the GPU kernels one provider call launched (CUDA)",
        description="Run one provider call under torch.profiler and list the kernels that "
                    f"actually ran. Providers: {', '.join(PROVIDERS)}.")
    kernels.add_argument("--provider", required=True, help="one provider name")
    kernels.add_argument("--phase", default="prefill", help="prefill, decode or fwdbwd")
    kernels.add_argument("--seqlen", type=int, default=4096,
                         help="sequence length (decode: KV length; default 4096)")
    kernels.add_argument("--heads", type=int, default=None, help="query heads (default: preset)")
    _add_shape_arguments(kernels, causal_default=False)
    kernels.add_argument("--trace", type=Path, default=None,
                         help="also save the profiler's Chrome trace here")
    kernels.add_argument("--json", action="store_true", help="print the kernel list as JSON")
    kernels.set_defaults(run=run_kernels)

    ncu = subparsers.add_parser(
        "ncu", help="Nsight Compute counters per kernel vs the cache-aware model (CUDA + ncu)",
        description="Profile provider calls with ncu (--clock-control none) and report per "
                    "kernel DRAM bytes, duration, speed of light, occupancy, registers, shared "
                    "memory, instructions, warp stalls and grid vs SMs, beside the cache-aware "
                    "and logical predictions.  --parse reads a saved CSV without a GPU.")
    ncu.add_argument("--providers", default=NCU_PROVIDERS,
                     help=f"comma-separated providers (default {NCU_PROVIDERS})")
    ncu.add_argument("--phase", default="prefill", help="prefill or decode (default prefill)")
    ncu.add_argument("--seqlens", default="4096", help="comma-separated lengths (default 4096)")
    ncu.add_argument("--heads", default="32", help="comma-separated query-head counts "
                                                    "(default 32; KV heads = heads unless "
                                                    "--kv-heads)")
    _add_shape_arguments(ncu, causal_default=False)
    ncu.add_argument("--out", default=str(DEFAULT_NCU_DIR),
                     help=f"folder for the raw and parsed CSVs (default {DEFAULT_NCU_DIR})")
    ncu.add_argument("--records", type=Path, default=DEFAULT_NCU_RECORDS,
                     help=f"records file, upserted (default {DEFAULT_NCU_RECORDS})")
    ncu.add_argument("--timeout", type=float, default=600.0, help="seconds for ncu (default 600)")
    ncu.add_argument("--parse", default=None, help="parse this ncu CSV instead of profiling")
    ncu.add_argument("--json", action="store_true", help="print kernels and comparisons as JSON")
    ncu.set_defaults(run=run_ncu_verb)


# ----- demo --------------------------------------------------------------------------------------
def _committed_results() -> Path:
    from attnlab.measure.records import committed_results

    return committed_results()


def _summarise_committed(console, records_dir: Path | None = None) -> None:
    from attnlab.measure.records import load_records, source_label

    folder = _committed_results() if records_dir is None else Path(records_dir)
    kind = "committed" if records_dir is None else "given"
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    if not files:
        console.print(f"  no {kind} records found under {source_label(folder)}")
        return
    records = load_records(folder)
    latency = [r for r in records if r["metric"] == "latency" and r["kernel"] == "call"]
    console.print(f"  {len(records)} {kind} records in {len(files)} file(s) under "
                  f"{source_label(folder)} "
                  f"({len(latency)} latency rows; GPUs: "
                  f"{', '.join(sorted({r['gpu'] for r in records}))})")
    if latency:
        def order(r):
            return (r["phase"], _short_shape(r["shape"]), r["provider"], r["shape"]["seqlen_k"],
                    r["shape"]["seqlen_q"])

        console.print(records_table(sorted(latency, key=order)[:40],
                                    f"{kind} latency records (first 40)"))


def demo(out_dir: Path, records_dir: Path | None = None) -> list[dict] | None:
    """On a CUDA machine a small bench into out_dir/measure.jsonl, returning its records;
    without one, a summary of ``records_dir`` (the committed results by default)."""
    from attnlab.measure import records as rec
    from attnlab.measure.providers import parse_providers
    from attnlab.measure.sweep import run_sweep
    from attnlab.shapes import preset

    console = _console()
    console.print("\n[bold]measure[/bold] — which kernels ran and how fast (attnlab bench)")
    if not _cuda_available():
        console.print(f"  {NEEDS_CUDA}")
        _summarise_committed(console, records_dir)
        return None
    path = Path(out_dir) / "measure.jsonl"
    env = rec.environment("attnlab demo")
    providers = parse_providers("eager,sdpa,sdpa_flash,sdpa_cudnn,attnlab")
    timing = {"target_ms": 30.0, "min_repeats": 5, "max_repeats": 50}
    prefill = preset("lesson-8b").shape(4096, causal=True)
    decode = prefill.replace(kv_heads=8)
    results = run_sweep(providers, ["prefill"], [1024, 4096], prefill, device="cuda", env=env,
                        timing=timing, out=path, progress=False)
    results += run_sweep(providers, ["decode"], [4096, 16384], decode, device="cuda", env=env,
                         timing=timing, out=path, progress=False)
    console.print(records_table([r.record for r in results],
                                f"lesson-8b layer, causal; decode with 8 KV heads — "
                                f"{rec.describe_environment(env)}"))
    console.print(f"  records: {path.name} in the demo's folder")
    return [r.record for r in results]
