"""Host time of one forward call, layer by layer, on a GPU: where the public path's
microseconds go before the kernel runs.

    PYTHONPATH=src python3 bench/host_cost_h200.py --out OUT [--phases forward,fwdbwd]

A tiny shape (1 x 128 tokens, one head, d = 128) keeps the GPU's work at a few
microseconds, so each layer's time per call is host time.  Layers, outermost first:
``attnlab.attention`` (validation, dispatch, launch), ``kernels.forward.flash_forward``
(dispatch + launch), ``dispatch.forward_config``, ``forward_sm90.launch``
(descriptors + JIT launch), the three TMA descriptors alone, the JIT launch with
prebuilt descriptors, and Triton's compiled-kernel launcher called directly (what a
launch costs without the JIT's argument binding); the Triton kernel's
``flash_forward`` and SDPA (cuDNN) for scale.  Writes host_cost.jsonl and prints a table.

Phase ``fwdbwd`` (only when asked; ``--phases fwdbwd`` alone for just it) times one training step's layers at the benchmark's N = 1k shapes
(B = 16, 16 heads, bf16, d = 64 and 128, causal): each call starts on an idle GPU
(synchronised before, not after), so its wall time is the host's alone even where the
GPU's work is longer.  Writes host_cost_fwdbwd.jsonl, plus cProfile's table (main
thread, by own time) of 200 calls each of flash_backward and of the grad-enabled
forward, host_cprofile_d{64,128}.txt.

Phase ``decode`` (only when asked: ``--phases decode``, ~70 s, cap 85 s) re-measures issue
#32's table: one ``flash_attn_with_kvcache`` call with a (batch,) int32 ``cache_seqlens``
tensor (and, paged, a ``block_table`` over the same storage in shuffled 16- and 256-token
pages), bf16, one query, causal, at the issue's five points (32q/8kv d=128: B1 x 4k, B1 x
128k, B16 x 32k; the seed's 24q/4kv d=256: B1 x 32k, B16 x 128k), against SDPA's cuDNN
backend.  Per provider and point: the GPU time under CUDA-graph replay (cold L2), the
eager call back to back (wall time per call: the larger of host and GPU time), and the
host time of one call issued to an idle GPU.  Writes host_cost_decode.jsonl (records)
point by point and prints the table.  A configuration of attnlab.measure.engine.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

from attnlab.inputs import layout_named
from attnlab.measure.engine import Bench

bench = Bench("host_cost_h200", __doc__)


def per_call_us(fn, calls: int = 300, rounds: int = 7) -> tuple[float, float]:
    """(median, min) over rounds of the mean host time of ``calls`` back-to-back calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(means), min(means)


def host_latency_us(fn, calls: int = 40) -> tuple[float, float]:
    """(median, min) host time of one call issued to an idle GPU."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples), min(samples)


def fwdbwd_layers(head_dim: int) -> dict:
    """The layers of one attnlab forward+backward at B = 16, 16 heads, N = 1k, causal."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnlab
    from attnlab.kernels.backward import flash_backward
    from attnlab.kernels.forward import flash_forward

    q, k, v = (torch.randn(16, 16, 1024, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    scale = head_dim ** -0.5
    with torch.no_grad():
        out, lse = flash_forward(q, k, v, layout="bhsd", scale=scale, causal=True)
    kept = attnlab.attention(q, k, v, causal=True)
    x = torch.randn(16, device="cuda", requires_grad=True)

    class Identity(torch.autograd.Function):  # a Python node's own cost in the engine
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    def cudnn_step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), grad)

    return {
        "fwd+bwd: autograd.grad(attention)": lambda: torch.autograd.grad(
            attnlab.attention(q, k, v, causal=True), (q, k, v), grad),
        "forward, grad enabled (autograd.Function)": lambda: attnlab.attention(
            q, k, v, causal=True),
        "forward, no grad": lambda: attnlab.attention(q.detach(), k.detach(), v.detach(),
                                                      causal=True),
        "backward: autograd.grad of a kept graph": lambda: torch.autograd.grad(
            kept, (q, k, v), grad, retain_graph=True),
        "flash_forward direct": lambda: flash_forward(q.detach(), k.detach(), v.detach(),
                                                      layout="bhsd", scale=scale, causal=True),
        "flash_backward direct": lambda: flash_backward(
            grad, q.detach(), k.detach(), v.detach(), out, lse, layout="bhsd", scale=scale,
            causal=True),
        "autograd baseline: grad of x * 2": lambda: torch.autograd.grad(x * 2, x,
                                                                        torch.ones_like(x)),
        "autograd baseline: grad through a Python Function": lambda: torch.autograd.grad(
            Identity.apply(x), x, torch.ones_like(x)),
        "SDPA cuDNN fwd+bwd (with its context manager)": cudnn_step,
    }


def backward_anatomy(head_dim: int, calls: int = 40) -> dict[str, float]:
    """Where the engine's backward time goes, median us from the grad call: until our
    node's backward starts (engine, device-thread hand-off), inside it, inside
    flash_backward, and from the node's return until grad returns."""
    import attnlab
    from attnlab.kernels import autograd as glue

    q, k, v = (torch.randn(16, 16, 1024, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    kept = attnlab.attention(q, k, v, causal=True)
    stamps: dict[str, int] = {}
    original_backward, original_flash = glue._EagerFlashAttention.backward, glue._flash_bwd

    def timed_flash(*args):
        stamps["flash_in"] = time.perf_counter_ns()
        result = original_flash(*args)
        stamps["flash_out"] = time.perf_counter_ns()
        return result

    def timed_backward(ctx, *grads):
        stamps["node_in"] = time.perf_counter_ns()
        result = original_backward(ctx, *grads)
        stamps["node_out"] = time.perf_counter_ns()
        return result

    glue._EagerFlashAttention.backward = staticmethod(timed_backward)
    glue._flash_bwd = timed_flash
    parts: dict[str, list[float]] = {"to node": [], "node, before flash_backward": [],
                                     "flash_backward": [], "node, after flash_backward": [],
                                     "node return to grad return": [], "total": []}
    try:
        for i in range(calls + 5):
            torch.cuda.synchronize()
            start = time.perf_counter_ns()
            torch.autograd.grad(kept, (q, k, v), grad, retain_graph=True)
            end = time.perf_counter_ns()
            if i < 5:
                continue
            for name, (a, b) in {"to node": (start, stamps["node_in"]),
                                 "node, before flash_backward": (stamps["node_in"],
                                                                 stamps["flash_in"]),
                                 "flash_backward": (stamps["flash_in"], stamps["flash_out"]),
                                 "node, after flash_backward": (stamps["flash_out"],
                                                                stamps["node_out"]),
                                 "node return to grad return": (stamps["node_out"], end),
                                 "total": (start, end)}.items():
                parts[name].append((b - a) / 1e3)
    finally:
        glue._EagerFlashAttention.backward = staticmethod(original_backward)
        glue._flash_bwd = original_flash
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in parts.items()}


def cprofile_table(fn, calls: int, orders=("tottime",), rows: int = 28) -> str:
    """cProfile's top functions over ``calls`` back-to-back calls of ``fn`` (already
    warm), one table per sort order (the main thread only)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    for order in orders:
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(rows)
    return text.getvalue()


def cprofile_tables(head_dim: int, calls: int = 200) -> str:
    """cProfile's top functions by own time over ``calls`` back-to-back calls each of
    flash_backward and the grad-enabled forward (the main thread only: the engine runs
    the backward node on its device thread, where cProfile does not look)."""
    layers = fwdbwd_layers(head_dim)
    text = []
    for name in ("flash_backward direct", "forward, grad enabled (autograd.Function)"):
        fn = layers[name]
        for _ in range(10):
            fn()
        text.append(f"== d={head_dim} {name}: {calls} calls\n{cprofile_table(fn, calls)}")
    return "".join(text)


def phase_fwdbwd(ctx) -> None:
    """One training step's layers at N = 1k, each call issued to an idle GPU; cProfile tables."""
    import triton

    env, rows = ctx.env, []
    for head_dim in (64, 128):
        for name, fn in fwdbwd_layers(head_dim).items():
            median, best = host_latency_us(fn)
            rows.append({"what": "host_cost_fwdbwd", "layer": name, "head_dim": head_dim,
                         "shape": "B=16 H=16 N=1024 bf16 causal bhsd",
                         "median_us": round(median, 1), "min_us": round(best, 1),
                         "triton": triton.__version__, **env})
            print(f"  d={head_dim:3d} {name:48s} {median:7.1f} us (min {best:6.1f})", flush=True)
            if name.startswith(("fwd+bwd", "SDPA")):
                # Back to back, unsynchronised: the wall time per call is the larger of
                # the host's and the GPU's time per call.
                per_call, _ = per_call_us(fn, calls=100, rounds=5)
                rows.append({**rows[-1], "layer": f"{name}, back to back",
                             "median_us": round(per_call, 1), "min_us": None})
                print(f"  d={head_dim:3d} {name + ', back to back':48s} {per_call:7.1f} us",
                      flush=True)
        for name, median in backward_anatomy(head_dim).items():
            rows.append({"what": "host_cost_fwdbwd", "layer": f"backward anatomy: {name}",
                         "head_dim": head_dim, "shape": "B=16 H=16 N=1024 bf16 causal bhsd",
                         "median_us": round(median, 1), "triton": triton.__version__, **env})
            print(f"  d={head_dim:3d} backward anatomy: {name:32s} {median:7.1f} us", flush=True)
    ctx.write_rows("host_cost_fwdbwd.jsonl", rows)
    for head_dim in (64, 128):
        ctx.path(f"host_cprofile_d{head_dim}.txt").write_text(cprofile_tables(head_dim))


@bench.phase("forward")
def phase_forward(ctx) -> None:
    """Host time per call of each layer of one forward, 1 x 128 tokens (the GPU's work: a few us)."""
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attnlab
    from attnlab.kernels import _sm90 as sm90_host
    from attnlab.kernels import dispatch
    from attnlab.kernels import forward_sm90 as sm90
    from attnlab.kernels.configs import forward_config
    from attnlab.kernels.forward import flash_forward
    from attnlab.shapes import AttentionShape

    env, committed_table = ctx.env, dict(dispatch.FORWARD_SM90.table())
    q, k, v = (torch.randn(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # bhsd: attnlab.attention's layout
    scale = 128 ** -0.5
    config = sm90.DEFAULT_CONFIGS[128]
    layers: dict[str, object] = {}
    if sm90.supports(q, k, v, True, config=config)[0]:
        # The public path must take the Gluon kernel whatever the table says at N = 128.
        # (Put back at the end of this phase: the fwdbwd phase's N = 1k must not see it.)
        dispatch._TABLES[dispatch.FORWARD_SM90] = {(128, True, b): config for b in (128, 1024)}
        kernel, meta = sm90._kernel_and_meta(config)
        descriptors = (sm90_host.descriptor(q, "bhsd", sm90.BLOCK_M // 2),
                       sm90_host.descriptor(k, "bhsd", config.block_n),
                       sm90_host.descriptor(v, "bhsd", config.block_n))
        out = torch.empty_like(q)
        lse = torch.empty(1, 1, 128, device="cuda", dtype=torch.float32)
        strides = layout_named("bhsd").bhs_strides(out)
        jit_args = (*descriptors, out, lse, *strides, 1, 1, 128, 128, 1, scale * sm90.LOG2E)
        jit_kwargs = dict(HEAD_DIM=128, BLOCK_M=sm90.BLOCK_M, BLOCK_N=config.block_n,
                          STAGES=config.stages, IS_CAUSAL=True,
                          PRODUCER_REGS=config.producer_regs, **meta,
                          maxnreg=sm90.MAXNREG)
        compiled = kernel[(1,)](*jit_args, **jit_kwargs)
        # The same launch Triton 3.6's JITFunction.run ends with, minus its argument
        # binding and cache lookup (constexprs ride along; the launcher skips them).
        bound = (*jit_args, *(jit_kwargs[name] for name in (
            "HEAD_DIM", "BLOCK_M", "BLOCK_N", "STAGES", "IS_CAUSAL", "PRODUCER_REGS",
            "CONSUMER_REGS", "PINGPONG", "EARLY_RESCALE", "VECTOR_STORE", "num_warps")))
        stream = torch.cuda.current_stream().cuda_stream

        def direct():
            compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                         None, None, *bound)

        layers.update({
            "attnlab.attention (Gluon)": lambda: attnlab.attention(q, k, v, causal=True),
            "flash_forward (Gluon)": lambda: flash_forward(q, k, v, layout="bhsd",
                                                           scale=scale, causal=True),
            "dispatch.forward_config": lambda: dispatch.forward_config(
                q, k, v, layout="bhsd", causal=True, window=(-1, -1), softcap=0.0),
            "forward_sm90.launch": lambda: sm90.launch(q, k, v, layout="bhsd", scale=scale,
                                                       causal=True, config=config),
            "3 TMA descriptors": lambda: [sm90_host.descriptor(t, "bhsd", r) for t, r in
                                          ((q, 64), (k, config.block_n), (v, config.block_n))],
            "JIT launch, prebuilt descriptors": lambda: kernel[(1,)](*jit_args, **jit_kwargs),
            "compiled-kernel launcher, direct": direct,
        })
    shape = AttentionShape(batch=1, query_heads=1, kv_heads=1, seqlen_q=128, seqlen_k=128,
                           head_dim=128, dtype="bf16", causal=True)
    triton_config = forward_config(shape)
    layers["flash_forward (Triton kernel)"] = lambda: flash_forward(
        q, k, v, layout="bhsd", scale=scale, causal=True, config=triton_config)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    layers["SDPA cuDNN (with its context manager)"] = cudnn
    rows = []
    for name, fn in layers.items():
        median, best = per_call_us(fn)
        rows.append({"what": "host_cost", "layer": name, "median_us": round(median, 1),
                     "min_us": round(best, 1), "triton": triton.__version__, **env})
        print(f"  {name:42s} {median:7.1f} us/call (min {best:6.1f})", flush=True)
    dispatch._TABLES[dispatch.FORWARD_SM90] = committed_table
    ctx.write_rows("host_cost.jsonl", rows)


bench.phase("fwdbwd", default=False)(phase_fwdbwd)

# ----- issue #32's decode table ----------------------------------------------------------------
DECODE_POINTS = (  # (batch, keys, query heads, kv heads, head dim): the rows
    (1, 4096, 32, 8, 128), (1, 131072, 32, 8, 128), (16, 32768, 32, 8, 128),
    (1, 32768, 24, 4, 256), (16, 131072, 24, 4, 256))
DECODE_VARIANTS = (("attnlab_decode", None), ("attnlab_decode_paged16", 16),
                   ("attnlab_decode_paged256", 256))


def decode_points(args) -> list:
    from attnlab.shapes import AttentionShape

    return [AttentionShape(batch=b, query_heads=h, kv_heads=kv, seqlen_q=1, seqlen_k=n,
                           head_dim=d, dtype="bf16", causal=True)
            for b, n, h, kv, d in DECODE_POINTS]


def decode_call(shape, page_size):
    """(fn, inputs) of the issue's call: tensor cache_seqlens (all full), maybe paged."""
    import attnlab

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(shape.batch, 1, shape.query_heads, shape.head_dim, generator=gen,
                    device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shape.batch, shape.seqlen_k, shape.kv_heads, shape.head_dim,
                        generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((shape.batch,), shape.seqlen_k, dtype=torch.int32, device="cuda")
    scale = shape.softmax_scale
    if page_size is None:
        return (lambda q, k, v, n: attnlab.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=n, causal=True, softmax_scale=scale)), (q, k, v, lengths)
    per_seq = shape.seqlen_k // page_size
    pages = [t.view(shape.batch * per_seq, page_size, shape.kv_heads, shape.head_dim)
             for t in (k, v)]
    order = torch.randperm(shape.batch * per_seq, generator=torch.Generator().manual_seed(0))
    table = order.view(shape.batch, per_seq).to(torch.int32).cuda()

    def paged(q, k, v, n, table):
        return attnlab.flash_attn_with_kvcache(q, k, v, cache_seqlens=n, block_table=table,
                                               causal=True, softmax_scale=scale)

    return paged, (q, *pages, lengths, table)


def eager_per_call_us(fn, inputs, gpu_ms: float) -> tuple[float, float]:
    """(back-to-back wall time per call, host time of one call to an idle GPU), us."""
    calls = max(10, min(300, int(20.0 / max(gpu_ms, 1e-3))))  # ~20 ms of GPU work a round
    back_to_back, _ = per_call_us(lambda: fn(*inputs), calls=calls, rounds=5)
    host, _ = host_latency_us(lambda: fn(*inputs), calls=30)
    return back_to_back, host


@bench.phase("decode", default=False, cap_s=85.0, plan=decode_points)
def phase_decode(ctx) -> list:
    """Issue #32's table: GPU (graph replay), eager and host time per call, attnlab vs cuDNN."""
    import traceback

    from attnlab.measure import records
    from attnlab.measure.providers import PROVIDERS, ProviderUnavailable, make_inputs, prepare
    from attnlab.measure.timing import time_call

    env, out = ctx.env, []

    def record(name, shape, metric, p20, p50, p80, repeats, method):
        return records.make_record(kernel="call", provider=name, phase="decode", shape=shape,
                                   metric=metric, unit="ms", p20=p20, p50=p50, p80=p80,
                                   repeats=repeats, env=env, timing_method=method)

    def measure(name, shape, fn, inputs, context=None):
        timing = time_call(fn, [inputs], warmup=3, flush="l2", cuda_graph=True,
                           context=context, target_ms=40.0, max_repeats=60)
        with context() if context is not None else contextlib.nullcontext():
            eager, host = eager_per_call_us(fn, inputs, timing.p50)
        rows = [record(name, shape, "latency", timing.p20, timing.p50, timing.p80,
                       timing.repeats, timing.method),
                record(name, shape, "eager_call", eager / 1e3, eager / 1e3, eager / 1e3, 5,
                       "back-to-back calls, wall time per call (median of 5 rounds)"),
                record(name, shape, "host_latency", host / 1e3, host / 1e3, host / 1e3, 30,
                       "one call issued to an idle GPU, host time (median of 30)")]
        print(f"  {name:26s} GPU {timing.p50 * 1e3:8.1f} us  eager {eager:8.1f} us  "
              f"host {host:6.1f} us", flush=True)
        return rows

    for shape in ctx.within_budget(ctx.plan, label=lambda s: s.describe()):
        print(f"== {shape.describe()}", flush=True)
        first = len(out)
        for name, page_size in DECODE_VARIANTS:
            try:
                fn, inputs = decode_call(shape, page_size)
                out += measure(name, shape, fn, inputs)
                attnlab_checks(inputs[0].device)
            except Exception as error:  # noqa: BLE001 -- recorded, the run goes on
                traceback.print_exc()
                out.append(records.skipped_record(provider=name, phase="decode", shape=shape,
                                                  reason=f"{type(error).__name__}: {error}",
                                                  env=env))
            fn = inputs = None
            torch.cuda.empty_cache()
        try:
            prepared = prepare(PROVIDERS["sdpa_cudnn"], shape, "decode", "cuda")
            inputs = make_inputs(shape, prepared.provider.input_layout, "cuda")
            out += measure("sdpa_cudnn", shape, prepared.unpinned_call, inputs, prepared.pin)
        except (ProviderUnavailable, Exception) as error:  # noqa: BLE001 -- recorded
            out.append(records.skipped_record(provider="sdpa_cudnn", phase="decode", shape=shape,
                                              reason=f"{type(error).__name__}: {error}", env=env))
        prepared = inputs = None
        torch.cuda.empty_cache()
        ctx.upsert("host_cost_decode.jsonl", out[first:])
    return out


@bench.phase("decode_profile", default=False, cap_s=40.0)
def phase_decode_profile(ctx) -> None:
    """Where a decode call's host time goes: cProfile over 300 back-to-back calls (B1 x 4k,
    tensor cache_seqlens; contiguous, 16-token pages) and the wall time per call beside it."""
    from attnlab.shapes import AttentionShape

    shape = AttentionShape(batch=1, query_heads=32, kv_heads=8, seqlen_q=1, seqlen_k=4096,
                           head_dim=128, dtype="bf16", causal=True)
    text, calls = [], 300
    for name, page_size in DECODE_VARIANTS[:2]:
        fn, inputs = decode_call(shape, page_size)
        for _ in range(20):
            fn(*inputs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(*inputs)
        wall_us = (time.perf_counter() - start) / calls * 1e6
        table = cprofile_table(lambda fn=fn, inputs=inputs: fn(*inputs), calls,
                               orders=("tottime", "cumulative"), rows=30)
        text.append(f"== {name} {shape.describe()}: {calls} calls, {wall_us:.1f} us per call "
                    f"unprofiled (back to back)\n{table}")
        print(f"  {name}: {wall_us:.1f} us per call back to back", flush=True)
    ctx.path("decode_cprofile.txt").write_text("".join(text))


def attnlab_checks(device) -> None:
    """The measured calls' indices were all in range (the record is empty)."""
    import attnlab

    attnlab.check_kvcache_indices(device)


@bench.finish
def print_decode_table(ctx) -> None:
    measured = ctx.results.get("decode")
    if not measured:
        return
    cells: dict[tuple, dict] = {}
    for r in measured:
        if r["metric"] == "skipped":
            continue
        s = r["shape"]
        point = (s["query_heads"], s["kv_heads"], s["head_dim"], s["batch"], s["seqlen_k"])
        cells.setdefault(point, {})[(r["provider"], r["metric"])] = r["p50"] * 1e3

    def cell(row, provider, metric):
        value = row.get((provider, metric))
        return "-" if value is None else f"{value:,.1f}"

    print("\none decode call, bf16, tensor cache_seqlens; us (GPU: CUDA-graph replay; eager: "
          "back to back; host: one call to an idle GPU)")
    print("point | attnlab GPU | cuDNN GPU | attnlab eager | cuDNN eager | attnlab host | "
          "cuDNN host | paged 16 / 256 GPU | paged 16 / 256 host | paged/contiguous")
    for (h, kv, d, b, n), row in cells.items():
        contiguous = row.get(("attnlab_decode", "latency"))
        ratios = [contiguous / row[(name, "latency")]
                  for name, _ in DECODE_VARIANTS[1:] if contiguous and (name, "latency") in row]
        print(f"{h}q/{kv}kv d={d}, B{b} x {n // 1024}k | {cell(row, 'attnlab_decode', 'latency')} | "
              f"{cell(row, 'sdpa_cudnn', 'latency')} | {cell(row, 'attnlab_decode', 'eager_call')} | "
              f"{cell(row, 'sdpa_cudnn', 'eager_call')} | "
              f"{cell(row, 'attnlab_decode', 'host_latency')} | "
              f"{cell(row, 'sdpa_cudnn', 'host_latency')} | "
              f"{cell(row, 'attnlab_decode_paged16', 'latency')} / "
              f"{cell(row, 'attnlab_decode_paged256', 'latency')} | "
              f"{cell(row, 'attnlab_decode_paged16', 'host_latency')} / "
              f"{cell(row, 'attnlab_decode_paged256', 'host_latency')} | "
              + " / ".join(f"{x:.2f}x" for x in ratios))

if __name__ == "__main__":
    sys.exit(bench.main())
