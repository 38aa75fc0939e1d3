"""``attnlab report --measure``: test the report's Amdahl projection against a real prefill.

On a CUDA machine: build a small decoder with random weights
(:mod:`attnlab.measure.decoder`), run its prefill with eager attention under
``torch.profiler``, derive the attention time share ``f`` from the exported Chrome
trace with the same classifier ``--trace`` uses, time attention alone (eager vs
attnlab's Triton kernel, same shape) for ``S_kernel``, project the end-to-end
speedup with Amdahl's law -- then run the prefill with attnlab's kernel and compare
**predicted vs measured**.  The gap is decomposed from the two traces (attention time
in the model vs in isolation, non-attention time that moved, profiler overhead), so
the "likely causes" are measured, not guessed.

It launches kernels, so it lives in ``measure/``; the report turns its record into
a workload (:mod:`attnlab.report.measurement`) and never launches anything.  It
exists so the report's arithmetic is checked on hardware, and it never runs in CI.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnlab.api import last_impl
from attnlab.dtypes import canonical_dtype
from attnlab.measure.profile import TraceSummary, classify_trace, load_trace
from attnlab.model.amdahl import amdahl_speedup

# Sized for one H200 in seconds: 8 Llama-style layers (0.9B parameters), 16 heads of
# d=128 at 4,096 tokens, FP16 -- the lesson's head geometry and prompt length.
DEFAULT_CONFIG = dict(layers=8, hidden=2048, query_heads=16, kv_heads=16, head_dim=128,
                      mlp_hidden=5632, vocab=32000, prompt_tokens=4096, batch=1)
WARMUP = 3
REPEATS = 15
# Candidate logits may differ from eager ones by rounding only: eager soft-maxes in FP32
# and rounds P to FP16, the kernel keeps P in registers.  Relative to the largest logit.
LOGITS_RELATIVE_TOLERANCE = 2e-2
# Parts of the gap below this share of the eager prefill are not worth naming.
GAP_CAUSE_THRESHOLD = 0.02


def require_cuda() -> None:
    """ValueError (exit 2 in the CLI) when no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--measure needs a CUDA GPU and this machine has none "
                         "(torch.cuda.is_available() is False); use a workload FILE, --trace "
                         "or --records here")


def _synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device, *, warmup: int = WARMUP,
            repeats: int = REPEATS) -> list[float]:
    """Per-call times in ms: CUDA events on a GPU, perf_counter on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    _synchronize(device)
    samples = []
    on_gpu = torch.device(device).type == "cuda"
    for _ in range(repeats):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - began) * 1e3)
    return samples


def profile_prefill(fn: Callable[[], Any], device, path: Path, patterns=None) -> TraceSummary:
    """One call under torch.profiler, exported as a Chrome trace and classified."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    fn()  # warm: compilation and autotuning stay out of the profile
    _synchronize(device)
    with profile(activities=activities) as profiler:
        fn()
        _synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    return classify_trace(load_trace(path), patterns=patterns, source=path.name)


def _gap_causes(eager: TraceSummary, candidate: TraceSummary, *, eager_ms: float,
                kernel_speedup: float, predicted_ms: float, candidate_ms: float) -> list[str]:
    """Where the measured prefill departs from the projection, from the two traces."""
    causes = []
    in_model = eager.class_ms["attention"] / candidate.class_ms["attention"]
    if abs(in_model / kernel_speedup - 1) > 0.05:
        causes.append(
            f"Inside the model attention got {in_model:.2f}× faster (trace: "
            f"{eager.class_ms['attention']:.2f} → {candidate.class_ms['attention']:.2f} ms), not "
            f"the {kernel_speedup:.2f}× measured in isolation: caches, neighbouring kernels and "
            f"launch gaps differ inside a model.")
    eager_rest = eager.total_ms - eager.class_ms["attention"]
    candidate_rest = candidate.total_ms - candidate.class_ms["attention"]
    moved = candidate_rest - eager_rest
    if abs(moved) > GAP_CAUSE_THRESHOLD * eager.total_ms:
        idle_moved = candidate.class_ms["idle"] - eager.class_ms["idle"]
        causes.append(
            f"Time outside attention moved by {moved:+.2f} ms in the traces (idle {idle_moved:+.2f} "
            f"ms): Amdahl holds it fixed; launch gaps and layout copies around the kernel do not.")
    overhead = eager.span_ms / eager_ms - 1
    if abs(overhead) > GAP_CAUSE_THRESHOLD:
        causes.append(
            f"The profiled eager prefill spans {eager.span_ms:.2f} ms against {eager_ms:.2f} ms "
            f"timed without the profiler ({overhead:+.1%}): the share f carries that distortion.")
    if not causes:
        causes.append(
            f"The traces show no single cause above {GAP_CAUSE_THRESHOLD:.0%} of the prefill: "
            f"the {candidate_ms - predicted_ms:+.2f} ms gap is within run-to-run noise.")
    return causes


def run_measurement(config=None, *, device="cuda", dtype=None, candidate=None,
                    candidate_name: str = "attnlab.attention(impl='triton')",
                    trace_dir: Path | str = Path("."), warmup: int = WARMUP,
                    repeats: int = REPEATS) -> dict[str, Any]:
    """Predicted vs measured end-to-end speedup of swapping the attention core.

    ``candidate`` is an attention core ``(q, k, v) -> o`` in the bhsd layout, causal;
    by default attnlab's Triton kernel.  Returns the measurement record (every number,
    plus both trace summaries) that :func:`attnlab.report.measurement.measurement_workload`
    turns into a report.
    """
    import torch

    from attnlab.measure.decoder import (
        DecoderConfig,
        attnlab_attention,
        build_decoder,
        describe,
        eager_attention,
        prompt,
    )

    config = config or DecoderConfig(**DEFAULT_CONFIG)
    dtype = dtype or (torch.float16 if torch.device(device).type == "cuda" else torch.float32)
    candidate = candidate or attnlab_attention("triton")
    trace_dir = Path(trace_dir)
    model = build_decoder(config, device=device, dtype=dtype)
    tokens = prompt(config, device=device)

    with torch.inference_mode():
        eager_logits = model(tokens, eager_attention).float()
        candidate_logits = model(tokens, candidate).float()
        difference = (eager_logits - candidate_logits).abs().max().item()
        scale = eager_logits.abs().max().item()
        if not difference <= LOGITS_RELATIVE_TOLERANCE * max(scale, 1e-6):
            raise RuntimeError(f"--measure: {candidate_name} changes the model's logits by "
                               f"{difference:.3g} (largest logit {scale:.3g}); refusing to time a "
                               f"kernel that computes something else")

        def eager_prefill():
            return model(tokens, eager_attention)

        def candidate_prefill():
            return model(tokens, candidate)

        eager_trace = profile_prefill(eager_prefill, device, trace_dir / "prefill-eager.trace.json")
        candidate_trace = profile_prefill(candidate_prefill, device,
                                          trace_dir / "prefill-candidate.trace.json")
        impl_ran = last_impl()

        # Attention alone, on the model's own shape (bhsd, causal), for S_kernel.
        generator = torch.Generator(device="cpu").manual_seed(1)

        def random(heads: int) -> torch.Tensor:
            return torch.randn(config.batch, heads, config.prompt_tokens, config.head_dim,
                               generator=generator, dtype=torch.float32).to(device, dtype)

        q, k, v = random(config.query_heads), random(config.kv_heads), random(config.kv_heads)
        kernel_eager = time_ms(lambda: eager_attention(q, k, v), device,
                               warmup=warmup, repeats=repeats)
        kernel_candidate = time_ms(lambda: candidate(q, k, v), device,
                                   warmup=warmup, repeats=repeats)
        eager_samples = time_ms(eager_prefill, device, warmup=warmup, repeats=repeats)
        candidate_samples = time_ms(candidate_prefill, device, warmup=warmup, repeats=repeats)

    eager_ms = statistics.median(eager_samples)
    candidate_ms = statistics.median(candidate_samples)
    kernel_speedup = statistics.median(kernel_eager) / statistics.median(kernel_candidate)
    time_share = eager_trace.attention_time_share
    predicted_speedup = amdahl_speedup(time_share, kernel_speedup)
    predicted_ms = eager_ms / predicted_speedup
    measured_speedup = eager_ms / candidate_ms
    device_name = (torch.cuda.get_device_name(torch.device(device))
                   if torch.device(device).type == "cuda" else "CPU")
    return {
        "model": describe(config), "config": config.as_dict(), "parameters": config.parameters(),
        "device": f"{device_name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}",
        "dtype": canonical_dtype(str(dtype)),
        "baseline": "eager attention (matmul, scale, mask, FP32 softmax, matmul)",
        "candidate": candidate_name, "candidate_impl_ran": impl_ran,
        "repeats": repeats, "warmup": warmup, "statistic": "median",
        "eager_ms": eager_ms, "candidate_ms": candidate_ms,
        "eager_samples_ms": eager_samples, "candidate_samples_ms": candidate_samples,
        "kernel_eager_ms": statistics.median(kernel_eager),
        "kernel_candidate_ms": statistics.median(kernel_candidate),
        "kernel_speedup": kernel_speedup, "time_share": time_share,
        "predicted_speedup": predicted_speedup, "predicted_ms": predicted_ms,
        "measured_speedup": measured_speedup,
        "gap": measured_speedup / predicted_speedup - 1.0, "gap_ms": candidate_ms - predicted_ms,
        "in_model_attention_speedup": (eager_trace.class_ms["attention"]
                                       / candidate_trace.class_ms["attention"]),
        "logits_max_abs_difference": difference,
        "gap_causes": _gap_causes(eager_trace, candidate_trace, eager_ms=eager_ms,
                                  kernel_speedup=kernel_speedup, predicted_ms=predicted_ms,
                                  candidate_ms=candidate_ms),
        "traces": {"eager": eager_trace.as_dict(), "candidate": candidate_trace.as_dict()},
        "trace_files": [str(trace_dir / "prefill-eager.trace.json"),
                        str(trace_dir / "prefill-candidate.trace.json")],
    }
