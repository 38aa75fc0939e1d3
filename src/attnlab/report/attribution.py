"""Every number of the latency attribution report, computed from a validated workload.

The report follows the lesson's exit task: the trace table with shares, what this one
trace says about the targets, the proposal, Amdahl's law first inside the boundary
the change touches (e.g. the GPU prefill) and then at the client-TTFT boundary, the
three boundary errors computed for this case, the next-measurement plan and, when
client samples are given, the p95 with a bootstrap confidence interval.

:func:`build_report` returns a plain JSON-able ``dict`` (schema ``SCHEMA``, documented
in ``docs/report.md``); the renderers read only that dict, so a report written with
``--json`` renders to the same page.  Assumption, as in the lesson: the segments form
a strictly serial, non-overlapping critical path, so client TTFT is their sum.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from attnlab.measure.profile import TraceSummary
from attnlab.model.amdahl import amdahl_speedup
from attnlab.model.flops import attention_flop_share
from attnlab.report.workload import Part, Workload, check_kernel_speedup, workload_to_dict

SCHEMA = "attnlab.report/1"
# p95 verdicts need at least one sample above the 95th percentile on average: below
# 20 samples the "p95" is the largest sample and its bootstrap interval cannot reach
# above it, so any verdict would be overconfident.
MIN_SAMPLES_FOR_VERDICT = 20
BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0  # fixed, so a report is reproducible byte for byte
CONFIDENCE = 0.95
PERCENTILE = 95.0


# ----------------------------------------------------------------------------------
# Inputs that modify the workload: a profiler trace, a measured kernel speedup.
# ----------------------------------------------------------------------------------
def with_trace(workload: Workload, trace: TraceSummary) -> Workload:
    """The proposal's segment split by the trace's measured time shares.

    The trace gives *shares*; the segment keeps its own duration (measured at its own
    boundary, e.g. a server span), so the trace's profiler overhead does not leak into
    the TTFT sum.  The proposal then targets the ``attention`` part.
    """
    proposal = workload.proposal
    if proposal.time_share is not None:
        raise ValueError("proposal.time_share and --trace both give the attention share; "
                         "remove proposal.time_share to use the trace")
    if proposal.part is not None and proposal.part != "attention":
        raise ValueError(f"proposal.part is {proposal.part!r} but a trace measures the "
                         f"'attention' part; set proposal.part to attention")
    segment = workload.segment(proposal.segment)
    parts = tuple(Part(name, ms) for name, ms in trace.segment_parts(segment.ms).items())
    note = (f"split by {trace.source}: attention {trace.shares()['attention']:.1%} of "
            f"{trace.mode} time")
    segments = tuple(dataclasses.replace(s, parts=parts, note=note)
                     if s.name == segment.name else s for s in workload.segments)
    trace_warnings = getattr(trace, "warnings", ())  # a duck-typed summary may have none
    warnings = (*workload.warnings, *(f"trace {trace.source}: {w}" for w in trace_warnings))
    return dataclasses.replace(workload, segments=segments, warnings=warnings,
                               proposal=dataclasses.replace(proposal, part="attention"))


def with_kernel_speedup(workload: Workload, kernel_speedup: float, source: str) -> Workload:
    """The workload with the proposal's kernel speedup replaced (validated > 0)."""
    kernel_speedup = check_kernel_speedup(kernel_speedup, "kernel speedup")
    proposal = dataclasses.replace(workload.proposal, kernel_speedup=float(kernel_speedup),
                                   speedup_source=source)
    return dataclasses.replace(workload, proposal=proposal)


# ----------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------
def p95_with_interval(samples: list[float] | tuple[float, ...], target_ms: float | None, *,
                      confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The 95th percentile of client TTFT samples, a percentile-bootstrap interval, a verdict.

    Verdict against a ``<= target`` SLO: ``meets`` when the whole interval is at or
    below the target, ``misses`` when it is wholly above, ``unknown`` when it straddles
    the target or there are fewer than ``MIN_SAMPLES_FOR_VERDICT`` samples.
    """
    values = np.asarray(samples, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("samples.ttft_ms must hold at least one sample")
    count = int(values.size)
    p95 = float(np.percentile(values, PERCENTILE))
    rng = np.random.default_rng(seed)
    estimates = np.empty(resamples)
    rows_per_block = max(1, 2_000_000 // count)  # bound the index matrix to ~16 MB
    for first in range(0, resamples, rows_per_block):
        rows = min(rows_per_block, resamples - first)
        picks = rng.integers(0, count, size=(rows, count))
        estimates[first:first + rows] = np.percentile(values[picks], PERCENTILE, axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = (float(v) for v in np.percentile(estimates, [100 * tail, 100 * (1 - tail)]))
    if target_ms is None:
        verdict, reason = "no target", "targets.ttft_p95_ms is not set"
    elif count < MIN_SAMPLES_FOR_VERDICT:
        verdict = "unknown"
        reason = (f"{count} samples: fewer than {MIN_SAMPLES_FOR_VERDICT}, so the p95 is the tail "
                  f"of a handful of requests")
    elif high <= target_ms:
        verdict, reason = "meets", "the whole interval is at or below the target"
    elif low > target_ms:
        verdict, reason = "misses", "the whole interval is above the target"
    else:
        verdict, reason = "unknown", "the interval straddles the target"
    needed = None
    if verdict == "unknown" and target_ms is not None and p95 != target_ms and high > low:
        # The interval's half-width shrinks like 1/sqrt(n): the n at which it would stop
        # straddling, if the p95 estimate stayed where it is (a rough planning number).
        half_width = (high - low) / 2.0
        needed = max(MIN_SAMPLES_FOR_VERDICT,
                     math.ceil(count * (half_width / abs(p95 - target_ms)) ** 2))
    return {
        "count": count, "p95_ms": p95, "ci_low_ms": low, "ci_high_ms": high,
        "confidence": confidence, "resamples": resamples, "seed": seed,
        "method": "percentile bootstrap of numpy's linear-interpolated 95th percentile",
        "min_ms": float(values.min()), "median_ms": float(np.median(values)),
        "max_ms": float(values.max()), "target_ms": target_ms, "verdict": verdict,
        "reason": reason, "samples_needed_estimate": needed,
    }


# ----------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------
def _compare(value: float | None, target: float | None) -> dict[str, Any] | None:
    """``<= target`` check of one trace value (not a percentile)."""
    if value is None:
        return None
    if target is None:
        return {"value_ms": value, "target_ms": None, "verdict": "no target", "margin_ms": None}
    return {"value_ms": value, "target_ms": target,
            "verdict": "meets" if value <= target else "exceeds", "margin_ms": target - value}


def _affected(workload: Workload) -> tuple[float, str]:
    """Milliseconds of the proposal's segment that the change touches, and what they are."""
    proposal = workload.proposal
    segment = workload.segment(proposal.segment)
    if proposal.part is not None:
        return segment.part(proposal.part).ms, f"part {proposal.part!r} of {segment.name}"
    if proposal.time_share is not None:
        return proposal.time_share * segment.ms, f"{proposal.time_share:.1%} of {segment.name}"
    return segment.ms, f"all of {segment.name}"


def _flop_share_error(workload: Workload, segment_ms: float, time_share: float,
                      projected_segment_ms: float, kernel_speedup: float,
                      ttft_ms: float) -> dict[str, Any]:
    proposal = workload.proposal
    result: dict[str, Any] = {"applicable": False, "time_share": time_share}
    if proposal.part is None or "attention" not in proposal.part.lower():
        result["reason"] = "the proposal does not target an attention part"
        return result
    preset = workload.model.model_preset()
    if preset is None:
        result["reason"] = "missing " + ", ".join(workload.model.missing_geometry())
        return result
    prompt_tokens = workload.model.prompt_tokens
    flop_share = attention_flop_share(preset, prompt_tokens)
    wrong_speedup = amdahl_speedup(flop_share, kernel_speedup)
    wrong_segment_ms = segment_ms / wrong_speedup
    result.update({
        "applicable": True, "flop_share": flop_share, "prompt_tokens": prompt_tokens,
        "flop_model": "causal attention matmul FLOPs vs 2 FLOPs per parameter per token "
                      "(attnlab.model.flops.attention_flop_share)",
        "wrong_segment_speedup": wrong_speedup, "wrong_segment_ms": wrong_segment_ms,
        "wrong_ttft_ms": ttft_ms - segment_ms + wrong_segment_ms,
        "understated_saving_ms": wrong_segment_ms - projected_segment_ms,
        "time_to_flop_share_ratio": time_share / flop_share if flop_share else None,
    })
    return result


def _held_fixed_error(workload: Workload, segment_ms: float, projected_segment_ms: float,
                      ttft_after_ms: float, affected_ms: float) -> dict[str, Any]:
    proposal = workload.proposal
    held = [s for s in workload.segments if s.name != proposal.segment]
    held_ms = math.fsum(s.ms for s in held)
    load_dependent = [s for s in held if s.load_dependent]
    scaled = None
    if load_dependent:
        # Sensitivity, not a prediction: in a saturated closed loop a request waits for
        # the prefills ahead of it, so queue dwell would shrink with prefill time.
        ratio = projected_segment_ms / segment_ms
        scaled_segments = [{"name": s.name, "before_ms": s.ms, "after_ms": s.ms * ratio}
                           for s in load_dependent]
        change = math.fsum(item["after_ms"] - item["before_ms"] for item in scaled_segments)
        scaled = {"scale": ratio, "segments": scaled_segments,
                  "ttft_ms": ttft_after_ms + change, "difference_ms": change}
    return {
        "held_fixed": [{"name": s.name, "ms": s.ms, "source": s.source,
                        "load_dependent": s.load_dependent} for s in held],
        "held_fixed_ms": held_ms,
        "share_of_projected_ttft": held_ms / ttft_after_ms if ttft_after_ms else None,
        "untouched_in_segment_ms": segment_ms - affected_ms,
        "load_dependent_scaled": scaled,
    }


def _plan_facts(workload: Workload, projected_segment_ms: float) -> dict[str, Any]:
    """What the next-measurement plan needs: which inputs are assumed, not measured."""
    proposal = workload.proposal
    return {
        "segment": proposal.segment,
        "projected_segment_ms": projected_segment_ms,
        "kernel_speedup_measured": bool(proposal.speedup_source
                                        and proposal.speedup_source.startswith("measured")),
        "load_dependent_segments": [s.name for s in workload.segments if s.load_dependent],
        "has_samples": bool(workload.samples_ttft_ms),
        "targets_attention": bool(proposal.part and "attention" in proposal.part.lower()),
    }


def _waterfall(workload: Workload, kernel_speedup: float,
               affected_ms: float) -> list[dict[str, Any]]:
    """One bar per segment (the proposal's part split out), before and after the change."""
    proposal = workload.proposal
    bars = []
    for segment in workload.segments:
        if segment.name == proposal.segment and proposal.part is None:
            # The whole segment, or a share of it with no named part: one bar.
            after = segment.ms - affected_ms + affected_ms / kernel_speedup
            bars.append({"label": segment.name, "segment": segment.name,
                         "before_ms": segment.ms, "after_ms": after, "changed": True})
            continue
        for piece in segment.parts or (Part(segment.name, segment.ms),):
            touched = segment.name == proposal.segment and piece.name == proposal.part
            bars.append({
                "label": f"{segment.name}: {piece.name}" if segment.parts else segment.name,
                "segment": segment.name, "before_ms": piece.ms,
                "after_ms": piece.ms / kernel_speedup if touched else piece.ms,
                "changed": touched,
            })
    return bars


def build_report(workload: Workload, *, trace: TraceSummary | None = None,
                 records: dict[str, Any] | None = None,
                 measurement: dict[str, Any] | None = None) -> dict[str, Any]:
    """All numbers of the report for a validated workload, as a JSON-able dict.

    ``trace``, ``records`` and ``measurement`` are included as provenance; apply them to
    the workload first (:func:`with_trace`, :func:`with_kernel_speedup`).
    """
    proposal = workload.proposal
    if proposal.kernel_speedup is None:
        raise ValueError("proposal.kernel_speedup is required: state it in the workload file, "
                         "or pass --kernel-speedup, or --records with measured timings")
    kernel_speedup = proposal.kernel_speedup
    segment = workload.segment(proposal.segment)
    if segment.ms <= 0:
        raise ValueError(f"proposal.segment {segment.name!r} lasts 0 ms: nothing to speed up")
    ttft_ms = workload.ttft_ms
    affected_ms, affected_label = _affected(workload)

    # Boundary 1: inside the segment the change touches (the lesson's GPU prefill).
    time_share = min(affected_ms / segment.ms, 1.0)
    segment_speedup = amdahl_speedup(time_share, kernel_speedup)
    projected_segment_ms = (segment.ms - affected_ms) + affected_ms / kernel_speedup
    # Boundary 2: client TTFT, everything outside the segment held fixed.
    client_share = min(affected_ms / ttft_ms, 1.0)
    client_speedup = amdahl_speedup(client_share, kernel_speedup)
    ttft_after_ms = ttft_ms - segment.ms + projected_segment_ms

    segments = []
    for s in workload.segments:
        segments.append({
            "name": s.name, "ms": s.ms, "source": s.source, "note": s.note,
            "load_dependent": s.load_dependent, "share_of_ttft": s.ms / ttft_ms,
            "parts": [{"name": p.name, "ms": p.ms,
                       "share_of_segment": p.ms / s.ms if s.ms else 0.0,
                       "share_of_ttft": p.ms / ttft_ms} for p in s.parts],
        })
    largest = max(workload.segments, key=lambda s: s.ms)
    targets = workload.targets
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "title": workload.title,
        "origin": workload.origin,
        "warnings": list(workload.warnings),
        "input": workload_to_dict(workload),
        "workload": dataclasses.asdict(workload.model),
        "targets": dataclasses.asdict(targets),
        "segments": segments,
        "ttft": {
            "segments_sum_ms": ttft_ms, "client_measured_ms": workload.client_ttft_ms,
            "client_source": workload.client_ttft_source,
            "client_mismatch": (None if workload.client_ttft_ms is None else
                                (ttft_ms - workload.client_ttft_ms) / workload.client_ttft_ms),
        },
        "decode": None if workload.decode_tpot_ms is None else {
            "tpot_ms": workload.decode_tpot_ms, "tokens_per_s": 1000.0 / workload.decode_tpot_ms,
            "source": workload.decode_source,
        },
        "observations": {
            "ttft_this_trace": _compare(ttft_ms, targets.ttft_p95_ms),
            "tpot_this_trace": _compare(workload.decode_tpot_ms, targets.tpot_ms),
            "largest_segment": {"name": largest.name, "ms": largest.ms,
                                "share_of_ttft": largest.ms / ttft_ms},
            "proposal_segment_share_of_ttft": segment.ms / ttft_ms,
        },
        "proposal": {
            "change": proposal.change, "segment": segment.name, "part": proposal.part,
            "time_share_given": proposal.time_share, "affected_ms": affected_ms,
            "affected": affected_label, "kernel_speedup": kernel_speedup,
            "speedup_source": proposal.speedup_source,
        },
        "segment_boundary": {
            "name": segment.name, "before_ms": segment.ms, "affected_ms": affected_ms,
            "time_share": time_share, "untouched_share": 1.0 - time_share,
            "speedup": segment_speedup, "after_ms": projected_segment_ms,
            "saved_ms": segment.ms - projected_segment_ms,
            "reduction": 1.0 - projected_segment_ms / segment.ms,
        },
        "client_boundary": {
            "name": "client TTFT", "before_ms": ttft_ms, "affected_ms": affected_ms,
            "time_share": client_share, "speedup": client_speedup, "after_ms": ttft_after_ms,
            "saved_ms": ttft_ms - ttft_after_ms, "reduction": 1.0 - ttft_after_ms / ttft_ms,
            "held_fixed_ms": ttft_ms - segment.ms,
            "meets_target_this_trace": (None if targets.ttft_p95_ms is None
                                        else ttft_after_ms <= targets.ttft_p95_ms),
        },
        "boundary_errors": {
            "kernel_speedup_on_ttft": {
                "wrong_ttft_ms": ttft_ms / kernel_speedup,
                "wrong_reduction": 1.0 - 1.0 / kernel_speedup,
                "projected_ttft_ms": ttft_after_ms,
                "overstated_saving_ms": ttft_after_ms - ttft_ms / kernel_speedup,
            },
            "flop_share_for_time_share": _flop_share_error(
                workload, segment.ms, time_share, projected_segment_ms, kernel_speedup, ttft_ms),
            "unmeasured_held_fixed": _held_fixed_error(
                workload, segment.ms, projected_segment_ms, ttft_after_ms, affected_ms),
        },
        "plan": _plan_facts(workload, projected_segment_ms),
        "p95": (p95_with_interval(workload.samples_ttft_ms, targets.ttft_p95_ms)
                if workload.samples_ttft_ms else None),
        "samples_source": workload.samples_source,
        "waterfall": {"bars": _waterfall(workload, kernel_speedup, affected_ms),
                      "target_ms": targets.ttft_p95_ms, "before_total_ms": ttft_ms,
                      "after_total_ms": ttft_after_ms},
        "trace": trace.as_dict() if trace is not None else None,
        "records": records,
        "measurement": measurement,
    }
    # Two routes to the client speedup must agree: Amdahl with the client share, and
    # the ratio of the summed segments.  A mismatch would be a bug in this module.
    ratio = ttft_ms / ttft_after_ms
    if not math.isclose(ratio, client_speedup, rel_tol=1e-9):
        raise AssertionError(f"client speedup {client_speedup} != TTFT ratio {ratio}")
    return report


__all__ = ["SCHEMA", "build_report", "p95_with_interval", "with_kernel_speedup", "with_trace"]
