"""Which kernels ran: GEMM classification on real kernel names, the Chrome-trace reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.measure import dispatch, ncu
from attnlab.measure import profile as trace_reader

DATA = Path(__file__).parent / "data"
# Captured on the H200 by bench/h200_measure.py (section 2); committed when available.
H200_TRACE = DATA / "trace_eager_typical_h200.json"


def anchor_names() -> dict[str, str]:
    """Real kernel names from the peers' H200 ncu capture, by what they do."""
    kernels = ncu.parse_csv(DATA / "h200-ncu-n4096-d128-h32.csv")
    named = {}
    for k in kernels:
        for key, needle in (("gemm_qk", "nvjet_sm90_hsh_256x128"), ("gemm_pv", "nvjet_sm90_hsh_128"),
                            ("scale", "MulFunctor"), ("softmax", "SoftMaxForward"),
                            ("masked_fill", "masked_fill"), ("flash", "flash_fwd_kernel"),
                            ("cudnn", "cudnn_generated"), ("triu", "triu_tril")):
            if needle in k.name:
                named.setdefault(key, k.name)
    return named


def test_gemm_classification_on_real_names():
    names = anchor_names()
    assert trace_reader.is_gemm(names["gemm_qk"]) and trace_reader.is_gemm(names["gemm_pv"])
    for other in ("scale", "softmax", "masked_fill", "flash", "cudnn", "triu"):
        assert not trace_reader.is_gemm(names[other]), other
    # attention kernels mention CUTLASS in their template arguments: still not a GEMM
    assert "cutlass" in names["flash"]
    assert trace_reader.is_gemm("void cutlass::Kernel2<cutlass_80_wmma_tensorop_h161616gemm_32x32>()")
    assert not trace_reader.is_gemm("void cutlass::Kernel<fmha_cutlassF_f16_aligned_64x64_rf_sm80>()")
    assert trace_reader.is_gemm("triton_tem_fused_mm_0") and not trace_reader.is_gemm("triton_tem_fused_0")


def test_base_and_short_names():
    assert trace_reader.base_name("void at::native::vectorized_elementwise_kernel<(int)8, X>(int, T)") \
        == "at::native::vectorized_elementwise_kernel"
    names = anchor_names()
    assert trace_reader.base_name(names["softmax"]) == "at::native::<unnamed>::cunn_SoftMaxForwardReg"
    assert trace_reader.short_name(names["softmax"]) == "cunn_SoftMaxForwardReg"
    # a generic elementwise kernel is named by the operation it applies
    assert trace_reader.short_name(names["scale"]) == "vectorized_elementwise_kernel[MulFunctor]"
    assert trace_reader.base_name("nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_TNT") == \
        "nvjet_sm90_hsh_256x128_64x4_1x2_h_bz_coopA_TNT"
    assert len(trace_reader.short_name("x" * 200, 20)) == 20


def test_summarize_aggregates_by_name_in_launch_order():
    kernels = trace_reader.summarize([("gemm", 10.0), ("softmax", 30.0), ("gemm", 12.0),
                                  ("Memset (Device)", 1.0)])
    assert kernels.names() == ["gemm", "softmax", "Memset (Device)"]
    assert kernels.launches == 4 and kernels.kernels[0].calls == 2
    assert kernels.total_us == pytest.approx(53.0) and kernels.gemm_us == pytest.approx(22.0)
    assert kernels.outside_gemm_share == pytest.approx(31.0 / 53.0)
    assert trace_reader.summarize([]).outside_gemm_share == 0.0


def write_trace(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_chrome_trace_gpu_events_sorted_by_start(tmp_path):
    names = anchor_names()
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::matmul", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": names["softmax"], "ts": 30, "dur": 20.5},
        {"ph": "X", "cat": "kernel", "name": names["gemm_qk"], "ts": 10, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 5, "dur": 1.0},
        {"ph": "X", "cat": "kernel", "name": names["gemm_pv"], "ts": 60, "dur": 4.0},
        {"ph": "f", "cat": "ac2g", "name": "launch", "ts": 10},
    ]
    kernels = trace_reader.parse_chrome_trace(write_trace(tmp_path / "t.json", events))
    assert kernels.names() == ["Memset (Device)", names["gemm_qk"], names["softmax"],
                               names["gemm_pv"]]
    assert kernels.gemm_us == pytest.approx(9.0)
    assert kernels.as_dict()["kernels"][2]["short_name"] == "cunn_SoftMaxForwardReg"


def test_a_real_cpu_profiler_trace_has_no_gpu_kernels():
    # exported by torch.profiler on a CPU machine (tests/data/make_report_trace.py)
    kernels = trace_reader.parse_chrome_trace(DATA / "report_cpu_prefill_trace.json")
    assert kernels.kernels == ()


@pytest.mark.skipif(not H200_TRACE.exists(),
                    reason="captured on the H200 by bench/h200_measure.py; commit it as "
                           "tests/data/trace_eager_typical_h200.json to run this test")
def test_captured_h200_trace_lists_the_typical_eager_kernels():
    kernels = trace_reader.parse_chrome_trace(H200_TRACE)
    assert kernels.launches >= 10  # the post's baseline launches about a dozen kernels
    assert sum(k.is_gemm for k in kernels.kernels) >= 1
    assert 0.5 < kernels.outside_gemm_share < 1.0


def test_bad_traces_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        trace_reader.parse_chrome_trace(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a Chrome trace JSON"):
        trace_reader.parse_chrome_trace(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        trace_reader.parse_chrome_trace(tmp_path / "list.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_profiling_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        dispatch.profile_call(lambda: None, ())


def test_a_record_names_the_kernels_that_ran_not_the_ones_meant(monkeypatch):
    class Seen:
        def names(self):
            return ["_split_kv_decode", "void at::native::fill_kernel"]

    entered = []

    class Pin:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(dispatch, "profile_call", lambda call, args: Seen())
    assert dispatch.kernels_that_ran(print, (), ("_split_kv_decode", "_combine_partials"),
                                     context=Pin) == Seen().names()
    assert entered == [True]
    assert dispatch.kernels_that_ran(print, ()) == Seen().names()
    with pytest.raises(RuntimeError, match="saw none of attnlab_decode's kernels \\(a name "
                                           "containing '_attn_fwd'\\); it saw _split_kv_decode, "
                                           "void at::native::fill_kernel"):
        dispatch.kernels_that_ran(print, (), ("_attn_fwd",), owner="attnlab_decode")
