"""The report's numbers: the lesson's default, other scenarios by hand, p95, records."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from attnlab.model.flops import attention_flop_share
from attnlab.report.attribution import (
    MIN_SAMPLES_FOR_VERDICT,
    build_report,
    p95_with_interval,
    with_kernel_speedup,
    with_trace,
)
from attnlab.report.speedup import kernel_speedup_from_records
from attnlab.report.workload import LESSON_DOCUMENT_QA, default_workload, parse_workload
from attnlab.shapes import preset


def approx(value, rel=1e-9):
    return pytest.approx(value, rel=rel)


# ----------------------------------------------------------------------------------
# The lesson's Document QA trace
# ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lesson_report():
    return build_report(default_workload())


def test_default_prefill_boundary(lesson_report):
    seg = lesson_report["segment_boundary"]
    assert seg["time_share"] == approx(0.40)
    assert seg["untouched_share"] == approx(0.60)
    assert seg["speedup"] == approx(1 / (0.60 + 0.40 / 3.0))
    assert round(seg["speedup"], 4) == 1.3636
    assert seg["after_ms"] == approx(174.0 + 116.0 / 3.0)
    assert round(seg["after_ms"], 2) == 212.67
    assert round(100 * seg["reduction"], 2) == 26.67


def test_default_client_boundary(lesson_report):
    cli = lesson_report["client_boundary"]
    assert cli["before_ms"] == 380.0
    assert round(cli["after_ms"], 2) == 302.67
    assert cli["after_ms"] == approx(15.0 + 65.0 + (174.0 + 116.0 / 3.0) + 10.0)
    assert round(cli["speedup"], 4) == 1.2555
    assert round(100 * cli["reduction"], 2) == 20.35
    assert cli["time_share"] == approx(116.0 / 380.0)
    assert cli["held_fixed_ms"] == 90.0


def test_default_shares_and_observations(lesson_report):
    shares = {s["name"]: round(100 * s["share_of_ttft"], 1) for s in lesson_report["segments"]}
    assert shares == {"network": 3.9, "queue": 17.1, "prefill": 76.3, "first_chunk": 2.6}
    obs = lesson_report["observations"]
    assert obs["ttft_this_trace"]["verdict"] == "exceeds"
    assert obs["ttft_this_trace"]["margin_ms"] == -30.0
    assert obs["tpot_this_trace"]["verdict"] == "meets"
    assert obs["largest_segment"]["name"] == "prefill"
    assert lesson_report["decode"]["tokens_per_s"] == approx(31.25)
    assert lesson_report["p95"] is None  # one trace: the p95 verdict is unknown


def test_default_boundary_errors(lesson_report):
    errors = lesson_report["boundary_errors"]
    kernel = errors["kernel_speedup_on_ttft"]
    assert round(kernel["wrong_ttft_ms"], 1) == 126.7
    assert kernel["overstated_saving_ms"] == approx(302.0 + 2 / 3 - 380.0 / 3.0)
    flop = errors["flop_share_for_time_share"]
    assert flop["applicable"]
    assert flop["flop_share"] == approx(attention_flop_share(preset("lesson-8b"), 4096))
    assert round(100 * flop["flop_share"]) == 6  # "~6% of FLOPs"
    assert flop["time_share"] == approx(0.40)
    assert flop["wrong_segment_speedup"] == approx(1 / ((1 - flop["flop_share"])
                                                        + flop["flop_share"] / 3.0))
    held = errors["unmeasured_held_fixed"]
    assert held["held_fixed_ms"] == 90.0
    assert [h["name"] for h in held["held_fixed"]] == ["network", "queue", "first_chunk"]
    scaled = held["load_dependent_scaled"]
    assert scaled["segments"][0]["after_ms"] == approx(65.0 * (212.0 + 2 / 3) / 290.0)
    assert scaled["ttft_ms"] == approx(302.0 + 2 / 3 - 65.0 + 65.0 * (212.0 + 2 / 3) / 290.0)


def test_default_waterfall_sums_to_both_totals(lesson_report):
    chart = lesson_report["waterfall"]
    assert sum(b["before_ms"] for b in chart["bars"]) == approx(380.0)
    assert sum(b["after_ms"] for b in chart["bars"]) == approx(chart["after_total_ms"])
    changed = [b for b in chart["bars"] if b["changed"]]
    assert [b["label"] for b in changed] == ["prefill: attention"]
    assert changed[0]["after_ms"] == approx(116.0 / 3.0)


# ----------------------------------------------------------------------------------
# Other scenarios, computed by hand
# ----------------------------------------------------------------------------------
def scenario(segments, proposal, **extra) -> dict:
    return build_report(parse_workload({"segments": segments, "proposal": proposal, **extra}))


@pytest.mark.parametrize("share, kernel, expected_speedup, expected_reduction", [
    (0.15, 3.5, 1.120, 10.71),  # the lesson's section 5
    (0.40, 3.5, 1.400, 28.57),
    (0.65, 3.5, 1.867, 46.43),
    (0.22, 2.8, 1.1647, 14.14),  # exercise 3: 1 / (0.78 + 0.22 / 2.8)
])
def test_single_segment_sensitivity(share, kernel, expected_speedup, expected_reduction):
    report = scenario(
        [{"name": "layer", "ms": 100.0, "source": "profile",
          "parts": {"attention": 100.0 * share, "rest": 100.0 * (1 - share)}}],
        {"change": "fused kernel", "segment": "layer", "part": "attention",
         "kernel_speedup": kernel})
    seg = report["segment_boundary"]
    assert seg["speedup"] == pytest.approx(expected_speedup, abs=5e-4)
    assert round(100 * seg["reduction"], 2) == pytest.approx(expected_reduction, abs=0.01)
    # With one segment the client boundary is the segment boundary.
    assert report["client_boundary"]["speedup"] == approx(seg["speedup"])
    # Without targets or samples nothing is judged.
    assert report["observations"]["ttft_this_trace"]["verdict"] == "no target"


def test_time_share_proposal_without_parts():
    # TTFT 200 ms; half of segment b (75 ms) gets 2x faster: b 150 -> 112.5, TTFT -> 162.5.
    report = scenario(
        [{"name": "a", "ms": 50.0, "source": "s"}, {"name": "b", "ms": 150.0, "source": "s"}],
        {"change": "c", "segment": "b", "time_share": 0.5, "kernel_speedup": 2.0})
    assert report["segment_boundary"]["after_ms"] == approx(112.5)
    assert report["segment_boundary"]["speedup"] == approx(150 / 112.5)
    assert report["client_boundary"]["after_ms"] == approx(162.5)
    assert report["client_boundary"]["speedup"] == approx(200 / 162.5)
    assert report["client_boundary"]["time_share"] == approx(75 / 200)
    bars = report["waterfall"]["bars"]
    assert [(b["label"], b["after_ms"]) for b in bars] == [("a", 50.0), ("b", 112.5)]
    # Not an attention part: the FLOP-share comparison does not apply.
    flop = report["boundary_errors"]["flop_share_for_time_share"]
    assert not flop["applicable"] and "attention" in flop["reason"]
    assert report["boundary_errors"]["unmeasured_held_fixed"]["load_dependent_scaled"] is None


def test_whole_segment_proposal():
    report = scenario(
        [{"name": "x", "ms": 30.0, "source": "s"}, {"name": "queue", "ms": 20.0, "source": "s"},
         {"name": "y", "ms": 50.0, "source": "s"}],
        {"change": "c", "segment": "y", "kernel_speedup": 2.0},
        targets={"ttft_p95_ms": 80.0})
    assert report["segment_boundary"]["time_share"] == 1.0
    assert report["segment_boundary"]["after_ms"] == 25.0
    assert report["client_boundary"]["after_ms"] == 75.0
    assert report["client_boundary"]["speedup"] == approx(100 / 75)
    assert report["client_boundary"]["meets_target_this_trace"] is True
    assert report["boundary_errors"]["kernel_speedup_on_ttft"]["wrong_ttft_ms"] == 50.0
    # The queue (load-dependent by name) scaled by 25/50 gives 10 ms instead of 20.
    scaled = report["boundary_errors"]["unmeasured_held_fixed"]["load_dependent_scaled"]
    assert scaled["ttft_ms"] == approx(65.0) and scaled["difference_ms"] == approx(-10.0)


def test_flop_share_at_another_prompt_length_and_missing_geometry():
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["workload"]["prompt_tokens"] = 2048
    flop = build_report(parse_workload(data))["boundary_errors"]["flop_share_for_time_share"]
    assert round(100 * flop["flop_share"], 1) == 3.2  # the lesson's 3.2% at 2,048 tokens
    del data["workload"]["parameters"]
    flop = build_report(parse_workload(data))["boundary_errors"]["flop_share_for_time_share"]
    assert not flop["applicable"] and "workload.parameters" in flop["reason"]


def test_kernel_speedup_override_and_requirement():
    workload = with_kernel_speedup(default_workload(), 2.0, "measured: test")
    report = build_report(workload)
    assert report["segment_boundary"]["after_ms"] == approx(174.0 + 58.0)
    assert report["plan"]["kernel_speedup_measured"]
    with pytest.raises(ValueError, match="kernel speedup must be a finite number > 0"):
        with_kernel_speedup(default_workload(), 0.0, "x")
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    del data["proposal"]["kernel_speedup"]
    with pytest.raises(ValueError, match="proposal.kernel_speedup is required"):
        build_report(parse_workload(data))


def test_zero_length_target_segment_is_refused():
    workload = parse_workload({"segments": [{"name": "a", "ms": 10.0, "source": "s"},
                                            {"name": "b", "ms": 0.0, "source": "s"}],
                               "proposal": {"change": "c", "segment": "b", "kernel_speedup": 2}})
    with pytest.raises(ValueError, match="proposal.segment 'b' lasts 0 ms"):
        build_report(workload)


# ----------------------------------------------------------------------------------
# p95 with a bootstrap interval
# ----------------------------------------------------------------------------------
def test_p95_point_estimate_is_numpys_linear_percentile():
    result = p95_with_interval(list(range(1, 101)), None)
    assert result["p95_ms"] == approx(95.05)
    assert result["verdict"] == "no target"
    assert result["ci_low_ms"] <= result["p95_ms"] <= result["ci_high_ms"]


def test_p95_verdicts():
    assert p95_with_interval([300.0] * 50, 350.0)["verdict"] == "meets"
    assert p95_with_interval([400.0] * 50, 350.0)["verdict"] == "misses"
    straddling = np.linspace(300.0, 400.0, 101)  # p95 = 395 exactly
    result = p95_with_interval(straddling, 395.0)
    assert result["ci_low_ms"] < 395.0 < result["ci_high_ms"]
    assert result["verdict"] == "unknown" and "straddles" in result["reason"]
    assert result["samples_needed_estimate"] is None  # p95 sits on the target
    near = p95_with_interval(straddling, 397.0)
    assert near["verdict"] == "unknown"
    assert near["samples_needed_estimate"] > 101


def test_p95_needs_enough_samples_for_a_verdict():
    few = [300.0] * (MIN_SAMPLES_FOR_VERDICT - 1)
    result = p95_with_interval(few, 350.0)
    assert result["verdict"] == "unknown" and "fewer than" in result["reason"]
    assert p95_with_interval(few + [300.0], 350.0)["verdict"] == "meets"


def test_p95_is_reproducible_and_in_the_report():
    rng = np.random.default_rng(7)
    samples = [float(v) for v in rng.normal(340.0, 20.0, 300)]
    first, second = p95_with_interval(samples, 350.0), p95_with_interval(samples, 350.0)
    assert first == second
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["samples"] = {"ttft_ms": samples}
    report = build_report(parse_workload(data))
    assert report["p95"] == first
    assert report["p95"]["verdict"] == "misses"  # 340 + 1.645 * 20 ~ 373 ms


# ----------------------------------------------------------------------------------
# Trace shares and bench records feeding the workload
# ----------------------------------------------------------------------------------
class FakeTrace:
    source, mode = "fake.json", "device kernels"

    def shares(self):
        return {"attention": 0.5, "gemm": 0.3, "other": 0.15, "idle": 0.05}

    def segment_parts(self, segment_ms):
        return {name: share * segment_ms for name, share in self.shares().items()}


def test_with_trace_splits_the_segment_by_the_trace_shares():
    workload = with_trace(default_workload(), FakeTrace())
    parts = {p.name: p.ms for p in workload.segment("prefill").parts}
    assert parts == approx({"attention": 145.0, "gemm": 87.0, "other": 43.5, "idle": 14.5})
    report = build_report(workload)
    assert report["segment_boundary"]["time_share"] == approx(0.5)
    assert report["segment_boundary"]["after_ms"] == approx(145.0 + 145.0 / 3.0)
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["proposal"].update(part=None, time_share=0.3)
    with pytest.raises(ValueError, match="proposal.time_share and --trace"):
        with_trace(parse_workload(data), FakeTrace())


def record(provider, p50, *, batch=1, gpu="NVIDIA H200", seqlen=4096, metric="latency",
           unit="ms", phase="prefill", kernel="call"):
    shape = {"batch": batch, "query_heads": 32, "kv_heads": 32, "seqlen_q": seqlen,
             "seqlen_k": seqlen, "head_dim": 128, "dtype": "fp16", "causal": True,
             "window": [-1, -1], "block_m": 128, "block_n": 64}
    return {"kernel": kernel, "provider": provider, "phase": phase, "shape": shape,
            "metric": metric, "unit": unit, "p20": p50 * 0.98, "p50": p50, "p80": p50 * 1.03,
            "repeats": 50, "gpu": gpu, "kernel_names": [f"{provider}_kernel"],
            "command": f"attnlab bench --provider {provider}"}


def test_records_give_the_measured_speedup_for_the_workloads_shape():
    records = [record("eager", 6.0), record("attnlab", 1.5), record("sdpa_flash", 2.0),
               record("eager", 99.0, seqlen=2048), record("attnlab", 1.0, seqlen=2048),
               record("eager", 50.0, batch=4), record("attnlab", 10.0, batch=4),
               record("attnlab", 0.5, kernel="_attn_fwd")]
    found = kernel_speedup_from_records(records, default_workload())
    assert found["kernel_speedup"] == approx(4.0)
    assert found["batch"] == 1 and found["gpu"] == "NVIDIA H200"
    assert found["kernel_speedup_low"] == approx(6.0 * 0.98 / (1.5 * 1.03))
    assert found["kernel_speedup_high"] == approx(6.0 * 1.03 / (1.5 * 0.98))
    # Units are converted: microseconds against milliseconds.
    mixed = [record("eager", 6000.0, unit="us"), record("attnlab", 1.5)]
    assert kernel_speedup_from_records(mixed, default_workload())["kernel_speedup"] == approx(4.0)


@pytest.mark.parametrize("records, message", [
    ([record("eager", 6.0, seqlen=2048)], "no timed prefill record"),
    ([record("eager", 6.0)], "proposal.candidate_provider 'attnlab' has no record"),
    ([record("attnlab", 1.0)], "proposal.baseline_provider 'eager' has no record"),
    ([record("eager", 6.0), record("attnlab", 1.0), record("eager", 6.0, metric="graph"),
      record("attnlab", 1.0, metric="graph")], "set proposal.records_metric"),
    ([record("eager", 6.0, gpu="A"), record("attnlab", 1.0, gpu="A"),
      record("eager", 6.0, gpu="B"), record("attnlab", 1.0, gpu="B")], "several GPUs"),
    ([record("eager", 6.0, gpu="A"), record("attnlab", 1.0, gpu="B")], "never measured on the same"),
])
def test_records_errors(records, message):
    with pytest.raises(ValueError, match=message):
        kernel_speedup_from_records(records, default_workload())
