"""Backward kernels on the H200: correctness, a small tile sweep, forward+backward timings.

    PYTHONPATH=src python3 bench/backward_h200.py --out $OUT [--quick]
        [--phases edge,profile,correct,sm90,tune,bench] [--tune-heads 64,128,256]
        [--flex all|default|none]

0. ``edge`` (only when asked): dQ/dK/dV error against float64 of attnlab and SDPA's
   backends on the tiny lengths with inputs x5;
   ``profile`` (only when asked): host time per call, event-timed call, CUDA-graph
   replay and per-kernel time of attnlab's forward+backward at N = 1k and 4k.

   ``sm90`` (only when asked): the Gluon sm_90 dK/dV kernel's candidates, accuracy
   and the backward timed with each against the Triton dK/dV kernel (``phase_sm90``).

   ``ncu`` (only when asked, <= 60 s): Nsight Compute's DRAM bytes of the forward and the
   two backward kernels of one fwd+bwd call at d = 128 (16 heads, 4 x 4k, causal) and
   the GQA d = 256 layer (24q/4kv, 4k, causal) against the cache-aware and logical
   models; ``backward_ncu.jsonl`` (records), ``backward_ncu_vs_model.jsonl``.

1. correctness: dQ, dK, dV against float64 autograd by the gradient rule
   (``attnlab.accuracy.check_gradients``) on a compact grid (every head dim of issue
   #12, fp16 and bf16, masks, GQA, ragged lengths), plus bit-identical repeats;
   written to ``backward_correctness.jsonl``; a failing case is recorded and the run
   goes on.
2. tune: BackwardConfig candidates for the backward alone at N = 4k (or
   ``--tune-seqlens``), per (head dim, masked); dK/dV tiles first with the dQ tiles
   fixed, then dQ tiles with the best dK/dV; the fastest accurate one per (head_dim_pad, masked, length bucket) as JSON
   lines in ``backward_tuning.jsonl`` (``"what": "backward_config_winner"``) and as
   ``BACKWARD_TUNED`` lines for ``attnlab/kernels/configs.py``.
3. bench: forward + backward (phase ``fwdbwd``), bf16, causal and not, d = 128 and 64
   with 16 heads at batch * seqlen = 16k, N in {1k, 4k, 16k}, and the GQA layer
   (24 q / 4 kv heads, d = 256, causal) at 4k and 16k; providers SDPA-cuDNN,
   SDPA-flash, FlexAttention (torch.compile'd), attnlab and attnlab with
   ``deterministic=True``.  TFLOP/s count 3.5x the forward's 4 B H N^2 d (halved when
   causal); peak memory per provider is its own record (metric ``peak_memory``).
   Records in ``attnlab.measure.records``' schema, upserted into
   ``backward_bench.jsonl``.

Default: about 5 minutes including compiles; ``--quick``: a thinned correctness grid,
no tuning and four benchmark points, about 2 minutes.  A configuration of
attnlab.measure.engine: phases, their budgets (``--correct-budget`` ...), --out, the
environment and the records are the engine's.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import itertools
import json
import math
import sys
import time

import torch

from attnlab.accuracy import check_gradients
from attnlab.commands.cli_support import parse_int_list
from attnlab.kernels import configs as config_table
from attnlab.kernels._sm90 import merged_table
from attnlab.kernels.backward import flash_backward
from attnlab.kernels.configs import BackwardConfig, backward_config, head_dim_padded, length_bucket
from attnlab.kernels.forward import flash_forward
from attnlab.measure.engine import BUDGET_SPENT, Bench
from attnlab.measure.providers import prepare, provider
from attnlab.measure.records import make_record, skipped_record
from attnlab.measure.timing import time_call
from attnlab.model.flops import conventional_attention_flops
from attnlab.shapes import AttentionShape

FWDBWD_FACTOR = 3.5  # forward + backward = 3.5x the forward's matmul FLOPs (2.5x for backward)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_inputs(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h, n):
        return torch.randn(batch, n, h, head_dim, device="cuda", dtype=dtype, generator=gen)

    return rand(heads, seqlen_q), rand(kv_heads, seqlen_k), rand(kv_heads, seqlen_k), \
        rand(heads, seqlen_q)


def gradients(q, k, v, dout, *, config=None, deterministic=False, dkdv_sm90=None,
              dq_sm90=None, **options):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = flash_forward(q, k, v, layout="bshd", scale=scale, **options)
    return flash_backward(dout, q, k, v, out, lse, layout="bshd", scale=scale, config=config,
                          deterministic=deterministic, dkdv_sm90=dkdv_sm90, dq_sm90=dq_sm90,
                          **options)


# ---------------------------------------------------------------------------
MASKS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (37, 5)},
    "softcap": {"softcap": 20.0, "causal": True},
}
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)


def correctness_cases(args) -> list[tuple]:
    quick = args.quick
    pairs = [(1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (1023, 1024), (2048, 2048)]
    heads = [(4, 4), (6, 2), (4, 1)]
    cases = []
    for i, (head_dim, pair, mask) in enumerate(itertools.product(HEAD_DIMS, pairs, MASKS)):
        if i % (7 if quick else 3):
            continue
        cases.append((head_dim, pair, heads[i % 3], mask, "bf16" if i % 2 else "fp16"))
    return cases


def accuracy_case(row: dict, inputs: tuple, seed: int, options: dict,
                  repeat_options: dict) -> bool:
    """One gradient case into ``row``: dQ, dK, dV against float64 by the gradient rule,
    and bit-identical when run again with ``repeat_options``; a crash is a failure."""
    head_dim = inputs[5]
    try:
        q, k, v, dout = make_inputs(*inputs, seed=seed)
        grads = gradients(q, k, v, dout, **options)
        again = gradients(q, k, v, dout, **{**options, **repeat_options})
        mask = {name: value for name, value in options.items()
                if name not in ("dkdv_sm90", "dq_sm90")}
        checks = check_gradients(grads, q, k, v, dout, layout="bshd",
                                 scale=1.0 / math.sqrt(head_dim), **mask)
        identical = all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))
        passed = all(c.passed for c in checks) and identical
        row.update(passed=passed, bit_identical=identical,
                   errors={c.name: [c.error, c.allowed] for c in checks})
    except Exception as error:  # noqa: BLE001 - a crashing case is a recorded failure
        passed = False
        row.update(passed=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    return passed


def phase_correct(ctx) -> None:
    """dQ, dK, dV against float64 by the gradient rule on a compact grid, bit-identical repeats."""
    started, failures, count = time.time(), 0, 0
    for head_dim, (seqlen_q, seqlen_k), (hq, hk), mask, dtype in ctx.within_budget(ctx.plan):
        row = {"what": "backward_accuracy", "head_dim": head_dim, "seqlen_q": seqlen_q,
               "seqlen_k": seqlen_k, "heads": hq, "kv_heads": hk, "mask": mask, "dtype": dtype,
               **ctx.env}
        passed = accuracy_case(row, (2, hq, hk, seqlen_q, seqlen_k, head_dim, DTYPES[dtype]),
                               head_dim + seqlen_q, MASKS[mask], {"deterministic": True})
        count += 1
        failures += not passed
        ctx.append_row("backward_correctness.jsonl", row)
        if not passed:
            print(f"FAIL d={head_dim} {seqlen_q}x{seqlen_k} h={hq}/{hk} {mask} {dtype}: "
                  f"{row.get('errors', row.get('error'))}", flush=True)
    print(f"correctness: {count - failures}/{count} passed ({time.time() - started:.0f} s)",
          flush=True)
    ctx.fail(failures)


# ---------------------------------------------------------------------------
TUNE_SHAPES = {  # head_dim -> (query_heads, kv_heads): the benchmark's layers at N = 4k
    64: (16, 16), 128: (16, 16), 256: (24, 4),
}


def dkdv_candidates(head_dim: int) -> list[tuple[int, int, int, int, bool]]:
    """(dkdv_block_m, dkdv_block_n, num_warps, num_stages, dkdv_split)."""
    if head_dim >= 256:
        # First the split programs (one for dV, one for dK: BackwardConfig.dkdv_split),
        # then the s10 winner (32 x 64, 8 warps, 3 stages) to measure them against.  Split,
        # 128 keys over 8 warps run every MMA as unreplicated 128-row wgmma with K and V
        # in shared memory, and (compiled here for sm_90a, Triton 3.6.0, LDL/STL causal /
        # full) 16 x 128 builds with 58 / 0 at 2 stages, 108 / 0 at 3, 32 x 128 with
        # 336 / 64 at 2: none inside a query-tile loop (all in the per-head loop around
        # them), where the unsplit tiles' replicated S^T and dP^T are 2 of 4 MMAs.
        return [(16, 128, 8, 2, True), (16, 128, 8, 3, True), (32, 128, 8, 2, True),
                (32, 128, 8, 1, True), (32, 64, 8, 3, False)]
    return [(64, 128, 8, 2, False), (32, 128, 8, 2, False), (64, 128, 8, 3, False),
            (32, 128, 4, 3, False), (64, 64, 4, 2, False), (128, 128, 8, 2, False)]


def dq_candidates(head_dim: int) -> list[tuple[int, int]]:
    """(dq_block_m, dq_block_n), timed at the dK/dV winner's warps and stages; at d = 256
    the first is also the dQ tile the dK/dV candidates are timed with."""
    if head_dim >= 256:
        # The compile sweep at 8 warps: 128 rows get unreplicated wgmma and build spill-free
        # (128 x 32: at 2-3 stages, 14/4 LDL/STL at 1; 128 x 16 at every stage count, but
        # 16-key steps re-read Q and dO from shared memory per 16 keys); 64 x 32 replicates
        # S and dP (0 spills at 2-3 stages); 64 x 64 is the base (needs 256 KiB at 3
        # stages: over the H200's 227); 32 x 64 mma.sync, spill-free (NOTES B16).
        return [(128, 32), (64, 64), (64, 32)]
    return [(128, 64), (64, 64), (128, 32), (64, 128), (128, 128)]


def dq_stand_in(head_dim: int, warps: int, base: BackwardConfig) -> tuple[int, int]:
    """The dQ tile a dK/dV candidate is timed with: the base's, except at d = 256, where
    the base's 64 x 64 needs 256 KiB of shared memory at 3 stages (the H200 has 227) and
    would fail every 3-stage candidate: there the compile sweep's (bench/backward_d256_tiles.py)
    spill-free 128 x 32 at 8 warps, and 64 x 32 at 4 (23-55 LDL/STL, fits at every stage
    count; 128 rows' fp32 accumulator alone needs 256 registers a thread at 4 warps)."""
    if head_dim < 256:
        return base.dq_block_m, base.dq_block_n
    return (128, 32) if warps == 8 else (64, 32)


def time_backward(q, k, v, dout, out, lse, config, causal, dkdv_sm90=None,
                  dq_sm90=None) -> float:
    scale = 1.0 / math.sqrt(q.shape[-1])

    def call():
        flash_backward(dout, q, k, v, out, lse, layout="bshd", scale=scale, causal=causal,
                       config=config, dkdv_sm90=dkdv_sm90, dq_sm90=dq_sm90)

    return time_call(call, [()], device="cuda", warmup=2, target_ms=150, min_repeats=5,
                     max_repeats=40).p50


def accurate(config: BackwardConfig, head_dim: int, causal: bool) -> bool:
    """The config on a small ragged GQA shape with the same head dim and mask."""
    q, k, v, dout = make_inputs(1, 6, 2, 333, 333 if causal else 397, head_dim, torch.bfloat16,
                                seed=5)
    grads = gradients(q, k, v, dout, config=config, causal=causal)
    return all(c.passed for c in check_gradients(grads, q, k, v, dout, layout="bshd",
                                                 scale=1.0 / math.sqrt(head_dim), causal=causal))


def tune_plan(args) -> list[tuple[int, int, bool]]:
    """(N, head dim, causal) in the order they are tuned (while the budget lasts)."""
    if args.quick:
        return []
    head_dims = parse_ints(args.tune_heads, "--tune-heads", allowed=TUNE_SHAPES)
    return list(itertools.product(parse_ints(args.tune_seqlens, "--tune-seqlens"), head_dims,
                                  (True, False)))


def phase_tune(ctx) -> dict:
    """BackwardConfig candidates for the backward alone: dK/dV tiles, then dQ tiles."""
    env = ctx.env
    winners: dict[tuple[int, bool, int], BackwardConfig] = {}

    def log_line(row):
        ctx.append_row("backward_tuning.jsonl", row)

    for seqlen, head_dim, causal in ctx.within_budget(ctx.plan):
        hq, hk = TUNE_SHAPES[head_dim]
        batch = max(1, 16384 // seqlen)
        shape = AttentionShape(batch=batch, query_heads=hq, kv_heads=hk, seqlen_q=seqlen,
                               seqlen_k=seqlen, head_dim=head_dim, dtype="bf16", causal=causal)
        backward_flops = 2.5 * conventional_attention_flops(shape)
        q, k, v, dout = make_inputs(batch, hq, hk, seqlen, seqlen, head_dim, torch.bfloat16)
        out, lse = flash_forward(q, k, v, layout="bshd", scale=1.0 / math.sqrt(head_dim),
                                 causal=causal)
        base = backward_config(shape)
        scored = []

        def try_config(config: BackwardConfig, stage: str) -> None:
            row = {"what": "backward_config", "stage": stage, "head_dim": head_dim,
                   "masked": causal, "shape": shape.as_dict(), "config": config.as_dict(), **env}
            try:
                t0 = time.time()
                ms = time_backward(q, k, v, dout, out, lse, config, causal)
                row.update(p50_ms=ms, tflops=backward_flops / ms / 1e9,
                           seconds_with_compile=time.time() - t0,
                           accurate=accurate(config, head_dim, causal))
                if row["accurate"]:
                    scored.append((ms, config))
            except Exception as error:  # noqa: BLE001 - a config that cannot run is data
                row.update(error=f"{type(error).__name__}: {str(error)[:300]}")
            log_line(row)

        for block_m, block_n, warps, stages, split in ctx.within_budget(
                dkdv_candidates(head_dim)):
            dq_block_m, dq_block_n = dq_stand_in(head_dim, warps, base)
            try_config(BackwardConfig(block_m, block_n, dq_block_m, dq_block_n, warps, stages,
                                      split), "dkdv")
        if not scored:
            continue
        best = min(scored)[1]
        for block_m, block_n in ctx.within_budget(dq_candidates(head_dim)):
            candidate = dataclasses.replace(best, dq_block_m=block_m, dq_block_n=block_n)
            if candidate != best:
                try_config(candidate, "dq")
        best_ms, best = min(scored)
        key = (head_dim_padded(head_dim), causal, length_bucket(seqlen))
        winners[key] = best
        log_line({"what": "backward_config_winner", "head_dim_pad": key[0],
                        "masked": causal, "bucket": key[2], "config": best.as_dict(),
                        "p50_ms": best_ms, "tflops": backward_flops / best_ms / 1e9, **env})
        print(f"tune d={head_dim} masked={causal}: {best} {backward_flops / best_ms / 1e9:.0f} "
              f"TFLOP/s (backward only)", flush=True)
    if winners:
        print("\nBACKWARD_TUNED = {")
        for (d, m, b), c in sorted(winners.items()):
            print(f"    ({d}, {m}, {b}): BackwardConfig({c.dkdv_block_m}, {c.dkdv_block_n}, "
                  f"{c.dq_block_m}, {c.dq_block_n}, {c.num_warps}, {c.num_stages}"
                  f"{', dkdv_split=True' if c.dkdv_split else ''}),")
        print("}")
    # The benchmark after it uses the winners, as a user would once they are committed.
    config_table.BACKWARD_TUNED.update(winners)
    return winners


# ---------------------------------------------------------------------------
# The Gluon sm_90 dK/dV kernel against the Triton one (kernels/backward_sm90.py)
# head_dim -> (block_m, stages[, dv_block_m, dv_stages]); session 5 run 1 measured more.
SM90_CANDIDATES = {
    128: [(64, 2), (64, 3), (32, 3)],  # m32 s2/s4: within 3% of m32 s3
    64: [(64, 2), (64, 3), (128, 2)],  # m64 s4, m32 s3: 0.6-1.0x m64 s2 (session 5);
                                       # m128 no longer spills (LSE/D in shared memory)
    # The dK launch's K and V leave room for 32-row tiles; the dV launch's for 64 (v64x2).
    256: [(32, 2, 64, 2), (32, 2), (32, 3)],  # s15 run 4: pipelined accumulates 4-15% slower
}
SM90_ACCURACY_PAIRS = [(1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (1023, 1024),
                       (2048, 2048), (64, 4000)]


def sm90_candidates(head_dim: int) -> list:
    """The Gluon dK/dV configs the sweep measures at ``head_dim``."""
    from attnlab.kernels.backward_sm90 import Sm90BackwardConfig

    return [Sm90BackwardConfig(*fields[:2], 24, *fields[2:])
            for fields in SM90_CANDIDATES[head_dim]]


def sm90_plan(args) -> list[tuple[int, int, bool]]:
    """(N, head dim, causal) of the timing sweep, in order (while the budget lasts)."""
    head_dims = parse_ints(args.sm90_heads, "--sm90-heads", allowed=SM90_CANDIDATES)
    return list(itertools.product(parse_ints(args.sm90_seqlens, "--sm90-seqlens"), head_dims,
                                  (True, False)))


def candidates_accuracy(ctx, path: str, what: str, option: str, candidates: dict
                        ) -> tuple[int, set[str]]:
    """A Gluon kernel's candidates against float64 (``accuracy_case``), each forced by
    ``flash_backward``'s ``option``: per head dim in ``candidates`` ((the default, every
    candidate)), the full grid for the default, four cases for the others.  Rows
    ``{what}_accuracy`` into ``path``; returns (failures, names of inaccurate configs).
    Nothing with ``--sm90-skip-accuracy``."""
    started, failures, count, inaccurate = time.time(), 0, 0, set()
    heads = [(4, 4), (6, 2), (4, 1)]
    for head_dim, (default, configs) in candidates.items():
        if ctx.args.sm90_skip_accuracy:
            break
        for config in configs:
            cases = list(itertools.product(SM90_ACCURACY_PAIRS, (False, True)))
            cases = cases if config == default else cases[3::4]
            for i, ((seqlen_q, seqlen_k), causal) in enumerate(cases):
                hq, hk = heads[i % 3]
                dtype = "bf16" if i % 2 else "fp16"
                row = {"what": f"{what}_accuracy", "config": config.name(),
                       "head_dim": head_dim, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
                       "heads": hq, "kv_heads": hk, "causal": causal, "dtype": dtype, **ctx.env}
                passed = accuracy_case(
                    row, (2, hq, hk, seqlen_q, seqlen_k, head_dim, DTYPES[dtype]),
                    head_dim + seqlen_q + i, {"causal": causal, option: config}, {})
                count += 1
                failures += not passed
                ctx.append_row(path, row)
                if not passed:
                    inaccurate.add(config.name())
                    print(f"FAIL {what} {config.name()} d={head_dim} {seqlen_q}x{seqlen_k} "
                          f"h={hq}/{hk} causal={causal} {dtype}: "
                          f"{row.get('errors', row.get('error'))}", flush=True)
    print(f"{what} accuracy: {count - failures}/{count} passed "
          f"({time.time() - started:.0f} s)", flush=True)
    return failures, inaccurate


def time_candidates(ctx, path: str, what: str, shape: AttentionShape, candidates,
                    option: str, baseline_config) -> dict[str, float]:
    """The backward's median ms at ``shape`` with the Triton kernel (``"triton"``, tiles
    ``baseline_config``; None: the committed tables) and with each Gluon candidate forced
    by ``flash_backward``'s ``option``; rows ``{what}_time`` into ``path`` (a candidate
    that cannot run is a row with its error)."""
    backward_flops = 2.5 * conventional_attention_flops(shape)
    q, k, v, dout = make_inputs(shape.batch, shape.query_heads, shape.kv_heads, shape.seqlen_q,
                                shape.seqlen_k, shape.head_dim, torch.bfloat16)
    out, lse = flash_forward(q, k, v, layout="bshd", scale=shape.head_dim ** -0.5,
                             causal=shape.causal)
    timed = {"triton": time_backward(q, k, v, dout, out, lse, baseline_config, shape.causal)}
    for config in candidates:
        try:
            timed[config.name()] = time_backward(q, k, v, dout, out, lse, None, shape.causal,
                                                 **{option: config})
        except Exception as error:  # noqa: BLE001 - a config that cannot run is data
            ctx.append_row(path, {"what": f"{what}_time", "config": config.name(),
                                  "shape": shape.as_dict(), "error": str(error)[:300],
                                  **ctx.env})
    for name, ms in timed.items():
        ctx.append_row(path, {"what": f"{what}_time", "config": name, "shape": shape.as_dict(),
                              "p50_ms": ms, "tflops": backward_flops / ms / 1e9,
                              "vs_triton": timed["triton"] / ms, **ctx.env})
    return timed


def record_winner(shape: AttentionShape, timed: dict[str, float], config_type,
                  entries: list, measured: set) -> str:
    """Note ``shape``'s bucket as measured and, where the best candidate is >= 2% faster
    than the Triton kernel, its dispatch-table entry; returns the printed line."""
    best = min((ms, name) for name, ms in timed.items() if name != "triton")
    gain = timed["triton"] / best[0]
    bucket = (shape.head_dim, shape.causal, length_bucket(max(shape.seqlen_q, shape.seqlen_k)))
    measured.add(bucket)
    if gain >= 1.02:
        entries.append({"head_dim": shape.head_dim, "causal": shape.causal, "bucket": bucket[2],
                        "config": dataclasses.asdict(config_type.from_name(best[1])),
                        "sm90_vs_triton": round(gain, 4)})
    line = (f"{shape.describe()}: backward with the Triton kernel {timed['triton']:.3f} ms, "
            f"best {best[1]} {best[0]:.3f} ms (x{gain:.2f}); "
            + ", ".join(f"{n} {ms:.3f}" for n, ms in timed.items()))
    print(line, flush=True)
    return line


def write_table(ctx, filename: str, config_type, entries: list, measured: set,
                inaccurate: set) -> None:
    """The dispatch-table candidate ``filename``: the committed table updated for this
    run's Triton and the buckets it timed only (``_sm90.merged_table``: other releases'
    entries and untimed buckets stay), without configs that failed accuracy."""
    entries = [e for e in entries if config_type(**e["config"]).name() not in inaccurate]
    committed = json.loads(importlib.resources.files("attnlab.kernels").joinpath(filename)
                           .read_text())
    table = merged_table(committed, entries, measured, ctx.env)
    ctx.path(filename).write_text(json.dumps(table, indent=1), encoding="utf-8")


def phase_sm90(ctx) -> None:
    """The Gluon sm_90 dK/dV kernel's candidates: accuracy, then timed against the Triton one.

    Accuracy of every candidate (the full grid for the defaults, four cases for the
    others), bit-identical repeats, then the backward timed with each candidate's dK/dV
    against the Triton dK/dV kernel (same dQ kernel and tiles) at the benchmark's shapes.
    Writes sm90_backward_sweep.jsonl and the dispatch-table candidate
    sm90_backward_dispatch.json (buckets where a candidate is >= 2% faster)."""
    from attnlab.kernels import backward_sm90 as sm90

    path = "sm90_backward_sweep.jsonl"
    head_dims = parse_ints(ctx.args.sm90_heads, "--sm90-heads", allowed=SM90_CANDIDATES)
    failures, inaccurate = candidates_accuracy(
        ctx, path, "sm90_backward", "dkdv_sm90",
        {d: (sm90.DEFAULT_CONFIGS[d], sm90_candidates(d)) for d in head_dims})

    lines, entries, measured = [], [], set()
    for seqlen, head_dim, causal in ctx.within_budget(ctx.plan):
        shape = AttentionShape(batch=max(1, 16384 // seqlen), query_heads=16, kv_heads=16,
                               seqlen_q=seqlen, seqlen_k=seqlen, head_dim=head_dim,
                               dtype="bf16", causal=causal)
        # The Triton baseline with its explicit tiles: the same dQ kernel for every candidate.
        timed = time_candidates(ctx, path, "sm90_backward", shape, sm90_candidates(head_dim),
                                "dkdv_sm90", backward_config(shape))
        lines.append(record_winner(shape, timed, sm90.Sm90BackwardConfig, entries, measured))
    write_table(ctx, "sm90_backward_dispatch.json", sm90.Sm90BackwardConfig, entries,
                measured, inaccurate)
    print("\n".join(lines))
    ctx.fail(failures)


# ---------------------------------------------------------------------------
# The dQ sweep's shapes: the seed's GQA layer, and the fwd+bwd table's d = 128 and 64,
# one per length bucket the table keys on (``--shapes`` picks some).
DQ_SHAPES = [AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=n, seqlen_k=n,
                            head_dim=256, dtype="bf16", causal=True)
             for n in (4096, 16384, 1024, 2048, 8192)] + [
    AttentionShape(batch=16384 // n, query_heads=16, kv_heads=16, seqlen_q=n, seqlen_k=n,
                   head_dim=d, dtype="bf16", causal=causal)
    for d, n, causal in ((128, 4096, True), (128, 4096, False), (128, 1024, True),
                         (128, 16384, True), (64, 4096, True), (64, 4096, False),
                         (128, 2048, True), (128, 8192, True), (128, 1024, False),
                         (128, 2048, False), (128, 8192, False), (128, 16384, False),
                         (64, 1024, True), (64, 16384, True))]


def dq_plan(args) -> list[AttentionShape]:
    return [s for s in DQ_SHAPES if shape_selected(s, args.shapes)]


def phase_dq(ctx) -> None:
    """The Gluon sm_90 dQ kernel's candidates: accuracy (the full grid for the defaults,
    four cases for the others; bit-identical repeats), then the backward timed with each
    candidate's dQ against the Triton dQ kernel (the same dK/dV dispatch) at DQ_SHAPES.
    Writes sm90_dq_sweep.jsonl and the dispatch-table candidate sm90_dq_dispatch.json
    (buckets where a candidate is >= 2% faster)."""
    from attnlab.kernels import dq_sm90

    path = "sm90_dq_sweep.jsonl"
    failures, inaccurate = candidates_accuracy(
        ctx, path, "sm90_dq", "dq_sm90",
        {d: (dq_sm90.DEFAULT_CONFIGS[d], dq_sm90.CANDIDATES[d]) for d in dq_sm90.CANDIDATES})

    lines, entries, measured = [], [], set()
    for shape in ctx.within_budget(ctx.plan):
        timed = time_candidates(ctx, path, "sm90_dq", shape, dq_sm90.CANDIDATES[shape.head_dim],
                                "dq_sm90", None)
        lines.append(record_winner(shape, timed, dq_sm90.Sm90DqConfig, entries, measured))
    write_table(ctx, "sm90_dq_dispatch.json", dq_sm90.Sm90DqConfig, entries, measured,
                inaccurate)
    print("\n".join(lines))
    ctx.fail(failures)


# ---------------------------------------------------------------------------
# The Gluon dK/dV launch's program order at the seed's layer: every schedule forced in
# turn (NOTES B25: at 16k the default head-by-head order re-reads rows ~25x from DRAM).
SCHEDULE_SHAPES = [AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=n, seqlen_k=n,
                                  head_dim=256, dtype="bf16", causal=True)
                   for n in (16384, 8192, 4096, 32768)]


def schedule_plan(args) -> list[AttentionShape]:
    return [s for s in SCHEDULE_SHAPES if shape_selected(s, args.shapes)]


def phase_schedule(ctx) -> None:
    """The backward's median ms with each ``dispatch.BackwardSchedule`` forced on the Gluon
    dK/dV launches (``dispatch.dkdv_schedule`` replaced, plans rebuilt), beside the one the
    dispatcher picks; rows into dkdv_schedule.jsonl."""
    from attnlab.kernels import backward, dispatch

    path = "dkdv_schedule.jsonl"
    choose, lines = dispatch.dkdv_schedule, []
    schedules = [dispatch.BackwardSchedule(major, split) for split in (1, 2)
                 for major in (False, True)]
    try:
        for shape in ctx.within_budget(ctx.plan):
            q, k, v, dout = make_inputs(shape.batch, shape.query_heads, shape.kv_heads,
                                        shape.seqlen_q, shape.seqlen_k, shape.head_dim,
                                        torch.bfloat16)
            out, lse = flash_forward(q, k, v, layout="bshd", scale=shape.softmax_scale,
                                     causal=True)
            timed = {}
            for schedule in [None, *schedules]:
                backward._PLANS.plans.clear()
                dispatch.dkdv_schedule = choose if schedule is None else (
                    lambda schedule=schedule, **_: schedule)
                name = "dispatch" if schedule is None else (
                    f"{'block' if schedule.block_major else 'head'}-major x{schedule.head_split}")
                timed[name] = time_backward(q, k, v, dout, out, lse, None, True)
                ctx.append_row(path, {"what": "dkdv_schedule_time", "schedule": name,
                                      "shape": shape.as_dict(), "p50_ms": timed[name],
                                      **ctx.env})
            lines.append(f"{shape.describe()}: backward ms " + ", ".join(
                f"{n} {ms:.3f}" for n, ms in timed.items()))
            print(lines[-1], flush=True)
    finally:
        dispatch.dkdv_schedule = choose
        backward._PLANS.plans.clear()
    print("\n".join(lines))


# ---------------------------------------------------------------------------
def bench_shapes(quick: bool) -> list[AttentionShape]:
    """The fwd+bwd table's shapes (--quick: four of them)."""
    shapes = []
    for head_dim, causal, seqlen in itertools.product((128, 64), (True, False),
                                                      (1024, 4096, 16384)):
        shapes.append(AttentionShape(batch=16384 // seqlen, query_heads=16, kv_heads=16,
                                     seqlen_q=seqlen, seqlen_k=seqlen, head_dim=head_dim,
                                     dtype="bf16", causal=causal))
    for seqlen in (4096, 16384):
        shapes.append(AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=seqlen,
                                     seqlen_k=seqlen, head_dim=256, dtype="bf16", causal=True))
    if quick:
        shapes = [s for s in shapes if s.seqlen_q == 4096 and (s.causal or s.head_dim == 128)]
    return shapes


def flex_wanted(shape: AttentionShape, mode: str) -> str | None:
    """None when FlexAttention runs on this shape, else the reason it does not."""
    if mode == "all":
        return None
    if mode == "none":
        return "FlexAttention not requested (--flex none)"
    if shape.seqlen_q == 1024 or shape.head_dim == 64:
        return ("not run in the default 5-minute budget (each shape is a ~30 s compile of "
                "forward and backward); run with --flex all")
    return None


def _attnlab_deterministic(shape: AttentionShape):
    from attnlab import attention

    options = {"causal": shape.causal, "scale": shape.softmax_scale,
               "enable_gqa": shape.group_size > 1, "impl": "triton", "deterministic": True}

    def call(q, k, v, grad_out):
        return torch.autograd.grad(attention(q, k, v, **options), (q, k, v), grad_out)

    return call


def measure(name: str, call, inputs: tuple, shape: AttentionShape, record_env: dict,
            profile: bool, unpinned_call=None, pin=None) -> list[dict]:
    """Latency and peak-memory records of one provider call.  The timer enters an SDPA
    backend pin once, outside the timed region; the memory and profile calls run pinned."""
    timing = time_call(unpinned_call or call, [inputs], device="cuda", warmup=3, target_ms=200,
                       min_repeats=5, max_repeats=50, context=pin)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    names = []
    if profile:
        try:
            from attnlab.measure.dispatch import profile_call

            names = [kernel.name for kernel in profile_call(call, inputs).kernels]
        except Exception as error:  # noqa: BLE001 - the timing stands; say why names are missing
            print(f"{name}: profiler failed: {error}", flush=True)
    flops = FWDBWD_FACTOR * conventional_attention_flops(shape)
    latency = make_record(kernel="call", provider=name, phase="fwdbwd", shape=shape,
                          metric="latency", unit="ms", p20=timing.p20, p50=timing.p50,
                          p80=timing.p80, repeats=timing.repeats,
                          tflops=flops / timing.p50 / 1e9, kernel_names=names, env=record_env)
    memory = make_record(kernel="call", provider=name, phase="fwdbwd", shape=shape,
                         metric="peak_memory", unit="bytes", p20=peak, p50=peak, p80=peak,
                         repeats=1, kernel_names=names, env=record_env)
    return [latency, memory]


BENCH_PROVIDERS = ("sdpa_cudnn", "sdpa_flash", "flex", "attnlab", "attnlab_deterministic")


def bench_plan(args) -> list[tuple[AttentionShape, list[str]]]:
    """(shape, providers) per point: --shapes filters the shapes, --providers names them."""
    names = [n for n in args.providers.split(",") if n]
    for name in names:
        if name != "attnlab_deterministic":
            provider(name)  # an unknown name is refused now, not after the compiles
    return [(shape, names) for shape in bench_shapes(args.quick)
            if shape_selected(shape, args.shapes)]


def phase_bench(ctx) -> list:
    """Forward + backward of attnlab (and deterministic) against cuDNN, FA2 and Flex."""
    record_env, args = ctx.env, ctx.args
    flex_mode = "none" if args.quick and args.flex == "default" else args.flex
    records, table = [], []
    for shape, providers in ctx.plan:
        row = {}
        for name in providers:
            reason = flex_wanted(shape, flex_mode) if name == "flex" else None
            if reason is None and ctx.spent():
                reason = BUDGET_SPENT
            if reason is not None:
                records.append(skipped_record(provider=name, phase="fwdbwd", shape=shape,
                                              reason=reason, env=record_env))
                continue
            try:
                if name == "attnlab_deterministic":
                    prepared = prepare(provider("attnlab"), shape, "fwdbwd", "cuda")
                    call, unpinned, pin = _attnlab_deterministic(shape), None, None
                else:
                    prepared = prepare(provider(name), shape, "fwdbwd", "cuda")
                    call, unpinned, pin = prepared.call, prepared.unpinned_call, prepared.pin
                inputs = prepared.inputs()
                measured = measure(name, call, inputs, shape, record_env, args.profile,
                                   unpinned_call=unpinned, pin=pin)
                records.extend(measured)
                row[name] = (measured[0]["tflops"], measured[1]["p50"])
                del inputs
            except Exception as error:  # noqa: BLE001 - ProviderUnavailable or a crash: recorded
                message = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
                print(f"{name} at {shape.describe()}: {message}", flush=True)
                records.append(skipped_record(provider=name, phase="fwdbwd", shape=shape,
                                              reason=message, env=record_env))
            torch.cuda.empty_cache()
        table.append((shape, row))
        # Upserted shape by shape, so a run stopped by its time limit keeps what it measured.
        ctx.upsert("backward_bench.jsonl", records)
        records = []
        print(f"{shape.describe()}: " + " ".join(f"{n}={t:.0f}" for n, (t, _) in row.items()),
              flush=True)
    return table


def print_table(ctx) -> None:
    table = ctx.results.get("bench") or []
    nan = float("nan")
    print("\nforward+backward TFLOP/s (bf16, 3.5x forward FLOPs); peak MiB in brackets")
    print(f"{'shape':44s} {'attnlab':>13s} {'det':>7s} {'cuDNN':>13s} {'flash':>13s} "
          f"{'flex':>13s} {'vs cuDNN':>8s} {'vs flex':>8s}")
    for shape, row in table:
        def cell(name):
            if name not in row:
                return f"{'-':>13s}"
            tflops, peak = row[name]
            return f"{tflops:6.0f} [{peak / 2**20:5.0f}]"

        ours = row.get("attnlab", (nan, 0))[0]
        det = row.get("attnlab_deterministic", (nan, 0))[0]
        label = (f"d={shape.head_dim} {shape.query_heads}/{shape.kv_heads} B={shape.batch} "
                 f"N={shape.seqlen_q} {'causal' if shape.causal else 'full'}")
        print(f"{label:44s} {cell('attnlab')} {det:7.0f} {cell('sdpa_cudnn')} "
              f"{cell('sdpa_flash')} {cell('flex')} "
              f"{ours / row.get('sdpa_cudnn', (nan, 0))[0]:7.2f}x "
              f"{ours / row.get('flex', (nan, 0))[0]:7.2f}x")


# ---------------------------------------------------------------------------
PROFILE_SHAPES = [(128, 1024, True), (128, 1024, False), (128, 4096, True), (64, 1024, True),
                  (64, 1024, False)]


def profile_plan(args) -> list[AttentionShape]:
    shapes = [AttentionShape(batch=16384 // seqlen, query_heads=16, kv_heads=16, seqlen_q=seqlen,
                             seqlen_k=seqlen, head_dim=head_dim, dtype="bf16", causal=causal)
              for head_dim, seqlen, causal in PROFILE_SHAPES]
    # The seed's GQA layer (24q/4kv, d = 256) at 4k: where the backward is furthest off.
    shapes.append(AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=4096,
                                 seqlen_k=4096, head_dim=256, dtype="bf16", causal=True))
    return [s for s in shapes if shape_selected(s, args.shapes)]


def shape_selected(shape: AttentionShape, parts: str) -> bool:
    """Whether ``--shapes`` (comma-separated parts of the description, '' = all) keeps it."""
    wanted = [p for p in parts.split(",") if p]
    return not wanted or any(part in shape.describe() for part in wanted)


def phase_profile(ctx) -> None:
    """Where one forward+backward call's time goes: host time per call (launches only,
    no sync), the event-timed call, the CUDA-graph replay, and the profiler's kernels."""
    for shape in ctx.plan:
        prepared = prepare(provider("attnlab"), shape, "fwdbwd", "cuda")
        inputs = prepared.inputs()
        call = prepared.call
        host_ms, events, graph, kernels = call_profile(call, inputs)
        # The step is GPU-bound when the host issues it in at most half the GPU's time
        # (issue #29's goal at N = 1k); the graph replay is the GPU's time alone.
        ratio = host_ms / graph if isinstance(graph, float) and graph > 0 else None
        row = {"what": "fwdbwd_profile", "shape": shape.as_dict(), "host_ms": host_ms,
               "event_ms": events, "graph_ms": graph, "host_over_gpu": ratio,
               "gpu_bound": None if ratio is None else ratio <= 0.5, "kernels_ms": kernels,
               **ctx.env}
        ctx.append_row("backward_profile.jsonl", row)
        if (shape.head_dim, shape.seqlen_q, shape.causal) == (128, 1024, True):
            ctx.path("backward_host_profile.txt").write_text(host_profile(call, inputs))
        print(f"profile {shape.describe()}: host {host_ms:.3f} ms/call, events {events:.3f}, "
              f"graph {graph if isinstance(graph, str) else f'{graph:.3f}'}, host/GPU "
              f"{'-' if ratio is None else f'{ratio:.2f} (goal <= 0.5)'}; kernels "
              + ", ".join(f"{n}={t:.3f}" for n, t in sorted(kernels.items(), key=lambda x: -x[1])),
              flush=True)


def call_profile(call, inputs) -> tuple[float, float, float | str, dict[str, float]]:
    """(host ms per call: launches only, no sync; the event-timed call; its CUDA-graph
    replay, or why it failed; ms per kernel name in one profiled call)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call(*inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        call(*inputs)
    host_ms = (time.perf_counter() - t0) / 20 * 1e3
    torch.cuda.synchronize()
    events = time_call(call, [inputs], device="cuda", warmup=2, target_ms=100,
                       cuda_graph=False).p50
    try:
        graph = time_call(call, [inputs], device="cuda", warmup=2, target_ms=100,
                          cuda_graph=True).p50
    except Exception as error:  # noqa: BLE001 - say why, keep the other numbers
        graph = f"{type(error).__name__}: {str(error)[:200]}"
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        call(*inputs)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in trace.events():
        if event.device_type.name == "CUDA":
            name = event.name.split("(")[0][:48]
            kernels[name] = kernels.get(name, 0.0) + event.device_time / 1e3
    return host_ms, events, graph, kernels


def host_profile(call, inputs, calls: int = 30) -> str:
    """cProfile of the host side of ``calls`` calls (the GPU runs behind), top entries."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call(*inputs)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return f"{calls} calls\n" + text.getvalue()


def phase_edge(ctx) -> None:
    """Gradient error against float64 of attnlab and of SDPA's backends on the tiny
    lengths with inputs x5 (the test's cases), beside the test's yardstick."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnlab.accuracy import reference_gradients

    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    for seqlens in ((1, 1), (1, 239), (239, 1)):
        gen = torch.Generator().manual_seed(sum(seqlens))

        def rand(h, n):
            return (5.0 * torch.randn(1, n, h, 64, generator=gen)).to(torch.bfloat16).cuda()

        q, k, v, dout = rand(2, seqlens[0]), rand(1, seqlens[1]), rand(1, seqlens[1]), \
            rand(2, seqlens[0])
        bhsd = [t.transpose(1, 2) for t in (q, k, v, dout)]
        oracle = reference_gradients(*bhsd)
        yard = reference_gradients(*bhsd, dtype=torch.bfloat16)
        errors = {"yardstick_bf16_math": [(a.double() - b).abs().max().item()
                                         for a, b in zip(yard, oracle, strict=True)]}
        try:
            grads = gradients(q, k, v, dout)
            errors["attnlab"] = [(g.transpose(1, 2).double() - o).abs().max().item()
                                 for g, o in zip(grads, oracle, strict=True)]
        except Exception as error:  # noqa: BLE001
            errors["attnlab"] = f"{type(error).__name__}: {str(error)[:200]}"
        for name, backend in backends.items():
            leaves = [t.detach().clone().requires_grad_() for t in bhsd[:3]]
            try:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(*leaves, enable_gqa=True)
                grads = torch.autograd.grad(out, leaves, bhsd[3])
                errors[name] = [(g.double() - o).abs().max().item() for g, o in zip(grads, oracle, strict=True)]
            except Exception as error:  # noqa: BLE001 - a backend that refuses the shape
                errors[name] = f"{type(error).__name__}: {str(error)[:120]}"
        ctx.append_row("backward_edge.jsonl", {"what": "backward_edge_errors", "seqlens": seqlens,
                                               "errors_dq_dk_dv": errors, **ctx.env})
        print(f"edge {seqlens}: " + "; ".join(
            f"{n}=" + (",".join(f"{e:.3f}" for e in errs) if isinstance(errs, list) else errs)
            for n, errs in errors.items()), flush=True)


NCU_SHAPES = (AttentionShape(batch=4, query_heads=16, kv_heads=16, seqlen_q=4096, seqlen_k=4096,
                             head_dim=128, dtype="bf16", causal=True),
              AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=4096, seqlen_k=4096,
                             head_dim=256, dtype="bf16", causal=True),
              # Out of the L2 replay's fit (model/l2.py): head by head, unsplit, where a
              # strict LRU cache thrashes (~27x the rows predicted).
              AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=16384,
                             seqlen_k=16384, head_dim=256, dtype="bf16", causal=True))

def phase_ncu(ctx) -> None:
    """Nsight Compute's DRAM bytes of attnlab's forward and two backward kernels (one
    fwd+bwd call per shape, ``--clock-control none``, caches flushed per kernel) against
    the cache-aware model (``measure.compare.predict`` / ``predict_backward``) and the
    logical one; records of the measured bytes, one comparison row per kernel, a table."""
    import tempfile
    from pathlib import Path

    from attnlab.measure import ncu
    from attnlab.measure.compare import (
        GOAL_RELATIVE_ERROR,
        attnlab_backward_plan,
        compare_case,
        logical_backward,
        ncu_records,
        predict_backward,
    )
    from attnlab.model.traffic import fused_forward_traffic

    binary = ncu.find_ncu()
    if binary is None:
        print("  ncu not found on PATH, $NCU or /usr/local/cuda/bin: skipped", flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="attnlab-ncu-bwd-"))
    cases = [("attnlab", "fwdbwd", shape) for shape in ctx.plan]
    try:
        detail = ctx.args.ncu_metrics
        metrics = ncu.CORE_METRICS if detail == "core" else tuple(ncu.METRICS)
        run = ncu.run_ncu(cases, work, ncu=binary, metrics=metrics,
                          section_set="full" if detail == "sections" else None,
                          timeout_s=max(10.0, ctx.deadline - time.monotonic() - 5))
    except Exception as error:  # noqa: BLE001 - say why; the log tail says more
        print(f"  ncu failed: {error}", flush=True)
        log = work / "ncu_log.txt"
        if log.exists():
            print("    " + "\n    ".join(log.read_text().splitlines()[-15:]), flush=True)
        return
    ncu.write_long_csv(run.kernels, ctx.path("ncu_backward/ncu_kernels.csv"))
    if ctx.args.ncu_metrics == "sections":  # every metric of the set, as ncu printed them
        ctx.path("ncu_backward/ncu_raw.csv").write_text(run.raw_csv.read_text())
    ctx.upsert("backward_ncu.jsonl", ncu_records(run.kernels, ctx.env))
    for label, reason in run.failed_cases.items():
        print(f"  case failed: {label}: {reason[:200]}", flush=True)
    for note in run.notes:
        print(f"  note: {note}", flush=True)
    by_case = ncu.group_by_case(ncu.join_preceding_case(run.kernels))
    for shape in ctx.plan:
        plan = attnlab_backward_plan(shape)
        comparison = compare_case("attnlab", shape, by_case.get(
            ncu.case_label("attnlab", ncu.FWDBWD_PHASE, shape), []), phase=ncu.FWDBWD_PHASE)
        # Logical bytes per predicted kernel, in launch order: at d = 256 the Gluon dV and
        # dK launches share the role "backward_dkdv".
        logical_of = [fused_forward_traffic(shape, write_lse=True,
                                            scope="layer").kernels[0].total_bytes]
        logical_of += [traffic.total_bytes for _, traffic in zip(
            predict_backward(shape), logical_backward(shape).kernels, strict=True)]
        for pair, logical in zip(comparison.pairs, logical_of, strict=True):
            role, kernel, model = pair.role, pair.measured, pair.predicted
            got = None if kernel is None or kernel.dram_bytes_read is None else (
                kernel.dram_bytes_read + (kernel.dram_bytes_write or 0))
            error = None if got is None else (model.total_bytes - got) / got
            row = {"what": "backward_ncu_vs_model", "shape": shape.as_dict(), "role": role,
                   "kernel": None if kernel is None else kernel.name[:120],
                   "measured_bytes": got, "predicted_bytes": model.total_bytes,
                   "predicted_read": model.read_bytes, "predicted_write": model.write_bytes,
                   "measured_read": None if kernel is None else kernel.dram_bytes_read,
                   "measured_write": None if kernel is None else kernel.dram_bytes_write,
                   "logical_bytes": logical, "relative_error": error,
                   "within_goal": None if error is None else abs(error) <= GOAL_RELATIVE_ERROR,
                   "duration_ns": None if kernel is None else kernel.duration_ns,
                   "registers": None if kernel is None else kernel.value(
                       "launch__registers_per_thread"),
                   "plan": {k: v for k, v in plan.items() if k not in ("dq", "dkdv")},
                   "notes": list(model.notes), **ctx.env}
            ctx.append_row("backward_ncu_vs_model.jsonl", row)
            if kernel is not None and ctx.args.ncu_metrics != "core":
                print(f"  {role}: {warp_state(kernel)}", flush=True)
            print(f"  {shape.describe()[:60]:60s} {role:14s} measured "
                  f"{'-' if got is None else f'{got / 1e6:8.1f}'} MB, cache model "
                  f"{model.total_bytes / 1e6:8.1f} MB "
                  f"({'-' if error is None else f'{error:+.1%}'}), logical {logical / 1e6:8.1f}",
                  flush=True)


def warp_state(kernel) -> str:
    """One line of where a kernel's time goes (ncu's full metric set): speed of light,
    occupancy, cycles per issue and its three largest stall reasons."""
    from attnlab.measure import ncu

    def value(metric):
        got = kernel.value(metric)
        return float("nan") if got is None else got

    stalls = sorted(((value(ncu.stall_metric(r)), r) for r in ncu.STALL_REASONS
                     if r not in ("selected", "not_selected")), reverse=True)[:3]
    return (f"SOL compute {value('sm__throughput.avg.pct_of_peak_sustained_elapsed'):.0f}% "
            f"memory {value('gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed'):.0f}%, "
            f"occupancy {value('sm__warps_active.avg.pct_of_peak_sustained_active'):.0f}%, "
            f"{value('smsp__average_warp_latency_per_inst_issued.ratio'):.1f} cycles/issue, "
            f"registers {value('launch__registers_per_thread'):.0f}; stalls "
            + ", ".join(f"{r} {v:.2f}" for v, r in stalls))


def parse_ints(text: str, option: str, allowed=None) -> list[int]:
    """Comma-separated ints for ``option``; with ``allowed``, each must be one of them."""
    values = parse_int_list(text, option)
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad:
        raise ValueError(f"{option}: {bad[0]} is not one of {', '.join(map(str, allowed))}")
    return values


bench = Bench("backward_h200", __doc__)
bench.option("--quick", action="store_true",
             help="thinned correctness grid, no tuning, four benchmark points")
bench.option("--flex", choices=("default", "all", "none"), default="default")
bench.option("--sm90-seqlens", default="4096,1024,16384,2048,8192")
bench.option("--sm90-heads", default="128,64")
bench.option("--tune-heads", default="128,64,256",
             help="head dims to tune, in order, while the tune budget lasts")
bench.option("--tune-seqlens", default="4096",
             help="sequence lengths to tune (one length bucket each), in order")
bench.option("--sm90-skip-accuracy", action="store_true",
             help="time only (the candidates' accuracy was recorded before)")
bench.option("--providers", default=",".join(BENCH_PROVIDERS),
             help="bench providers, comma-separated (default: all five)")
bench.option("--shapes", default="", help="bench and profile only shapes whose description "
                                          "contains one of these comma-separated parts, e.g. "
                                          "'Nq=1024,d=64'")
bench.option("--profile", action="store_true", help="list each call's kernels")
bench.option("--ncu-metrics", choices=("core", "full", "sections"), default="core",
             help="ncu phase: the DRAM bytes the model comparison needs (core), or also the "
                  "speed of light, occupancy and warp stalls per kernel (full), or also "
                  "every metric of ncu's full section set, kept in ncu_raw.csv (sections: "
                  "pipe utilisation, shared-memory wavefronts, ...)")
# The order they run in: the ones only run when asked first, the tuning before the table.
bench.phase("edge", default=False)(phase_edge)
bench.phase("profile", default=False, plan=profile_plan)(phase_profile)
bench.phase("ncu", default=False, cap_s=60.0,
            plan=lambda args: [s for s in NCU_SHAPES if shape_selected(s, args.shapes)])(phase_ncu)
bench.phase("correct", cap_s=45.0, plan=correctness_cases)(phase_correct)
bench.phase("sm90", default=False, cap_s=200.0, plan=sm90_plan)(phase_sm90)
bench.phase("dq", default=False, cap_s=200.0, plan=dq_plan)(phase_dq)
bench.phase("schedule", default=False, cap_s=200.0, plan=schedule_plan)(phase_schedule)
bench.phase("tune", cap_s=90.0, plan=tune_plan)(phase_tune)
bench.phase("bench", cap_s=150.0, plan=bench_plan)(phase_bench)
bench.finish(print_table)


if __name__ == "__main__":
    sys.exit(bench.main())
