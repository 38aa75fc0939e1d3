"""Every attnlab kernel over a compact grid of awkward shapes, in one process, for
compute-sanitizer (issue #11); and the > 2^31-element forward cases (phase ``big``).

    compute-sanitizer --tool memcheck python3 bench/sanitize_h200.py [--out DIR]
    compute-sanitizer --tool racecheck python3 bench/sanitize_h200.py --racecheck
    PYTHONPATH=src python3 bench/sanitize_h200.py --phases big --out $OUT

(run from the repository root with ``PYTHONPATH=src``).  The grid: ragged edges (lengths 1,
17, 113, 257, q != k), padded head dims (59, 111; 256), GQA 3:1 and MQA, causal with
rows that see no key, sliding windows, softcap, both dense layouts, fp16 and bf16, the
forced 64-bit offset path; varlen with empty sequences, sequences without keys and
q != k; the backward (dense and varlen, deterministic too) and split-KV decode
(contiguous cache with ragged lengths, paged cache with the last page partly filled)
when their modules import; the sm_90 Gluon forward and dK/dV kernels when they support the GPU.  Each case
is also checked against the float64 reference (the accuracy rule; gradients by the 3x
rule), so a kernel that reads nothing wrong but computes something wrong fails too.

Under memcheck the kernels run ~100x slower and each new configuration still compiles
once, so the shapes stay small; ``--racecheck`` runs every Gluon case and a third of the
others (racecheck is slower still).  The summary line is last: cases run, passed, failed, skipped.  The
sanitizer's own ``ERROR SUMMARY`` line follows it.

``big`` (no sanitizer): 64 queries x 600k keys and 600k queries x 256 keys at 32 heads
x d 128 (bshd: 2.46e9 elements, past 2^31), the same K/V size in bhsd, and varlen
batches whose tokens pass 2^31 elements; each compared head by head (the first and the
last head, whole rows) with the float64 reference by the accuracy rule.  ~40 GB of GPU
memory; a case that does not fit is skipped with the reason.

A configuration of attnlab.measure.engine: rows go to sanitize_cases.jsonl (the grid)
and sanitize_big.jsonl under --out.  ``--device cpu`` runs the grid's cases under
TRITON_INTERPRET=1 (the Gluon ones skip): ``--device cpu --only 'forward seqlen_q=1 '``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import traceback

import torch

from attnlab.accuracy import check_accuracy, check_gradients
from attnlab.kernels import forward as forward_module
from attnlab.kernels.forward import flash_forward
from attnlab.measure.engine import Bench

DEVICE = "cuda"  # the case functions also run under TRITON_INTERPRET=1 with DEVICE = "cpu"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def rand(*shape, dtype=torch.float16, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(shape, device=DEVICE, dtype=dtype, generator=gen)


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)


def dense_inputs(case: dict, seed: int):
    batch, heads, kv_heads = case.get("batch", 2), *case.get("heads", (2, 2))
    seqlen_q, seqlen_k, head_dim, dtype = case["seqlen_q"], case["seqlen_k"], case["d"], case["dtype"]
    layout = case.get("layout", "bshd")

    def dims(h, n):
        return (batch, n, h, head_dim) if layout == "bshd" else (batch, h, n, head_dim)

    return (rand(*dims(heads, seqlen_q), dtype=dtype, seed=seed),
            rand(*dims(kv_heads, seqlen_k), dtype=dtype, seed=seed + 1),
            rand(*dims(kv_heads, seqlen_k), dtype=dtype, seed=seed + 2))


def mask_options(case: dict) -> dict:
    return {"causal": case.get("causal", False), "window": case.get("window", (-1, -1)),
            "softcap": case.get("softcap", 0.0)}


# ---------------------------------------------------------------------------
# One case per kernel call; each returns a short description of what it checked.
# ---------------------------------------------------------------------------

def run_forward(case: dict, seed: int) -> str:
    q, k, v = dense_inputs(case, seed)
    layout, scale = case.get("layout", "bshd"), 1.0 / math.sqrt(case["d"])
    out, lse = flash_forward(q, k, v, layout=layout, scale=scale, **mask_options(case))
    sync()
    result = check_accuracy(out, lse, q, k, v, scale=scale, layout=layout, **mask_options(case))
    if not result.passed:
        raise AssertionError(f"accuracy: {result}")
    return f"error {result.error:.2e} <= {result.allowed:.2e}"


def run_forward_64bit(case: dict, seed: int) -> str:
    """The OFFSETS_64 code path on a small shape: the same bits as the 32-bit path."""
    q, k, v = dense_inputs(case, seed)
    options = dict(layout=case.get("layout", "bshd"), scale=0.125, **mask_options(case))
    fast = flash_forward(q, k, v, **options)
    original = forward_module.offsets_need_int64
    forward_module.offsets_need_int64 = lambda *args: True
    try:
        wide = flash_forward(q, k, v, **options)
    finally:
        forward_module.offsets_need_int64 = original
    sync()
    if not (torch.equal(fast[0], wide[0]) and torch.equal(fast[1], wide[1])):
        raise AssertionError("64-bit path differs from the 32-bit path")
    return "64-bit path == 32-bit path"


def varlen_inputs(case: dict, seed: int):
    lengths_q, lengths_k = case["lengths_q"], case["lengths_k"]
    heads, kv_heads = case.get("heads", (2, 2))
    d, dtype = case["d"], case["dtype"]
    return (rand(sum(lengths_q), heads, d, dtype=dtype, seed=seed),
            rand(sum(lengths_k), kv_heads, d, dtype=dtype, seed=seed + 1),
            rand(sum(lengths_k), kv_heads, d, dtype=dtype, seed=seed + 2),
            dict(cu_seqlens_q=cumulative(lengths_q), cu_seqlens_k=cumulative(lengths_k),
                 max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k)))


def sequences(lengths_q, lengths_k):
    q_start = k_start = 0
    for length_q, length_k in zip(lengths_q, lengths_k, strict=True):
        yield slice(q_start, q_start + length_q), slice(k_start, k_start + length_k)
        q_start += length_q
        k_start += length_k


def run_varlen(case: dict, seed: int) -> str:
    q, k, v, varlen = varlen_inputs(case, seed)
    scale = 1.0 / math.sqrt(case["d"])
    out, lse = flash_forward(q, k, v, layout="thd", scale=scale, **mask_options(case), **varlen)
    sync()
    worst = 0.0
    for rows, keys in sequences(case["lengths_q"], case["lengths_k"]):
        if rows.start == rows.stop:
            continue
        if keys.start == keys.stop:
            if not (torch.all(out[rows] == 0) and torch.all(torch.isneginf(lse[:, rows]))):
                raise AssertionError("a sequence without keys must give zeros and -inf")
            continue
        result = check_accuracy(out[None, rows], lse[None, :, rows], q[None, rows],
                                k[None, keys], v[None, keys], scale=scale, layout="bshd",
                                **mask_options(case))
        if not result.passed:
            raise AssertionError(f"sequence {rows}: {result}")
        worst = max(worst, result.error / max(result.allowed, 1e-30))
    return f"worst error / allowed {worst:.2f}"


def run_backward(case: dict, seed: int) -> str:
    from attnlab.kernels.backward import flash_backward

    varlen = "lengths_q" in case
    scale = 1.0 / math.sqrt(case["d"])
    if varlen:
        q, k, v, extra = varlen_inputs(case, seed)
        layout = "thd"
    else:
        q, k, v = dense_inputs(case, seed)
        extra, layout = {}, case.get("layout", "bshd")
    options = dict(layout=layout, scale=scale, **mask_options(case), **extra)
    out, lse = flash_forward(q, k, v, **options)
    # An expanded dO (stride 0 over the batch, as out.sum().backward() gives) when asked.
    dout = torch.randn_like(out[:1]).expand_as(out) if case.get("expanded_dout") \
        else torch.randn_like(out)
    sm90 = None
    if "dkdv_sm90" in case:
        from attnlab.kernels.backward_sm90 import Sm90BackwardConfig, supports

        sm90 = Sm90BackwardConfig.from_name(case["dkdv_sm90"])
        ok, reason = supports(q, k, v, dout.contiguous(), layout=layout, config=sm90)
        if not ok:
            raise Skip(reason)
    grads = flash_backward(dout, q, k, v, out, lse, deterministic=case.get("deterministic", False),
                           dkdv_sm90=sm90, **options)
    sync()
    pieces = [(slice(None), slice(None))] if not varlen else \
        list(sequences(case["lengths_q"], case["lengths_k"]))
    for rows, keys in pieces:
        if varlen and (rows.start == rows.stop or keys.start == keys.stop):
            continue
        if varlen:
            one = [t[None, rows] for t in (q, dout)] + [t[None, keys] for t in (k, v)]
            q1, dout1, k1, v1 = one
            g = (grads[0][None, rows], grads[1][None, keys], grads[2][None, keys])
            checks = check_gradients(g, q1, k1, v1, dout1, scale=scale, layout="bshd",
                                     **mask_options(case))
        else:
            checks = check_gradients(grads, q, k, v, dout, scale=scale, layout=layout,
                                     **mask_options(case))
        if not all(c.passed for c in checks):
            raise AssertionError(f"gradients: {checks}")
    return "gradients within 3x"


def run_decode(case: dict, seed: int) -> str:
    from attnlab.kernels.decode import flash_decode

    batch, (heads, kv_heads), d, dtype = case["batch"], case["heads"], case["d"], case["dtype"]
    lengths, capacity = case["cache_lengths"], case["capacity"]
    q = rand(batch, case.get("seqlen_q", 1), heads, d, dtype=dtype, seed=seed)
    k_dense = rand(batch, capacity, kv_heads, d, dtype=dtype, seed=seed + 1)
    v_dense = rand(batch, capacity, kv_heads, d, dtype=dtype, seed=seed + 2)
    scale = 1.0 / math.sqrt(d)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    if case.get("page_size"):
        page = case["page_size"]
        pages_per_seq = capacity // page
        # Pages of all sequences shuffled into one pool; the block table finds them.
        order = torch.randperm(batch * pages_per_seq, generator=torch.Generator().manual_seed(seed))
        pool_k = torch.empty(batch * pages_per_seq, page, kv_heads, d, dtype=dtype, device=DEVICE)
        pool_v = torch.empty_like(pool_k)
        pool_k[order] = k_dense.reshape(batch * pages_per_seq, page, kv_heads, d)
        pool_v[order] = v_dense.reshape(batch * pages_per_seq, page, kv_heads, d)
        block_table = order.view(batch, pages_per_seq).to(torch.int32).to(DEVICE)
        out, lse = flash_decode(q, pool_k, pool_v, scale=scale, causal=True,
                                cache_seqlens=cache_seqlens, block_table=block_table)
    else:
        out, lse = flash_decode(q, k_dense, v_dense, scale=scale, causal=True,
                                cache_seqlens=cache_seqlens)
    sync()
    for b, length in enumerate(lengths):
        result = check_accuracy(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_dense[b:b + 1, :length],
                                v_dense[b:b + 1, :length], scale=scale, causal=True,
                                layout="bshd")
        if not result.passed:
            raise AssertionError(f"sequence {b}: {result}")
    return "each sequence within the accuracy rule"


def run_forward_sm90(case: dict, seed: int) -> str:
    from attnlab.kernels.forward_sm90 import DEFAULT_CONFIGS, flash_forward_sm90, supports

    q, k, v = dense_inputs(case, seed)
    config = dataclasses.replace(DEFAULT_CONFIGS[case["d"]], **{
        field: case[field] for field in ("schedule", "persistent", "rescale", "store")
        if field in case})
    ok, reason = supports(q, k, v, case.get("causal", False), config=config)
    if not ok:
        raise Skip(reason)
    scale = 1.0 / math.sqrt(case["d"])
    out, lse = flash_forward_sm90(q, k, v, layout="bshd", scale=scale,
                                  causal=case.get("causal", False), config=config)
    sync()
    result = check_accuracy(out, lse, q, k, v, scale=scale, causal=case.get("causal", False),
                            layout="bshd")
    if not result.passed:
        raise AssertionError(f"accuracy: {result}")
    return f"error {result.error:.2e} <= {result.allowed:.2e}"


class Skip(Exception):
    """A case that cannot run here, with the reason."""


F16, BF16 = torch.float16, torch.bfloat16


def describe(case: dict) -> str:
    """A case in one short line: key=value, lists of repeats shortened."""
    def text(value):
        if isinstance(value, list) and len(value) > 6:
            return f"[{value[0]}]x{len(value)}" if len(set(value)) == 1 else f"[{len(value)} items]"
        return str(value).replace("torch.", "").replace(" ", "")
    return " ".join(f"{key}={text(value)}" for key, value in case.items())


def grid() -> list[tuple[str, object, dict]]:
    forward = [
        dict(seqlen_q=1, seqlen_k=1, d=32, dtype=F16),
        dict(seqlen_q=17, seqlen_k=257, d=59, dtype=BF16, heads=(6, 2), causal=True),
        dict(seqlen_q=257, seqlen_k=17, d=64, dtype=F16, causal=True),  # rows without keys
        dict(seqlen_q=113, seqlen_k=113, d=111, dtype=BF16, heads=(3, 1), window=(19, 7)),
        dict(seqlen_q=40, seqlen_k=8, d=32, dtype=F16, window=(2, 0)),  # a window hiding rows
        dict(seqlen_q=130, seqlen_k=200, d=128, dtype=BF16, causal=True, softcap=30.0),
        dict(seqlen_q=97, seqlen_k=129, d=128, dtype=F16, layout="bhsd", heads=(4, 2)),
        dict(seqlen_q=65, seqlen_k=190, d=256, dtype=BF16, heads=(4, 1), causal=True),
        dict(seqlen_q=300, seqlen_k=300, d=64, dtype=F16, batch=1, window=(64, 0)),
    ]
    varlen = [
        dict(lengths_q=[5, 0, 70, 1, 33], lengths_k=[9, 3, 70, 0, 40], d=64, dtype=F16),
        dict(lengths_q=[129, 0, 17], lengths_k=[64, 5, 300], d=128, dtype=BF16, heads=(4, 2),
             causal=True),
        dict(lengths_q=[1] * 50, lengths_k=[3] * 50, d=32, dtype=F16, window=(1, 0)),
        dict(lengths_q=[200, 31], lengths_k=[150, 31], d=111, dtype=BF16, causal=True,
             softcap=10.0),
    ]
    backward = [
        dict(seqlen_q=113, seqlen_k=203, d=64, dtype=F16, heads=(6, 2), causal=True),
        dict(seqlen_q=97, seqlen_k=97, d=128, dtype=BF16, window=(19, 7), deterministic=True),
        dict(seqlen_q=70, seqlen_k=20, d=59, dtype=F16, causal=True, layout="bhsd"),
        dict(lengths_q=[33, 0, 70, 5], lengths_k=[40, 4, 70, 0], d=64, dtype=BF16, causal=True),
    ]
    decode = [
        dict(batch=3, heads=(8, 2), d=128, dtype=BF16, capacity=512, cache_lengths=[1, 300, 512]),
        dict(batch=2, heads=(4, 4), d=64, dtype=F16, capacity=256, cache_lengths=[37, 250],
             page_size=64),  # the last page of each sequence partly filled
    ]
    cases = [(f"forward {describe(c)}", run_forward, c) for c in forward]
    cases.append(("forward 64-bit path", run_forward_64bit,
                  dict(seqlen_q=97, seqlen_k=130, d=64, dtype=F16, heads=(4, 2), window=(40, 3))))
    cases += [(f"varlen {describe(c)}", run_varlen, c) for c in varlen]
    cases += [(f"backward {describe(c)}", run_backward, c) for c in backward]
    cases += [(f"decode {describe(c)}", run_decode, c) for c in decode]
    cases.append(("forward_sm90 causal d128", run_forward_sm90,
                  dict(seqlen_q=300, seqlen_k=300, d=128, dtype=BF16, batch=1, causal=True)))
    # Ragged GQA with both schedules, and a persistent grid walking several blocks per
    # program (48 x 3 query blocks > 132 SMs), causal rows without keys included.
    for schedule in ("split", "pingpong"):
        cases.append((f"forward_sm90 {schedule} ragged GQA d64", run_forward_sm90,
                      dict(seqlen_q=203, seqlen_k=113, d=64, dtype=F16, heads=(6, 2),
                           causal=True, schedule=schedule)))
    cases.append(("forward_sm90 persistent d256", run_forward_sm90,
                  dict(seqlen_q=300, seqlen_k=217, d=256, dtype=BF16, batch=48, heads=(1, 1),
                       causal=True, persistent=True)))
    # The early O rescale and the 16-byte O stores (a ragged last block's rows masked).
    for d in (64, 128, 256):
        cases.append((f"forward_sm90 early rescale, vector store d{d}", run_forward_sm90,
                      dict(seqlen_q=250, seqlen_k=301, d=d, dtype=BF16, batch=40, heads=(3, 1),
                           causal=d != 128, persistent=True, rescale="early", store="vector")))
    # The Gluon dK/dV kernel: ragged GQA both ways round (rows without keys, a partial
    # last key block), bhsd, an expanded dO, several query heads per program.
    sm90_backward = [
        dict(seqlen_q=203, seqlen_k=113, d=64, dtype=F16, heads=(6, 2), causal=True,
             dkdv_sm90="sm90bwd[m64,s3,r24]"),
        dict(seqlen_q=113, seqlen_k=203, d=128, dtype=BF16, heads=(4, 1), causal=True,
             dkdv_sm90="sm90bwd[m32,s3,r24]"),
        dict(seqlen_q=97, seqlen_k=300, d=128, dtype=F16, heads=(4, 2), layout="bhsd",
             dkdv_sm90="sm90bwd[m64,s2,r24]", expanded_dout=True),
        dict(seqlen_q=257, seqlen_k=257, d=64, dtype=BF16, heads=(2, 2), batch=3,
             dkdv_sm90="sm90bwd[m128,s2,r24]"),
        # d = 256: the dV launch (its own 64-row tiles) and the dK launch.
        dict(seqlen_q=203, seqlen_k=113, d=256, dtype=BF16, heads=(6, 2), causal=True,
             dkdv_sm90="sm90bwd[m32,s2,r24,v64x2]"),
        dict(seqlen_q=97, seqlen_k=300, d=256, dtype=F16, heads=(4, 1), layout="bhsd",
             dkdv_sm90="sm90bwd[m32,s3,r24]", expanded_dout=True),
    ]
    cases += [(f"backward_sm90 {describe(c)}", run_backward, c) for c in sm90_backward]
    return cases


# ---------------------------------------------------------------------------
# --big: past 2^31 elements
# ---------------------------------------------------------------------------

def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


def big_dense(layout: str, seqlen_q: int, seqlen_k: int, causal: bool,
              kernel: str = "triton") -> str:
    heads, d = 32, 128
    need = 2 * max(seqlen_q, seqlen_k) * heads * d * 2 + (6 << 30)
    if free_bytes() < need:
        raise Skip(f"needs {need / 2**30:.0f} GiB free, {free_bytes() / 2**30:.0f} GiB free")
    case = dict(batch=1, heads=(heads, heads), seqlen_q=seqlen_q, seqlen_k=seqlen_k, d=d,
                dtype=BF16, layout=layout)
    q, k, v = dense_inputs(case, seed=21)
    scale = 1.0 / math.sqrt(d)
    if kernel.startswith("gluon"):
        from attnlab.kernels.forward_sm90 import DEFAULT_CONFIGS, flash_forward_sm90, supports
        config = dataclasses.replace(DEFAULT_CONFIGS[d], persistent=kernel == "gluon-persistent")
        ok, reason = supports(q, k, v, causal, config=config)
        if not ok:
            raise Skip(reason)
        out, lse = flash_forward_sm90(q, k, v, layout=layout, scale=scale, causal=causal,
                                      config=config)
    else:
        out, lse = flash_forward(q, k, v, layout=layout, scale=scale, causal=causal)
    sync()
    axis = 2 if layout == "bshd" else 1
    for head in (0, heads - 1):  # the chunked reference: one head's whole rows at a time
        one = [t.narrow(axis, head, 1) for t in (q, k, v, out)]
        result = check_accuracy(one[3], lse[:, head:head + 1], *one[:3], scale=scale,
                                causal=causal, layout=layout)
        if not result.passed:
            raise AssertionError(f"head {head}: {result}")
    return f"q {tuple(q.shape)} k {tuple(k.shape)}: heads 0 and {heads - 1} within the rule"


def big_varlen(lengths_q: list[int]) -> str:
    heads, kv_heads, d = 32, 8, 128
    need = 2 * sum(lengths_q) * heads * d * 2 + (6 << 30)
    if free_bytes() < need:
        raise Skip(f"needs {need / 2**30:.0f} GiB free, {free_bytes() / 2**30:.0f} GiB free")
    lengths_k = [256 + 37 * i for i in range(len(lengths_q))]
    case = dict(lengths_q=lengths_q, lengths_k=lengths_k, heads=(heads, kv_heads), d=d, dtype=BF16)
    q, k, v, varlen = varlen_inputs(case, seed=22)
    scale = 1.0 / math.sqrt(d)
    out, lse = flash_forward(q, k, v, layout="thd", scale=scale, **varlen)
    sync()
    for rows, keys in sequences(lengths_q, lengths_k):
        tail = slice(max(rows.start, rows.stop - 4096), rows.stop)  # the largest offsets
        for head in (0, heads - 1):
            kv = slice(head // 4, head // 4 + 1)
            result = check_accuracy(out[None, tail, head:head + 1], lse[None, head:head + 1, tail],
                                    q[None, tail, head:head + 1], k[None, keys, kv],
                                    v[None, keys, kv], scale=scale, layout="bshd")
            if not result.passed:
                raise AssertionError(f"rows {tail} head {head}: {result}")
    return f"{sum(lengths_q)} tokens x {heads} heads: each sequence's last rows within the rule"


def big_cases() -> list[tuple[str, object, tuple]]:
    return [
        ("big: bshd 64 q x 600k k, causal (K/V past 2^31)", big_dense, ("bshd", 64, 600_000, True)),
        ("big: bshd 600k q x 256 k (Q/O past 2^31)", big_dense, ("bshd", 600_000, 256, False)),
        ("big: bhsd 64 q x 600k k, causal (32-bit row path)", big_dense,
         ("bhsd", 64, 600_000, True)),
        ("big: Gluon bshd 64 q x 600k k, causal (K/V past 2^31)", big_dense,
         ("bshd", 64, 600_000, True, "gluon")),
        ("big: Gluon bhsd 600k q x 256 k (Q/O past 2^31)", big_dense,
         ("bhsd", 600_000, 256, False, "gluon-persistent")),
        ("big: varlen [100000, 1, 499999] (first token past 2^31)", big_varlen,
         ([100_000, 1, 499_999],)),
        ("big: varlen [7, 599993] (64-bit row path)", big_varlen, ([7, 599_993],)),
    ]


# ---------------------------------------------------------------------------
bench = Bench("sanitize_h200", __doc__, devices=("cuda", "cpu"))
bench.option("--racecheck", action="store_true",
             help="the Gluon cases and every third other case only")
bench.option("--only", default="", help="only cases whose name contains this")


def chosen(cases: list, args) -> list[tuple[int, tuple]]:
    """(index, case) of those --only names; seeds follow the index in the whole list, so
    --only reruns the same inputs."""
    return [(index, c) for index, c in enumerate(cases) if args.only in c[0]]


def grid_plan(args) -> list[tuple[int, tuple]]:
    cases = grid()
    if args.racecheck:
        # Every Gluon case (its shared memory, mbarriers and TMA are explicit, so a
        # race there is ours) and a third of the rest (Triton manages theirs).
        cases = [c for i, c in enumerate(cases) if "_sm90" in c[0] or i % 3 == 0]
    return chosen(cases, args)


def big_plan(args) -> list[tuple[int, tuple]]:
    return chosen([(name, lambda c, seed, fn=fn: fn(*c), params)
                   for name, fn, params in big_cases()], args)


def run_cases(ctx, file: str) -> None:
    """Each case once: passed, failed (with the traceback) or skipped (with the reason)."""
    globals()["DEVICE"] = ctx.device
    rows, started = [], time.time()
    for index, (name, fn, case) in ctx.within_budget(ctx.plan, label=lambda c: c[1][0]):
        t0 = time.time()
        try:
            detail, status = fn(case, 100 + index), "passed"
        except Skip as reason:
            detail, status = str(reason), "skipped"
        except ImportError as error:
            detail, status = f"module not available: {error}", "skipped"
        except Exception as error:  # noqa: BLE001 - record it and go on to the next case
            traceback.print_exc()
            detail, status = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}", "failed"
        rows.append({"case": name, "status": status, "detail": detail,
                     "seconds": round(time.time() - t0, 2)})
        print(f"[{status:7s}] {name}  ({detail}; {time.time() - t0:.1f} s)", flush=True)
        if ctx.phase == "big":
            torch.cuda.empty_cache()
    ctx.write_rows(file, [{**row, **ctx.env} for row in rows])
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "failed", "skipped")}
    print(f"summary: {len(rows)} cases, {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped, {time.time() - started:.0f} s")
    ctx.fail(counts["failed"])


@bench.phase("grid", plan=grid_plan)
def grid_phase(ctx) -> None:
    """Every kernel over the compact grid of awkward shapes (run it under compute-sanitizer)."""
    run_cases(ctx, "sanitize_cases.jsonl")


@bench.phase("big", default=False, plan=big_plan)
def big_phase(ctx) -> None:
    """Forward cases past 2^31 elements, head by head against float64 (~40 GB)."""
    run_cases(ctx, "sanitize_big.jsonl")


if __name__ == "__main__":
    sys.exit(bench.main())
