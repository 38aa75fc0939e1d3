"""Issue 5 on the H200, in one call: kernels proven, sweeps timed, DRAM bytes counted.

    PYTHONPATH=src python3 bench/h200_measure.py            # writes under $OUT

Phases, in order (``--phases``); each has a time cap and the sweeps stop at the
run's budget, 450 s (points that do not fit are recorded as skipped, with that reason):

1. ceilings: a bf16 GEMM's TFLOP/s and a 2 GiB device copy's TB/s;
2. kernels: what one call of each main provider launches (torch.profiler), plus
   one Chrome trace of the typical eager baseline (test data for the parser);
3. ncu: N in {1k, 4k, 16k} x heads in {1, 32}, d=128, fp16, no mask, for eager,
   sdpa_flash, sdpa_cudnn and attnlab, in two Nsight Compute sessions (1k+4k, then
   16k; --clock-control none), compared with the cache-aware model;
4. ``prefill`` sweep (lesson-8b layer: 32 heads, d=128, fp16, causal) and ``decode``
   sweep (32 query / 8 KV heads) for every provider, each point checked against the
   reference and its kernel names recorded; FlexAttention last (``flex_prefill``,
   ``flex_decode``: it compiles).

Expected wall time: about 5-7 minutes; at most about 8 (ncu's two sessions are
capped at 120 + 150 s, the sweeps stop 450 s after the start).

Files under $OUT (8, at most one folder deep):
  records.jsonl            every bench record (ceilings, latency, skipped + reasons)
  kernels.json             kernel lists per provider
  trace_eager_typical.json profiler trace of one eager_typical call (parser test data)
  cache_model_vs_ncu.md    predicted vs measured DRAM bytes
  ncu/ncu_kernels.csv      ncu counters, long format (same as ../shared/anchors)
  ncu/ncu_raw.csv          ncu's own raw-page CSV
  ncu/summary.json         per-kernel summaries, comparisons, notes, failed cases
  log.txt                  this script's full output

A configuration of attnlab.measure.engine (phases, budget, --out, environment, records).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from attnlab.measure.engine import Bench

ROOT = Path(__file__).resolve().parents[1]
PREFILL_LENGTHS = [1024, 2048, 4096, 8192, 16384]
DECODE_LENGTHS = [1024, 4096, 16384, 65536]
FLEX_PREFILL_LENGTHS = [1024, 4096, 16384]
FLEX_DECODE_LENGTHS = [4096, 65536]
NCU_LENGTHS = [1024, 4096, 16384]
NCU_HEADS = [1, 32]
NCU_PROVIDERS = ["eager", "sdpa_flash", "sdpa_cudnn", "attnlab"]
TIMING = {"target_ms": 40.0, "min_repeats": 5, "max_repeats": 100}
RECORDS = "records.jsonl"

bench = Bench("h200_measure", __doc__, budget_s=450.0)


class Tee:
    """Everything printed (stdout and tracebacks) goes to the terminal and to log.txt."""

    def __init__(self, stream, log) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()


@bench.setup
def log_and_child_path(ctx) -> None:
    log = ctx.path("log.txt").open("w", encoding="utf-8")
    sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)
    # The ncu target is a child process: it must import this checkout's attnlab too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])


@bench.phase("ceilings")
def ceilings(ctx) -> None:
    """A bf16 GEMM's TFLOP/s and a 2 GiB device copy's TB/s."""
    from attnlab.measure.sweep import measure_ceilings

    measured = measure_ceilings(ctx.env)
    ctx.upsert(RECORDS, measured)
    for r in measured:
        print(f"  {r['kernel']}: {r['p50']:.1f} {r['unit']}")


def kernel_cases(args) -> list[tuple]:
    """(provider, phase, shape) of each kernel list."""
    from attnlab.measure.providers import provider
    from attnlab.measure.sweep import phase_shape
    from attnlab.shapes import preset

    lesson = preset("lesson-8b").shape(4096, causal=False)
    gqa = preset("qwen-gqa").shape(4096, causal=True)
    cases = [(name, "prefill", lesson) for name in
             ("eager", "eager_typical", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
              "sdpa_math", "attnlab")]
    cases += [(name, "prefill", lesson.replace(causal=True)) for name in ("sdpa", "attnlab")]
    cases += [(name, "prefill", gqa) for name in ("eager_typical", "sdpa", "attnlab")]
    cases += [(name, "decode", phase_shape(lesson.replace(kv_heads=8, causal=True), "decode",
                                           4096))
              for name in ("eager_typical", "sdpa", "sdpa_flash", "sdpa_cudnn", "attnlab")]
    for name, _, _ in cases:
        provider(name)  # a renamed provider fails here, on a CPU
    return cases


@bench.phase("kernels", cap_s=45.0, plan=kernel_cases)
def kernels_section(ctx) -> None:
    """What one call of each main provider launches, plus one trace of eager_typical."""
    import torch

    from attnlab.measure.dispatch import profile_call
    from attnlab.measure.profile import short_name
    from attnlab.measure.providers import prepare, provider
    from attnlab.shapes import preset

    out = []
    for name, phase, shape in ctx.within_budget(ctx.plan, label=lambda case: case[0]):
        try:
            call = prepare(provider(name), shape, phase, "cuda")
            inputs = call.inputs()
            kernels = profile_call(call.call, inputs)
            out.append({"provider": name, "phase": phase, "shape": shape.as_dict(),
                        **kernels.as_dict()})
            print(f"  {name:14s} {phase:7s} {shape.describe():60s} {kernels.launches:3d} launches, "
                  f"{100 * kernels.outside_gemm_share:5.1f}% outside GEMMs: "
                  + ", ".join(short_name(k.name, 40) for k in kernels.kernels[:4]))
        except Exception as error:
            message = " ".join(str(error).split())[:300]
            out.append({"provider": name, "phase": phase, "shape": shape.as_dict(),
                        "error": f"{type(error).__name__}: {message}"})
            print(f"  {name:14s} {phase:7s} failed: {type(error).__name__}: {message}")
        torch.cuda.empty_cache()
    # A captured trace for the parser's test: the post's GQA baseline, small enough to commit.
    try:
        small = preset("qwen-gqa").shape(1024, causal=True)
        call = prepare(provider("eager_typical"), small, "prefill", "cuda")
        profile_call(call.call, call.inputs(), trace_path=ctx.path("trace_eager_typical.json"))
    except Exception:
        traceback.print_exc()
    ctx.path("kernels.json").write_text(json.dumps(out, indent=1))


@bench.phase("ncu")
def ncu_section(ctx) -> list:
    """Two ncu sessions (short lengths, then 16k; capped at 120 + 150 s), so a slow one
    cannot lose the other; compared with the cache-aware model."""
    from attnlab.measure import ncu
    from attnlab.measure.compare import compare_cases, comparison_markdown, predicted_kernel_count
    from attnlab.measure.sweep import phase_shape
    from attnlab.shapes import AttentionShape

    binary = ncu.find_ncu()
    if binary is None:
        print("  ncu not found on PATH, $NCU or /usr/local/cuda/bin: skipped")
        return []

    def cases(lengths):
        return [(p, "prefill", phase_shape(AttentionShape(query_heads=h, kv_heads=h,
                                                          head_dim=128, dtype="fp16"),
                                           "prefill", n))
                for n in lengths for h in NCU_HEADS for p in NCU_PROVIDERS]

    kernels, raw_parts, summary = [], [], {"sessions": []}
    for lengths, timeout in ((NCU_LENGTHS[:-1], 120.0), (NCU_LENGTHS[-1:], 150.0)):
        work = Path(tempfile.mkdtemp(prefix="attnlab-ncu-"))
        session = cases(lengths)
        print(f"  session N={lengths}: {len(session)} cases, timeout {timeout:.0f} s",
              flush=True)
        try:
            run = ncu.run_ncu(session, work, ncu=binary, timeout_s=timeout,
                              kernel_counts=predicted_kernel_count)
        except Exception as error:
            print(f"  ncu failed: {error}")
            log = work / "ncu_log.txt"
            if log.exists():
                print("  ncu log tail:\n    " + "\n    ".join(log.read_text().splitlines()[-15:]))
            summary["sessions"].append({"lengths": lengths, "error": str(error)})
            continue
        for kernel in run.kernels:  # IDs restart per session; keep them unique in one file
            kernel.id += 10000 * len(summary["sessions"])
        kernels += run.kernels
        raw_parts.append(run.raw_csv.read_text())
        log_text = (work / "ncu_log.txt").read_text() if (work / "ncu_log.txt").exists() else ""
        summary["sessions"].append({
            "lengths": lengths, "ncu_command": run.command, "metrics": run.metrics,
            "notes": run.notes, "failed_cases": run.failed_cases,
            "ncu_log_tail": log_text.splitlines()[-30:]})
        for label, reason in run.failed_cases.items():
            print(f"  case failed: {label}: {reason[:200]}")
        for note in run.notes:
            print(f"  note: {note}")
    comparisons = []
    if kernels:
        ncu.write_long_csv(kernels, ctx.path("ncu/ncu_kernels.csv"))
        ctx.path("ncu/ncu_raw.csv").write_text("\n==attnlab== next ncu session\n".join(raw_parts))
        comparisons = compare_cases(kernels)
        ctx.path("cache_model_vs_ncu.md").write_text(comparison_markdown(comparisons))
        summary["kernels"] = [k.summary() for k in kernels]
        summary["comparisons"] = [c.as_dict() for c in comparisons]
    ctx.path("ncu/summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return comparisons


def sweep_plan(name: str):
    """The plan of one sweep phase: its points (provider, phase, length, base shape)."""
    def plan(args) -> list[tuple]:
        from attnlab.measure.providers import PROVIDERS, parse_providers
        from attnlab.shapes import preset

        prefill = preset("lesson-8b").shape(4096, causal=True)
        decode = prefill.replace(kv_heads=8)
        not_flex = [p for p in PROVIDERS.values() if p.name != "flex"]
        flex = parse_providers("flex")
        providers, phase, lengths, base = {
            "prefill": (not_flex, "prefill", PREFILL_LENGTHS, prefill),
            "decode": (not_flex, "decode", DECODE_LENGTHS, decode),
            "flex_prefill": (flex, "prefill", FLEX_PREFILL_LENGTHS, prefill),
            "flex_decode": (flex, "decode", FLEX_DECODE_LENGTHS, decode)}[name]
        return [(p, phase, n, base) for p in providers for n in lengths]
    return plan


def sweep(ctx) -> list:
    """Every provider over lengths (measure.sweep): checked, its kernels proven, timed."""
    from attnlab.measure.sweep import run_sweep

    providers = list({point[0].name: point[0] for point in ctx.plan}.values())
    lengths = list(dict.fromkeys(point[2] for point in ctx.plan))
    _, phase, _, base = ctx.plan[0]
    return run_sweep(providers, [phase], lengths, base, device="cuda", env=ctx.env,
                     timing=TIMING, out=ctx.path(RECORDS), deadline=ctx.deadline,
                     progress=False)


for _name, _cap in (("prefill", 80.0), ("decode", 40.0), ("flex_prefill", 40.0),
                    ("flex_decode", 25.0)):
    bench.phase(_name, cap_s=_cap, plan=sweep_plan(_name))(sweep)


@bench.finish
def summary(ctx) -> None:
    results = [r for name in ("prefill", "decode", "flex_prefill", "flex_decode")
               for r in ctx.results.get(name) or []]
    print_summary([r.record for r in results], ctx.results.get("ncu") or [])
    print(f"\nfiles in {ctx.out_dir}:")
    for path in sorted(p for p in ctx.out_dir.rglob("*") if p.is_file()):
        print(f"  {path.relative_to(ctx.out_dir)}  ({path.stat().st_size:,} bytes)")


def print_summary(records: list[dict], comparisons: list) -> None:
    from attnlab.measure.compare import markdown_table
    from attnlab.measure.profile import short_name

    for phase in ("prefill", "decode"):
        rows = [r for r in records if r["phase"] == phase]
        if not rows:
            continue
        key = "seqlen_k" if phase == "decode" else "seqlen_q"
        lengths = sorted({r["shape"][key] for r in rows})
        print(f"\n{phase}: median ms per call ({'KV length' if phase == 'decode' else 'N'} "
              f"across; '-' = skipped, reasons below)")
        print(f"  {'provider':15s}" + "".join(f"{n:>10d}" for n in lengths) + "   main kernel")
        providers = sorted({r["provider"] for r in rows},
                           key=lambda p: [r["provider"] for r in rows].index(p))
        for provider_name in providers:
            cells, kernel = [], ""
            for n in lengths:
                match = [r for r in rows if r["provider"] == provider_name and r["shape"][key] == n]
                if match and match[0]["metric"] == "latency":
                    cells.append(f"{match[0]['p50']:10.4f}")
                    names = [m for m in match[0]["kernel_names"] if not m.startswith("Memset")]
                    if names:
                        kernel = f"{len(names)} kernel(s): {short_name(names[0], 38)}"
                else:
                    cells.append(f"{'-':>10s}")
            print(f"  {provider_name:15s}" + "".join(cells) + f"   {kernel}")
    reasons: dict[str, set] = {}
    for r in records:
        if r["metric"] == "skipped":
            reasons.setdefault(r["provider"], set()).add(r["reason"][:150])
    if reasons:
        print("\nskipped:")
        for provider_name, why in reasons.items():
            print(f"  {provider_name}: " + " | ".join(sorted(why))[:300])
    if comparisons:
        print("\nDRAM bytes, ncu vs the cache-aware model (MB):")
        print(markdown_table(comparisons))
        met = sum(c.meets_goal for c in comparisons)
        print(f"within 15%: {met} of {len(comparisons)} cases")


if __name__ == "__main__":
    sys.exit(bench.main())
