"""The seed's comparison on the H200: eager, SDPA, FlashAttention-4, FlashInfer and attnlab.

    pip install -q --no-compile --no-deps --no-index --target /tmp/peers \\
        $(awk '!/^#/{print ".whl/peers/"$1}' .whl/peers/WHEELS.txt)
    PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages:src \\
        python3 bench/seed_h200.py --out $OUT/seed --budget-s 290

(The wheels and why each: docs/performance.md; the second PYTHONPATH entry is the CuTe
DSL's packages, which its wheel's .pth file would add in a site folder.)  About 290 s
of budget plus the install: the phases' caps (--<phase>-budget) share it.

The post's layer (the ``qwen-gqa`` preset): batch 1, 24 query heads sharing 4 KV heads,
head dim 256, bf16.  One records file per table in --out, every provider in one run:

* ``seed_prefill.jsonl``: causal prefill at N = 1k ... 32k;
* ``seed_decode_b1.jsonl``, ``seed_decode_b16.jsonl``: one query token over a full cache
  of 1k ... 128k tokens, batch 1 and 16; contiguous, and on 16-token pages (the
  ``*_paged16`` providers);
* ``seed_fwdbwd.jsonl``: forward + backward at N = 1k, 4k, 16k (FA4 has a Hopper backward);
* ``--phases ...,ncu`` (not by default): Nsight Compute on each provider's kernels at
  prefill 4k and decode batch 1 x 32k (``ncu/``, the project's ncu runner).

Each point goes through ``measure.sweep.measure_point``: the provider's reason when it
cannot run (a skipped record), else its output against float64 (the first sequence), the
kernels it launched (it must launch its own: ``Provider.kernels``) and its median latency.
Decode is timed under CUDA-graph replay (a provider whose capture fails is timed with
events and its record says so), prefill by the timer's rule (graphs for calls under
0.1 ms); every graph-timed record has its un-captured time beside it (metric
``latency_uncaptured``: the same call launched from Python, as a caller without graphs
sees it).  TFLOP/s count 4·B·H·N²·d, halved when causal; TB/s the compulsory bytes.

Compile time is in the budget and reported (``jit.jsonl``, the closing table):
FlashInfer's nvcc builds start at once in a background thread beside the GPU work
(``measure.peer_jit``; cache under /tmp, this GPU's architecture only); a FlashInfer point
whose module is still building is measured at the end of its table.  The first call of
every provider in every table (FA4's CuTe compile, Triton's, a FlashInfer module load) is
timed on its own; a provider whose first call fails is recorded with that reason for the
whole table and the run goes on.  Records are written point by point; points the budget
did not reach are recorded as such.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from attnlab.measure import records as rec
from attnlab.measure.engine import BUDGET_SPENT, Bench
from attnlab.measure.providers import PROVIDERS, ProviderUnavailable, prepare, provider
from attnlab.measure.sweep import measure_point, point_command
from attnlab.shapes import AttentionShape, format_tokens, preset

LAYER = preset("qwen-gqa")
PREFILL_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DECODE_CACHES = (1024, 4096, 16384, 32768, 65536, 131072)
FWDBWD_LENGTHS = (1024, 4096, 16384)
QUICK = {"prefill": (1024, 4096), "decode": (1024, 32768), "fwdbwd": (1024,)}
TABLES = {"prefill": "seed_prefill.jsonl", "decode_b1": "seed_decode_b1.jsonl",
          "decode_b16": "seed_decode_b16.jsonl", "fwdbwd": "seed_fwdbwd.jsonl"}
PROVIDERS_OF = {
    "prefill": ("eager_typical", "eager", "sdpa_cudnn", "sdpa_flash", "attnlab", "fa4",
                "flashinfer"),
    "decode": ("eager_typical", "eager", "sdpa_cudnn", "sdpa_flash", "attnlab_decode",
               "attnlab_decode_paged16", "fa4", "fa4_paged16", "flashinfer",
               "flashinfer_paged16"),
    "fwdbwd": ("eager", "sdpa_cudnn", "sdpa_flash", "attnlab", "fa4"),
}
# Providers whose modules FlashInfer builds in the background.
PREBUILT = ("flashinfer", "flashinfer_paged16")
# Timed work per point; decode forced under graphs (the timer's own rule estimates with a
# host clock: a 20 us kernel behind 300 us of Python would be event-timed).
TIMING = {"target_ms": 40.0, "min_repeats": 5, "max_repeats": 200}
PHASE_TIMING = {"prefill": {**TIMING, "cuda_graph": None}, "decode": {**TIMING, "cuda_graph": True},
                "fwdbwd": {**TIMING, "cuda_graph": None}}
FLOP_COUNT = "conventional"
NCU_POINTS = (("prefill", 1, 4096), ("decode", 1, 32768))

bench = Bench("seed_h200", __doc__, budget_s=300.0,
              command="PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages:src "
                      "python3 bench/seed_h200.py")
bench.option("--quick", action="store_true", help="two lengths per table (a smoke run)")
bench.option("--flex", action="store_true", help="add FlexAttention (torch.compile per shape)")
bench.option("--providers", default=None,
             help="comma-separated providers instead of each table's list (kept per table "
                  "when the provider has that phase)")


def log(*args) -> None:
    print(*args, flush=True)


@dataclass(frozen=True)
class Point:
    table: str
    phase: str
    shape: AttentionShape
    provider: str

    def label(self) -> str:
        return f"{self.provider} {self.shape.describe()}"


def table_providers(args, phase: str) -> tuple[str, ...]:
    if args.providers:
        names = tuple(n.strip() for n in args.providers.split(",") if n.strip())
        for name in names:
            provider(name)  # an unknown name is refused by name, before any GPU work
        return tuple(n for n in names if phase in PROVIDERS[n].phases)
    names = PROVIDERS_OF[phase]
    if args.flex and phase != "fwdbwd":
        names = (*names, "flex")
    return names


def lengths(args, phase: str) -> tuple[int, ...]:
    if args.quick:
        return QUICK[phase]
    return {"prefill": PREFILL_LENGTHS, "decode": DECODE_CACHES, "fwdbwd": FWDBWD_LENGTHS}[phase]


def table_plan(table: str, phase: str, batch: int = 1):
    """Points outer, providers inner: a budget that runs out leaves every provider measured
    at the shorter lengths rather than some providers at all of them."""
    def plan(args) -> list[Point]:
        points = []
        for length in lengths(args, phase):
            shape = LAYER.shape(length, batch=batch, causal=True)
            if phase == "decode":
                shape = shape.replace(seqlen_q=1)
            points += [Point(table, phase, shape, name) for name in table_providers(args, phase)]
        return points
    return plan


# ----- the run's state: prebuilds, first calls ----------------------------------------------
@dataclass
class RunState:
    prebuild: object | None = None            # measure.peer_jit.FlashInferPrebuild
    prebuild_note: str | None = None
    first_calls: dict = field(default_factory=dict)   # (table, provider) -> row
    started: float = field(default_factory=time.monotonic)

    def module(self, point: Point) -> str | None:
        """The FlashInfer module this point's call needs, when it is built here."""
        if point.provider not in PREBUILT or self.prebuild is None:
            return None
        from attnlab.measure.peer_jit import module_for

        return module_for(point.provider, point.phase, point.shape.batch)

    def ready(self, point: Point) -> bool:
        """False while the FlashInfer module this point's call needs is being built."""
        module = self.module(point)
        return module is None or self.prebuild.done(module)

    def build_error(self, point: Point) -> str | None:
        """Why this point's module failed to build (its call would only compile again)."""
        module = self.module(point)
        build = None if module is None else self.prebuild.builds.get(module)
        if build is None or build.error is None:
            return None
        return f"failed: FlashInfer's JIT build of its {module} module failed: {build.error}"


@bench.setup
def setup(ctx) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    state = ctx.results["state"] = RunState()
    capability = tuple(torch.cuda.get_device_capability())
    log(f"GPU {torch.cuda.get_device_name()} sm_{capability[0]}{capability[1]}, "
        f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    plans = bench.plans(ctx.args, [bench.phases[name] for name in ctx.phases])
    wanted = {case[0] if isinstance(case, tuple) else case.provider
              for plan in plans.values() for case in plan or []}
    if not wanted & set(PREBUILT):
        return
    from attnlab.measure import peer_jit

    try:
        settings = peer_jit.configure_flashinfer(peer_jit.DEFAULT_CACHE, capability)
        reason = PROVIDERS["flashinfer"].checker(LAYER.shape(1024), "prefill")
        if reason:
            state.prebuild_note = f"no prebuild: {reason}"
        else:
            specs = peer_jit.module_specs(torch.bfloat16, LAYER.head_dim, capability)
            state.prebuild = peer_jit.FlashInferPrebuild(specs).start()
            state.prebuild_note = f"prebuild started ({settings})"
    except Exception as error:  # noqa: BLE001 - the providers then compile in the foreground
        state.prebuild_note = f"no prebuild: {type(error).__name__}: {error}"
    log(f"FlashInfer: {state.prebuild_note}")
    ctx.append_row("jit.jsonl", {"what": "flashinfer prebuild", "note": state.prebuild_note,
                                 **ctx.env})


# ----- one point -------------------------------------------------------------------------------
def first_call(ctx, point: Point) -> str | None:
    """Time the provider's first call in this table (compilation, module load, library
    initialisation); the reason when it fails, which then stands for the whole table."""
    state: RunState = ctx.results["state"]
    key = (point.table, point.provider)
    if key in state.first_calls:
        return state.first_calls[key]["error"]
    row = {"what": "first call", "table": point.table, "provider": point.provider,
           "phase": point.phase, "shape": point.shape.as_dict(), "seconds": None, "error": None}
    begin = time.monotonic()
    try:
        call = prepare(PROVIDERS[point.provider], point.shape, point.phase, "cuda")
        inputs = call.inputs(seed=0)
        call.call(*inputs)
        torch.cuda.synchronize()
        row["seconds"] = round(time.monotonic() - begin, 2)
        del call, inputs
    except ProviderUnavailable:
        row["seconds"] = 0.0  # measure_point records the provider's own reason
    except Exception as error:  # noqa: BLE001 - a failing first call is this table's result
        traceback.print_exc()
        row["seconds"] = round(time.monotonic() - begin, 2)
        row["error"] = (f"failed on its first call: {type(error).__name__}: "
                        f"{' '.join(str(error).split())[:400]}")
    torch.cuda.empty_cache()
    state.first_calls[key] = row
    ctx.append_row("jit.jsonl", {**row, **ctx.env})
    if row["seconds"] and row["seconds"] > 1.0:
        log(f"  first call of {point.provider} ({point.table}): {row['seconds']:.1f} s")
    return row["error"]


def uncaptured_record(result, timing: dict, env: dict) -> dict:
    """The un-captured time of a graph-timed point, as a record beside it."""
    main, timed = result.record, result.uncaptured
    factor = main["p50"] / timed.p50
    command = point_command(PROVIDERS[main["provider"]], main["phase"], result.shape,
                            {**timing, "cuda_graph": False}, FLOP_COUNT)
    return rec.make_record(
        kernel="call", provider=main["provider"], phase=main["phase"], shape=main["shape"],
        metric="latency_uncaptured", unit="ms", p20=timed.p20, p50=timed.p50, p80=timed.p80,
        repeats=timed.repeats, env={**env, "command": command},
        tflops=None if main["tflops"] is None else main["tflops"] * factor,
        tbps=None if main["tbps"] is None else main["tbps"] * factor,
        kernel_names=main["kernel_names"], timing_method=timed.describe_method())


def measure(ctx, point: Point) -> list[dict]:
    env, timing = ctx.env, PHASE_TIMING[point.phase]
    p = PROVIDERS[point.provider]
    failure = ctx.results["state"].build_error(point) or first_call(ctx, point)
    if failure:
        point_env = {**env, "command": point_command(p, point.phase, point.shape, timing,
                                                     FLOP_COUNT)}
        return [rec.skipped_record(provider=p.name, phase=point.phase, shape=point.shape,
                                   reason=failure, env=point_env)]
    options = dict(device="cuda", env=env, check_batches=1, time_uncaptured=True,
                   flop_count=FLOP_COUNT)
    result = measure_point(p, point.shape, point.phase, timing=timing, **options)
    if result.skipped and timing.get("cuda_graph") and result.record["reason"].startswith("failed"):
        # A call that cannot be captured is timed with events (its timing_method says so).
        log(f"  {p.name}: {result.record['reason'][:120]}; again without CUDA graphs")
        result = measure_point(p, point.shape, point.phase, timing={**timing, "cuda_graph": False},
                               **options)
    out = [result.record]
    if result.uncaptured is not None:
        out.append(uncaptured_record(result, timing, env))
    return out


def describe(record: dict) -> str:
    if record["metric"] == rec.SKIPPED:
        return f"skip ({record['reason'][:110]})"
    field, unit, digits = (("tbps", "TB/s", 2) if record["phase"] == "decode"
                           else ("tflops", "TFLOP/s", 0))
    rate = "-" if record[field] is None else f"{record[field]:.{digits}f} {unit}"
    method = (record.get("timing_method") or "").split(",")[0]
    return f"{record['p50'] * 1e3:9.1f} us  {rate}  [{method}]"


def measure_points(ctx, points: list[Point]) -> set[Point]:
    """Measure points while the phase has time, each record written as it comes; the
    points measured."""
    done = set()
    for point in ctx.within_budget(points, label=Point.label):
        try:
            records = measure(ctx, point)
        except Exception as error:  # noqa: BLE001 - the run goes on
            traceback.print_exc()
            point_env = {**ctx.env, "command": ctx.command}
            records = [rec.skipped_record(provider=point.provider, phase=point.phase,
                                          shape=point.shape, env=point_env,
                                          reason=f"failed: {type(error).__name__}: {error}")]
        gc.collect()
        torch.cuda.empty_cache()
        ctx.upsert(TABLES[point.table], records)
        ctx.results.setdefault("records", {}).setdefault(point.table, []).extend(records)
        done.add(point)
        log(f"  {point.provider:24s} {format_tokens(point.shape.seqlen_k):>5s}  "
            f"{describe(records[0])}")
    return done


def record_unmeasured(ctx, points: list[Point], reason: str) -> None:
    """Points the budget did not reach, recorded as such (never silently forgotten)."""
    for point in points:
        command = point_command(PROVIDERS[point.provider], point.phase, point.shape,
                                PHASE_TIMING[point.phase], FLOP_COUNT)
        record = rec.skipped_record(provider=point.provider, phase=point.phase,
                                    shape=point.shape, reason=reason,
                                    env={**ctx.env, "command": command})
        ctx.upsert(TABLES[point.table], [record])
        ctx.results.setdefault("records", {}).setdefault(point.table, []).append(record)


BUILDING = ("not measured: FlashInfer's JIT build was still running when the run's time "
            "ran out")


def run_table(ctx) -> None:
    """The phase's points; FlashInfer's, while its modules are still building, go to the
    ``deferred`` phase (or wait at the end of this one when that phase is not run)."""
    state: RunState = ctx.results["state"]
    ready = [point for point in ctx.plan if state.ready(point)]
    later = [point for point in ctx.plan if point not in ready]
    done = measure_points(ctx, ready)
    record_unmeasured(ctx, [point for point in ready if point not in done], BUDGET_SPENT)
    if "deferred" in ctx.phases:
        ctx.results.setdefault("deferred", []).extend(later)
    elif later:
        finish_deferred(ctx, later)


def finish_deferred(ctx, points: list[Point]) -> None:
    """Wait (within the phase's time) for the builds, then measure the points whose module
    is built; the others are recorded as still building."""
    if not points:
        return
    state: RunState = ctx.results["state"]
    if not all(state.ready(point) for point in points):
        waited = state.prebuild.wait(ctx.deadline - time.monotonic())
        log(f"  waited {waited:.0f} s for FlashInfer's builds "
            f"({'done' if state.prebuild.done() else 'still running'})")
    ready = [point for point in points if state.ready(point)]
    done = measure_points(ctx, ready)
    record_unmeasured(ctx, [point for point in ready if point not in done], BUDGET_SPENT)
    record_unmeasured(ctx, [point for point in points if point not in ready], BUILDING)


# ----- the tables -------------------------------------------------------------------------------
@bench.phase("prefill", cap_s=80.0, plan=table_plan("prefill", "prefill"))
def prefill(ctx):
    """Causal prefill, batch 1, N = 1k to 32k (seed_prefill.jsonl)."""
    return run_table(ctx)


@bench.phase("decode_b1", cap_s=55.0, plan=table_plan("decode_b1", "decode"))
def decode_b1(ctx):
    """Decode, batch 1, cache 1k to 128k, contiguous and paged 16 (seed_decode_b1.jsonl)."""
    return run_table(ctx)


@bench.phase("decode_b16", cap_s=65.0, plan=table_plan("decode_b16", "decode", batch=16))
def decode_b16(ctx):
    """Decode, batch 16, cache 1k to 128k, contiguous and paged 16 (seed_decode_b16.jsonl)."""
    return run_table(ctx)


@bench.phase("fwdbwd", cap_s=35.0, plan=table_plan("fwdbwd", "fwdbwd"))
def fwdbwd(ctx):
    """Forward + backward, causal, batch 1, N = 1k, 4k and 16k (seed_fwdbwd.jsonl)."""
    return run_table(ctx)


@bench.phase("deferred", cap_s=70.0)
def deferred(ctx):
    """The points whose provider's module was still building when their table ran
    (FlashInfer), after its builds, into their tables' files."""
    finish_deferred(ctx, ctx.results.get("deferred", []))


def ncu_cases(args) -> list[tuple[str, str, AttentionShape]]:
    cases = []
    for phase, batch, length in NCU_POINTS:
        shape = LAYER.shape(length, batch=batch, causal=True)
        if phase == "decode":
            shape = shape.replace(seqlen_q=1)
        cases += [(name, phase, shape) for name in table_providers(args, phase)
                  if not name.startswith("eager")]
    return cases


@bench.phase("ncu", default=False, cap_s=120.0, plan=ncu_cases)
def ncu(ctx):
    """Nsight Compute on each provider's kernels at prefill 4k and decode 1 x 32k (ncu/)."""
    from attnlab.measure.ncu import find_ncu, run_ncu

    if find_ncu() is None:
        log("ncu: Nsight Compute (ncu) not found; skipped")
        return None
    budget = max(10.0, ctx.deadline - time.monotonic())
    run = run_ncu(ctx.plan, ctx.path("ncu"), timeout_s=budget)
    ctx.write_rows("ncu/ncu_summary.jsonl", [kernel.summary() for kernel in run.kernels])
    for label, status in run.failed_cases.items():
        log(f"ncu: {label}: {status[:200]}")
    log(f"ncu: {len(run.kernels)} kernels profiled ({run.long_csv}); " + "; ".join(run.notes))
    return run


# ----- the closing table -----------------------------------------------------------------------
PEERS_SHOWN = ("sdpa_cudnn", "sdpa_flash", "fa4", "flashinfer", "flex")


def fastest_peer(row: dict) -> dict | None:
    """The fastest measured provider at a point that is neither attnlab nor eager."""
    peers = [r for name, r in row.items()
             if not name.startswith(("attnlab", "eager")) and r["metric"] == "latency"]
    return min(peers, key=lambda r: r["p50"], default=None)


@bench.finish
def print_tables(ctx) -> None:
    state: RunState = ctx.results.get("state") or RunState()
    for table in TABLES:
        measured = [r for r in ctx.results.get("records", {}).get(table, [])
                    if r["metric"] in ("latency", rec.SKIPPED)]
        if not measured:
            continue
        names = list(dict.fromkeys(r["provider"] for r in measured))
        by_point: dict[int, dict] = {}
        for r in measured:
            by_point.setdefault(r["shape"]["seqlen_k"], {})[r["provider"]] = r
        log(f"\n{table} ({TABLES[table]}): median us; '-' not measured (reason in the records)")
        log("N | " + " | ".join(names) + " | fastest peer | attnlab / peer")
        for length, row in sorted(by_point.items()):
            cells = ["-" if row.get(n) is None or row[n]["metric"] != "latency"
                     else f"{row[n]['p50'] * 1e3:.1f}" for n in names]
            peer = fastest_peer(row)
            ours = next((row[n] for n in ("attnlab_decode", "attnlab") if n in row
                         and row[n]["metric"] == "latency"), None)
            ratio = f"{peer['p50'] / ours['p50']:.2f}x" if peer and ours else "-"
            log(f"{format_tokens(length)} | " + " | ".join(cells) +
                f" | {peer['provider'] if peer else '-'} | {ratio}")
    log("\nfirst calls (compile, load, initialisation), seconds:")
    for (table, name), row in state.first_calls.items():
        if row["error"] or (row["seconds"] or 0) >= 1.0:
            log(f"  {table:10s} {name:24s} {row['seconds']}" + (f"  {row['error'][:100]}"
                                                                if row["error"] else ""))
    if state.prebuild is not None:
        for build in state.prebuild.rows():
            log(f"  FlashInfer build {build['module']}: {build['seconds']} s"
                + (f"  FAILED {build['error']}" if build["error"] else ""))
        ctx.write_rows("flashinfer_builds.jsonl", [{**b, **ctx.env} for b in state.prebuild.rows()])
    log(f"wall {time.monotonic() - state.started:.0f} s")


if __name__ == "__main__":
    sys.exit(bench.main())
