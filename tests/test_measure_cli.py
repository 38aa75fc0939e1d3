"""`attnlab bench | kernels | ncu` and the measure demo: bad input, no GPU, parsing, sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.commands import measure as command
from attnlab.measure import records as rec
from attnlab.measure.providers import parse_providers
from attnlab.measure.sweep import run_sweep
from attnlab.shapes import AttentionShape

DATA = Path(__file__).parent / "data"
NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("argv, message", [
    (["bench", "--providers", "fa9"], "unknown provider 'fa9'"),
    (["bench", "--seqlens", "1024,abc"], "--seqlens must be comma-separated ints"),
    (["bench", "--seqlens", "0"], "--seqlens must be comma-separated ints >= 1"),
    (["bench", "--phase", "train"], "--phases: unknown phase 'train'"),
    (["bench", "--flush", "sometimes"], "--flush must be one of"),
    (["bench", "--preset", "gpt-9"], "preset must be one of"),
    (["bench", "--dtype", "fp8"], "dtype must be one of"),
    (["bench", "--window", "1,2,3"], "--window must be LEFT,RIGHT"),
    (["kernels", "--provider", "nope"], "unknown provider"),
    (["kernels", "--provider", "eager", "--phase", "prefill,decode"], "one phase"),
    (["ncu", "--heads", "32,x"], "--heads must be comma-separated ints"),
    (["ncu", "--parse", "/no/such/file.csv"], "--parse needs an ncu CSV file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["kernels"])  # --provider is required
    assert exit_info.value.code == 2
    assert "--provider" in capsys.readouterr().err


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("argv", [["bench"], ["kernels", "--provider", "sdpa_flash"], ["ncu"]])
def test_without_cuda_the_verbs_say_what_they_need(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "need a CUDA GPU" in captured.err and "bench/results/" in captured.err
    assert captured.out == ""  # no numbers that were not measured


def test_replot_draws_from_records_without_a_gpu(tmp_path, capsys):
    from test_measure_plots import fixture_records

    rec.upsert_records(tmp_path / "bench.jsonl", fixture_records())
    assert main(["bench", "--replot", "--out", str(tmp_path), "--plots", str(tmp_path / "p"),
                 "--json"]) == 0
    plots = json.loads(capsys.readouterr().out)["plots"]
    # one PNG per question (latency, throughput) per phase: the plots module's contract
    assert len(plots) == 4 and all(Path(p).exists() and p.endswith(".png") for p in plots)
    assert main(["bench", "--replot", "--out", str(tmp_path / "none.jsonl")]) == 2
    assert "no records" in capsys.readouterr().err


def test_ncu_parse_prints_the_counter_table(capsys):
    assert main(["ncu", "--parse", str(DATA / "h200-ncu-n4096-d128-h32.csv")]) == 0
    out = capsys.readouterr().out
    assert "cudnn_generated_fort_native_sdpa_sm90" in out
    assert "100.86" in out  # cuDNN's DRAM read, MB
    assert "132 / -" in out  # grid vs SMs (the anchors did not record the SM count)


def test_ncu_parse_json(capsys):
    assert main(["ncu", "--parse", str(DATA / "h200-ncu-n4096-d128-h1.csv"), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert len(payload["kernels"]) == 21
    assert payload["comparisons"] == []  # the peers' labels carry no full shape


def test_ncu_parse_compares_our_own_captures(tmp_path, capsys):
    from attnlab.measure import ncu

    kernels = ncu.parse_csv(DATA / "h200-ncu-n4096-d128-h32.csv")
    shape = AttentionShape(query_heads=32, kv_heads=32, seqlen_q=4096, seqlen_k=4096)
    ours = ncu.case_label("sdpa_cudnn", "prefill", shape)
    for k in kernels:
        k.case = ours if k.case == "sdpa_cudnn|causal=False|H=32" else None
    ncu.write_long_csv(kernels, tmp_path / "ours.csv")
    assert main(["ncu", "--parse", str(tmp_path / "ours.csv"), "--json"]) == 0
    (comparison,) = json.loads(capsys.readouterr().out)["comparisons"]
    assert comparison["provider"] == "sdpa_cudnn" and comparison["meets_goal"]


def test_sweep_on_cpu_writes_records_and_reasons(tmp_path):
    out = tmp_path / "bench.jsonl"
    env = rec.environment("attnlab bench")
    base = AttentionShape(query_heads=4, kv_heads=2, head_dim=16, dtype="fp32", causal=True)
    results = run_sweep(parse_providers("eager,sdpa_math,sdpa_flash"), ["prefill", "decode"],
                        [32, 48], base, device="cpu", env=env,
                        timing={"target_ms": 2.0, "max_repeats": 5}, out=out, progress=False)
    stored = rec.load_records(out)
    assert len(results) == len(stored) == 12
    measured = [r for r in stored if r["metric"] == "latency"]
    assert {r["provider"] for r in measured} == {"eager", "sdpa_math"}
    for r in measured:
        assert r["p20"] <= r["p50"] <= r["p80"] and r["tflops"] > 0 and r["tbps"] > 0
        assert r["command"].startswith("attnlab bench --phase ")
        assert f"--providers {r['provider']}" in r["command"]
    skipped = [r for r in stored if r["metric"] == "skipped"]
    assert {r["reason"] for r in skipped} == {"sdpa_flash needs a CUDA GPU"}
    decode = [r for r in stored if r["phase"] == "decode"]
    assert {r["shape"]["seqlen_q"] for r in decode} == {1}
    assert {r["shape"]["seqlen_k"] for r in decode} == {32, 48}


def test_sweep_deadline_records_what_was_not_measured(tmp_path):
    env = rec.environment("attnlab bench")
    base = AttentionShape(query_heads=2, kv_heads=2, head_dim=16, dtype="fp32")
    results = run_sweep(parse_providers("eager"), ["prefill"], [16, 32], base, device="cpu",
                        env=env, deadline=0.0, progress=False)
    assert [r.record["reason"] for r in results] == \
        ["not measured: the run's time budget was spent before this point"] * 2


@pytest.mark.skipif(not NO_CUDA, reason="the CPU branch of the demo")
def test_demo_without_cuda_points_at_committed_records(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(command, "_committed_results", lambda: tmp_path / "results")
    command.demo(tmp_path)
    out = capsys.readouterr().out
    assert "measurements need a CUDA GPU" in out and "bench/results/" in out
    assert "no committed records found" in out
    results = tmp_path / "results"
    env = {**rec.environment("attnlab bench"), "gpu": "NVIDIA H200"}
    rec.upsert_records(results / "bench.jsonl", [rec.make_record(
        kernel="call", provider="sdpa_cudnn", phase="prefill",
        shape=AttentionShape(seqlen_q=4096, seqlen_k=4096), metric="latency", unit="ms",
        p20=0.4, p50=0.42, p80=0.45, repeats=10, env=env, tflops=600.0, tbps=0.05,
        kernel_names=["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"])])
    command.demo(tmp_path)
    out = capsys.readouterr().out
    assert "1 committed records" in out and "NVIDIA H200" in out and "sdpa_cudnn" in out


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU")
def test_tiny_bench_end_to_end_on_gpu(tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["bench", "--providers", "eager,sdpa,sdpa_flash", "--phase", "prefill,decode",
            "--seqlens", "256,512", "--heads", "4", "--kv-heads", "2", "--target-ms", "5",
            "--out", str(out), "--plots", str(tmp_path / "plots"), "--json"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    measured = [r for r in payload["records"] if r["metric"] == "latency"]
    assert measured and all(r["kernel_names"] for r in measured)
    flash = [r for r in measured if r["provider"] == "sdpa_flash"]
    assert all(any("flash" in n for n in r["kernel_names"]) for r in flash)
    assert len(payload["plots"]) == 8
    assert main(["kernels", "--provider", "eager", "--seqlen", "512", "--heads", "4",
                 "--json"]) == 0
    kernels = json.loads(capsys.readouterr().out)
    assert kernels["launches"] >= 4 and sum(k["is_gemm"] for k in kernels["kernels"]) == 2


@pytest.mark.parametrize("flop_count", ["exact", "conventional"])
@pytest.mark.parametrize("phase", ["prefill", "decode", "fwdbwd"])
def test_a_points_command_reproduces_its_shape_and_flop_convention(phase, flop_count):
    # The record's `command` must ask the CLI for the same point: shape, phase and the
    # TFLOP/s convention (the README's tables count 4BHN^2d, halved when causal).
    import shlex

    from attnlab.cli import build_parser
    from attnlab.measure.sweep import phase_shape, point_command, sweep_length
    from attnlab.shapes import AttentionShape

    base = AttentionShape(batch=4, query_heads=24, kv_heads=4, head_dim=256, dtype="bf16",
                          causal=True)
    shape = phase_shape(base, phase, 4096)
    provider = parse_providers("attnlab")[0]
    argv = shlex.split(point_command(provider, phase, shape, {}, flop_count))
    assert argv[:2] == ["attnlab", "bench"]
    args = build_parser().parse_args(argv[1:])
    assert args.flop_count == flop_count and args.phases == phase  # --phase: its old spelling
    heads = int(args.heads)
    rebuilt = phase_shape(command._base_shape(args, heads=heads), phase,
                          int(args.seqlens))
    assert rebuilt.describe() == shape.describe()
    assert int(args.seqlens) == sweep_length(shape, phase)
