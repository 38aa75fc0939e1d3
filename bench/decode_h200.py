"""Flash-Decoding on the H200: correctness at real sizes, then decode latency and K/V TB/s.

One call does everything (issue #13's grid), so a lease is spent on measurements:

    PYTHONPATH=src python3 bench/decode_h200.py --out $OUT [--quick]
        [--phases correct,ceiling,timing,tune]

1. correctness (float64 reference, the accuracy rule): 4k/32k/128k caches, paged
   (16, 256) == contiguous, per-sequence lengths, append + rotary, CUDA-graph capture;
   a failing case is recorded and the run goes on;
2. the ceiling: a 2 GiB device-to-device copy (bytes read + written per second);
3. timing, all providers in one run under CUDA-graph replay (SDPA backends pinned
   outside the timed region, the timer's ``context``): bf16, 32 query / 8 KV heads,
   d = 128, one query token, batch {1, 16, 64} x cache {4k, 32k, 128k}, contiguous and
   paged (page 16 and 256, attnlab only); plus seqlen_q = 4 and 16 (speculative
   decoding).  Per point: median latency, K/V bytes read per second, and for attnlab
   the split count and programs launched against the SMs;
4. ``tune`` (only when asked): a few points with other split counts and key tiles
   (decode_tuning.jsonl);
5. ``paged_sweep`` (only when asked: ``--phases paged_sweep``, ~50 s, cap 60 s):
   contiguous vs paged 16 / 256 at B1 x 32k, B16 x 32k, B1 x 128k (d = 128)
   and the seed's d = 256 B1 x 32k, tensor cache_seqlens (decode_paged_sweep.jsonl);
6. ``rows_sweep`` (only when asked, cap 90 s): 16 queries per sequence at B1 / B16 x 32k,
   contiguous and paged 16 / 256, under the base tiling and ``ROWS_SWEEP_CONFIGS``
   (decode_rows_sweep.jsonl);
7. ``flush`` (only when asked, cap 90 s): attnlab's bf16 and fp8 caches and cuDNN under
   the timer's zeroing and clean L2 flushes, at B1 x 4k / 32k, B16 x 32k and the seed's
   d = 256 B1 x 32k (decode_flush.jsonl).

Writes decode.jsonl (records schema, phase "decode"), decode_launch.jsonl,
correctness.jsonl, decode_tuning.jsonl into --out; prints a table last.  A
configuration of attnlab.measure.engine (phases, --out, environment, records).
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

import attnlab
from attnlab.accuracy import check_accuracy
from attnlab.kernels.configs import DecodeConfig, decode_config
from attnlab.kernels.decode import flash_decode, launch_plan
from attnlab.kernels.dispatch import sm_count
from attnlab.measure import records
from attnlab.measure.dispatch import kernels_that_ran
from attnlab.measure.engine import Bench
from attnlab.measure.providers import PROVIDERS, ProviderUnavailable, make_inputs, prepare
from attnlab.measure.timing import time_call
from attnlab.model import cache as cache_model
from attnlab.model import traffic
from attnlab.reference.decode import kvcache_attention
from attnlab.shapes import AttentionShape

HEADS, KV_HEADS, DIM = 32, 8, 128
PEERS = ("sdpa_cudnn", "sdpa_flash", "flex", "eager")
KERNEL_NAMES = ["_split_kv_decode", "_combine_partials"]
FLEX_COMPILE_BUDGET_S = 60.0

bench = Bench("decode_h200", __doc__)
bench.option("--quick", action="store_true", help="a few points only (~1 minute)")


def log(*args) -> None:
    print(*args, flush=True)


def bf16(*shape, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def pages_of(cache: torch.Tensor, page_size: int, seed: int = 0):
    """The same storage seen as (pages, page_size, kv_heads, d), pages in shuffled order."""
    batch, capacity = cache.shape[:2]
    per_seq = capacity // page_size
    pages = cache.view(batch * per_seq, page_size, *cache.shape[2:])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    return pages, table.to(torch.int32).cuda()


def gathered(pages, table, length):
    """Dense (batch, length, kv_heads, d) from pages, for the reference."""
    return pages[table.long()].flatten(1, 2)[:, :length]


# ----- 1. correctness ----------------------------------------------------------------------
@bench.phase("correct")
def correctness(ctx) -> None:
    """Flash-decoding against float64: long caches, paged == contiguous, append + rotary + graph."""
    env, quick, rows, failures = ctx.env, ctx.args.quick, [], 0

    def case(name, fn):
        nonlocal failures
        start = time.perf_counter()
        try:
            passed, detail = fn()
        except Exception as error:  # record and go on
            passed, detail = False, f"{type(error).__name__}: {error}"
            traceback.print_exc()
        failures += not passed
        rows.append({"what": name, "passed": passed, "detail": detail,
                     "seconds": round(time.perf_counter() - start, 2), **env})
        log(f"{'ok  ' if passed else 'FAIL'} {name}: {detail}")

    def dense(batch, seqlen_k, seqlen_q=1, **options):
        def run():
            q = bf16(batch, seqlen_q, HEADS, DIM, seed=1)
            k, v = bf16(batch, seqlen_k, KV_HEADS, DIM, seed=2), bf16(batch, seqlen_k, KV_HEADS, DIM, seed=3)
            out, lse = attnlab.flash_attn_with_kvcache(q, k, v, return_softmax_lse=True,
                                                       window_size=options.get("window", (-1, -1)),
                                                       causal=options.get("causal", False),
                                                       softcap=options.get("softcap", 0.0))
            worst = []
            for b in sorted({0, batch - 1}):
                result = check_accuracy(out[b:b + 1].cpu(), lse[b:b + 1].cpu(), q[b:b + 1].cpu(),
                                        k[b:b + 1].cpu(), v[b:b + 1].cpu(), layout="bshd", **options)
                worst.append(result)
            ok = all(r.passed for r in worst)
            return ok, "; ".join(f"err {r.error:.2e} allowed {r.allowed:.2e} lse {r.lse_error:.1e}"
                                 for r in worst)
        return run

    def paged_vs_contiguous(page_size, seqlen_q):
        def run():
            batch, capacity = 8, 8192
            q = bf16(batch, seqlen_q, HEADS, DIM, seed=4)
            k, v = bf16(batch, capacity, KV_HEADS, DIM, seed=5), bf16(batch, capacity, KV_HEADS, DIM, seed=6)
            lengths = torch.randint(1, capacity, (batch,), generator=torch.Generator().manual_seed(1),
                                    dtype=torch.int32).cuda()
            k_pages, table = pages_of(k, page_size, seed=2)
            v_pages, _ = pages_of(v, page_size, seed=2)
            k_dense, v_dense = gathered(k_pages, table, capacity), gathered(v_pages, table, capacity)
            paged = attnlab.flash_attn_with_kvcache(q, k_pages, v_pages, block_table=table,
                                                    cache_seqlens=lengths, causal=True,
                                                    return_softmax_lse=True)
            contiguous = attnlab.flash_attn_with_kvcache(q, k_dense, v_dense, cache_seqlens=lengths,
                                                         causal=True, return_softmax_lse=True)
            same = torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
            ref, _ = kvcache_attention(q, k_dense, v_dense, cache_seqlens=lengths, causal=True)
            error = (paged[0].double() - ref.double()).abs().max().item()
            return same and error < 2e-2, f"paged == contiguous: {same}; max err vs float64 {error:.2e}"
        return run

    def append_rotary_graph():
        batch, capacity, seqlen_new = 4, 4096, 1
        q = bf16(batch, seqlen_new, HEADS, DIM, seed=7)
        k_new, v_new = bf16(batch, seqlen_new, KV_HEADS, DIM, seed=8), bf16(batch, seqlen_new, KV_HEADS, DIM, seed=9)
        k_cache, v_cache = bf16(batch, capacity, KV_HEADS, DIM, seed=10), bf16(batch, capacity, KV_HEADS, DIM, seed=11)
        angle = torch.rand(capacity, 32, device="cuda") * 6.3
        cos, sin = angle.cos(), angle.sin()
        lengths = torch.tensor([10, 1000, 4000, 0], dtype=torch.int32, device="cuda")
        options = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=True,
                       max_seqlen_k=capacity)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        expected = attnlab.flash_attn_with_kvcache(q, ref_k, ref_v, k_new, v_new, impl="reference",
                                                   **options)
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        eager = attnlab.flash_attn_with_kvcache(q, eager_k, eager_v, k_new, v_new, **options)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **options)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = attnlab.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **options)
        graph.replay()
        torch.cuda.synchronize()
        caches_ok = torch.equal(k_cache, eager_k) and torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        error = (eager.double() - expected.double()).abs().max().item()
        same = torch.equal(captured, eager)
        return caches_ok and same and error < 2e-2, (
            f"caches == reference: {caches_ok}; graph == eager: {same}; err vs reference {error:.2e}")

    case("dense 1 x 4097, causal", dense(1, 4097, causal=True))
    case("dense 4 x 32768, causal", dense(4, 32768, causal=True))
    case("dense 1 x 131072, causal", dense(1, 131072, causal=True))
    case("dense 2 x 8192, seqlen_q 16, causal", dense(2, 8192, seqlen_q=16, causal=True))
    if not quick:
        case("dense 2 x 20000, window (1024, 0), softcap 30",
             dense(2, 20000, causal=True, window=(1024, 0), softcap=30.0))
        case("dense 64 x 4096, seqlen_q 4, causal", dense(64, 4096, seqlen_q=4, causal=True))
    for page_size in (16, 256):
        case(f"paged {page_size} == contiguous, per-sequence lengths, seqlen_q 1",
             paged_vs_contiguous(page_size, 1))
    case("paged 16 == contiguous, seqlen_q 4", paged_vs_contiguous(16, 4))
    case("append + rotary + CUDA graph == eager == reference", append_rotary_graph)
    ctx.write_rows("correctness.jsonl", rows)
    log(f"correctness: {len(rows) - failures}/{len(rows)} passed")
    ctx.fail(failures)


# ----- 2. the device-copy ceiling --------------------------------------------------------------
@bench.phase("ceiling")
def copy_ceiling(ctx) -> float:
    """A 2 GiB device-to-device copy: the bytes-per-second roof of a decode."""
    env = ctx.env
    elements = 2**30  # bf16: 2 GiB
    src = torch.empty(elements, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    timing = time_call(lambda a, b: b.copy_(a), [(src, dst)], warmup=3, repeats=20, flush="none",
                       cuda_graph=False)
    moved = 2 * elements * 2  # read + written
    tbps = moved / (timing.p50 * 1e-3) / 1e12
    record = records.make_record(
        kernel="copy", provider="device_copy", phase="decode", shape={}, metric="latency",
        unit="ms", p20=timing.p20, p50=timing.p50, p80=timing.p80, repeats=timing.repeats,
        env=env, tbps=tbps, kernel_names=["copy_"], timing_method=timing.method)
    del src, dst
    torch.cuda.empty_cache()
    log(f"device copy 2 GiB: {timing.p50:.3f} ms, {tbps:.2f} TB/s (read + written)")
    ctx.upsert("decode.jsonl", [record])
    return tbps


# ----- 3. timing -------------------------------------------------------------------------------
def kv_bytes(shape: AttentionShape) -> int:
    """K + V bytes a GQA-packed decode reads once (the byte model, layer scope)."""
    model = traffic.flash_decoding_traffic(shape, num_splits=1, scope="layer")
    return model.bytes_of("K") + model.bytes_of("V")


def measure(name, fn, inputs, shape, env, *, context=None, kernel_names=(), flush="l2",
            moved=None):
    # Every decode point is timed under graph replay: the timer's automatic rule estimates
    # with a host clock, and attnlab's host-side checks made a 20 us kernel look like a
    # 370 us call, so it was event-timed (run 1).  A provider whose capture fails is
    # event-timed and says so in timing_method.
    try:
        timing = time_call(fn, [inputs], warmup=3, flush=flush, cuda_graph=True, context=context,
                           target_ms=60.0, max_repeats=100)
    except Exception as error:  # noqa: BLE001 -- any capture failure: time it plainly, say so
        log(f"  {name}: graph capture failed ({type(error).__name__}: {str(error)[:80]}); "
            "event-timed")
        timing = time_call(fn, [inputs], warmup=3, flush=flush, cuda_graph=False,
                           context=context, target_ms=60.0, max_repeats=100)
    # The record names what the profiler saw launch (one of ``kernel_names`` among them),
    # not what was meant to: a one-split call runs no combine.
    names = kernels_that_ran(fn, inputs, tuple(kernel_names), owner=name, context=context)
    tbps = (kv_bytes(shape) if moved is None else moved) / (timing.p50 * 1e-3) / 1e12
    record = records.make_record(
        kernel="call", provider=name, phase="decode", shape=shape, metric="latency", unit="ms",
        p20=timing.p20, p50=timing.p50, p80=timing.p80, repeats=timing.repeats, env=env,
        tbps=tbps, kernel_names=names,
        timing_method=timing.method if flush == "l2" else timing.describe_method())
    return record


def skipped(name, shape, reason, env):
    log(f"  skip {name} {shape.describe()}: {reason}")
    return records.skipped_record(provider=name, phase="decode", shape=shape, reason=reason, env=env)


def attnlab_decode_call(shape: AttentionShape, page_size: int | None, seed: int = 0):
    """(fn, inputs) of flash_attn_with_kvcache on a full cache, contiguous or paged."""
    q = bf16(shape.batch, shape.seqlen_q, HEADS, DIM, seed=seed)
    k = bf16(shape.batch, shape.seqlen_k, KV_HEADS, DIM, seed=seed + 1)
    v = bf16(shape.batch, shape.seqlen_k, KV_HEADS, DIM, seed=seed + 2)
    scale = shape.softmax_scale
    if page_size is None:
        return (lambda q, k, v: attnlab.flash_attn_with_kvcache(q, k, v, causal=True, softmax_scale=scale)), (q, k, v)
    k_pages, table = pages_of(k, page_size, seed=seed)
    v_pages, _ = pages_of(v, page_size, seed=seed)

    def paged(q, k, v, table):
        return attnlab.flash_attn_with_kvcache(q, k, v, block_table=table, causal=True,
                                               softmax_scale=scale)

    return paged, (q, k_pages, v_pages, table)


def peer_call(name: str, shape: AttentionShape):
    """(fn, inputs, context) of a measure.providers provider, or a skip reason (str)."""
    provider = PROVIDERS[name]
    try:
        # Speculative decoding runs as "prefill": the providers' decode phase is one token.
        prepared = prepare(provider, shape, "decode" if shape.seqlen_q == 1 else "prefill", "cuda")
        fn, pin = prepared.unpinned_call, prepared.pin
    except ProviderUnavailable as error:
        return str(error)
    return fn, make_inputs(shape, provider.input_layout, "cuda"), pin


def timing_grid(args) -> list[AttentionShape]:
    quick = args.quick
    batches, lengths = ((1, 16), (4096, 32768)) if quick else ((1, 16, 64), (4096, 32768, 131072))
    points = [(b, n, 1) for b in batches for n in lengths]
    spec = [(1, 32768, 4), (16, 32768, 4), (1, 32768, 16), (16, 32768, 16)]
    points += spec[:2] if quick else spec
    for name in ("attnlab", *PEERS):
        PROVIDERS[name]  # noqa: B018 - a peer renamed in measure.providers fails here, on a CPU
    return [AttentionShape(batch=batch, query_heads=HEADS, kv_heads=KV_HEADS, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, head_dim=DIM, dtype="bf16", causal=True)
            for batch, seqlen_k, seqlen_q in points]


@bench.phase("timing", plan=timing_grid)
def timing(ctx) -> tuple[list, list]:
    """attnlab's decode (contiguous, paged 16 and 256) and the peers, under CUDA-graph replay."""
    env, sms = ctx.env, ctx.results["sms"]
    out, launches = [], []
    flex_spent = 0.0
    for shape in ctx.within_budget(ctx.plan, label=AttentionShape.describe):
        batch, seqlen_k, seqlen_q = shape.batch, shape.seqlen_k, shape.seqlen_q
        first = len(out)
        log(f"== {shape.describe()}")
        plan = launch_plan(batch=batch, kv_heads=KV_HEADS, query_heads=HEADS, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, head_dim=DIM, sm_count=sms)
        launches.append({"shape": shape.as_dict(), **plan, **env})
        variants = [("attnlab_decode", None), ("attnlab_decode_paged16", 16),
                    ("attnlab_decode_paged256", 256)]
        for name, page_size in variants:
            try:
                fn, inputs = attnlab_decode_call(shape, page_size)
                record = measure(name, fn, inputs, shape, env, kernel_names=KERNEL_NAMES)
                out.append(record)
                log(f"  {name:24s} {record['p50'] * 1e3:9.1f} us  {record['tbps']:.2f} TB/s  "
                    f"splits {plan['num_splits']}, {plan['programs']} programs / {sms} SMs")
                del fn, inputs
            except Exception as error:
                traceback.print_exc()
                out.append(skipped(name, shape, f"failed: {type(error).__name__}: {error}", env))
            torch.cuda.empty_cache()
        for name in ("attnlab", *PEERS):
            if name == "flex" and flex_spent > FLEX_COMPILE_BUDGET_S:
                out.append(skipped(name, shape, f"flex compile budget ({FLEX_COMPILE_BUDGET_S:.0f} s "
                                   "per run) spent on earlier points", env))
                continue
            start = time.perf_counter()
            prepared = peer_call(name, shape)
            if isinstance(prepared, str):
                out.append(skipped(name, shape, prepared, env))
                continue
            fn, inputs, pin = prepared
            del prepared  # the inputs must be freed after this point (64 x 128k: 34 GB)
            try:
                record = measure(name, fn, inputs, shape, env, context=pin)
                out.append(record)
                log(f"  {name:24s} {record['p50'] * 1e3:9.1f} us  {record['tbps']:.2f} TB/s")
            except Exception as error:
                traceback.print_exc()
                out.append(skipped(name, shape, f"failed: {type(error).__name__}: {error}", env))
            if name == "flex":
                flex_spent += time.perf_counter() - start
            del fn, inputs
            torch.cuda.empty_cache()
        ctx.upsert("decode.jsonl", out[first:])  # this point's records, kept at once
    ctx.write_rows("decode_launch.jsonl", launches)
    return out, launches


# ----- 4. tuning ---------------------------------------------------------------------------------
@bench.phase("tune", default=False)
def tuning(ctx) -> None:
    """Other split counts and key tiles at a few points (decode_tuning.jsonl)."""
    env, sms, out = ctx.env, ctx.results["sms"], []
    base = decode_config(DIM)
    configs = [base, DecodeConfig(128, 4, 3, 1), DecodeConfig(64, 4, 4, 2), DecodeConfig(32, 4, 4, 3)]
    for batch, seqlen_k in ((1, 32768), (16, 32768), (1, 131072), (64, 4096)):
        shape = AttentionShape(batch=batch, query_heads=HEADS, kv_heads=KV_HEADS, seqlen_q=1,
                               seqlen_k=seqlen_k, head_dim=DIM, dtype="bf16", causal=True)
        q = bf16(batch, 1, HEADS, DIM, seed=1)
        k, v = bf16(batch, seqlen_k, KV_HEADS, DIM, seed=2), bf16(batch, seqlen_k, KV_HEADS, DIM, seed=3)
        chosen = launch_plan(batch=batch, kv_heads=KV_HEADS, query_heads=HEADS, seqlen_q=1,
                             seqlen_k=seqlen_k, head_dim=DIM, sm_count=sms)["num_splits"]
        for config in configs:
            for splits in sorted({1, max(1, chosen // 2), chosen, min(128, 2 * chosen), 64, 128}):
                name = (f"attnlab_decode[block_n={config.block_n},stages={config.num_stages},"
                        f"splits={splits}]")
                try:
                    def fn(q, k, v, config=config, splits=splits):
                        return flash_decode(q, k, v, scale=shape.softmax_scale, causal=True,
                                            num_splits=splits, config=config)
                    record = measure(name, fn, (q, k, v), shape, env, kernel_names=KERNEL_NAMES)
                    out.append(record)
                    log(f"  tune {shape.describe()} {name}: {record['p50'] * 1e3:.1f} us "
                        f"{record['tbps']:.2f} TB/s")
                except Exception as error:
                    out.append(skipped(name, shape, f"failed: {type(error).__name__}: {error}", env))
        del q, k, v
        torch.cuda.empty_cache()
    ctx.upsert("decode_tuning.jsonl", out)


# ----- 4b. split counts of short batch-1 caches --------------------------------------------------
SHORT_SPLIT_POINTS = ((4096, 32, 8, 128), (8192, 32, 8, 128), (16384, 32, 8, 128),
                      (4096, 24, 4, 256), (8192, 24, 4, 256))


@bench.phase("short_splits", default=False, cap_s=60.0)
def short_splits(ctx) -> None:
    """Batch 1 with 4k-16k keys (issue #32: B1 x 4k >= cuDNN): every split count against
    the one the rule picks and cuDNN, graph-timed (decode_short_splits.jsonl)."""
    env, sms, out = ctx.env, ctx.results["sms"], []
    for seqlen_k, heads, kv_heads, dim in ctx.within_budget(SHORT_SPLIT_POINTS):
        shape = AttentionShape(batch=1, query_heads=heads, kv_heads=kv_heads, seqlen_q=1,
                               seqlen_k=seqlen_k, head_dim=dim, dtype="bf16", causal=True)
        q = bf16(1, 1, heads, dim, seed=1)
        k, v = bf16(1, seqlen_k, kv_heads, dim, seed=2), bf16(1, seqlen_k, kv_heads, dim, seed=3)
        chosen = launch_plan(batch=1, kv_heads=kv_heads, query_heads=heads, seqlen_q=1,
                             seqlen_k=seqlen_k, head_dim=dim, sm_count=sms)["num_splits"]
        tiles = -(-seqlen_k // decode_config(dim).block_n)
        row = []
        for splits in sorted({1, 2, 4, 6, 8, 11, 16, 22, 32, chosen} & set(range(1, tiles + 1))):
            name = f"attnlab_decode[splits={splits}{',chosen' if splits == chosen else ''}]"
            def fn(q, k, v, splits=splits):
                return flash_decode(q, k, v, scale=shape.softmax_scale, causal=True,
                                    num_splits=splits)
            record = measure(name, fn, (q, k, v), shape, env, kernel_names=KERNEL_NAMES)
            out.append(record)
            row.append(f"{splits}:{record['p50'] * 1e3:.1f}")
        try:
            prepared = prepare(PROVIDERS["sdpa_cudnn"], shape, "decode", "cuda")
            inputs = make_inputs(shape, prepared.provider.input_layout, "cuda")
            record = measure("sdpa_cudnn", prepared.unpinned_call, inputs, shape, env,
                             context=prepared.pin)
            out.append(record)
            row.append(f"cudnn:{record['p50'] * 1e3:.1f}")
        except ProviderUnavailable as error:
            out.append(skipped("sdpa_cudnn", shape, str(error), env))
        log(f"  {shape.describe()} (rule: {chosen}) us by splits: {' '.join(row)}")
        del q, k, v
        torch.cuda.empty_cache()
    ctx.upsert("decode_short_splits.jsonl", out)


# ----- 5. paged caches against the contiguous one ----------------------------------------------
PAGED_SWEEP_POINTS = ((1, 32768, 32, 8, 128), (16, 32768, 32, 8, 128), (1, 131072, 32, 8, 128),
                      (1, 32768, 24, 4, 256))


def one_token_points(points) -> list[AttentionShape]:
    """Causal bf16 one-token decodes at (batch, seqlen_k, query heads, kv heads, d) points."""
    return [AttentionShape(batch=b, query_heads=h, kv_heads=kv, seqlen_q=1, seqlen_k=n,
                           head_dim=d, dtype="bf16", causal=True)
            for b, n, h, kv, d in points]


def one_token_qkv(shape: AttentionShape):
    """Random bf16 (q, k cache, v cache) of a one-token point, bshd."""
    b, n, d = shape.batch, shape.seqlen_k, shape.head_dim
    return (bf16(b, 1, shape.query_heads, d, seed=1), bf16(b, n, shape.kv_heads, d, seed=2),
            bf16(b, n, shape.kv_heads, d, seed=3))


def paged_sweep_points(args) -> list[AttentionShape]:
    return one_token_points(PAGED_SWEEP_POINTS)


@bench.phase("paged_sweep", default=False, cap_s=60.0, plan=paged_sweep_points)
def paged_sweep(ctx) -> list[dict]:
    """Contiguous vs paged (16, 256) caches, the same keys."""
    env, out, table_rows = ctx.env, [], []
    for shape in ctx.within_budget(ctx.plan, label=AttentionShape.describe):
        log(f"== paged sweep {shape.describe()}")
        q, k, v = one_token_qkv(shape)
        lengths = torch.full((shape.batch,), shape.seqlen_k, dtype=torch.int32, device="cuda")
        config = decode_config(shape.head_dim)
        variants = [("attnlab_decode", None)] + [(f"attnlab_decode_paged{page_size}", page_size)
                                                 for page_size in (16, 256)]
        row = {"shape": shape.describe()}
        for name, page_size in variants:
            try:
                if page_size is None:
                    inputs = (q, k, v, lengths)

                    def fn(q, k, v, n, config=config):
                        return flash_decode(q, k, v, scale=shape.softmax_scale, causal=True,
                                            cache_seqlens=n, config=config)
                else:
                    (k_pages, table), (v_pages, _) = (pages_of(t, page_size) for t in (k, v))
                    inputs = (q, k_pages, v_pages, lengths, table)

                    def fn(q, k, v, n, table, config=config):
                        return flash_decode(q, k, v, scale=shape.softmax_scale, causal=True,
                                            cache_seqlens=n, block_table=table, config=config)
                record = measure(name, fn, inputs, shape, env, kernel_names=KERNEL_NAMES)
                out.append(record)
                row[name] = record["p50"] * 1e3
                log(f"  {name:34s} {record['p50'] * 1e3:9.1f} us  {record['tbps']:.2f} TB/s")
            except Exception as error:  # noqa: BLE001 -- recorded, the sweep goes on
                traceback.print_exc()
                out.append(skipped(name, shape, f"failed: {type(error).__name__}: {error}", env))
        table_rows.append(row)
        ctx.upsert("decode_paged_sweep.jsonl", out[-len(variants):])
        del q, k, v
        torch.cuda.empty_cache()
    log("\npaged / contiguous (GPU time ratio; > 1 is slower)")
    for row in table_rows:
        contiguous = row.get("attnlab_decode")
        cells = []
        for page_size in (16, 256):
            t = row.get(f"attnlab_decode_paged{page_size}")
            cells.append(f"page {page_size}: " + (
                "-" if t is None or contiguous is None else f"{t / contiguous:.2f}x"))
        log(f"{row['shape']}: contiguous {contiguous or float('nan'):.1f} us; " + "; ".join(cells))
    return out


# ----- 6. tilings for several query rows per KV head (seqlen_q > 1) --------------------------
# At 16 queries per sequence (64 rows per KV head) the d = 128 tiling spills (19 / 26
# LDL/STL contiguous / page 16, Triton 3.6.0, compiled here) and page 16 ran at 0.72x of
# contiguous (session 12 run 3); these tilings build spill-free at 64 rows.
ROWS_SWEEP_POINTS = ((16, 32768, 16), (1, 32768, 16))
ROWS_SWEEP_CONFIGS = (DecodeConfig(128, 8, 3, 1), DecodeConfig(64, 4, 4, 1),
                      DecodeConfig(64, 8, 3, 2))


def rows_sweep_points(args) -> list[AttentionShape]:
    return [AttentionShape(batch=b, query_heads=HEADS, kv_heads=KV_HEADS, seqlen_q=sq,
                           seqlen_k=n, head_dim=DIM, dtype="bf16", causal=True)
            for b, n, sq in ROWS_SWEEP_POINTS]


@bench.phase("rows_sweep", default=False, cap_s=90.0, plan=rows_sweep_points)
def rows_sweep(ctx) -> list[dict]:
    """Contiguous and paged (16, 256) caches under the base tiling and ROWS_SWEEP_CONFIGS."""
    env, out = ctx.env, []
    for shape in ctx.within_budget(ctx.plan, label=AttentionShape.describe):
        log(f"== rows sweep {shape.describe()}")
        b, n, sq = shape.batch, shape.seqlen_k, shape.seqlen_q
        q = bf16(b, sq, HEADS, DIM, seed=1)
        k, v = bf16(b, n, KV_HEADS, DIM, seed=2), bf16(b, n, KV_HEADS, DIM, seed=3)
        lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
        caches = {0: (k, v, None)}
        for page_size in (16, 256):
            (k_pages, table), (v_pages, _) = (pages_of(t, page_size) for t in (k, v))
            caches[page_size] = (k_pages, v_pages, table)
        base_out = {}
        for config in (decode_config(DIM), *ROWS_SWEEP_CONFIGS):
            for page_size, (kc, vc, table) in caches.items():
                name = (f"attnlab_decode{f'_paged{page_size}' if page_size else ''}"
                        f"[block_n={config.block_n},warps={config.num_warps},"
                        f"stages={config.num_stages}]")
                try:
                    def fn(q, k, v, n, config=config, table=table):
                        return flash_decode(q, k, v, scale=shape.softmax_scale, causal=True,
                                            cache_seqlens=n, block_table=table, config=config)
                    # Against the base tiling's output on the same cache (the GPU tests'
                    # tiling): another tiling only reorders fp32 sums, far below bf16's
                    # 2^-8.  Not against the contiguous cache: pages_of shuffles the
                    # pages, so a paged cache holds other keys at each position (session
                    # 12 run 4 compared across caches and failed every paged row).
                    got = fn(q, kc, vc, lengths)[0].float()
                    differs = (got - base_out.setdefault(page_size, got)).abs().max().item()
                    if not differs <= 2e-2:
                        ctx.fail()
                    record = measure(name, fn, (q, kc, vc, lengths), shape, env,
                                     kernel_names=KERNEL_NAMES)
                    out.append(record)
                    log(f"  {name:58s} {record['p50'] * 1e3:9.1f} us  {record['tbps']:.2f} TB/s"
                        f"  max |out - base| {differs:.1e}")
                except Exception as error:  # noqa: BLE001 -- recorded, the sweep goes on
                    traceback.print_exc()
                    out.append(skipped(name, shape, f"failed: {type(error).__name__}: {error}",
                                       env))
        ctx.upsert("decode_rows_sweep.jsonl", out)
        del q, k, v, caches
        torch.cuda.empty_cache()
    return out


# ----- 7. the timer's flush ---------------------------------------------------------------------
# Zeroing the flush buffer leaves L2 holding up to ~50 MB of dirty lines that the timed
# call writes back to DRAM; reading it (flush="l2_clean") leaves clean ones.  Session 13
# run 1 (bench/NOTES.md, S18): the write-back was ~10 us of every batch-1 decode, for
# every provider.
FLUSH_POINTS = ((1, 4096, 32, 8, 128), (1, 32768, 32, 8, 128), (16, 32768, 32, 8, 128),
                (1, 32768, 24, 4, 256))
FLUSH_PROVIDERS = ("attnlab_decode", "attnlab_decode_fp8", "sdpa_cudnn")


@bench.phase("flush", default=False, cap_s=90.0,
             plan=lambda args: one_token_points(FLUSH_POINTS))
def flush_check(ctx) -> list[dict]:
    """attnlab's bf16 and fp8 caches and cuDNN under the timer's zeroing flush and its
    clean (read) flush."""
    from attnlab.reference.fp8 import quantize_per_head

    env, out, rows = ctx.env, [], []
    for shape in ctx.within_budget(ctx.plan, label=AttentionShape.describe):
        log(f"== flush {shape.describe()}")
        q, k, v = one_token_qkv(shape)
        (k8, kd), (v8, vd) = quantize_per_head(k), quantize_per_head(v)
        scale = shape.softmax_scale
        fp8_bytes = cache_model.decode_kv_bytes(shape, kv_dtype="fp8", kv_scales="kv-head")

        def plain(q, k, v):
            return attnlab.flash_attn_with_kvcache(q, k, v, causal=True, softmax_scale=scale)

        def fp8(q, k, v, kd, vd):
            return attnlab.flash_attn_with_kvcache(q, k, v, causal=True, softmax_scale=scale,
                                                   k_descale=kd, v_descale=vd)

        calls = [("attnlab_decode", plain, (q, k, v), None),
                 ("attnlab_decode_fp8", fp8, (q, k8, v8, kd, vd), None)]
        peer = peer_call("sdpa_cudnn", shape)
        if not isinstance(peer, str):
            calls.append(("sdpa_cudnn", *peer))
        row = {"shape": shape.describe()}
        for flush in ("l2", "l2_clean"):
            for name, fn, inputs, context in calls:
                try:
                    record = measure(name, fn, inputs, shape, env, context=context, flush=flush,
                                     kernel_names=() if name == "sdpa_cudnn" else KERNEL_NAMES,
                                     moved=fp8_bytes if name.endswith("fp8") else None)
                except Exception as error:  # noqa: BLE001 -- recorded, the sweep goes on
                    traceback.print_exc()
                    out.append(skipped(name, shape, f"failed: {type(error).__name__}: {error}",
                                       env))
                    continue
                out.append(record)
                row[(name, flush)] = record["p50"] * 1e3
                log(f"  {flush:8s} {name:24s} {record['p50'] * 1e3:9.1f} us")
        rows.append(row)
        ctx.upsert("decode_flush.jsonl", out)
        del q, k, v, k8, v8, calls
        torch.cuda.empty_cache()
    log("\nus, flush l2 / l2_clean: " + ", ".join(FLUSH_PROVIDERS))
    for row in rows:
        cells = [f"{row.get((name, 'l2'), float('nan')):.1f} / "
                 f"{row.get((name, 'l2_clean'), float('nan')):.1f}" for name in FLUSH_PROVIDERS]
        log(f"{row['shape']}: " + " | ".join(cells))
    return out


@bench.setup
def setup(ctx) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    ctx.results["sms"] = sm_count(torch.device("cuda"))


# ----- the table -----------------------------------------------------------------------------------
@bench.finish
def print_table(ctx) -> None:
    measured, launches = ctx.results.get("timing") or ([], [])
    ceiling_tbps, sms = ctx.results.get("ceiling") or float("nan"), ctx.results.get("sms")
    by_point: dict[tuple, dict[str, dict]] = {}
    for record in measured:
        s = record["shape"]
        key = (s["batch"], s["seqlen_k"], s["seqlen_q"])
        by_point.setdefault(key, {})[record["provider"]] = record
    plans = {(p["shape"]["batch"], p["shape"]["seqlen_k"], p["shape"]["seqlen_q"]): p for p in launches}
    names = ["attnlab_decode", "attnlab_decode_paged16", "attnlab_decode_paged256", "attnlab", *PEERS]
    log(f"\nbf16, {HEADS} q / {KV_HEADS} kv heads, d={DIM}, causal; median us (TB/s of K/V); "
        f"device copy {ceiling_tbps:.2f} TB/s; {sms} SMs")
    log("B x N x Sq | splits | programs | " + " | ".join(names) + " | vs cuDNN | % of copy")
    for key, row in by_point.items():
        plan = plans.get(key, {})
        cells = []
        for name in names:
            r = row.get(name)
            cells.append("-" if r is None or r["metric"] == "skipped"
                         else f"{r['p50'] * 1e3:.1f} ({r['tbps']:.2f})")
        ours, cudnn = row.get("attnlab_decode"), row.get("sdpa_cudnn")
        ratio = (f"{cudnn['p50'] / ours['p50']:.2f}x" if ours and cudnn and ours["metric"] != "skipped"
                 and cudnn["metric"] != "skipped" else "-")
        share = (f"{100 * ours['tbps'] / ceiling_tbps:.0f}%" if ours and ours["metric"] != "skipped"
                 else "-")
        log(f"{key[0]} x {key[1]} x {key[2]} | {plan.get('num_splits', '-')} | "
            f"{plan.get('programs', '-')} | " + " | ".join(cells) + f" | {ratio} | {share}")


if __name__ == "__main__":
    sys.exit(bench.main())
