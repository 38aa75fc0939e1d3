"""Sequence-length sweeps: check, prove, time, record — for every provider and phase.

For each (phase, provider, length) point:

1. **can it run?**  The provider's reason if not: recorded as a ``skipped`` row.
2. **is it right?**  Its output is checked against ``attnlab.reference.naive`` in
   float64 on the last query rows (bottom-right alignment makes those rows'
   visible keys identical to the full problem's) by :mod:`attnlab.accuracy`'s rule,
   the one every kernel is held to (no LSE here: not every provider returns one).  A wrong answer is
   recorded as skipped, with the error, and never timed.
3. **what ran?**  On a GPU the call runs once under ``torch.profiler`` and the
   kernel names go into the row, so "SDPA" always says which SDPA; a provider that
   names its kernels (``Provider.kernels``) is recorded as skipped when none of them ran.
4. **how fast?**  :func:`attnlab.measure.timing.time_call`, then TFLOP/s from the
   exact FLOP count and TB/s from the compulsory bytes (Q, K, V read once, O
   written once; the backward adds dO read and dQ, dK, dV written).

Decode points have one query token and the sweep's length as the KV length.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from attnlab.measure import records as rec
from attnlab.measure.providers import (
    Provider,
    ProviderUnavailable,
    prepare,
    to_bhsd,
    unproven_kernels,
)
from attnlab.shapes import AttentionShape

DEFAULT_CHECK_ROWS = 64


def phase_shape(base: AttentionShape, phase: str, seqlen: int) -> AttentionShape:
    """The shape of one sweep point: prefill/fwdbwd are square, decode has one query."""
    if phase not in rec.PHASES:
        raise ValueError(f"phase must be one of {list(rec.PHASES)}, got {phase!r}")
    if phase == "decode":
        return base.replace(seqlen_q=1, seqlen_k=seqlen)
    return base.replace(seqlen_q=seqlen, seqlen_k=seqlen)


def sweep_length(shape: AttentionShape, phase: str) -> int:
    """The x axis of a sweep: KV length for decode, sequence length otherwise."""
    return shape.seqlen_k if phase == "decode" else shape.seqlen_q


def flops(shape: AttentionShape, phase: str) -> int:
    """Exact FLOPs of one point: the pairs the mask permits (``attention_flops``)."""
    from attnlab.model.flops import attention_flops, backward_flops

    forward = attention_flops(shape)
    return forward + backward_flops(shape) if phase == "fwdbwd" else forward


def compulsory_bytes(shape: AttentionShape, phase: str, *, kv_dtype: str | None = None) -> int:
    """Bytes any implementation must move: inputs read once, outputs written once; K and
    V in the dtype they are stored in (``kv_dtype``: an fp8 cache moves 1 byte each)."""
    from attnlab.model.traffic import kv_element_bytes

    b = shape.element_bytes
    q = shape.batch * shape.query_heads * shape.seqlen_q * shape.head_dim * b
    kv = (2 * shape.batch * shape.kv_heads * shape.seqlen_k * shape.head_dim
          * kv_element_bytes(shape, kv_dtype))
    forward = q + kv + q                       # Q, K, V read; O written
    if phase != "fwdbwd":
        return forward
    return forward + (q + kv + q + q) + (q + kv)  # + Q, K, V, O, dO read; dQ, dK, dV written


@dataclass(frozen=True)
class CheckResult:
    rows: int
    error: float
    allowed: float
    passed: bool


def check_output(out, inputs: tuple, p: Provider, shape: AttentionShape, *,
                 rows: int = DEFAULT_CHECK_ROWS, batches: int | None = None) -> CheckResult:
    """Judge the last ``rows`` query rows of ``out`` by :func:`attnlab.accuracy.check_accuracy`.

    Bottom-right alignment makes the last rows' visible keys those of the full problem,
    so those rows alone are the same problem with a shorter query (no LSE: not every
    provider returns one).  ``batches``: judge only the first that many sequences (each
    is its own problem; the float64 oracle of a 16 x 128k decode would not fit a GPU).
    ``inputs`` are the call's arguments: a provider that stores them otherwise (an fp8
    cache) is judged on the values they stand for (its ``storage``).
    """
    from attnlab.accuracy import check_accuracy

    if batches is not None and (isinstance(batches, bool) or not isinstance(batches, int)
                                or batches < 1):
        raise ValueError(f"batches must be an int >= 1 or None (all), got {batches!r}")
    if p.storage is not None:  # batch-major arguments: the judged sequences alone
        inputs = p.storage.values(*(t.detach()[:batches] for t in inputs))
    q, k, v = (to_bhsd(t.detach(), p.input_layout)[:batches] for t in inputs[:3])
    out = to_bhsd(out.detach(), p.output_layout)[:batches]
    rows = min(rows, shape.seqlen_q)
    verdict = check_accuracy(out[:, :, -rows:, :], None, q[:, :, -rows:, :], k, v,
                             causal=shape.causal, scale=shape.softmax_scale, window=shape.window)
    return CheckResult(rows, verdict.error, verdict.allowed + ALLOWANCE_SLACK, verdict.passed)


# check_accuracy's own additive slack (its rule is error <= allowed + 1e-6).
ALLOWANCE_SLACK = 1e-6


@dataclass
class PointResult:
    provider: str
    phase: str
    shape: AttentionShape
    record: dict
    timing_ms: float | None = None
    check: CheckResult | None = None
    # The same call timed without CUDA-graph capture (launch overhead included), when asked.
    uncaptured: object | None = None  # a measure.timing.Timing

    @property
    def skipped(self) -> bool:
        return self.record["metric"] == rec.SKIPPED


def point_command(p: Provider, phase: str, shape: AttentionShape, options: dict,
                  flop_count: str = "exact") -> str:
    """The command that reproduces one point (its TFLOP/s convention included)."""
    argv = ["attnlab", "bench", "--phase", phase, "--providers", p.name,
            "--seqlens", str(sweep_length(shape, phase)), "--batch", str(shape.batch),
            "--heads", str(shape.query_heads), "--kv-heads", str(shape.kv_heads),
            "--head-dim", str(shape.head_dim), "--dtype", shape.dtype,
            "--causal" if shape.causal else "--no-causal"]
    if shape.has_window:
        argv += ["--window", f"{shape.window[0]},{shape.window[1]}"]
    if options.get("cuda_graph") is not None:
        argv.append("--cuda-graph" if options["cuda_graph"] else "--no-cuda-graph")
    if options.get("flush") not in (None, "l2"):
        argv += ["--flush", options["flush"]]
    if flop_count != "exact":
        argv += ["--flop-count", flop_count]
    return shlex.join(argv)


def conventional_flops(shape: AttentionShape, phase: str) -> int:
    """The benchmark convention ``4 B H Nq Nk d``, halved when causal (the peers' anchors,
    flash-attn's benchmarks): use it to compare with numbers reported that way."""
    from attnlab.model.flops import BACKWARD_MATMUL_FLOPS_PER_PAIR_PER_DIM as BACKWARD
    from attnlab.model.flops import MATMUL_FLOPS_PER_PAIR_PER_DIM as FORWARD
    from attnlab.model.flops import conventional_attention_flops

    forward = conventional_attention_flops(shape)
    return forward + forward * BACKWARD // FORWARD if phase == "fwdbwd" else forward


FLOP_COUNTS = {"exact": flops, "conventional": conventional_flops}


def measure_point(p: Provider, shape: AttentionShape, phase: str, *, device: str,
                  env: dict, timing: dict | None = None, check_rows: int = DEFAULT_CHECK_ROWS,
                  prove_kernels: bool = True, flop_count: str = "exact",
                  check_batches: int | None = None,
                  time_uncaptured: bool = False) -> PointResult:
    """Check, prove and time one provider on one shape; a skipped record on any failure.

    ``flop_count``: "exact" (the mask's pairs) or "conventional" (4BHN^2d, halved
    when causal) for the record's TFLOP/s.  ``check_batches``: how many sequences the
    float64 check judges (:func:`check_output`).  ``time_uncaptured``: a call timed
    under CUDA-graph replay is timed again without it (``PointResult.uncaptured``).
    """
    if flop_count not in FLOP_COUNTS:
        raise ValueError(f"flop_count must be one of {list(FLOP_COUNTS)}, got {flop_count!r}")
    count_flops = FLOP_COUNTS[flop_count]
    from attnlab.measure.dispatch import profile_call
    from attnlab.measure.timing import time_call

    timing = dict(timing or {})
    env = {**env, "command": point_command(p, phase, shape, timing, flop_count)}

    def skip(reason: str, check: CheckResult | None = None) -> PointResult:
        record = rec.skipped_record(provider=p.name, phase=phase, shape=shape, reason=reason,
                                    env=env)
        return PointResult(p.name, phase, shape, record, None, check)

    try:
        call = prepare(p, shape, phase, device)
    except ProviderUnavailable as error:
        return skip(str(error).split(": ", 1)[-1])
    try:
        inputs = call.inputs(seed=0)
        check = check_output(call.forward(*call.forward_inputs(inputs)), inputs, p, shape,
                             rows=check_rows, batches=check_batches)
        if not check.passed:
            return skip(f"wrong result: max error {check.error:.3g} on the last {check.rows} "
                        f"query rows > allowed {check.allowed:.3g}", check)
        names: list[str] = []
        if device == "cuda" and prove_kernels:
            names = profile_call(call.call, inputs).names()
            unproven = unproven_kernels(p, names)
            if unproven:
                return skip(unproven, check)
        sets = [inputs]
        if timing.get("flush") == "rotate":
            sets += [call.inputs(seed=s) for s in (1, 2, 3)]
        result = time_call(call.unpinned_call, sets, device=device, context=call.pin, **timing)
        uncaptured = None
        if time_uncaptured and result.method == "cuda-graph":
            uncaptured = time_call(call.unpinned_call, sets, device=device, context=call.pin,
                                   **{**timing, "cuda_graph": False})
    except Exception as error:  # the provider's own failure is a result too
        import torch

        if device == "cuda":
            torch.cuda.empty_cache()
        message = " ".join(str(error).split())
        return skip(f"failed: {type(error).__name__}: {message[:400]}")
    seconds = result.p50 / 1e3
    record = rec.make_record(
        kernel="call", provider=p.name, phase=phase, shape=shape, metric="latency", unit="ms",
        p20=result.p20, p50=result.p50, p80=result.p80, repeats=result.repeats, env=env,
        tflops=count_flops(shape, phase) / seconds / 1e12,
        tbps=compulsory_bytes(shape, phase, kv_dtype=p.storage and p.storage.kv_dtype)
        / seconds / 1e12, kernel_names=names,
        timing_method=result.describe_method())
    return PointResult(p.name, phase, shape, record, result.p50, check, uncaptured)


def run_sweep(providers: Sequence[Provider], phases: Sequence[str], seqlens: Sequence[int],
              base: AttentionShape, *, device: str, env: dict, timing: dict | None = None,
              check_rows: int = DEFAULT_CHECK_ROWS, out: str | Path | None = None,
              deadline: float | None = None, progress: bool = True,
              prove_kernels: bool = True, flop_count: str = "exact") -> list[PointResult]:
    """Every (phase, provider, length) point, provider-major so one slow provider's
    compile (Flex) does not interleave; ``deadline`` (time.monotonic()) skips the rest."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    points = [(phase, p, n) for phase in phases for p in providers for n in seqlens]
    results: list[PointResult] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("measuring", total=len(points))
        for phase, p, seqlen in points:
            shape = phase_shape(base, phase, seqlen)
            bar.update(task, description=f"{phase:7s} {p.name:15s} N={seqlen}")
            if deadline is not None and time.monotonic() > deadline:
                point_env = {**env, "command": point_command(p, phase, shape, timing or {},
                                                             flop_count)}
                record = rec.skipped_record(provider=p.name, phase=phase, shape=shape,
                                            reason="not measured: the run's time budget was "
                                                   "spent before this point", env=point_env)
                result = PointResult(p.name, phase, shape, record)
            else:
                result = measure_point(p, shape, phase, device=device, env=env, timing=timing,
                                       check_rows=check_rows, prove_kernels=prove_kernels,
                                       flop_count=flop_count)
            results.append(result)
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()  # a materialising provider's scores must not linger
            if out is not None:
                rec.upsert_records(out, [result.record])
            bar.advance(task)
    return results


# ----- measured ceilings ----------------------------------------------------------------------
def measure_ceilings(env: dict, *, gemm_size: int = 8192, copy_bytes: int = 2 * 2**30) -> list[dict]:
    """The two roofs, measured: a bf16 GEMM's TFLOP/s and a device copy's TB/s (read + write)."""
    import torch

    from attnlab.measure.timing import percentile, time_call

    if not torch.cuda.is_available():
        raise RuntimeError("measuring ceilings needs a CUDA GPU")
    a = torch.randn(gemm_size, gemm_size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(gemm_size, gemm_size, device="cuda", dtype=torch.bfloat16)
    gemm = time_call(torch.matmul, [(a, b)], device="cuda", flush="none", target_ms=200)
    src = torch.empty(copy_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = time_call(lambda: dst.copy_(src), [()], device="cuda", flush="none", target_ms=200)
    gemm_flops = 2 * gemm_size**3
    tflops = [gemm_flops / (ms / 1e3) / 1e12 for ms in gemm.samples_ms]
    tbps = [2 * copy_bytes / (ms / 1e3) / 1e12 for ms in copy.samples_ms]
    out = []
    for kernel, metric, unit, values, timing in (
            (f"bf16 GEMM {gemm_size}^3", "tflops", "TFLOP/s", tflops, gemm),
            (f"device copy {copy_bytes // 2**30} GiB (read + write)", "tbps", "TB/s", tbps, copy)):
        command = "python3 bench/h200_measure.py (measure_ceilings)"
        out.append(rec.make_record(
            kernel=kernel, provider="ceiling", phase="prefill", shape={}, metric=metric,
            unit=unit, p20=percentile(values, 20), p50=percentile(values, 50),
            p80=percentile(values, 80), repeats=timing.repeats, env={**env, "command": command}))
    return out
