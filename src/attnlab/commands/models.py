"""`attnlab traffic | memory | amdahl | roofline | exercises`: the exact models, printed.

Every number comes from :mod:`attnlab.model` and is printed with its scope; bytes
are exact integers in ``--json`` and binary units (KiB, MiB, GiB) in tables.  With
no options each verb reproduces the lesson's numbers for its default workload (one
layer of the nominal 8B model at N = 4,096, d = 128, FP16, B_r = 128, B_c = 64).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rich.table import Table

from attnlab.commands.cli_support import (
    dumps,
    new_console,
    parse_dtype,
    parse_float,
    parse_float_list,
    parse_int,
    parse_length,
    parse_window,
    ranges,
)
from attnlab.report.model_reports import (
    amdahl_report,
    ceilings,
    exercises_report,
    memory_report,
    roofline_report,
    traffic_report,
)

DEFAULT_PRESET = "lesson-8b"
DEFAULT_SEQLEN = "4096"
DEFAULT_GPU = "H100 SXM"  # the lesson's ridge-point example
DEFAULT_TIME_SHARES = "0.15,0.40,0.65"
DEFAULT_SPEEDUP = "3.5"
DEFAULT_FLOP_SHARE = "0.032"  # "Lesson 2's count", as the lesson quotes it
DEFAULT_FLOP_SHARE_TOKENS = "2048"


# ----- parsing: cli_support's parsers, so a bad value is one line and exit 2 --------------
def _shape_and_preset(args: argparse.Namespace, *, causal: bool):
    """The AttentionShape the shape options describe, its preset and its score dtype."""
    from attnlab.shapes import preset

    model = preset(args.preset)
    seqlen = parse_length(args.seqlen, "--seqlen")
    seqlen_q = seqlen if args.seqlen_q is None else parse_length(args.seqlen_q, "--seqlen-q")
    seqlen_k = seqlen if args.seqlen_k is None else parse_length(args.seqlen_k, "--seqlen-k")
    overrides = {}
    for option, field in (("heads", "query_heads"), ("kv_heads", "kv_heads"),
                          ("head_dim", "head_dim"), ("batch", "batch"),
                          ("block_m", "block_m"), ("block_n", "block_n")):
        text = getattr(args, option)
        if text is not None:
            overrides[field] = parse_length(text, "--" + option.replace("_", "-"))
    if "query_heads" in overrides and "kv_heads" not in overrides and model.kv_heads == model.query_heads:
        overrides["kv_heads"] = overrides["query_heads"]  # an MHA preset stays MHA
    dtype = None if args.dtype is None else parse_dtype(args.dtype, "--dtype")
    if dtype is not None:
        overrides["dtype"] = dtype
    window = parse_window(args.window) if getattr(args, "window", None) else (-1, -1)
    shape = model.shape(seqlen_q, seqlen_k=seqlen_k, causal=causal, window=window)
    try:
        shape = shape.replace(**overrides)
    except ValueError as error:  # name the CLI options, not the dataclass fields
        message = str(error).replace("query_heads", "--heads").replace("kv_heads", "--kv-heads")
        raise ValueError(message) from None
    if args.score_dtype is not None:
        score_dtype = parse_dtype(args.score_dtype, "--score-dtype")
    else:
        score_dtype = dtype if dtype is not None else model.score_dtype
    return shape, model, score_dtype


def _layers(args: argparse.Namespace, model) -> int:
    return model.attention_layers if args.layers is None else parse_int(args.layers, "--layers")


# ----- output helpers --------------------------------------------------------------------
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: int) -> str:
    """Binary units for printing only: 138412032 -> '132.00 MiB'."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _table(*columns: tuple[str, str]) -> Table:
    table = Table()
    for name, justify in columns:
        table.add_column(name, justify=justify)
    return table


# ----- traffic ---------------------------------------------------------------------------
def print_traffic(report: dict) -> None:
    console = new_console(120)
    shape = report["shape"]
    console.print(f"Logical HBM traffic, {report['scope_label']}: Nq={shape['seqlen_q']}, "
                  f"Nk={shape['seqlen_k']}, d={shape['head_dim']}, {shape['dtype']} "
                  f"(scores {report['score_dtype']}), heads {shape['query_heads']}/"
                  f"{shape['kv_heads']} (q/kv), batch {shape['batch']}, "
                  f"B_r={shape['block_m']}, B_c={shape['block_n']}")
    table = _table(("algorithm: kernels, then total", "left"), ("condition", "left"),
                   ("reads MiB", "right"), ("writes MiB", "right"), ("total MiB", "right"),
                   ("total bytes", "right"))
    for row in report["rows"]:
        for kernel in row["kernels"]:
            table.add_row(f"  {kernel['kernel']}", "", _mib(kernel["read_bytes"]),
                          _mib(kernel["write_bytes"]), _mib(kernel["total_bytes"]),
                          f"{kernel['total_bytes']:,}")
        table.add_row(f"[bold]{row['label']}[/bold]", row["condition"],
                      f"[bold]{_mib(row['read_bytes'])}[/bold]",
                      f"[bold]{_mib(row['write_bytes'])}[/bold]",
                      f"[bold]{_mib(row['total_bytes'])}[/bold]",
                      f"[bold]{row['total_bytes']:,}[/bold]", end_section=True)
    console.print(table)
    for ratio in report["ratios"]:
        console.print(f"{ratio['candidate']}: {ratio['label']}")
    if "gqa_kv_bytes" in report:
        gqa = report["gqa_kv_bytes"]
        console.print(f"GQA, fused forward K+V bytes {gqa['scope_label']} ({gqa['condition']}): "
                      f"{human_bytes(gqa['unpacked'])} one pass per query head, "
                      f"{human_bytes(gqa['packed'])} with a group's query heads packed "
                      f"into one pass ({gqa['unpacked'] / gqa['packed']:.2f}x fewer)")
    console.print("Logical model: no L2 reuse, so measured DRAM bytes of fused kernels are "
                  "far lower (K/V re-reads hit L2); use it to rank designs.")


def run_traffic(args: argparse.Namespace) -> int:
    from attnlab.model.traffic import BACKWARD_VARIANTS

    condition = {None: "both", True: "causal", False: "unmasked"}[args.causal]
    shape, model, score_dtype = _shape_and_preset(args, causal=bool(args.causal))
    scope = args.scope
    layers = _layers(args, model) if scope == "model" else None
    if args.layers is not None and scope != "model":
        raise ValueError("--layers applies only to --scope model")
    if args.backward is not None and args.backward not in BACKWARD_VARIANTS:
        raise ValueError(f"--backward must be one of {list(BACKWARD_VARIANTS)}, got {args.backward!r}")
    splits = None if args.decode_splits is None else parse_int(args.decode_splits, "--decode-splits")
    report = traffic_report(shape, scope=scope, layers=layers, score_dtype=score_dtype,
                            condition=condition, write_lse=args.write_lse, pack_gqa=args.pack_gqa,
                            backward=args.backward, decode_splits=splits,
                            cross_condition=args.cross_condition)
    print(dumps(report)) if args.json else print_traffic(report)
    return 0


# ----- memory ----------------------------------------------------------------------------
def print_memory(report: dict) -> None:
    console = new_console(120)
    shape = report["shape"]
    console.print(f"Memory footprints by scope: Nq={shape['seqlen_q']}, Nk={shape['seqlen_k']}, "
                  f"d={shape['head_dim']}, {shape['query_heads']} query heads, batch "
                  f"{shape['batch']}, scores {report['score_dtype']}, B_r={shape['block_m']}, "
                  f"B_c={shape['block_n']}")
    table = _table(("what", "left"), ("scope", "left"), ("size", "right"), ("bytes", "right"),
                   ("assumption", "left"))
    for item in report["items"]:
        table.add_row(item["name"], item["scope"], human_bytes(item["bytes"]),
                      f"{item['bytes']:,}", item["assumption"])
    console.print(table)
    console.print("Only the exported LSE reaches HBM in a fused kernel; the rest of the "
                  "fused rows are on-chip buffers.")


def run_memory(args: argparse.Namespace) -> int:
    shape, model, score_dtype = _shape_and_preset(args, causal=bool(args.causal))
    heads = (None if args.heads_in_parallel is None
             else parse_int(args.heads_in_parallel, "--heads-in-parallel"))
    report = memory_report(shape, score_dtype=score_dtype, layers=_layers(args, model),
                           heads_in_parallel=heads)
    print(dumps(report)) if args.json else print_memory(report)
    return 0


# ----- amdahl ----------------------------------------------------------------------------
def print_amdahl(report: dict) -> None:
    console = new_console(120)
    console.print(f"Amdahl on a time share: {report['formula']}")
    table = _table(("f_time (attention share of time)", "right"), ("S_kernel", "right"),
                   ("boundary speedup", "right"), ("latency reduction", "right"))
    for row in report["sensitivity"]:
        table.add_row(f"{row['time_share']:.1%}", f"{row['kernel_speedup']:g}x",
                      f"{row['speedup']:.3f}x", f"{row['latency_reduction']:.2%}")
    console.print(table)
    trap = report["flop_share_trap"]
    computed = trap["computed_flop_share"]
    console.print("The FLOP-share trap, same kernel speedup:")
    trap_table = _table(("share used", "left"), ("share", "right"), ("projected speedup", "right"),
                        ("valid?", "left"))
    trap_table.add_row("time share (profiled)", f"{trap['time_share']:.1%}",
                       f"{trap['time_share_speedup']:.3f}x", "yes: time is what Amdahl divides")
    trap_table.add_row("FLOP share (as quoted)", f"{trap['flop_share']:.1%}",
                       f"{trap['flop_share_speedup']:.3f}x", "no: omits softmax, masking, stalls")
    trap_table.add_row(f"FLOP share ({computed['preset']}, {computed['prompt_tokens']:,} tokens, "
                       "computed)", f"{computed['flop_share']:.2%}",
                       f"{computed['speedup_if_misused']:.3f}x", "no: same reason")
    console.print(trap_table)
    chain = report["chain"]
    inputs = chain["inputs"]
    console.print(f"Boundary chain ({chain['assumption']}): attention {inputs['attention_time']:g} "
                  f"ms of a {inputs['prefill_time']:g} ms prefill over {inputs['layers']} layers, "
                  f"{inputs['outside_prefill_time']:g} ms outside the prefill, S_kernel = "
                  f"{inputs['kernel_speedup']:g}x")
    chain_table = _table(("boundary", "left"), ("before ms", "right"), ("after ms", "right"),
                         ("kernel's time share", "right"), ("speedup", "right"),
                         ("reduction", "right"))
    for row in chain["boundaries"]:
        chain_table.add_row(row["name"], f"{row['time_before']:.2f}", f"{row['time_after']:.2f}",
                            f"{row['time_share']:.1%}", f"{row['speedup']:.4f}x",
                            f"{row['latency_reduction']:.2%}")
    console.print(chain_table)


def run_amdahl(args: argparse.Namespace) -> int:
    from attnlab.shapes import preset

    shares = parse_float_list(args.time_share, "--time-share", minimum=0.0, maximum=1.0)
    speedup = parse_float(args.speedup, "--speedup", minimum=0.0, min_open=True)
    flop_share = parse_float(args.flop_share, "--flop-share", minimum=0.0, maximum=1.0)
    preset(args.preset)
    tokens = parse_int(args.prompt_tokens, "--prompt-tokens")
    chain = {}
    for option, key in (("attention_ms", "attention_time"), ("prefill_ms", "prefill_time"),
                        ("outside_ms", "outside_prefill_time")):
        text = getattr(args, option)
        if text is not None:
            chain[key] = parse_float(text, "--" + option.replace("_", "-"), minimum=0.0)
    if args.chain_speedup is not None:
        chain["kernel_speedup"] = parse_float(args.chain_speedup, "--chain-speedup",
                                              minimum=0.0, min_open=True)
    if args.layers is not None:
        chain["layers"] = parse_int(args.layers, "--layers")
    report = amdahl_report(shares, speedup, flop_share, args.preset, tokens, chain=chain)
    print(dumps(report)) if args.json else print_amdahl(report)
    return 0


# ----- roofline --------------------------------------------------------------------------
def _ceilings(args: argparse.Namespace):
    return ceilings(
        args.gpu,
        measured_tflops=None if args.measured_tflops is None else parse_float(
            args.measured_tflops, "--measured-tflops", minimum=0.0, min_open=True),
        measured_tbps=None if args.measured_tbps is None else parse_float(
            args.measured_tbps, "--measured-tbps", minimum=0.0, min_open=True),
        peaks_file=args.peaks_file)


def print_roofline(report: dict) -> None:
    console = new_console(120)
    gpu = report["gpu"]
    console.print(f"Roofline on {gpu['name']}: {gpu['dense_tflops']:g} TFLOP/s dense FP16/BF16, "
                  f"{gpu['hbm_tbps']:g} TB/s HBM, ridge {gpu['ridge_point']:.1f} FLOP/byte "
                  f"({gpu['source']})")
    shape = report["shape"]
    console.print(f"Kernels {report['scope_label']}, Nq={shape['seqlen_q']}, "
                  f"Nk={shape['seqlen_k']}, d={shape['head_dim']}, {shape['dtype']}, "
                  f"{'causal' if shape['causal'] else 'unmasked'}; {report['flops_note']}")
    table = _table(("algorithm", "left"), ("kernel", "left"), ("GFLOP", "right"),
                   ("MiB", "right"), ("FLOP/byte", "right"), ("bound", "left"),
                   ("attainable TFLOP/s", "right"), ("roofline time us", "right"))
    for row in report["kernels"]:
        intensity = row["flop_per_byte"]
        table.add_row(row["algorithm"], row["kernel"], f"{row['flops'] / 1e9:.3f}",
                      _mib(row["bytes"]), f"{intensity:.2f}", row["bound"],
                      f"{row['attainable_tflops']:.1f}", f"{row['min_time_us']:.2f}")
    console.print(table)
    ridges = ", ".join(f"{name} {value:.1f}" for name, value in
                       report["datasheet_ridge_points"].items())
    console.print(f"Datasheet ridge points (FLOP/byte): {ridges}. Peaks, not sustained. "
                  "Logical bytes count every K/V re-read; L2 hits make a real fused kernel "
                  "move fewer bytes, so its measured intensity is higher.")


def run_roofline(args: argparse.Namespace) -> int:
    gpu = _ceilings(args)
    shape, model, score_dtype = _shape_and_preset(args, causal=bool(args.causal))
    scope = args.scope
    if args.layers is not None and scope != "model":
        raise ValueError("--layers applies only to --scope model")
    layers = _layers(args, model) if scope == "model" else None
    report = roofline_report(shape, gpu, scope=scope, layers=layers, score_dtype=score_dtype)
    print(dumps(report)) if args.json else print_roofline(report)
    return 0


# ----- exercises -------------------------------------------------------------------------
def print_exercises(report: dict) -> None:
    console = new_console(120)
    one, two, three, four = report["exercises"]
    console.print(f"[bold]1.[/bold] {one['question']} ({one['scope']})")
    table = _table(("algorithm", "left"), ("reads", "right"), ("writes", "right"),
                   ("total", "right"))
    for key in ("naive", "fused"):
        row = one[key]
        table.add_row(row["label"], human_bytes(row["read_bytes"]), human_bytes(row["write_bytes"]),
                      f"{human_bytes(row['total_bytes'])} ({row['total_bytes']:,} B)")
    console.print(table)
    console.print(f"   reduction: {one['ratio']['label']}")

    console.print(f"\n[bold]2.[/bold] {two['question']}")
    table = _table(("tile", "right"), ("m", "right"), ("alpha", "right"), ("l", "right"),
                   ("a", "right"))
    for step in two["steps"]:
        alpha = "-" if step["m_old"] == -math.inf else f"{step['alpha']:.4f}"  # first tile
        table.add_row(str(step["tile"]), f"{step['m_new']:.4f}", alpha,
                      f"{step['l']:.4f}", "[" + ", ".join(f"{x:.4f}" for x in step["a"]) + "]")
    console.print(table)
    out = ", ".join(f"{x:.4f}" for x in two["output"])
    ref = ", ".join(f"{x:.4f}" for x in two["full_row_softmax_output"])
    console.print(f"   O = a / l = [{out}]; full-row softmax gives [{ref}] "
                  f"({'match' if two['matches'] else 'MISMATCH'}, "
                  f"max diff {two['max_abs_difference']:.1e})")

    console.print(f"\n[bold]3.[/bold] {three['question']}")
    console.print(f"   time share {three['time_share']:.0%}: {three['time_share_speedup']:.3f}x "
                  f"({three['time_share_reduction']:.1%} less latency)")
    console.print(f"   FLOP share {three['flop_share']:.1%}: {three['flop_share_speedup']:.3f}x "
                  f"({three['flop_share_reduction']:.1%}); at the section-5 speedup 3.5x it "
                  f"would be {three['flop_share_at_lesson_speedup_3_5']:.3f}x")
    console.print(f"   capacity plan: {three['capacity_plan']}")

    console.print(f"\n[bold]4.[/bold] {four['question']} (tiles numbered from 1)")
    console.print(f"   rows {four['rows'][0]}-{four['rows'][1]}; loads KV tiles "
                  f"{ranges(four['loaded'])}; full (no mask): {ranges(four['full'])}; "
                  f"element mask: {ranges(four['masked'])}")
    console.print(f"   row {four['example_row']} may see keys {four['example_row_sees_keys'][0]}-"
                  f"{four['example_row_sees_keys'][1]} but its loaded tiles hold "
                  f"{four['future_keys_loaded_for_example_row']} future keys; "
                  f"{four['without_the_mask']}")


def run_exercises(args: argparse.Namespace) -> int:
    report = exercises_report()
    print(dumps(report)) if args.json else print_exercises(report)
    return 0


# ----- registration ----------------------------------------------------------------------
def _add_shape_options(parser: argparse.ArgumentParser, *, scope: bool = True,
                       causal_default: bool | None = False) -> None:
    group = parser.add_argument_group("shape")
    group.add_argument("--preset", default=DEFAULT_PRESET,
                       help=f"model preset: lesson-8b or qwen-gqa (default {DEFAULT_PRESET})")
    group.add_argument("--seqlen", default=DEFAULT_SEQLEN,
                       help=f"query and key length (default {DEFAULT_SEQLEN})")
    group.add_argument("--seqlen-q", help="query length (default --seqlen)")
    group.add_argument("--seqlen-k", help="key length (default --seqlen)")
    group.add_argument("--batch", help="sequences (default 1)")
    group.add_argument("--heads", help="query heads (default: the preset's)")
    group.add_argument("--kv-heads", help="K/V heads, must divide --heads (default: the preset's)")
    group.add_argument("--head-dim", help="head dimension d (default: the preset's)")
    group.add_argument("--dtype", help="input dtype: fp16, bf16, fp32, fp64 or their torch "
                                       "names (bfloat16, float16, ...; default: the preset's)")
    group.add_argument("--score-dtype", help="dtype S and P are stored in by the naive path "
                                             "(default: the preset's, or --dtype)")
    group.add_argument("--block-m", help="B_r, query rows per tile (default 128)")
    group.add_argument("--block-n", help="B_c, key rows per tile (default 64)")
    group.add_argument("--window", help="sliding window LEFT,RIGHT, -1 = unbounded")
    group.add_argument("--causal", action=argparse.BooleanOptionalAction, default=causal_default,
                       help="bottom-right causal mask" + (
                           " (default: both conditions, each with its matched baseline)"
                           if causal_default is None else " (default off)"))
    group.add_argument("--layers", help="attention layers for model-wide scopes "
                                        "(default: the preset's)")
    if scope:
        group.add_argument("--scope", default="head", choices=("head", "kv-group", "layer", "model"),
                           help="what the bytes cover (default head)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def register(subparsers: argparse._SubParsersAction) -> None:
    traffic = subparsers.add_parser(
        "traffic", help="logical HBM bytes per kernel: naive vs FlashAttention",
        description="Exact logical HBM bytes (reads and writes per kernel) of the naive "
                    "materialising baseline (3 kernels, and 4 as eager PyTorch launches), the "
                    "idealised causal baseline and the FlashAttention-2 forward, with the "
                    "matched ratios (2.00x unmasked, 1.94x causal at the defaults).")
    _add_shape_options(traffic, causal_default=None)
    traffic.add_argument("--write-lse", action="store_true", help="the fused kernel writes the LSE")
    traffic.add_argument("--pack-gqa", action="store_true",
                         help="query heads sharing a KV head read it in one pass")
    traffic.add_argument("--backward", help="add the FA-2 backward: two-pass or atomic-dq")
    traffic.add_argument("--decode-splits", help="add Flash-Decoding with this many KV splits")
    traffic.add_argument("--cross-condition", action="store_true",
                         help="also print unmasked-naive / causal-fused, labelled cross-condition")
    traffic.set_defaults(run=run_traffic)

    memory = subparsers.add_parser(
        "memory", help="memory footprints of S, P and the softmax statistics, by scope",
        description="S + P per head, one layer's transient peak, training retention over all "
                    "layers, and the softmax statistics (whole head, one CTA, exported LSE).")
    _add_shape_options(memory, scope=False)
    memory.add_argument("--heads-in-parallel", help="add a transient peak with this many heads live")
    memory.set_defaults(run=run_memory)

    amdahl = subparsers.add_parser(
        "amdahl", help="Amdahl from a time share: sensitivity, FLOP-share trap, boundary chain",
        description="Layer speedup from a measured attention time share and a kernel speedup; "
                    "the same kernel through a FLOP share (invalid); and the chain kernel -> "
                    "layer -> prefill -> client TTFT (default: the lesson's exit task).")
    amdahl.add_argument("--time-share", default=DEFAULT_TIME_SHARES,
                        help=f"comma-separated time shares in [0, 1] (default {DEFAULT_TIME_SHARES})")
    amdahl.add_argument("--speedup", default=DEFAULT_SPEEDUP,
                        help=f"kernel speedup > 0 (default {DEFAULT_SPEEDUP})")
    amdahl.add_argument("--flop-share", default=DEFAULT_FLOP_SHARE,
                        help=f"FLOP share for the trap, in [0, 1] (default {DEFAULT_FLOP_SHARE})")
    amdahl.add_argument("--preset", default=DEFAULT_PRESET,
                        help=f"preset whose FLOP share is computed (default {DEFAULT_PRESET})")
    amdahl.add_argument("--prompt-tokens", default=DEFAULT_FLOP_SHARE_TOKENS,
                        help=f"prompt length for the computed FLOP share "
                             f"(default {DEFAULT_FLOP_SHARE_TOKENS})")
    amdahl.add_argument("--attention-ms", help="chain: attention time in the prefill (default 116)")
    amdahl.add_argument("--prefill-ms", help="chain: prefill time (default 290)")
    amdahl.add_argument("--outside-ms", help="chain: TTFT outside the prefill (default 90)")
    amdahl.add_argument("--chain-speedup", help="chain: kernel speedup (default 3.0)")
    amdahl.add_argument("--layers", help="chain: layers in the prefill (default 32)")
    amdahl.add_argument("--json", action="store_true", help="print JSON instead of tables")
    amdahl.set_defaults(run=run_amdahl)

    roofline = subparsers.add_parser(
        "roofline", help="arithmetic intensity of each kernel against a GPU's ridge point",
        description="FLOPs, logical bytes and FLOP/byte of the naive kernels and the fused "
                    "forward, against datasheet or measured ceilings.")
    _add_shape_options(roofline)
    roofline.add_argument("--gpu", default=DEFAULT_GPU,
                          help=f"A100, H100 SXM, H200 or B200 (default {DEFAULT_GPU})")
    roofline.add_argument("--measured-tflops", help="replace the datasheet FLOP/s ceiling")
    roofline.add_argument("--measured-tbps", help="replace the datasheet bandwidth ceiling")
    roofline.add_argument("--peaks-file", help="JSONL with {'kind': 'peak', 'tflops'|'tbps': ...}")
    roofline.set_defaults(run=run_roofline)

    exercises = subparsers.add_parser(
        "exercises", help="the lesson's four exercises, answered by the library",
        description="Exercise 1 (traffic), 2 (online-softmax trace), 3 (Amdahl vs FLOP share) "
                    "and 4 (causal tile plan), each computed, not typed in.")
    exercises.add_argument("--json", action="store_true", help="print JSON instead of tables")
    exercises.set_defaults(run=run_exercises)


# ----- demo ------------------------------------------------------------------------------
def demo(out_dir: Path, records_dir: Path | None = None) -> None:  # no records needed
    """Traffic, memory and Amdahl for the default workload, as JSON files plus a summary."""
    from attnlab.model import amdahl
    from attnlab.shapes import LESSON_SHAPE, PRESETS

    model = PRESETS[DEFAULT_PRESET]
    traffic_json = traffic_report(LESSON_SHAPE, score_dtype=model.score_dtype)
    memory_json = memory_report(LESSON_SHAPE, score_dtype=model.score_dtype,
                                layers=model.attention_layers)
    amdahl_json = amdahl_report(list(amdahl.LESSON_TIME_SHARES), amdahl.LESSON_KERNEL_SPEEDUP,
                                amdahl.LESSON_FLOP_SHARE, DEFAULT_PRESET,
                                int(DEFAULT_FLOP_SHARE_TOKENS))
    files = {"models-traffic.json": traffic_json, "models-memory.json": memory_json,
             "models-amdahl.json": amdahl_json}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, report in files.items():
        (out_dir / name).write_text(dumps(report) + "\n")
    console = new_console(120)
    console.print(f"\n[bold]models[/bold] ({LESSON_SHAPE.describe()}, logical bytes per head)")
    for row in traffic_json["rows"]:
        console.print(f"  {row['label']}: {human_bytes(row['total_bytes'])}")
    for ratio in traffic_json["ratios"]:
        console.print(f"  {ratio['label']}")
    by_name = {(i["name"], i["scope"]): i["bytes"] for i in memory_json["items"]}
    console.print(f"  S + P {human_bytes(by_name[('S + P', 'per head')])} per head, "
                  f"{human_bytes(by_name[('S + P, transient peak', 'per layer')])} per layer "
                  f"(heads in parallel)")
    speedups = ", ".join(f"{r['time_share']:.0%} -> {r['speedup']:.3f}x"
                         for r in amdahl_json["sensitivity"])
    console.print(f"  Amdahl at S_kernel = {amdahl.LESSON_KERNEL_SPEEDUP:g}x: {speedups}")
    console.print(f"  wrote {', '.join(files)}")
