"""Ring attention on H200s: correctness, weak scaling, and the scaling model's inputs.

Two modes, one script:

* **multi-GPU** (2, 4 or 8 GPUs of one node, NCCL), launched by torchrun::

      PYTHONPATH=src python3 -m torch.distributed.run --standalone --nproc-per-node 4 \\
          bench/ring_h200.py --out $OUT [--totals 131072,524288] [--phases correct,prefill,fwdbwd]

  Correctness first (small shapes, gathered on rank 0, against the float64 reference
  with the project's rules), then per total length: the ring call, the same ring with
  its communication removed (compute only), the transfers alone, and one GPU running
  the 1/P-long sequence (weak-scaling baseline).  Efficiency = P * baseline / ring;
  exposed transfer = ring - compute only (it includes the ring's per-call shape check,
  one small all_gather), hidden share = 1 - exposed / transfers.  Every time is the
  slowest rank's.

* **single GPU** (the scaling model's inputs, ``attnlab.model.ring``)::

      PYTHONPATH=src python3 bench/ring_h200.py --single-gpu --out $OUT \\
          [--tokens-per-gpu 8192,16384,32768,65536,131072]

  Times each block kind a ring step runs (the local causal block and the two
  unmasked remote kinds, as views exactly as the ring slices them), the fp32 merge
  and the gradient accumulation, for forward and forward + backward; then prints
  the model's weak-scaling prediction for 2...64 GPUs at ``--link-gbps``.

Workload (the issue's): causal, bf16, head_dim 128, 32 heads, batch 1.  Records go to
``--out``/ring_h200.jsonl in the schema of ``attnlab.measure.records`` (correctness to
ring_correctness.jsonl).  NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as the lent machines require.

A configuration of attnlab.measure.engine: phases ``correct``, ``prefill`` (the forward)
and ``fwdbwd``, the shared ``--budget`` (default 420 s; every rank decides on the slowest
rank's clock), --out (written by rank 0).  ``--device cpu`` exercises the script on CPU
tensors (gloo, TRITON_INTERPRET=1), tiny shapes; its numbers mean nothing.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attnlab.accuracy import check_accuracy, check_gradients
from attnlab.commands.cli_support import parse_int_list
from attnlab.distributed import ring_attention, ring_step_block, shard_sequence, unshard_sequence
from attnlab.distributed.ring import (
    _add_block_grads,
    _Hop,
    _merge_block,
    _Ring,
    _ring_backward,
    _ring_forward,
)
from attnlab.kernels.backward import flash_backward
from attnlab.kernels.forward import flash_forward
from attnlab.measure.engine import BUDGET_SPENT, Bench
from attnlab.measure.records import make_record, skipped_record
from attnlab.measure.timing import time_call
from attnlab.model import ring as ring_model
from attnlab.model.flops import attention_flops, backward_flops
from attnlab.reference.inputs import TORCH_DTYPE_NAMES
from attnlab.shapes import AttentionShape

# NVLink multicast must stay off on the lent machines; NCCL reads this when its first
# communicator starts, torch's symmetric memory when it is first used: both later.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

RECORDS_FILE = "ring_h200.jsonl"
CORRECTNESS_FILE = "ring_correctness.jsonl"


@dataclass(frozen=True)
class Workload:
    """What one run measures on which device (the issue's workload by default)."""

    device: str = "cuda"
    heads: int = 32
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    # (name, total tokens, heads, kv heads, head dim, causal) of the correctness checks
    correctness_cases: tuple = (("causal-gqa-d128", 2048, 8, 2, 128, True),
                                ("full-mha-d64", 1024, 4, 4, 64, False),
                                ("causal-mqa-d128", 4096, 4, 1, 128, True))


# --device cpu: the script's own logic on CPU tensors (gloo, Triton's interpreter), tiny
# shapes, so it can be exercised where no GPU is; its numbers mean nothing.
SMOKE = Workload(device="cpu", heads=2, head_dim=16, dtype=torch.float16,
                 correctness_cases=(("causal-gqa", 32, 4, 2, 16, True),
                                    ("full-mha", 16, 2, 2, 16, False)))
RUN = Workload()
FORWARD_KERNELS = ["_attn_fwd"]
BACKWARD_KERNELS = ["_attn_bwd_dkdv", "_attn_bwd_dq"]
TARGET_MS = 2000.0  # timed work per measurement: these calls take milliseconds to seconds


BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def empty_cache() -> None:
    if RUN.device == "cuda":
        torch.cuda.empty_cache()


def shard_shape(tokens_per_gpu: int, kv_heads: int) -> AttentionShape:
    return AttentionShape(batch=1, query_heads=RUN.heads, kv_heads=kv_heads,
                          seqlen_q=tokens_per_gpu, seqlen_k=tokens_per_gpu, head_dim=RUN.head_dim,
                          dtype=TORCH_DTYPE_NAMES[RUN.dtype], causal=True)


def randn(*shape, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=RUN.device).manual_seed(seed)
    return torch.randn(shape, device=RUN.device, dtype=RUN.dtype, generator=generator)


def synchronize() -> None:
    if RUN.device == "cuda":
        torch.cuda.synchronize()


def synchronized_ms(fn) -> float:
    """One call, wall-clock with the device drained: the estimate that sizes the repeats."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return (time.perf_counter() - start) * 1e3


def repeats_for(estimate_ms: float, most: int) -> int:
    return max(3, min(most, math.ceil(TARGET_MS / max(estimate_ms, 1e-3))))


def measure(fn, repeats: int):
    # No L2 flush: every call here moves far more than the 50 MB L2 holds.
    return time_call(fn, [()], device=RUN.device, warmup=1, repeats=repeats, flush="none")


def latency_record(env, *, kernel, provider, phase, shape, timing, flops=None,
                   kernel_names=()) -> dict:
    tflops = flops / (timing.p50 * 1e-3) / 1e12 if flops else None
    return make_record(kernel=kernel, provider=provider, phase=phase, shape=shape,
                       metric="latency", unit="ms", p20=timing.p20, p50=timing.p50,
                       p80=timing.p80, repeats=timing.repeats, env=env, tflops=tflops,
                       kernel_names=kernel_names)


def phase_flops(shape: AttentionShape, phase: str) -> int:
    return attention_flops(shape) + (backward_flops(shape) if phase == "fwdbwd" else 0)


# ---------------------------------------------------------------------------
# Correctness (both modes): gathered ring output and gradients vs float64.
# ---------------------------------------------------------------------------

def run_correctness(env: dict, rank: int) -> list[dict]:
    rows = []
    for name, total, heads, kv_heads, head_dim, causal in RUN.correctness_cases:
        row = {"what": "ring_correctness", "case": name, "world_size": dist.get_world_size(),
               "total_tokens": total, "passed": False, **env}
        try:
            generator = torch.Generator().manual_seed(7)  # the same full tensors on every rank
            q = torch.randn(1, total, heads, head_dim, generator=generator)
            k, v = (torch.randn(1, total, kv_heads, head_dim, generator=generator)
                    for _ in range(2))
            dout = torch.randn(q.shape, generator=generator)
            q, k, v, dout = (t.to(device=RUN.device, dtype=RUN.dtype) for t in (q, k, v, dout))
            shards = [shard_sequence(t, causal=causal).requires_grad_() for t in (q, k, v)]
            out, lse = ring_attention(*shards, causal=causal, impl="triton", return_lse=True)
            out.backward(shard_sequence(dout, causal=causal))
            gathered = [unshard_sequence(t, causal=causal)
                        for t in (out.detach(), *(s.grad for s in shards))]
            full_lse = unshard_sequence(lse, causal=causal, seq_dim=2)
            if rank == 0:
                forward = check_accuracy(gathered[0], full_lse, q, k, v, causal=causal,
                                         layout="bshd")
                grads = check_gradients(gathered[1:], q, k, v, dout, causal=causal,
                                        layout="bshd")
                row.update(passed=forward.passed and all(g.passed for g in grads),
                           forward_error=forward.error, forward_allowed=forward.allowed,
                           lse_error=forward.lse_error,
                           gradients={g.name: [g.error, g.allowed] for g in grads})
        except Exception as error:  # record it and go on: the timings still matter
            row["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        if rank == 0:
            print(f"correctness {name} on {row['world_size']} GPU(s): "
                  f"{'PASS' if row['passed'] else 'FAIL'} {row.get('error', '')}", flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Single GPU: the model's inputs.
# ---------------------------------------------------------------------------

def step_blocks(tokens_per_gpu: int) -> dict:
    """The ring's own block plan for each block kind (a 2-rank ring shows all three)."""
    plan = dict(world_size=2, local_seqlen=tokens_per_gpu, causal=True)
    return {ring_model.LOCAL_STEP: ring_step_block(0, rank=0, **plan),
            ring_model.REMOTE_LATER: ring_step_block(1, rank=0, **plan),   # from rank 1
            ring_model.REMOTE_EARLIER: ring_step_block(1, rank=1, **plan)}  # from rank 0


def time_blocks(env, shard: AttentionShape, args, passes: list[str]) -> list[dict]:
    n, heads, head_dim = shard.seqlen_q, shard.query_heads, shard.head_dim
    scale = 1.0 / math.sqrt(head_dim)
    q, dout = randn(1, n, heads, head_dim, seed=1), randn(1, n, heads, head_dim, seed=2)
    k, v = (randn(1, n, shard.kv_heads, head_dim, seed=3 + i) for i in range(2))
    expected_shapes = ring_model.ring_block_shapes(shard)
    records, block_grads = [], {}
    for kernel, block in step_blocks(n).items():
        qb, kb, vb, dob = q[:, block.q_rows], k[:, block.kv_rows], v[:, block.kv_rows], \
            dout[:, block.q_rows]
        shape = shard.replace(seqlen_q=qb.shape[1], seqlen_k=kb.shape[1], causal=block.causal)
        assert shape == expected_shapes[kernel], (kernel, shape, expected_shapes[kernel])
        options = dict(layout="bshd", scale=scale, causal=block.causal)
        forward = lambda: flash_forward(qb, kb, vb, **options)

        def forward_backward():
            out, lse = flash_forward(qb, kb, vb, **options)
            return flash_backward(dob, qb, kb, vb, out, lse, **options)

        for phase, fn, names in (("prefill", forward, FORWARD_KERNELS),
                                 ("fwdbwd", forward_backward, FORWARD_KERNELS + BACKWARD_KERNELS)):
            if phase not in passes:
                continue
            timing = measure(fn, repeats_for(synchronized_ms(fn), args.repeats))
            records.append(latency_record(env, kernel=kernel, provider="attnlab", phase=phase,
                                          shape=shape, timing=timing,
                                          flops=phase_flops(shape, phase), kernel_names=names))
        if kernel != ring_model.LOCAL_STEP and "fwdbwd" in passes:
            block_grads[kernel] = (block, forward_backward())
    # The fp32 bookkeeping of one step, with the ring's own functions.
    if "prefill" in passes:
        out_acc = torch.zeros(q.shape, device=RUN.device, dtype=torch.float32)
        lse_acc = torch.zeros(1, heads, n, device=RUN.device, dtype=torch.float32)
        part_out, part_lse = flash_forward(q, k, v, layout="bshd", scale=scale)
        part_out = part_out.transpose(1, 2)  # as the ring's block step hands it over
        merge = lambda: _merge_block(out_acc, lse_acc, slice(0, n), part_out, part_lse)
        records.append(latency_record(env, kernel=ring_model.MERGE, provider="attnlab",
                                      phase="prefill", shape=shard,
                                      timing=measure(merge, args.repeats)))
    if block_grads:
        dq = torch.zeros(q.shape, device=RUN.device, dtype=torch.float32)
        dk, dv = (torch.zeros(k.shape, device=RUN.device, dtype=torch.float32) for _ in range(2))
        timings = [measure(lambda: _add_block_grads(dq, dk, dv, block, *grads), args.repeats)
                   for block, grads in block_grads.values()]
        records.append(latency_record(env, kernel=ring_model.GRAD_ACCUMULATE, provider="attnlab",
                                      phase="fwdbwd", shape=shard,
                                      timing=max(timings, key=lambda t: t.p50)))
    return records


def print_model(records: list[dict], shard: AttentionShape, args, passes: list[str]) -> list[dict]:
    link = ring_model.RingLink(intra_node_bytes_per_s=args.link_gbps * 1e9,
                               inter_node_bytes_per_s=args.inter_node_gbps * 1e9)
    forward = ring_model.pass_times_from_records(records, shard)
    backward = ring_model.pass_times_from_records(records, shard, phase="fwdbwd") \
        if "fwdbwd" in passes else None
    rows = []
    for phase in passes:
        for row in ring_model.weak_scaling(shard, forward, backward, phase=phase, link=link):
            print(f"  model {phase:7s} P={row.world_size:2d} total {row.total_tokens:>8d}: "
                  f"efficiency {row.efficiency:6.1%}  ring {row.ring_ms:9.2f} ms  exposed "
                  f"{row.exposed_transfer_ms:7.2f} ms  hidden {str(row.transfer_hidden):5s} "
                  f"hop at {row.hop_bytes_per_s / 1e9:5.0f} GB/s, hides at >= "
                  f"{row.hiding_bytes_per_s / 1e9:6.1f} GB/s", flush=True)
            rows.append(dict(vars(row), link_intra_gbps=args.link_gbps,
                             link_inter_gbps=args.inter_node_gbps))
    return rows


def time_single_gpu(ctx) -> list[dict]:
    """Each block kind a ring step runs, the merge and the gradient accumulation, per shard length."""
    records, env, args = [], ctx.env, ctx.args
    for n in args.tokens_per_gpu:
        shard = shard_shape(n, args.kv_heads)
        reason = BUDGET_SPENT if ctx.spent() else None
        if reason is None:
            try:
                measured = time_blocks(env, shard, args, [ctx.phase])
                records += measured
                print(f"tokens per GPU {n}:", flush=True)
                for r in measured:
                    print(f"  {r['kernel']:22s} {r['phase']:7s} q {r['shape']['seqlen_q']:>7d} "
                          f"k {r['shape']['seqlen_k']:>7d} {r['p50']:9.3f} ms "
                          f"{(r['tflops'] or 0):6.1f} TFLOP/s", flush=True)
            except Exception as error:
                ctx.fail()
                traceback.print_exc()
                reason = f"{type(error).__name__}: {error}"[:500]
        if reason is not None:
            records.append(skipped_record(provider="attnlab", phase=ctx.phase, shape=shard,
                                          reason=reason, env=env, kernel=ring_model.LOCAL_STEP))
        empty_cache()
    return records


def model_predictions(ctx, records: list[dict]) -> list[dict]:
    """The model's weak scaling from the measured blocks (it needs the forward's times)."""
    passes = [p for p in ("prefill", "fwdbwd") if ctx.results.get(p)]
    if "prefill" not in passes:
        return []
    measured = [r for r in records if r["metric"] == "latency"]
    predictions = []
    for n in ctx.args.tokens_per_gpu:
        shard = shard_shape(n, ctx.args.kv_heads)
        try:
            predictions += print_model(measured, shard, ctx.args, passes)
        except (KeyError, ValueError) as error:  # a shard the budget left unmeasured
            print(f"  model at {n} tokens per GPU: {error}", flush=True)
    return predictions


# ---------------------------------------------------------------------------
# Multi-GPU: the ring itself.
# ---------------------------------------------------------------------------

class ComputeOnlyRing(_Ring):
    """The ring's exact compute, its hops removed: each rank keeps its own K/V."""

    def start_hop(self, tensors):
        return _Hop(tensors, [])


def agreed_max(value: float) -> float:
    """The largest value over the ranks (every rank gets it, so every rank decides alike)."""
    tensor = torch.tensor([value], device=RUN.device, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


@dataclass(frozen=True)
class SlowestRank:
    """A timing's percentiles, each the largest over the ranks: the ring runs at its slowest."""

    p20: float
    p50: float
    p80: float
    repeats: int


def ring_measure(fn, most: int) -> SlowestRank:
    """Time fn with the same number of calls on every rank; the slowest rank's percentiles."""
    repeats = repeats_for(agreed_max(synchronized_ms(fn)), most)
    dist.barrier()
    timing = measure(fn, repeats)
    return SlowestRank(agreed_max(timing.p20), agreed_max(timing.p50), agreed_max(timing.p80),
                       repeats)


def time_ring(env, total: int, phase: str, args, rank: int, world_size: int) -> tuple[list, dict]:
    n = total // world_size
    shard = shard_shape(n, args.kv_heads)
    full = shard.replace(seqlen_q=total, seqlen_k=total)
    heads, head_dim = shard.query_heads, shard.head_dim
    scale = 1.0 / math.sqrt(head_dim)
    q = randn(1, n, heads, head_dim, seed=10 + rank)
    k, v = (randn(1, n, args.kv_heads, head_dim, seed=20 + 2 * rank + i) for i in range(2))
    dout = randn(1, n, heads, head_dim, seed=40 + rank)
    ring = _Ring.of(None)
    local = ComputeOnlyRing(ring.group, ring.rank, ring.world_size, ring.next_peer,
                            ring.previous_peer)
    if phase == "prefill":
        full_ring = lambda: ring_attention(q, k, v, causal=True, impl="triton")
        compute_only = lambda: _ring_forward(q, k, v, scale=scale, causal=True, impl="triton",
                                             ring=local)
        baseline = lambda: flash_forward(q, k, v, layout="bshd", scale=scale, causal=True)

        def transfers():
            kv = (k, v)
            for _ in range(world_size - 1):
                kv = ring.start_hop(kv).wait()
    else:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def full_ring():
            for t in leaves:
                t.grad = None
            ring_attention(*leaves, causal=True, impl="triton").backward(dout)

        def compute_only():
            out, lse = _ring_forward(q, k, v, scale=scale, causal=True, impl="triton", ring=local)
            return _ring_backward(dout, q, k, v, out.to(RUN.dtype), lse, scale=scale, causal=True,
                                  impl="triton", deterministic=False, ring=local)

        def baseline():
            out, lse = flash_forward(q, k, v, layout="bshd", scale=scale, causal=True)
            return flash_backward(dout, q, k, v, out, lse, layout="bshd", scale=scale,
                                  causal=True)

        grads = tuple(torch.zeros(t.shape, device=RUN.device, dtype=torch.float32)
                      for t in (k, v))

        def transfers():  # the forward ring's hops, then the backward's K/V and dK/dV hops
            kv = (k, v)
            for _ in range(world_size - 1):
                kv = ring.start_hop(kv).wait()
            kv, acc = (k, v), grads
            for step in range(world_size):
                if step < world_size - 1:
                    kv = ring.start_hop(kv).wait()
                acc = ring.start_hop(acc).wait()

    names = FORWARD_KERNELS + (BACKWARD_KERNELS if phase == "fwdbwd" else [])
    measured = {what: ring_measure(fn, args.repeats)
                for what, fn in (("ring", full_ring), ("compute-only", compute_only),
                                 ("transfers", transfers), ("baseline", baseline))}
    slowest = {what: timing.p50 for what, timing in measured.items()}
    records = []
    if rank == 0:
        for what, shape, flops in (
                ("ring", full, phase_flops(full, phase) / world_size),
                ("compute-only", full, phase_flops(full, phase) / world_size),
                ("transfers", full, None),
                ("baseline", shard, phase_flops(shard, phase))):
            kernel = f"ring x{world_size} {what}" if what != "baseline" else "one GPU, 1/P length"
            records.append(latency_record(env, kernel=kernel, provider="attnlab-ring",
                                          phase=phase, shape=shape, timing=measured[what],
                                          flops=flops, kernel_names=names if flops else []))
    exposed = max(slowest["ring"] - slowest["compute-only"], 0.0)
    summary = {
        "world_size": world_size, "total_tokens": total, "tokens_per_gpu": n, "phase": phase,
        "ring_ms": slowest["ring"], "compute_only_ms": slowest["compute-only"],
        "transfers_ms": slowest["transfers"], "baseline_ms": slowest["baseline"],
        "efficiency": world_size * slowest["baseline"] / slowest["ring"],
        "exposed_transfer_ms": exposed,
        "hidden_share": 1.0 - min(exposed / slowest["transfers"], 1.0),
        "per_step_compute_ms": slowest["compute-only"] / world_size,
        "per_hop_transfer_ms": slowest["transfers"] / (world_size - 1) if phase == "prefill"
        else None,
        "kv_hop_bytes": ring_model.kv_shard_bytes(shard),
    }
    return records, summary


def time_multi_gpu(ctx) -> tuple[list[dict], list[dict]]:
    """The ring, the ring without hops, the hops alone and one GPU at 1/P, per total length."""
    env, args, phase = ctx.env, ctx.args, ctx.phase
    rank, world_size = dist.get_rank(), dist.get_world_size()
    records, summaries = [], []
    for total in args.totals:
        # Every rank must take the same branch: decide on the slowest rank's clock.
        out_of_time = agreed_max(float(ctx.spent())) > 0
        full = shard_shape(total // world_size, args.kv_heads).replace(seqlen_q=total,
                                                                      seqlen_k=total)
        if out_of_time or total % (2 * world_size):
            reason = BUDGET_SPENT if out_of_time else \
                f"total {total} is not a multiple of 2 * world_size = {2 * world_size}"
            if rank == 0:
                records.append(skipped_record(provider="attnlab-ring", phase=phase,
                                              shape=full, reason=reason, env=env,
                                              kernel=f"ring x{world_size} ring"))
            continue
        try:
            measured, summary = time_ring(env, total, phase, args, rank, world_size)
            records += measured
            summaries.append(summary)
            if rank == 0:
                print(f"P={world_size} total {total} {phase}: ring {summary['ring_ms']:.2f} ms"
                      f", efficiency {summary['efficiency']:.1%}, exposed "
                      f"{summary['exposed_transfer_ms']:.2f} ms of "
                      f"{summary['transfers_ms']:.2f} ms transfers "
                      f"(hidden {summary['hidden_share']:.0%})", flush=True)
        except Exception as error:  # an OOM is on every rank alike: they go on together
            ctx.fail()
            traceback.print_exc()
            if rank == 0:
                records.append(skipped_record(provider="attnlab-ring", phase=phase,
                                              shape=full,
                                              reason=f"{type(error).__name__}: {error}"[:500],
                                              env=env, kernel=f"ring x{world_size} ring"))
        empty_cache()
    return records, summaries


# ---------------------------------------------------------------------------

def print_table(summaries: list[dict]) -> None:
    print("\n| GPUs | total | tokens/GPU | phase | ring ms | 1 GPU at 1/P ms | efficiency | "
          "exposed / transfers ms | hidden |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s['world_size']} | {s['total_tokens']} | {s['tokens_per_gpu']} | {s['phase']} | "
              f"{s['ring_ms']:.2f} | {s['baseline_ms']:.2f} | {s['efficiency']:.1%} | "
              f"{s['exposed_transfer_ms']:.2f} / {s['transfers_ms']:.2f} | "
              f"{s['hidden_share']:.0%} |")


bench = Bench("ring_h200", __doc__, budget_s=420.0, devices=("cuda", "cpu"))
bench.option("--single-gpu", action="store_true",
             help="measure the model's per-step inputs on one GPU")
bench.option("--totals", type=lambda text: parse_int_list(text, "--totals"),
             default=[131072, 524288], help="multi-GPU: total sequence lengths (comma-separated)")
bench.option("--tokens-per-gpu", type=lambda text: parse_int_list(text, "--tokens-per-gpu"),
             default=[8192, 16384, 32768, 65536, 131072],
             help="single GPU: shard lengths to measure")
bench.option("--kv-heads", type=int, default=RUN.heads)
bench.option("--repeats", type=int, default=10, help="at most this many timed calls")
bench.option("--collective-timeout-s", type=int, default=300)
bench.option("--link-gbps", type=float, default=ring_model.NVLINK4_BYTES_PER_S / 1e9,
             help="model: hop bandwidth inside a node, GB/s per direction")
bench.option("--inter-node-gbps", type=float, default=ring_model.NDR_INFINIBAND_BYTES_PER_S / 1e9,
             help="model: hop bandwidth between nodes, GB/s per direction")
bench.option("--quick", action="store_true",
             help="the smallest useful run: 128k total / 32k per GPU, 3 repeats")


@bench.setup
def start_group(ctx) -> None:
    """The workload (tiny on the CPU), the device and the process group (NCCL or gloo)."""
    global RUN
    args = ctx.args
    if args.quick:
        args.totals, args.tokens_per_gpu, args.repeats = [131072], [8192, 32768], 3
    if ctx.device == "cpu":
        RUN = SMOKE
        args.totals, args.tokens_per_gpu, args.repeats = [64], [16], 3
        args.kv_heads = min(args.kv_heads, RUN.heads)
    if args.single_gpu:
        if RUN.device == "cuda":
            torch.cuda.set_device(0)
        # A group of one runs the ring's own code path (no hops) through NCCL.
        dist.init_process_group(BACKENDS[RUN.device], store=dist.HashStore(), rank=0,
                                world_size=1)
        return
    if RUN.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(BACKENDS[RUN.device],
                            timeout=datetime.timedelta(seconds=args.collective_timeout_s))
    if dist.get_world_size() < 2:
        raise SystemExit("multi-GPU mode needs torchrun with --nproc-per-node >= 2 "
                         "(use --single-gpu for one GPU)")


@bench.phase("correct")
def correct(ctx) -> list[dict]:
    """Small shapes through the ring, gathered on rank 0, against float64 (outputs, gradients)."""
    rows = run_correctness(ctx.env, dist.get_rank())
    if dist.get_rank() == 0:
        ctx.fail(sum(not row["passed"] for row in rows))
    return rows


def time_pass(ctx):
    """One pass (the forward, or forward + backward) timed in the chosen mode."""
    return time_single_gpu(ctx) if ctx.args.single_gpu else time_multi_gpu(ctx)


bench.phase("prefill")(time_pass)
bench.phase("fwdbwd")(time_pass)


@bench.finish
def write_outputs(ctx) -> None:
    if dist.get_rank() == 0:
        passes = [ctx.results.get(p) or [] for p in ("prefill", "fwdbwd")]
        if ctx.args.single_gpu:
            records = [r for measured in passes for r in measured]
            summaries = model_predictions(ctx, records)
        else:
            records = [r for measured, _ in passes for r in measured]
            summaries = [s for _, measured in passes for s in measured]
            print_table(summaries)
        ctx.upsert(RECORDS_FILE, records)
        for name, rows in ((CORRECTNESS_FILE, ctx.results.get("correct") or []),
                           ("ring_summary.jsonl", summaries)):
            for row in rows:
                ctx.append_row(name, row)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(bench.main())
