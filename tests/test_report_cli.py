"""`attnlab report` from each input, its exit codes, and the demo section."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from attnlab.cli import main
from attnlab.measure.profile import summarize_trace
from attnlab.report.attribution import build_report
from attnlab.report.workload import LESSON_DOCUMENT_QA, default_workload
from attnlab.shapes import AttentionShape

CPU_TRACE = Path(__file__).parent / "data" / "report_cpu_prefill_trace.json"


def write_workload(tmp_path: Path, data: dict, name: str = "workload.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_json(capsys, *argv) -> dict:
    assert main(["report", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_table(capsys):
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    for expected in ("290.0 ms", "212.67 ms", "1.3636×", "26.67%", "302.67 ms", "1.2555×",
                     "20.35%", "126.67 ms"):
        assert expected in out, expected


def test_default_json_is_the_built_in_report(capsys):
    assert run_json(capsys) == json.loads(json.dumps(build_report(default_workload())))


def test_file_and_out(tmp_path, capsys):
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["proposal"]["kernel_speedup"] = 2.0
    out_dir = tmp_path / "out"
    assert main(["report", str(write_workload(tmp_path, data)), "--out", str(out_dir)]) == 0
    assert "written:" in capsys.readouterr().out
    report = json.loads((out_dir / "report.json").read_text())
    assert report["segment_boundary"]["after_ms"] == pytest.approx(174.0 + 58.0)
    assert (out_dir / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert (out_dir / "report.md").exists() and (out_dir / "waterfall.svg").exists()


def test_trace_input(capsys):
    report = run_json(capsys, "--trace", str(CPU_TRACE))
    share = summarize_trace(CPU_TRACE).attention_time_share
    assert report["segment_boundary"]["time_share"] == pytest.approx(share)
    assert report["segment_boundary"]["before_ms"] == 290.0  # the segment keeps its duration
    assert report["trace"]["mode"] == "CPU ops"
    assert report["segment_boundary"]["after_ms"] == pytest.approx(
        290.0 * (1 - share) + 290.0 * share / 3.0)


def records_file(tmp_path: Path, timings: dict[str, float]) -> Path:
    shape = AttentionShape(query_heads=32, kv_heads=32, seqlen_q=4096, seqlen_k=4096,
                           head_dim=128, dtype="fp16", causal=True).as_dict()
    lines = []
    for provider, p50 in timings.items():
        lines.append(json.dumps({
            "kernel": "call", "provider": provider, "phase": "prefill", "shape": shape,
            "metric": "latency", "unit": "ms", "p20": p50 * 0.99, "p50": p50, "p80": p50 * 1.01,
            "repeats": 30, "tflops": None, "tbps": None, "kernel_names": [f"{provider}_k"],
            "gpu": "NVIDIA H200", "torch": "2.13.0", "triton": "3.6.0", "driver": "570",
            "git_commit": "abc", "timestamp": "2026-01-01T00:00:00+00:00",
            "command": f"attnlab bench --provider {provider}"}))
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_records_input(tmp_path, capsys):
    pytest.importorskip("attnlab.measure.records")
    report = run_json(capsys, "--records", str(records_file(tmp_path, {"eager": 8.0,
                                                                        "attnlab": 2.0})))
    assert report["proposal"]["kernel_speedup"] == pytest.approx(4.0)
    assert report["proposal"]["speedup_source"].startswith("measured: eager 8.000 ms")
    assert report["records"]["gpu"] == "NVIDIA H200"
    assert report["segment_boundary"]["after_ms"] == pytest.approx(174.0 + 29.0)
    assert report["plan"]["kernel_speedup_measured"]


def test_kernel_speedup_option(capsys):
    report = run_json(capsys, "--kernel-speedup", "2")
    assert report["segment_boundary"]["after_ms"] == pytest.approx(232.0)


def one_line_error(capsys, argv) -> str:
    assert main(["report", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("attnlab report: error: ")
    return lines[0]


@pytest.mark.parametrize("change, field", [
    (lambda d: d["segments"][1].update(ms=-65.0), "segments[1].ms"),
    (lambda d: d["segments"][1].pop("ms"), "segments[1].ms"),
    (lambda d: d["segments"][2]["parts"].update(attention=300.0), "segments[2].parts"),
    (lambda d: d["proposal"].update(segment="gpu"), "proposal.segment"),
    (lambda d: d["proposal"].update(part="softmax"), "proposal.part"),
    (lambda d: d["proposal"].update(part=None, time_share=1.2), "proposal.time_share"),
    (lambda d: d["proposal"].update(kernel_speedup=0.0), "proposal.kernel_speedup"),
])
def test_bad_workload_files_exit_2_naming_the_field(tmp_path, capsys, change, field):
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    change(data)
    line = one_line_error(capsys, [str(write_workload(tmp_path, data, "bad.yaml"))])
    assert f"bad.yaml: {field}" in line


def test_trace_with_no_attention_exits_2(tmp_path, capsys):
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["trace_patterns"] = {"attention": ["^none$"], "attention_scopes": ["^none$"]}
    line = one_line_error(capsys, [str(write_workload(tmp_path, data)), "--trace", str(CPU_TRACE)])
    assert "no attention CPU ops" in line


@pytest.mark.parametrize("argv, message", [
    (["--kernel-speedup", "0"], "kernel speedup must be a finite number > 0"),
    (["--kernel-speedup", "2", "--records", "x.jsonl"], "--records and --kernel-speedup"),
    (["--trace", "missing-trace.json"], "cannot be read"),
    (["missing.yaml"], "cannot be read"),
    (["--measure", "--kernel-speedup", "2"], "--measure builds its own workload"),
])
def test_bad_arguments_exit_2(capsys, argv, message):
    assert message in one_line_error(capsys, argv)


def test_measure_without_cuda_is_a_clear_error(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --measure would run")
    assert "--measure needs a CUDA GPU" in one_line_error(capsys, ["--measure"])


def test_warnings_go_to_stderr_and_do_not_fail(tmp_path, capsys):
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["client"]["ttft_ms"] = 420.0
    assert main(["report", str(write_workload(tmp_path, data))]) == 0
    err = capsys.readouterr().err
    assert err.startswith("attnlab report: warning: segments sum to 380 ms but client.ttft_ms")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--kernel-speedup", "fast"])
    assert exit_info.value.code == 2


def test_demo_section(tmp_path, capsys):
    from attnlab.commands import report as report_command

    report_command.demo(tmp_path)
    out = capsys.readouterr().out
    assert "212.67 ms" in out and "302.67 ms" in out and "126.67 ms" in out
    written = json.loads((tmp_path / "report" / "report.json").read_text())
    assert written == json.loads(json.dumps(build_report(default_workload())))
    assert (tmp_path / "report" / "report.html").exists()
