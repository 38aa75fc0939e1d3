"""The Gluon sm_90 forward (attnlab.kernels.forward_sm90) on the H200: accuracy, a sweep of
its meta-parameters against today's Triton kernel and SDPA-cuDNN, and the SASS evidence.

    ATTNLAB_GIT_COMMIT=<sha> PYTHONPATH=src python3 bench/sm90_h200.py --out $OUT [--quick]
        [--phases accuracy,sweep,sass]

About 4 minutes (compiles included).  Writes into --out:
  sm90_accuracy.jsonl   one row per accuracy case (the project's rule, check_accuracy)
  sm90_forward.jsonl    one contract record per timing (attnlab.measure.records)
  sm90_winners.json     per (head_dim, causal, length bucket): the faster attnlab kernel,
                        the best sm90 config, and the ratios to cuDNN (a tuning step's input)
  sm90_sass/            cuobjdump --dump-sass of the compiled variants + their evidence
TFLOP/s count 4·B·H·N²·d, halved when causal.  A config that fails accuracy is not timed.
A configuration of attnlab.measure.engine (phases, --sweep-budget, --out, environment,
records); on a GPU without the sm_90 kernel it says why and exits 2.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
import time
import traceback

import torch

from attnlab.accuracy import check_accuracy
from attnlab.kernels import forward_sm90 as sm90
from attnlab.kernels._sm90 import SHARED_MEMORY_LIMIT, disassemble
from attnlab.kernels.configs import forward_config, length_bucket
from attnlab.kernels.forward import flash_forward
from attnlab.measure.engine import Bench, Unavailable
from attnlab.measure.providers import prepare, provider
from attnlab.measure.records import make_record
from attnlab.measure.timing import time_call
from attnlab.shapes import AttentionShape

TOKENS = 16384  # batch * seqlen

bench = Bench("sm90_h200", __doc__)
bench.option("--quick", action="store_true", help="N=4k only, two configs per d")
bench.option("--head-dims", default="128,64,256",
             help="head dims the sweep times (256 = the GQA layer)")
bench.option("--gqa-seqlens", default="1024,4096,16384",
             help="sequence lengths of the d=256 GQA layer (24 q / 4 kv heads, causal)")
bench.option("--schedules", default=",".join(sm90.SCHEDULES))
bench.option("--rescales", default="late", help=f"of {sm90.RESCALES}")
bench.option("--stores", default="direct", help=f"of {sm90.STORES}")


def flops(shape: AttentionShape) -> float:
    full = 4 * shape.batch * shape.query_heads * shape.seqlen_q * shape.seqlen_k * shape.head_dim
    return full / 2 if shape.causal else full


def rand_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(h, n):
        dims = (batch, n, h, head_dim) if layout == "bshd" else (batch, h, n, head_dim)
        return torch.randn(dims, generator=gen, device="cuda", dtype=dtype)

    return draw(heads, seqlen_q), draw(kv_heads, seqlen_k), draw(kv_heads, seqlen_k)


def accuracy_case(q, k, v, *, layout, causal, config=None) -> dict:
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = sm90.flash_forward_sm90(q, k, v, layout=layout, scale=scale, causal=causal,
                                       config=config)
    again, _ = sm90.flash_forward_sm90(q, k, v, layout=layout, scale=scale, causal=causal,
                                       config=config)
    result = check_accuracy(out, lse, q, k, v, causal=causal, scale=scale, layout=layout)
    return {"error": result.error, "allowed": result.allowed, "lse_error": result.lse_error,
            "deterministic": bool(torch.equal(out, again)),
            "passed": bool(result.passed and torch.equal(out, again))}


@bench.phase("accuracy")
def phase_accuracy(ctx) -> None:
    """A compact grid: head dims, masks, ragged lengths, GQA/MQA, both layouts and dtypes,
    for every schedule (at each head dim's default tiles)."""
    quick = ctx.args.quick
    pairs = [(1, 1), (113, 203), (203, 113), (1023, 1024), (2000, 2000)]
    if not quick:
        pairs += [(1, 239), (239, 1), (128, 217)]
    rows, failures, i = [], 0, 0
    # A persistent program walks several blocks only when there are more blocks than SMs:
    # batch 16 makes that so for the longer pairs.
    for head_dim, schedule, persistent in itertools.product(
            sm90.SUPPORTED_HEAD_DIMS, sm90.SCHEDULES, (False, True)):
        config = dataclasses.replace(sm90.DEFAULT_CONFIGS[head_dim], schedule=schedule,
                                     persistent=persistent)
        batch = 16 if persistent else 2
        for causal in (False, True):
            for (nq, nk) in pairs:
                for heads in ((4, 4), (6, 2), (3, 1)):
                    i += 1
                    dtype = (torch.float16, torch.bfloat16)[i % 2]
                    layout = ("bshd", "bhsd")[(i // 2) % 2]
                    case = {"head_dim": head_dim, "schedule": schedule,
                            "persistent": persistent, "batch": batch, "causal": causal,
                            "seqlen_q": nq,
                            "seqlen_k": nk, "heads": heads, "dtype": str(dtype),
                            "layout": layout}
                    try:
                        q, k, v = rand_qkv(batch, *heads, nq, nk, head_dim, dtype, layout,
                                           seed=i)
                        case.update(accuracy_case(q, k, v, layout=layout, causal=causal,
                                                  config=config))
                    except Exception as error:  # noqa: BLE001 - record it and go on
                        case.update(passed=False, exception=f"{type(error).__name__}: {error}"[:500])
                    rows.append(case)
                    if not case["passed"]:
                        failures += 1
                        print("ACCURACY FAIL", json.dumps(case), flush=True)
    ctx.write_rows("sm90_accuracy.jsonl", rows)
    print(f"accuracy: {len(rows) - failures}/{len(rows)} passed", flush=True)
    ctx.fail(failures)


def sweep_configs(head_dim: int, quick: bool, schedules=sm90.SCHEDULES,
                  rescales=("late",), stores=("direct",)) -> list[sm90.Sm90Config]:
    """One program per block or persistent, for each schedule, rescale place and store,
    at each head dim's default tiles (the best of session 3's first sweep,
    bench/NOTES.md attempt 11: the other stage count was within 2% where it fit)."""
    base = sm90.DEFAULT_CONFIGS[head_dim]
    candidates = [dataclasses.replace(base, schedule=schedule, persistent=persistent,
                                      rescale=rescale, store=store)
                  for persistent in (False, True) for schedule in schedules
                  for rescale in rescales for store in stores]
    candidates = [c for c in candidates
                  if sm90.shared_memory_bytes(head_dim, c) <= SHARED_MEMORY_LIMIT]
    if quick:
        candidates = candidates[:2]
    return candidates


def record_for(name, shape, timing, env, kernel_names=()):
    return make_record(kernel="call", provider=name, phase="prefill", shape=shape.as_dict(),
                       metric="latency", unit="ms", p20=timing.p20, p50=timing.p50,
                       p80=timing.p80, repeats=timing.repeats,
                       tflops=flops(shape) / timing.p50 / 1e9, kernel_names=kernel_names,
                       env=env, timing_method=timing.describe_method())


def time_shape(shape: AttentionShape, configs, env, records, failed_configs) -> dict:
    """Every sm90 config, today's Triton kernel and SDPA-cuDNN on one shape; TFLOP/s by name."""
    q, k, v = rand_qkv(shape.batch, shape.query_heads, shape.kv_heads, shape.seqlen_q,
                       shape.seqlen_k, shape.head_dim, torch.bfloat16, "bshd", seed=1)
    scale = shape.softmax_scale
    row = {}

    def timed(name, fn, inputs, context=None, kernel_names=()):
        try:
            timing = time_call(fn, inputs, device="cuda", target_ms=50.0, context=context)
        except Exception as error:  # noqa: BLE001 - print, record nothing, go on
            print(f"  {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            return
        records.append(record_for(name, shape, timing, env, kernel_names))
        row[name] = flops(shape) / timing.p50 / 1e9

    for config in configs:
        key = (shape.head_dim, shape.causal, config)
        if key in failed_configs:
            continue
        timed(config.name(), lambda q, k, v, c=config: sm90.flash_forward_sm90(
            q, k, v, layout="bshd", scale=scale, causal=shape.causal, config=c),
            [(q, k, v)], kernel_names=[sm90.kernel_name(config)])
    # An explicit config keeps flash_forward on the Triton kernel (no Gluon dispatch).
    triton_config = forward_config(shape)
    timed("attnlab_triton", lambda q, k, v: flash_forward(q, k, v, layout="bshd", scale=scale,
                                                          causal=shape.causal,
                                                          config=triton_config),
          [(q, k, v)], kernel_names=["_attn_fwd"])
    try:
        cudnn = prepare(provider("sdpa_cudnn"), shape, "prefill", "cuda")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's layout, no copy
        timed("sdpa_cudnn", cudnn.unpinned_call, [(qt, kt, vt)], context=cudnn.pin)
    except Exception as error:  # noqa: BLE001
        print(f"  sdpa_cudnn unavailable: {error}", flush=True)
    return row


def check_configs(configs, head_dim, causal, failed_configs, accuracy_rows):
    """Each config once on a ragged GQA shape before it is timed (768 query blocks: a
    persistent program walks ~6 of them)."""
    for config in configs:
        try:
            q, k, v = rand_qkv(16, 6, 2, 1000, 1337, head_dim, torch.bfloat16, "bshd",
                               seed=head_dim)
            case = accuracy_case(q, k, v, layout="bshd", causal=causal, config=config)
        except Exception as error:  # noqa: BLE001
            case = {"passed": False, "exception": f"{type(error).__name__}: {error}"[:500]}
        case.update(head_dim=head_dim, causal=causal, config=config.__dict__)
        accuracy_rows.append(case)
        if not case["passed"]:
            failed_configs.add((head_dim, causal, config))
            print("CONFIG FAILS ACCURACY, not timed:", json.dumps(case), flush=True)


def variants_of(args) -> dict:
    """The sweep's schedules, rescale places and stores, each checked against the kernel's."""
    variants = {}
    for option, allowed in (("schedules", sm90.SCHEDULES), ("rescales", sm90.RESCALES),
                            ("stores", sm90.STORES)):
        values = [v for v in getattr(args, option).split(",") if v]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(f"--{option} must be comma-separated from {', '.join(allowed)}, "
                             f"got {getattr(args, option)!r}")
        variants[option] = values
    return variants


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(n) for n in text.split(",") if n)
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--gqa-seqlens must be comma-separated positive lengths, got {text!r}")
    return lengths


def sweep_plan(args) -> list[tuple]:
    """(d, query heads, kv heads, causal, N) per shape; every config of each is built too."""
    head_dims = [int(d) for d in args.head_dims.split(",") if d]
    lengths = {128: (1024, 2048, 4096, 8192, 16384), 64: (1024, 4096, 16384)}
    plan = [(d, 16, 16, causal, n) for d in (128, 64) for causal in (False, True)
            for n in lengths[d]]
    plan += [(256, 24, 4, True, n) for n in parse_lengths(args.gqa_seqlens)]  # the GQA layer
    plan = [p for p in plan if p[0] in head_dims]
    for d in {p[0] for p in plan}:
        sweep_configs(d, args.quick, **variants_of(args))
    return [p for p in plan if p[4] == 4096] if args.quick else plan


@bench.phase("sweep", cap_s=170.0, plan=sweep_plan)
def phase_sweep(ctx) -> list[tuple]:
    """Every config, the Triton kernel and cuDNN per shape; the winners per bucket."""
    env, quick, variants = ctx.env, ctx.args.quick, variants_of(ctx.args)
    records, table, failed, accuracy_rows = [], [], set(), []
    # Bring the clocks up first: in session 3 run 4 every config of the first shape timed
    # after a cold start measured ~35% low (bench/NOTES.md, attempt 13's notes).
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    warm_until = time.time() + 2.0
    while time.time() < warm_until:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    del a
    checked = set()
    for d, hq, hk, causal, n in ctx.within_budget(ctx.plan):
        configs = sweep_configs(d, quick, **variants)
        if (d, causal) not in checked:
            check_configs(configs, d, causal, failed, accuracy_rows)
            checked.add((d, causal))
        shape = AttentionShape(batch=max(1, TOKENS // n), query_heads=hq, kv_heads=hk,
                               seqlen_q=n, seqlen_k=n, head_dim=d, dtype="bf16", causal=causal)
        try:
            row = time_shape(shape, configs, env, records, failed)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            continue
        table.append((d, hq, hk, causal, n, row))
        best = max(((t, name) for name, t in row.items() if name.startswith("sm90")),
                   default=(float("nan"), "-"))
        print(f"d={d} h={hq}/{hk} causal={causal!s:5} N={n:5}: best sm90 {best[0]:4.0f} "
              f"({best[1]})  triton {row.get('attnlab_triton', float('nan')):4.0f}  "
              f"cudnn {row.get('sdpa_cudnn', float('nan')):4.0f}", flush=True)
    ctx.upsert("sm90_forward.jsonl", records)
    ctx.write_rows("sm90_config_accuracy.jsonl", accuracy_rows)
    ctx.path("sm90_winners.json").write_text(json.dumps(
        {"env": env, "winners": winners(table)}, indent=1))
    return table


def winners(table) -> list[dict]:
    """Per (head_dim, causal, length bucket): which attnlab kernel to dispatch, and its ratios."""
    nan = float("nan")
    rows = []
    for d, hq, hk, causal, n, row in table:
        sm90_rows = {name: t for name, t in row.items() if name.startswith("sm90")}
        best_name = max(sm90_rows, key=sm90_rows.get) if sm90_rows else None
        best = sm90_rows.get(best_name, nan) if best_name else nan
        triton_t, cudnn_t = row.get("attnlab_triton", nan), row.get("sdpa_cudnn", nan)
        rows.append({
            "head_dim": d, "heads": [hq, hk], "causal": causal, "bucket": length_bucket(n),
            "seqlen": n, "winner": "sm90" if best > triton_t else "triton",
            "sm90_config": best_name, "sm90_tflops": best, "triton_tflops": triton_t,
            "cudnn_tflops": cudnn_t, "sm90_vs_triton": best / triton_t,
            "sm90_vs_cudnn": best / cudnn_t, "triton_vs_cudnn": triton_t / cudnn_t,
        })
    return rows


@bench.phase("sass")
def phase_sass(ctx) -> None:
    """SASS + evidence (n_regs, spills, setmaxnreg, ex2 between the waits) per launched variant."""
    summary = []
    compiled = [kernel for cache in getattr(sm90._attn_fwd_sm90, "device_caches", {}).values()
                for kernel in cache[0].items()]
    for i, (key, kernel) in enumerate(compiled):
        try:
            kernel._init_handles()
            tag = f"variant{i}"
            entry = {"tag": tag, "specialisation": str(key)[:600], "n_regs": kernel.n_regs,
                     "n_spills": kernel.n_spills, "shared": kernel.metadata.shared,
                     **sm90.overlap_evidence(kernel.asm)}
            sass = disassemble(kernel.asm["cubin"])
            if sass is not None and i < 4:
                ctx.path(f"sm90_sass/{tag}.sass").write_text(sass)
            summary.append(entry)
        except Exception as error:  # noqa: BLE001
            summary.append({"tag": f"variant{i}", "error": str(error)[:300]})
    ctx.path("sm90_sass/evidence.json").write_text(json.dumps(summary, indent=1, default=str))
    for entry in summary[:6]:
        print("sass:", json.dumps({k: entry.get(k) for k in (
            "tag", "n_regs", "n_spills", "shared", "setmaxnreg", "ex2_between_waits",
            "local_memory_ops", "error")}, default=str), flush=True)


@bench.setup
def sm90_runs_here(ctx) -> None:
    q = torch.empty(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
    ok, reason = sm90.supports(q, q, q, causal=True)
    if not ok:
        raise Unavailable(f"the sm90 kernel does not run here: {reason}")


@bench.finish
def print_table(ctx) -> None:
    print("\nbf16 TFLOP/s          sm90(best) / triton / cudnn   sm90/triton  sm90/cudnn  config")
    for r in winners(ctx.results.get("sweep") or []):
        print(f"  d={r['head_dim']:3d} h={r['heads'][0]:2d}/{r['heads'][1]:2d} "
              f"causal={r['causal']!s:5} N={r['seqlen']:5d}: {r['sm90_tflops']:5.0f} / "
              f"{r['triton_tflops']:5.0f} / {r['cudnn_tflops']:5.0f}   "
              f"{r['sm90_vs_triton']:6.2f}x    {r['sm90_vs_cudnn']:6.2f}x   {r['sm90_config']}")


if __name__ == "__main__":
    sys.exit(bench.main())
