"""`attnlab traffic | memory | amdahl | roofline | exercises`: tables, JSON, bad input."""

from __future__ import annotations

import json

import pytest

from attnlab.cli import main

MiB, GiB = 2**20, 2**30


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_traffic_defaults_reproduce_the_lesson(capsys):
    report = run_json(capsys, "traffic")
    totals = {row["variant"] + "/" + row["condition"]: row["total_bytes"] for row in report["rows"]}
    assert totals == {"naive-3k/unmasked": 132 * MiB, "naive-4k/unmasked": 196 * MiB,
                      "fa2-forward/unmasked": 66 * MiB, "naive-causal-half/causal": 68 * MiB,
                      "fa2-forward/causal": 35 * MiB}
    assert [round(r["ratio"], 2) for r in report["ratios"]] == [2.0, 2.97, 1.94]
    assert all(r["matched"] for r in report["ratios"])
    assert report["scope"] == "head"


def test_traffic_table_names_scope_and_values(capsys):
    assert main(["traffic"]) == 0
    out = capsys.readouterr().out
    assert "per head" in out and "132.00" in out and "66.00" in out and "35.00" in out
    assert "2.00x" in out and "1.94x" in out and "CROSS" not in out


def test_traffic_cross_condition_only_when_asked(capsys):
    report = run_json(capsys, "traffic", "--cross-condition")
    cross = [r for r in report["ratios"] if not r["matched"]]
    assert len(cross) == 1 and "CROSS-CONDITION" in cross[0]["label"]
    assert cross[0]["ratio"] == 132 / 35


def test_traffic_options(capsys):
    report = run_json(capsys, "traffic", "--preset", "qwen-gqa", "--causal", "--scope", "layer",
                      "--backward", "two-pass", "--write-lse")
    variants = [row["variant"] for row in report["rows"]]
    assert variants == ["naive-causal-half", "fa2-forward", "fa2-backward-two-pass"]
    assert report["score_dtype"] == "fp32" and report["gqa_kv_bytes"]["packed"] * 6 == \
        report["gqa_kv_bytes"]["unpacked"]
    decode = run_json(capsys, "traffic", "--seqlen-q", "1", "--seqlen-k", "32768", "--kv-heads",
                      "8", "--no-causal", "--scope", "layer", "--decode-splits", "8")
    assert decode["rows"][-1]["variant"] == "flash-decoding"
    model = run_json(capsys, "traffic", "--scope", "model", "--no-causal")
    assert model["rows"][0]["total_bytes"] == 32 * 32 * 132 * MiB


def test_memory_defaults(capsys):
    report = run_json(capsys, "memory")
    items = {(i["name"], i["scope"]): i["bytes"] for i in report["items"]}
    assert items[("S + P", "per head")] == 64 * MiB
    assert items[("S + P, transient peak", "per layer")] == 2 * GiB
    assert items[("S + P, training retention", "per model (32 attention layers)")] == 64 * GiB
    assert items[("m and l (running statistics)", "per head")] == 32 * 1024
    assert items[("LSE (exported)", "per head")] == 16 * 1024


def test_memory_qwen_post_values(capsys):
    for seqlen, expected in (("2048", 384 * MiB), ("8192", 6 * GiB)):
        report = run_json(capsys, "memory", "--preset", "qwen-gqa", "--seqlen", seqlen)
        s = next(i for i in report["items"] if i["name"] == "S (score matrix)")
        assert s["bytes"] == expected
    assert main(["memory", "--preset", "qwen-gqa", "--seqlen", "2048"]) == 0
    assert "384.00 MiB" in capsys.readouterr().out


def test_amdahl_defaults(capsys):
    report = run_json(capsys, "amdahl")
    assert [f"{r['speedup']:.3f}" for r in report["sensitivity"]] == ["1.120", "1.400", "1.867"]
    assert f"{report['flop_share_trap']['flop_share_speedup']:.3f}" == "1.023"
    assert f"{report['flop_share_trap']['computed_flop_share']['flop_share']:.4f}" == "0.0325"
    client = report["chain"]["boundaries"][-1]
    assert client["name"] == "client TTFT" and f"{client['time_after']:.2f}" == "302.67"
    assert main(["amdahl"]) == 0
    out = capsys.readouterr().out
    assert "1.120x" in out and "1.023x" in out and "302.67" in out


def test_amdahl_options(capsys):
    report = run_json(capsys, "amdahl", "--time-share", "0.22", "--speedup", "2.8",
                      "--attention-ms", "100", "--prefill-ms", "200", "--outside-ms", "0",
                      "--chain-speedup", "2", "--layers", "4")
    assert f"{report['sensitivity'][0]['speedup']:.3f}" == "1.165"
    assert report["chain"]["boundaries"][2]["time_after"] == 150.0


def test_roofline(capsys):
    report = run_json(capsys, "roofline")
    assert f"{report['gpu']['ridge_point']:.0f}" == "295"
    softmax = [k for k in report["kernels"] if k["kernel"].startswith("softmax")]
    assert softmax and all(k["flop_per_byte"] == 1.0 and k["bound"] == "memory" for k in softmax)
    measured = run_json(capsys, "roofline", "--gpu", "H200", "--measured-tflops", "701.5",
                        "--measured-tbps", "4.27")
    assert measured["gpu"]["dense_tflops"] == 701.5
    assert main(["roofline", "--gpu", "b200", "--causal"]) == 0
    assert "B200" in capsys.readouterr().out


def test_roofline_peaks_file(tmp_path, capsys):
    path = tmp_path / "peaks.jsonl"
    path.write_text('{"kind": "peak", "tflops": 700.0}\n{"kind": "peak", "tbps": 4.0}\n')
    report = run_json(capsys, "roofline", "--gpu", "H200", "--peaks-file", str(path))
    assert report["gpu"]["ridge_point"] == 175.0


def test_exercises_are_computed(capsys):
    report = run_json(capsys, "exercises")
    one, two, three, four = report["exercises"]
    assert one["naive"]["read_bytes"] == 67 * MiB and one["fused"]["total_bytes"] == 66 * MiB
    assert one["ratio"]["ratio"] == 2.0
    assert [round(x, 4) for x in two["output"]] == [4.6025, 5.6025] and two["matches"]
    assert round(two["steps"][1]["alpha"], 4) == 0.1353
    assert f"{three['time_share_speedup']:.3f}" == "1.165"
    assert f"{three['flop_share_speedup']:.3f}" == "1.021"
    assert four["loaded"] == list(range(1, 11)) and four["masked"] == [9, 10]
    assert four["rows"] == [513, 640] and four["future_keys_loaded_for_example_row"] == 127
    assert main(["exercises"]) == 0
    out = capsys.readouterr().out
    assert "132.00 MiB" in out and "4.6025" in out and "element mask: 9-10" in out


def test_demo_section_writes_json(tmp_path, capsys):
    from attnlab.commands import models

    models.demo(tmp_path)
    traffic = json.loads((tmp_path / "models-traffic.json").read_text())
    memory = json.loads((tmp_path / "models-memory.json").read_text())
    amdahl = json.loads((tmp_path / "models-amdahl.json").read_text())
    assert traffic["rows"][0]["total_bytes"] == 132 * MiB
    assert any(i["bytes"] == 2 * GiB for i in memory["items"])
    assert len(amdahl["sensitivity"]) == 3
    assert "2.00x" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["traffic", "--seqlen", "0"], "--seqlen must be an int >= 1"),
    (["traffic", "--seqlen", "many"], "--seqlen must be an int >= 1"),
    (["traffic", "--kv-heads", "5"], "--kv-heads must divide --heads"),
    (["traffic", "--heads", "0"], "--heads must be an int >= 1"),
    (["traffic", "--dtype", "fp8"], "dtype must be one of"),
    (["traffic", "--score-dtype", "int8"], "dtype must be one of"),
    (["traffic", "--preset", "gpt"], "preset must be one of"),
    (["traffic", "--block-m", "-4"], "--block-m must be an int >= 1"),
    (["traffic", "--window", "3"], "--window must be LEFT,RIGHT"),
    (["traffic", "--backward", "fast"], "--backward must be one of"),
    (["traffic", "--decode-splits", "0"], "--decode-splits must be an int >= 1"),
    # more splits than KV tiles is flash-attn's rule (trailing splits empty); past the
    # model's bound it is refused
    (["traffic", "--seqlen-q", "1", "--seqlen-k", "128", "--decode-splits", "5000", "--no-causal"],
     "num_splits must be an int in [1, 4096]"),
    (["traffic", "--layers", "4"], "--layers applies only to --scope model"),
    (["traffic", "--cross-condition", "--causal"], "--cross-condition needs both conditions"),
    (["traffic", "--scope", "head", "--preset", "qwen-gqa", "--pack-gqa"], "kv-group"),
    (["memory", "--heads-in-parallel", "99"], "heads_in_parallel must be an int in [1, 32]"),
    (["memory", "--layers", "0"], "--layers must be an int >= 1"),
    (["amdahl", "--time-share", "1.5"], "--time-share must be a number in [0, 1]"),
    (["amdahl", "--time-share", "-0.1"], "--time-share must be a number in [0, 1]"),
    (["amdahl", "--time-share", ""], "--time-share must be comma-separated"),
    (["amdahl", "--speedup", "0"], "--speedup must be a number > 0"),
    (["amdahl", "--speedup", "nan"], "--speedup must be a finite number"),
    (["amdahl", "--flop-share", "2"], "--flop-share must be a number in [0, 1]"),
    (["amdahl", "--prompt-tokens", "0"], "--prompt-tokens must be an int >= 1"),
    (["amdahl", "--attention-ms", "400"], "must not exceed prefill_time"),
    (["amdahl", "--chain-speedup", "-1"], "--chain-speedup must be a number > 0"),
    (["roofline", "--gpu", "V100"], "unknown GPU 'V100'; known: A100, B200, H100 SXM, H200"),
    (["roofline", "--measured-tbps", "0"], "--measured-tbps must be a number > 0"),
    (["roofline", "--peaks-file", "/nonexistent.jsonl"], "is not a file"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err


@pytest.mark.parametrize("argv", [["traffic", "--scope", "galaxy"], ["exercises", "--what"]])
def test_argparse_errors_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
