"""The trace classifier: on a real torch.profiler trace (CPU) and on Kineto-shaped GPU events."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from attnlab.measure.profile import (
    DEFAULT_PATTERNS,
    MODE_CPU,
    MODE_DEVICE,
    classify_trace,
    load_trace,
    resolve_patterns,
    summarize_trace,
)

DATA = Path(__file__).parent / "data"
CPU_TRACE = DATA / "report_cpu_prefill_trace.json"


@pytest.fixture(scope="module")
def cpu_trace() -> dict:
    return load_trace(CPU_TRACE)


@pytest.fixture(scope="module")
def cpu_summary():
    return summarize_trace(CPU_TRACE)


# ----------------------------------------------------------------------------------
# The committed trace: a real CPU profile of an eager prefill (tests/data/make_report_trace.py)
# ----------------------------------------------------------------------------------
def _brute_force_self_times(trace: dict) -> list[tuple[dict, float, list[str]]]:
    """Each cpu_op, its self time and the names of everything enclosing it -- O(n^2)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"
              and e.get("cat") in ("cpu_op", "user_annotation")]
    ops = [e for e in events if e["cat"] == "cpu_op"]

    def inside(inner, outer):
        return (inner is not outer and outer["ts"] <= inner["ts"]
                and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3)

    result = []
    for op in ops:
        parents = [o for o in ops if inside(op, o)]
        children = [c for c in ops if inside(c, op)]
        # Direct children: not inside another child.
        direct = [c for c in children if not any(inside(c, other) for other in children)]
        self_us = max(op["dur"] - sum(c["dur"] for c in direct), 0.0)
        scopes = [e["name"] for e in events if inside(op, e)]
        result.append((op, self_us, scopes + [p["name"] for p in parents]))
    return result


def test_committed_trace_is_a_real_profiler_export(cpu_trace):
    assert "traceEvents" in cpu_trace and cpu_trace.get("schemaVersion") == 1
    assert CPU_TRACE.stat().st_size < 300_000
    names = {e.get("name") for e in cpu_trace["traceEvents"]}
    assert {"aten::bmm", "aten::_softmax", "aten::mm", "attention", "prefill"} <= names


def test_cpu_trace_attention_time_matches_a_brute_force_count(cpu_trace, cpu_summary):
    attention_us = gemm_us = 0.0
    for op, self_us, enclosing in _brute_force_self_times(cpu_trace):
        if "softmax" in op["name"] or "attention" in enclosing or any(
                "softmax" in name for name in enclosing):
            attention_us += self_us
        elif op["name"] in ("aten::mm", "aten::bmm", "aten::addmm", "aten::linear",
                            "aten::matmul") or any(
                name in ("aten::linear", "aten::matmul", "aten::mm") for name in enclosing):
            gemm_us += self_us
    assert cpu_summary.mode == MODE_CPU
    assert cpu_summary.class_ms["attention"] == pytest.approx(attention_us / 1000, rel=1e-6)
    assert cpu_summary.class_ms["gemm"] == pytest.approx(gemm_us / 1000, rel=1e-6)


def test_cpu_trace_shares_are_consistent(cpu_summary):
    s = cpu_summary
    assert s.events == 550
    # One host thread: self times plus host gaps tile the span exactly.
    assert s.total_ms == pytest.approx(s.span_ms, rel=1e-6)
    assert sum(s.shares().values()) == pytest.approx(1.0)
    assert s.attention_time_share == pytest.approx(s.class_ms["attention"] / s.total_ms)
    assert 0.2 < s.attention_time_share < 0.7
    assert s.segment_parts(290.0)["attention"] == pytest.approx(290.0 * s.attention_time_share)


def test_cpu_trace_attributes_ops_for_the_right_reason(cpu_summary):
    rows = {(r.name, r.category): r for r in cpu_summary.top_names}
    assert "inside scope 'attention'" in rows[("aten::bmm", "attention")].reason
    assert rows[("aten::bmm", "attention")].count == 4  # QK^T and PV in each of 2 layers
    assert rows[("aten::_softmax", "attention")].reason == "name matches /softmax/"
    assert rows[("aten::mm", "gemm")].count == 15  # 7 projections x 2 layers + LM head
    assert ("aten::silu", "other") in rows
    assert all(r.category != "attention" for r in cpu_summary.top_names
               if r.name in ("aten::mm", "aten::silu"))


def test_scope_rule_is_what_moves_eager_matmuls_into_attention():
    without_scopes = summarize_trace(CPU_TRACE, patterns={"attention_scopes": [r"^no such scope$"]})
    with_scopes = summarize_trace(CPU_TRACE)
    moved = with_scopes.class_ms["attention"] - without_scopes.class_ms["attention"]
    assert moved > 0
    assert without_scopes.class_ms["gemm"] - with_scopes.class_ms["gemm"] > 0
    bmm = {r.category for r in without_scopes.top_names if r.name == "aten::bmm"}
    assert bmm == {"gemm"}
    assert without_scopes.total_ms == pytest.approx(with_scopes.total_ms)


def test_trace_without_attention_is_an_error():
    nothing = {"attention": [r"^nothing$"], "attention_scopes": [r"^nothing$"]}
    with pytest.raises(ValueError, match=r"report_cpu_prefill_trace.json: no attention CPU ops "
                                         r"among 550"):
        summarize_trace(CPU_TRACE, patterns=nothing)


def test_gzip_trace_and_bad_files(tmp_path, cpu_summary):
    packed = tmp_path / "trace.json.gz"
    packed.write_bytes(gzip.compress(CPU_TRACE.read_bytes()))
    assert summarize_trace(packed).class_ms == cpu_summary.class_ms
    not_json = tmp_path / "notes.json"
    not_json.write_text("attention 40%")
    with pytest.raises(ValueError, match="not a Chrome trace JSON"):
        summarize_trace(not_json)
    no_events = tmp_path / "empty.json"
    no_events.write_text(json.dumps({"traceEvents": [{"ph": "M", "name": "process_name"}]}))
    with pytest.raises(ValueError, match="no kernel or CPU-op events"):
        summarize_trace(no_events)
    with pytest.raises(ValueError, match="no traceEvents list"):
        classify_trace({"events": []}, source="x.json")
    with pytest.raises(ValueError, match="cannot be read"):
        summarize_trace(tmp_path / "missing.json")


def test_pattern_overrides_are_validated():
    assert resolve_patterns(None) == DEFAULT_PATTERNS
    assert resolve_patterns({"gemm": ["mm"]})["gemm"] == ("mm",)
    with pytest.raises(ValueError, match="trace_patterns: unknown class 'mlp'"):
        resolve_patterns({"mlp": ["x"]})
    with pytest.raises(ValueError, match=r"trace_patterns.gemm\[0\] '\(' holds \(: patterns "
                                         r"are plain text"):
        resolve_patterns({"gemm": ["("]})
    with pytest.raises(ValueError, match="non-empty list"):
        resolve_patterns({"gemm": "gemm"})


@pytest.mark.parametrize("pattern", ["(a+)+$", "^(a|aa)+$", "flash.*fwd", "a{2,}", r"\bmm",
                                     "[ab]", "mid^dle", "mid$dle", "^", "", "x" * 201])
def test_a_regex_or_empty_pattern_is_refused_by_name(pattern):
    with pytest.raises(ValueError, match=r"trace_patterns.attention\[0\]"):
        resolve_patterns({"attention": [pattern]})


@pytest.mark.parametrize("pattern, name, found", [
    ("softmax", "void at::native::cunn_SoftMaxForward<float>", True),
    ("^attention$", "Attention", True), ("^attention$", "self_attention", False),
    ("^aten::", "aten::mm", True), ("^aten::", "x aten::mm", False),
    ("_fwd$", "flash_fwd", True), ("_fwd$", "flash_fwd_kernel", False),
    ("a.b", "a.b", True), ("a.b", "axb", False),  # '.' is a dot, as kernel names write it
])
def test_patterns_are_plain_text_anchored_by_caret_and_dollar(pattern, name, found):
    from attnlab.measure.profile import _Matcher

    matcher = _Matcher(resolve_patterns({"attention": [pattern]}))
    assert (matcher.match("attention", name) == pattern) is found


def test_the_default_scope_patterns_match_what_the_regexes_did():
    """The defaults, once regular expressions, written out as plain patterns."""
    import re

    from attnlab.measure.profile import _Matcher

    matcher = _Matcher(DEFAULT_PATTERNS)
    scope = re.compile(r"^(core|self|sdpa|flash)[_ ]?attention$", re.IGNORECASE)
    gemm = re.compile(r"^aten::(mm|bmm|addmm|baddbmm|addbmm|mv|dot|linear|_addmm_activation|"
                      r"_scaled_mm)$", re.IGNORECASE)
    names = ["core_attention", "Self Attention", "sdpaattention", "flash_attention",
             "xcore_attention", "core-attention", "core_attention_x", "attention",
             "aten::mm", "aten::addmm", "aten::mm_x", "aten::_scaled_mm", "aten::linear",
             "aten::bmm.out"]
    for name in names:
        assert bool(matcher.match("attention_scopes", name)) == bool(
            scope.search(name) or name.lower() == "attention" or "scaled_dot_product" in name
            or "flash_attn" in name.lower()), name
        assert bool(matcher.match("gemm", name)) == bool(
            gemm.search(name) or any(p in name.lower() for p in (
                "gemm", "gemv", "cutlass", "cublas", "xmma", "wgmma", "nvjet", "matmul", "_mm_",
                "bmm", "triton_tem_fused_mm"))), name


# ----------------------------------------------------------------------------------
# GPU traces: events laid out as Kineto writes them (kernel <- correlation -> launch,
# launch nested in cpu_op / user_annotation ranges on the host thread).
# ----------------------------------------------------------------------------------
class KinetoTrace:
    """Builds a small trace in Kineto's layout; times in microseconds."""

    def __init__(self):
        self.events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}}]
        self.correlation = 0

    def scope(self, name, ts, dur, cat="cpu_op"):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 10, "tid": 10,
                            "ts": ts, "dur": dur, "args": {}})
        return self

    def kernel(self, name, ts, dur, *, launch_at=None, stream=7, cat="kernel"):
        self.correlation += 1
        if launch_at is not None:
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                                "pid": 10, "tid": 10, "ts": launch_at, "dur": 2.0,
                                "args": {"correlation": self.correlation}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                            "ts": ts, "dur": dur,
                            "args": {"correlation": self.correlation, "stream": stream}})
        return self

    def trace(self):
        return {"schemaVersion": 1, "traceEvents": self.events}


def device_trace():
    t = KinetoTrace()
    # Layer: eager attention under record_function("attention") ...
    t.scope("attention", 0, 100, cat="user_annotation")
    t.scope("aten::matmul", 1, 20).scope("aten::bmm", 2, 18)
    t.kernel("sm90_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize128x128x64", 1000, 40, launch_at=5)
    t.scope("aten::softmax", 30, 20).scope("aten::_softmax", 31, 18)
    t.kernel("void at::native::cunn_SoftMaxForward<8, float>", 1050, 30, launch_at=35)
    t.scope("aten::masked_fill", 55, 10)
    t.kernel("void at::native::elementwise_kernel<128, 2>", 1090, 10, launch_at=57)
    # ... then the MLP outside it.
    t.scope("aten::linear", 120, 20).scope("aten::addmm", 121, 18)
    t.kernel("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", 1110, 50, launch_at=125)
    t.scope("aten::silu", 150, 10)
    t.kernel("void at::native::vectorized_elementwise_kernel<4, silu>", 1170, 20, launch_at=152)
    # A fused kernel launched by SDPA, and one with no launch event at all.
    t.scope("aten::_scaled_dot_product_flash_attention", 170, 20)
    t.kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 1200, 30,
             launch_at=172)
    t.kernel("Memcpy DtoD (Device -> Device)", 1240, 10, cat="gpu_memcpy")
    return t.trace()


def test_device_trace_classification_by_hand():
    summary = classify_trace(device_trace(), source="gpu.json")
    assert summary.mode == MODE_DEVICE
    # attention: bmm gemm in scope 40 + softmax 30 + masked_fill in scope 10 + flash 30.
    assert summary.class_ms["attention"] == pytest.approx(0.110)
    assert summary.class_ms["gemm"] == pytest.approx(0.050)  # the MLP's nvjet GEMM
    assert summary.class_ms["other"] == pytest.approx(0.030)  # silu 20 + memcpy 10
    # Span 1000..1250 us; kernels busy 40+30+10+50+20+30+10 = 190 us; idle 60 us.
    assert summary.span_ms == pytest.approx(0.250)
    assert summary.class_ms["idle"] == pytest.approx(0.060)
    assert summary.attention_time_share == pytest.approx(110 / 250)
    reasons = {r.name.split("<")[0]: r.reason for r in summary.top_names}
    assert reasons["sm90_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize128x128x64"] == \
        "inside scope 'attention' (matches /^attention$/)"
    assert reasons["void at::native::cunn_SoftMaxForward"] == "name matches /softmax/"
    # The memcpy has no launch event; only its name can classify it.
    assert summary.notes == ("1 of 7 kernels have no launch event in the trace; only their names "
                             "classify them",)


def test_device_annotation_and_overlapping_streams():
    t = KinetoTrace()
    t.kernel("sm80_xmma_gemm_bf16bf16", 0, 100)  # no launch: GEMM by name
    t.kernel("sm80_xmma_gemm_bf16bf16", 50, 100, stream=8)  # overlaps on another stream
    t.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "attention", "pid": 0,
                     "tid": 8, "ts": 40, "dur": 200})
    summary = classify_trace(t.trace(), source="streams.json")
    # The second GEMM lies inside the device-side "attention" range.
    assert summary.class_ms["attention"] == pytest.approx(0.100)
    assert summary.class_ms["gemm"] == pytest.approx(0.100)
    assert summary.overlap_ms == pytest.approx(0.050)  # 200 us of kernels in a 150 us union
    assert summary.class_ms["idle"] == pytest.approx(0.0)
    assert any("overlapped" in note for note in summary.notes)


@pytest.mark.parametrize("name, expected", [
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("_attn_fwd", "attention"),
    ("void (anonymous namespace)::softmax_warp_forward<c10::Half, float, 12>", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>", "attention"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_cublas",
     "gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_256x128_32x3_nn>", "gemm"),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_nn", "gemm"),
    ("matmul_kernel", "gemm"),
    ("triton_poi_fused_mul_silu_0", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>",
     "other"),
])
def test_kernel_name_table(name, expected):
    t = KinetoTrace().kernel(name, 0, 10).kernel("flash_fwd_kernel", 10, 10)
    summary = classify_trace(t.trace())
    found = {r.category for r in summary.top_names if r.name == name}
    assert found == {expected}


@pytest.mark.parametrize("name, expected", [
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_softmax", "attention"),
    ("aten::addmm", "gemm"),
    ("aten::bmm", "gemm"),
    ("aten::layer_norm", "other"),
])
def test_cpu_op_name_table(name, expected):
    events = [{"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": 0, "dur": 5},
              {"ph": "X", "cat": "cpu_op", "name": "aten::softmax", "pid": 1, "tid": 1,
               "ts": 10, "dur": 5}]
    summary = classify_trace({"traceEvents": events})
    assert {r.category for r in summary.top_names if r.name == name} == {expected}
