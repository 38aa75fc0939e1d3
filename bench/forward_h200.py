"""Forward kernel on the H200: correctness at real sizes, config tuning, peer timings.

One call does everything so a lease is spent on measurements, not start-ups:

    PYTHONPATH=src python3 bench/forward_h200.py --out $OUT [--phases tune,correct,bench,profile]

Writes JSON lines to --out (correctness.jsonl, forward_tuning.jsonl,
prefill_forward.jsonl) and prints a short table last.  TFLOP/s count
4·B·H·Nq·Nk·d, halved when causal (the convention of ../shared/anchors).

A configuration of attnlab.measure.engine (phases, budgets, --out, environment,
records); inputs and the peers from measure.providers, timing from measure.timing, the
benchmark phase from measure.sweep; only the kernel-level phases (accuracy grid, config
tuning) call the launcher directly.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time

import torch

from attnlab.accuracy import check_accuracy
from attnlab.kernels import configs as config_table
from attnlab.kernels.configs import ForwardConfig, forward_config, length_bucket
from attnlab.kernels.forward import flash_forward
from attnlab.measure.engine import Bench
from attnlab.measure.providers import make_inputs as provider_inputs
from attnlab.measure.providers import parse_providers
from attnlab.measure.sweep import conventional_flops
from attnlab.measure.timing import time_call
from attnlab.shapes import AttentionShape

# Timed work per tuning candidate; short calls are timed as CUDA-graph replays.
TUNE_TIMING = {"target_ms": 60.0, "min_repeats": 10, "max_repeats": 200}
BENCH_TIMING = {"target_ms": 100.0, "min_repeats": 10, "max_repeats": 200}
BENCH_LENGTHS = {"d128": [1024, 2048, 4096, 8192, 16384], "d64": [1024, 4096, 16384],
                 "gqa_d256": [1024, 4096, 16384, 32768]}
FLEX_SOME = {"d128": [1024, 4096, 16384], "d64": [4096], "gqa_d256": [4096, 16384]}

bench = Bench("forward_h200", __doc__)
bench.option("--flex", nargs="?", const="some", choices=("some", "all"),
             help="add FlexAttention: at a few lengths per group, or at all")
bench.option("--groups", default="d128,d64,gqa_d256",
             help="the bench phase's shape groups (comma-separated)")


def flops(shape: AttentionShape) -> int:
    """4·B·H·Nq·Nk·d, halved when causal: the convention of the peers' anchors."""
    return conventional_flops(shape, "prefill")


def make_inputs(shape: AttentionShape, layout="bshd", seed=0):
    return provider_inputs(shape, layout, "cuda", seed=seed)


def time_ms(fn, inputs=((),)) -> tuple[float, float, float]:
    timing = time_call(fn, list(inputs), device="cuda", **TUNE_TIMING)
    return timing.p20, timing.p50, timing.p80


# ---------------------------------------------------------------------------
TUNE_GROUPS = {
    # name: (head_dim, query_heads, kv_heads, tokens, causal)
    "d128": (128, 16, 16, 16384, None),
    "d64": (64, 32, 32, 16384, None),
    "gqa_d256": (256, 24, 4, None, True),
}


def candidate_configs(head_dim: int, masked: bool) -> list[ForwardConfig]:
    """Run 1 (bench/results/runs/2026-11-29-run1) pruned the space: 128-row tiles
    want 8 warps, 64-row tiles 4; K/V through TMA gained nothing (bench/NOTES.md)."""
    shapes = [(64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8)]
    if head_dim == 256:
        shapes = [(64, 32, 4), (64, 64, 4), (128, 32, 8), (128, 64, 8), (64, 64, 8)]
    configs = []
    for block_m, block_n, warps in shapes:
        for stages in (2, 3, 4):
            smem = (block_m + 2 * stages * block_n) * head_dim * 2
            if smem > 228 * 1024:
                continue
            configs.append(ForwardConfig(block_m, block_n, warps, stages))
    return configs


def group_shape(group: str, seqlen: int, causal: bool) -> AttentionShape:
    head_dim, hq, hk, tokens, fixed_causal = TUNE_GROUPS[group]
    batch = max(1, tokens // seqlen) if tokens else 1
    return AttentionShape(batch=batch, query_heads=hq, kv_heads=hk, seqlen_q=seqlen, seqlen_k=seqlen,
                          head_dim=head_dim, dtype="bf16",
                          causal=causal if fixed_causal is None else fixed_causal)


def run_ours(shape, q, k, v, config):
    scale = 1.0 / math.sqrt(shape.head_dim)
    return lambda: flash_forward(q, k, v, layout="bshd", scale=scale, causal=shape.causal,
                                 config=config)


def check_config(config: ForwardConfig, like: AttentionShape):
    """Accuracy of one config on a small ragged shape with the same head dim and mask."""
    shape = like.replace(batch=1, query_heads=like.group_size * 2, kv_heads=2, seqlen_q=1000,
                         seqlen_k=1000 if like.causal else 1037)
    q, k, v = make_inputs(shape, seed=3)
    out, lse = run_ours(shape, q, k, v, config)()
    return check_accuracy(out, lse, q, k, v, causal=shape.causal, scale=shape.softmax_scale,
                          layout="bshd")


def bucket_lengths(group: str) -> list[int]:
    return [1024, 2048, 4096, 8192, 16384] if group != "gqa_d256" else [1024, 4096, 16384]


def tune_plan(args) -> list[tuple[str, bool, list[ForwardConfig]]]:
    """(group, causal, candidates at N = 4k) in the order they are tuned."""
    return [(group, causal, candidate_configs(TUNE_GROUPS[group][0], causal))
            for group in TUNE_GROUPS
            for causal in ((True,) if TUNE_GROUPS[group][4] else (False, True))]


@bench.phase("tune", cap_s=200.0, plan=tune_plan)
def phase_tune(ctx) -> dict:
    """Every candidate at N=4k per (group, causal); the best 4 of those at every length
    bucket; the winner per bucket becomes the TUNED table (printed for configs.py)."""
    tuned: dict[tuple[int, bool, int], ForwardConfig] = {}

    def log(**row):
        ctx.append_row("forward_tuning.jsonl", {"what": "forward_config", **row, **ctx.env})

    for group, causal, candidates in ctx.plan:
        shape = group_shape(group, 4096, causal)
        q, k, v = make_inputs(shape)
        scored = []
        for config in ctx.within_budget(candidates, label=lambda c, g=group: f"{g} {c}"):
            t0 = time.time()
            try:
                fn = run_ours(shape, q, k, v, config)
                fn()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                p20, p50, p80 = time_ms(fn)
                check = check_config(config, shape)
            except Exception as error:  # noqa: BLE001 - a config that cannot compile is data
                log(group=group, causal=causal, config=config.__dict__, error=str(error)[:300])
                continue
            log(group=group, causal=causal, shape=shape.as_dict(), config=config.__dict__,
                p20=p20, p50=p50, p80=p80, compile_s=compile_s, accurate=check.passed,
                error=check.error, tflops=flops(shape) / p50 / 1e9)
            if check.passed:
                scored.append((p50, config))
            else:
                print(f"tune: {config} FAILED accuracy", flush=True)
        scored.sort(key=lambda item: item[0])
        finalists = [c for _, c in scored[:4]]
        for seqlen in bucket_lengths(group):
            shape = group_shape(group, seqlen, causal)
            q, k, v = make_inputs(shape)
            timed = []
            for config in finalists:
                p20, p50, p80 = time_ms(run_ours(shape, q, k, v, config))
                log(group=group, causal=causal, shape=shape.as_dict(), config=config.__dict__,
                    p20=p20, p50=p50, p80=p80, tflops=flops(shape) / p50 / 1e9, stage="bucket")
                timed.append((p50, config))
            if timed:
                best_ms, best = min(timed, key=lambda item: item[0])
                key = (shape.head_dim, causal, length_bucket(seqlen))
                tuned[key] = best
                print(f"tune {group} causal={causal} N={seqlen}: {best} "
                      f"{flops(shape) / best_ms / 1e9:.0f} TFLOP/s", flush=True)
    ctx.path("tuned_configs.json").write_text(json.dumps(
        [{"head_dim_pad": d, "masked": m, "bucket": b, "config": c.__dict__}
         for (d, m, b), c in sorted(tuned.items())], indent=1))
    # The rest of this run uses the table just measured, as a user would once it is
    # pasted into attnlab/kernels/configs.py.
    config_table.TUNED.update(tuned)
    print("\nTUNED = {")
    for (d, m, b), c in sorted(tuned.items()):
        print(f"    ({d}, {m}, {b}): ForwardConfig({c.block_m}, {c.block_n}, {c.num_warps}, "
              f"{c.num_stages}),")
    print("}")
    return tuned


# Where the Gluon path's public call measured host-bound (bench/NOTES.md, attempt 14).
PROFILE_SHAPES = [("d128", 1024, True), ("d128", 2048, True), ("d128", 1024, False),
                  ("gqa_d256", 1024, True)]


@contextlib.contextmanager
def _kernel_forced(shape: AttentionShape, kernel: str):
    """The public path with this shape's bucket sent to the Gluon kernel (its default
    config) or kept off it, whatever the committed table says."""
    from attnlab.kernels import dispatch, forward_sm90

    table = dict(dispatch.FORWARD_SM90.table())
    key = (shape.head_dim, shape.causal, length_bucket(shape.seqlen_q))
    if kernel == "gluon":
        table[key] = forward_sm90.DEFAULT_CONFIGS[shape.head_dim]
    else:
        table.pop(key, None)
    with dispatch.table_override(dispatch.FORWARD_SM90, table):
        yield


@bench.phase("profile", default=False,
             plan=lambda args: [group_shape(*point) for point in PROFILE_SHAPES])
def phase_profile(ctx) -> None:
    """Host time of one public forward call on each kernel: launches only (no sync), the
    event-timed and the graph-replayed call, the kernels the profiler saw, and a cProfile
    of the Gluon path's host side."""
    from backward_h200 import call_profile, host_profile

    from attnlab.measure.providers import prepare, provider

    for index, shape in enumerate(ctx.plan):
        prepared = prepare(provider("attnlab"), shape, "prefill", "cuda")
        inputs = prepared.inputs()
        for kernel in ("gluon", "triton"):
            with _kernel_forced(shape, kernel):
                call = prepared.call
                host_ms, events, graph, kernels = call_profile(call, inputs)
                if kernel == "gluon" and index == 0:
                    ctx.path("forward_host_profile.txt").write_text(host_profile(call, inputs))
            ctx.append_row("forward_profile.jsonl", {
                "what": "forward_profile", "kernel": kernel, "shape": shape.as_dict(),
                "host_ms": host_ms, "event_ms": events, "graph_ms": graph, "kernels": kernels,
                **ctx.env})
            print(f"profile {shape.describe()} {kernel}: host {host_ms:.3f} ms/call, events "
                  f"{events:.3f}, graph {graph}; {', '.join(kernels)}", flush=True)


# ---------------------------------------------------------------------------
def correct_cases(args) -> list[tuple[AttentionShape, str]]:
    """The accuracy grid at real sizes, thinned deterministically so it fits a lease:
    every pair, head dim and mask appear, GQA ratios rotate, fp16 and bf16 alternate."""
    cases = []
    pairs = [(1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (108, 256), (1023, 1024), (4096, 4096)]
    pairs += [(b, a) for a, b in pairs if a != b]
    for (nq, nk) in pairs:
        for d in (32, 59, 64, 111, 128, 256):
            for (hq, hk) in ((4, 4), (6, 2), (4, 1)):
                for mask in ("none", "causal", "window", "softcap"):
                    cases.append((nq, nk, d, hq, hk, mask))
    cases = [c for i, c in enumerate(cases) if i % 5 == 0]
    return [(AttentionShape(batch=2, query_heads=hq, kv_heads=hk, seqlen_q=nq, seqlen_k=nk,
                            head_dim=d, dtype="bf16" if i % 2 else "fp16"), mask)
            for i, (nq, nk, d, hq, hk, mask) in enumerate(cases)]


@bench.phase("correct", plan=correct_cases)
def phase_correct(ctx):
    """The accuracy grid at real sizes, both layouts, fp16 and bf16."""
    env, rows, failures = ctx.env, [], 0
    for i, (shape, mask) in enumerate(ctx.plan):
        d = shape.head_dim
        q, k, v = make_inputs(shape, seed=i)
        options = dict(causal=mask == "causal", window=(37, 5) if mask == "window" else (-1, -1),
                       softcap=20.0 if mask == "softcap" else 0.0)
        scale = 1.0 / math.sqrt(d)
        out, lse = flash_forward(q, k, v, layout="bshd", scale=scale, **options)
        out2, _ = flash_forward(q, k, v, layout="bshd", scale=scale, **options)
        result = check_accuracy(out, lse, q, k, v, scale=scale, layout="bshd", **options)
        deterministic = torch.equal(out, out2)
        ok = result.passed and deterministic
        failures += not ok
        rows.append({"what": "forward_accuracy", "shape": shape.as_dict(), "mask": mask,
                     "error": result.error, "allowed": result.allowed,
                     "lse_rel_error": result.lse_error, "deterministic": deterministic,
                     "passed": ok, **env})
        if not ok:
            print(f"FAIL {shape.describe()} {mask}: err {result.error:.3e} allowed "
                  f"{result.allowed:.3e} lse {result.lse_error:.2e} det {deterministic}", flush=True)
    # Extreme logits stay finite.
    shape = AttentionShape(batch=1, query_heads=2, kv_heads=2, seqlen_q=257, seqlen_k=513, head_dim=64,
                           dtype="bf16")
    q, k, v = make_inputs(shape, seed=7)
    big = (q * 100).clamp(-1e4, 1e4)
    out, lse = flash_forward(big, k, v, layout="bshd", scale=1.0, causal=True)
    finite = bool(torch.isfinite(out).all())
    failures += not finite
    rows.append({"what": "forward_extreme_logits_finite", "passed": finite, **env})
    ctx.write_rows("correctness.jsonl", rows)
    print(f"correctness: {len(rows) - failures}/{len(rows)} passed", flush=True)
    ctx.fail(failures)


def bench_plan(args) -> list[tuple[str, bool, int, list]]:
    """(group, causal, N, providers) per point: attnlab and the peers, Flex where asked."""
    groups = [g for g in args.groups.split(",") if g]
    unknown = [g for g in groups if g not in BENCH_LENGTHS]
    if unknown:
        raise ValueError(f"--groups: unknown group {unknown[0]!r}; the groups are "
                         f"{', '.join(BENCH_LENGTHS)}")
    flex_lengths = {"some": FLEX_SOME, "all": BENCH_LENGTHS}.get(args.flex, {})
    peers, flex = parse_providers("attnlab,sdpa_cudnn,sdpa_flash"), parse_providers("flex")
    return [(group, causal, seqlen,
             peers + (flex if seqlen in flex_lengths.get(group, ()) else []))
            for group in groups
            for causal in ((True,) if TUNE_GROUPS[group][4] else (False, True))
            for seqlen in BENCH_LENGTHS[group]]


@bench.phase("bench", cap_s=240.0, plan=bench_plan)
def phase_bench(ctx) -> list:
    """attnlab through its public path (the committed/tuned table) against the peers:
    measure/'s sweep (each point checked against the reference, its kernels proven,
    SDPA pins entered outside the timed region), records upserted."""
    from attnlab.measure.sweep import run_sweep

    table = []
    for group, causal, seqlen, providers in ctx.plan:
        base = group_shape(group, seqlen, causal)
        results = run_sweep(providers, ["prefill"], [seqlen], base, device="cuda",
                            env=ctx.env, timing=BENCH_TIMING,
                            out=ctx.path("prefill_forward.jsonl"), deadline=ctx.deadline,
                            progress=False, flop_count="conventional")
        row = {}
        for result in results:
            if result.skipped:
                print(f"{result.provider} at {base.describe()}: "
                      f"{result.record['reason'][:160]}", flush=True)
            else:
                row[result.provider] = result.record["tflops"]
        table.append((group, causal, seqlen, row))
        print(f"{group} causal={causal} N={seqlen}: " +
              " ".join(f"{n}={t:.0f}" for n, t in row.items()), flush=True)
    return table


@bench.setup
def first_call(ctx) -> None:
    t0 = time.time()
    shape = group_shape("d128", 4096, False)
    q, k, v = make_inputs(shape)
    flash_forward(q, k, v, layout="bshd", scale=shape.softmax_scale)
    torch.cuda.synchronize()
    print(f"first call (compile + run) of the default d=128 config: {time.time() - t0:.1f} s "
          f"({forward_config(shape)})", flush=True)


@bench.finish
def print_table(ctx) -> None:
    print("\nTFLOP/s (bf16)                      attnlab / cudnn / flash / flex   vs cudnn  vs best")
    for group, causal, seqlen, row in ctx.results.get("bench") or []:
        nan = float("nan")
        ours, cudnn = row.get("attnlab", nan), row.get("sdpa_cudnn", nan)
        best_peer = max((t for n, t in row.items() if n != "attnlab"), default=nan)
        print(f"  {group:9s} causal={causal!s:5s} N={seqlen:6d}: {ours:6.0f} / {cudnn:6.0f} / "
              f"{row.get('sdpa_flash', nan):6.0f} / {row.get('flex', nan):6.0f}"
              f"   {ours / cudnn:5.2f}x   {ours / best_peer:5.2f}x")


if __name__ == "__main__":
    sys.exit(bench.main())
