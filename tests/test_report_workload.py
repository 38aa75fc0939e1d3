"""The workload file: parsing, every bad-input path, warnings."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import yaml

from attnlab.report.workload import (
    LESSON_DOCUMENT_QA,
    UNATTRIBUTED_PART,
    default_workload,
    load_workload,
    parse_workload,
    workload_to_dict,
)


def lesson() -> dict:
    return copy.deepcopy(LESSON_DOCUMENT_QA)


def prefill(data: dict) -> dict:
    return next(s for s in data["segments"] if s["name"] == "prefill")


def test_default_is_the_lessons_document_qa_trace():
    workload = default_workload()
    assert [s.name for s in workload.segments] == ["network", "queue", "prefill", "first_chunk"]
    assert [s.ms for s in workload.segments] == [15.0, 65.0, 290.0, 10.0]
    assert workload.ttft_ms == 380.0
    assert workload.segment("prefill").part("attention").ms == 116.0
    assert workload.proposal.kernel_speedup == 3.0
    assert workload.targets.ttft_p95_ms == 350.0 and workload.targets.tpot_ms == 40.0
    assert workload.decode_tpot_ms == 32.0
    assert workload.warnings == ()
    # The queue is the one segment whose duration moves with load.
    assert [s.name for s in workload.segments if s.load_dependent] == ["queue"]


def test_issue_example_yaml_parses(tmp_path):
    text = """
workload: {model: "nominal 8B dense", layers: 32, query_heads: 32, kv_heads: 32, head_dim: 128, dtype: fp16,
           concurrency: 8, prompt_tokens: 4096, output_tokens: 128}
targets: {ttft_p95_ms: 350.0, tpot_ms: 40.0}
segments:
  - {name: network, ms: 15.0, source: "synchronized socket ingress delta"}
  - {name: queue, ms: 65.0, source: "server enqueue/dequeue timestamps"}
  - {name: prefill, ms: 290.0, source: "CUDA profiler span", parts: {attention: 116.0, other: 174.0}}
  - {name: first_chunk, ms: 10.0, source: "SSE serialization"}
decode: {tpot_ms: 32.0}
proposal: {change: "FlashAttention-2 causal prefill kernel", segment: prefill, part: attention, kernel_speedup: 3.0}
samples: {ttft_ms: [300.0, 310.5, 420.0]}
"""
    path = tmp_path / "qa.yaml"
    path.write_text(text)
    workload = load_workload(path)
    assert workload.ttft_ms == 380.0
    assert workload.samples_ttft_ms == (300.0, 310.5, 420.0)
    # No parameter count in the issue's example: the FLOP share cannot be computed.
    assert workload.model.model_preset() is None
    assert "workload.parameters" in workload.model.missing_geometry()


def test_json_file_and_round_trip(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(lesson()))
    workload = load_workload(path)
    assert dataclasses.replace(workload, origin="built-in") == \
        dataclasses.replace(default_workload(), origin="built-in")
    again = parse_workload(workload_to_dict(workload), origin=workload.origin)
    assert again == workload


@pytest.mark.parametrize("written, expected", [
    (8_000_000_000, 8_000_000_000), (8.0e9, 8_000_000_000), ("8e9", 8_000_000_000),
    ("8B", 8_000_000_000), ("1.5b", 1_500_000_000), ("70M", 70_000_000),
])
def test_parameter_counts(written, expected):
    data = lesson()
    data["workload"]["parameters"] = written
    assert parse_workload(data).model.parameters == expected


def test_preset_fills_geometry_and_file_overrides_it():
    data = lesson()
    data["workload"] = {"preset": "qwen-gqa", "prompt_tokens": 2048, "layers": 48}
    model = parse_workload(data).model
    assert (model.query_heads, model.kv_heads, model.head_dim) == (24, 4, 256)
    assert model.attention_layers == 16 and model.layers == 48
    assert model.model_preset().parameters == 27_000_000_000


# ----------------------------------------------------------------------------------
# Bad input: one line, naming the field.
# ----------------------------------------------------------------------------------
def _segment(data, name):
    return next(s for s in data["segments"] if s["name"] == name)


BAD_INPUTS = {
    "negative duration": (lambda d: _segment(d, "queue").update(ms=-5.0), "segments[1].ms"),
    "missing duration": (lambda d: _segment(d, "queue").pop("ms"), "segments[1].ms"),
    "duration as text": (lambda d: _segment(d, "queue").update(ms="65 ms"), "segments[1].ms"),
    "infinite duration": (lambda d: _segment(d, "queue").update(ms=float("inf")), "segments[1].ms"),
    "negative part": (lambda d: prefill(d)["parts"].update(attention=-1.0),
                      "segments[2].parts.attention"),
    "parts exceed segment": (lambda d: prefill(d)["parts"].update(attention=200.0),
                             "segments[2].parts"),
    "empty parts": (lambda d: prefill(d).update(parts={}), "segments[2].parts"),
    "unknown segment": (lambda d: d["proposal"].update(segment="decode"), "proposal.segment"),
    "unknown part": (lambda d: d["proposal"].update(part="mlp"), "proposal.part"),
    "share above 1": (lambda d: d["proposal"].update(part=None, time_share=1.5),
                      "proposal.time_share"),
    "negative share": (lambda d: d["proposal"].update(part=None, time_share=-0.1),
                       "proposal.time_share"),
    "part and share": (lambda d: d["proposal"].update(time_share=0.4), "proposal.part"),
    "zero speedup": (lambda d: d["proposal"].update(kernel_speedup=0), "proposal.kernel_speedup"),
    "negative speedup": (lambda d: d["proposal"].update(kernel_speedup=-2.0),
                         "proposal.kernel_speedup"),
    "speedup as bool": (lambda d: d["proposal"].update(kernel_speedup=True),
                        "proposal.kernel_speedup"),
    "missing proposal": (lambda d: d.pop("proposal"), "proposal"),
    "missing segment in proposal": (lambda d: d["proposal"].pop("segment"), "proposal.segment"),
    "missing segments": (lambda d: d.pop("segments"), "segments"),
    "empty segments": (lambda d: d.update(segments=[]), "segments"),
    "segment not a mapping": (lambda d: d["segments"].append(12), "segments[4]"),
    "segment without name": (lambda d: _segment(d, "queue").pop("name"), "segments[1].name"),
    "duplicate segment name": (lambda d: d["segments"].append({"name": "queue", "ms": 1.0}),
                               "segments[4].name"),
    "unknown top-level field": (lambda d: d.update(segmentz=[]), "segmentz"),
    "unknown segment field": (lambda d: _segment(d, "queue").update(millis=3), "millis"),
    "unknown workload field": (lambda d: d["workload"].update(heads=32), "heads"),
    "bad dtype": (lambda d: d["workload"].update(dtype="fp8"), "workload.dtype"),
    "kv heads do not divide": (lambda d: d["workload"].update(kv_heads=5), "workload.kv_heads"),
    "bad parameter count": (lambda d: d["workload"].update(parameters="eight billion"),
                            "workload.parameters"),
    "zero layers": (lambda d: d["workload"].update(layers=0), "workload.layers"),
    "unknown preset": (lambda d: d["workload"].update(preset="gpt-5"), "workload.preset"),
    "zero target": (lambda d: d["targets"].update(ttft_p95_ms=0), "targets.ttft_p95_ms"),
    "negative client total": (lambda d: d["client"].update(ttft_ms=-1), "client.ttft_ms"),
    "samples not a list": (lambda d: d.update(samples={"ttft_ms": 300}), "samples.ttft_ms"),
    "negative sample": (lambda d: d.update(samples={"ttft_ms": [300, -1]}), "samples.ttft_ms[1]"),
    "bad load_dependent": (lambda d: _segment(d, "queue").update(load_dependent="yes"),
                           "segments[1].load_dependent"),
    "bad pattern": (lambda d: d.update(trace_patterns={"gemm": ["("]}), "trace_patterns.gemm[0]"),
    "unknown pattern class": (lambda d: d.update(trace_patterns={"mlp": ["x"]}), "mlp"),
    "unattributed as proposal part": (
        lambda d: (prefill(d)["parts"].update(attention=100.0),
                   d["proposal"].update(part="unattributed")), "proposal.part"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_the_field(case):
    mutate, field = BAD_INPUTS[case]
    data = lesson()
    mutate(data)
    with pytest.raises(ValueError) as error:
        parse_workload(data)
    message = str(error.value)
    assert field in message, message
    assert "\n" not in message


def test_nan_duration_from_yaml(tmp_path):
    data = lesson()
    path = tmp_path / "nan.yaml"
    text = yaml.safe_dump(data).replace("ms: 65.0", "ms: .nan")
    path.write_text(text)
    with pytest.raises(ValueError, match=r"nan.yaml: segments\[1\]\.ms .*finite"):
        load_workload(path)


def test_file_errors_name_the_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("segments: [ {name: a, ms: 1\n")
    with pytest.raises(ValueError, match=r"broken.yaml: not valid YAML"):
        load_workload(broken)
    with pytest.raises(ValueError, match="cannot be read"):
        load_workload(tmp_path / "missing.yaml")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        load_workload(bad_json)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="list.yaml: the workload file's top level must be a mapping"):
        load_workload(listing)


# ----------------------------------------------------------------------------------
# Warnings, not errors
# ----------------------------------------------------------------------------------
def test_client_total_within_one_percent_is_quiet():
    data = lesson()
    data["client"]["ttft_ms"] = 383.0  # 0.8% above the 380 ms sum
    assert parse_workload(data).warnings == ()


def test_client_total_off_by_more_than_one_percent_warns():
    data = lesson()
    data["client"]["ttft_ms"] = 400.0  # 5% apart
    workload = parse_workload(data)
    assert len(workload.warnings) == 1
    assert "client.ttft_ms" in workload.warnings[0] and "5.0%" in workload.warnings[0]
    assert workload.ttft_ms == 380.0  # the numbers still come from the segments


def test_parts_short_of_the_segment_add_an_unattributed_part_and_warn():
    data = lesson()
    prefill(data)["parts"] = {"attention": 116.0, "other": 150.0}
    workload = parse_workload(data)
    parts = {p.name: p.ms for p in workload.segment("prefill").parts}
    assert parts == {"attention": 116.0, "other": 150.0, UNATTRIBUTED_PART: 24.0}
    assert any("unattributed" in w for w in workload.warnings)


def test_rounded_parts_are_not_an_error():
    data = lesson()
    prefill(data)["parts"] = {"attention": 116.0, "other": 174.1}  # rounding, 0.03% over
    parse_workload(data)


def test_missing_source_and_slowdown_warn():
    data = lesson()
    del _segment(data, "network")["source"]
    data["proposal"]["kernel_speedup"] = 0.8
    warnings = parse_workload(data).warnings
    assert any("segments[0] (network) has no source" in w for w in warnings)
    assert any("slowdown" in w for w in warnings)
