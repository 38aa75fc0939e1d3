"""The explainer page's embedded data equals what attnlab's models and reference say.

Every check recomputes the number from the owning module (attnlab.model,
attnlab.reference, attnlab.measure.records) or from first principles, so a page
number can only pass if it is the model's number.  The browser tests
(test_explain_browser.py) then check that the page shows exactly these values.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from attnlab.cli import main as cli_main
from attnlab.explain import build_page_data, render_page, write_page
from attnlab.explain.measured import measured_section
from attnlab.explain.page import embed_json
from attnlab.explain.units import (
    format_bytes,
    format_index_ranges,
    format_mib,
    format_number,
    format_ratio,
    format_tokens,
)
from attnlab.measure.records import validate_record
from attnlab.model import amdahl, flops, memory
from attnlab.reference import tile_plan
from attnlab.shapes import PRESETS, AttentionShape

MIB = 1024 ** 2
GIB = 1024 ** 3


@pytest.fixture(scope="module")
def data() -> dict:
    return build_page_data(None)


# ----------------------------------------------------------------- units
@pytest.mark.parametrize(("num_bytes", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (32 * 1024, "32 KiB"),
    (384 * MIB, "384 MiB"), (6 * GIB, "6 GiB"), (1536 * MIB, "1.50 GiB"), (1025, "1.00 KiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


def test_format_helpers():
    assert format_mib(138_412_032) == "132.00 MiB"
    assert format_ratio(132 / 35) == "3.77\u00d7"
    assert format_tokens(2048) == "2k" and format_tokens(131072) == "128k"
    assert format_tokens(1000) == "1,000"
    assert format_number(float("-inf")) == "\u2212\u221e"
    assert format_number(3.0) == "3" and format_number(0.1353352832) == "0.1353"
    assert format_index_ranges([0, 1, 2, 3, 4, 5, 6, 7]) == "1\u20138"
    assert format_index_ranges([8, 9]) == "9, 10"
    assert format_index_ranges([0, 2, 3, 4, 9]) == "1, 3\u20135, 10"
    assert format_index_ranges([]) == "none"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_format_bytes_rejects_non_byte_counts(bad):
    with pytest.raises(ValueError, match="num_bytes"):
        format_bytes(bad)


# ----------------------------------------------------------------- 1. memory slider
def test_memory_stops_cover_512_to_128k(data):
    seqlens = [stop["seqlen"] for stop in data["memory"]["stops"]]
    assert seqlens[0] == 512 and seqlens[-1] == 128 * 1024
    assert all(b == 2 * a for a, b in zip(seqlens, seqlens[1:], strict=False))
    assert {p["name"] for p in data["memory"]["presets"]} == {"qwen-gqa", "lesson-8b"}


def test_memory_values_are_the_memory_model_at_every_stop(data):
    for entry in data["memory"]["presets"]:
        model = PRESETS[entry["name"]]
        assert len(entry["values"]) == len(data["memory"]["stops"])
        for stop, values in zip(data["memory"]["stops"], entry["values"], strict=True):
            expected = memory.score_matrix_bytes(model.shape(stop["seqlen"]), model.score_dtype)
            assert values["s_bytes"] == expected
            assert values["s_text"] == format_bytes(expected)
            assert values["s_exact"] == f"{expected:,} bytes"
            assert values["sp_bytes"] == 2 * expected
            assert values["layers_bytes"] == expected * model.attention_layers
        tile = memory.score_tile_bytes(128, 64, model.score_dtype)
        assert entry["tile"]["bytes"] == tile and entry["tile"]["text"] == format_bytes(tile)


def test_memory_matches_the_post_for_the_gqa_preset(data):
    gqa = next(p for p in data["memory"]["presets"] if p["name"] == "qwen-gqa")
    by_seqlen = {v["seqlen"]: v for v in gqa["values"]}
    assert by_seqlen[2048]["s_text"] == "384 MiB"
    assert by_seqlen[8192]["s_text"] == "6 GiB"
    assert gqa["tile"]["text"] == "32 KiB"
    # One head's S at 2k, FP32: 2048^2 * 4 B = 16 MiB = 512 tiles of 32 KiB.
    assert by_seqlen[2048]["tile_ratio_text"] == "512\u00d7"
    assert data["memory"]["default_preset"] == "qwen-gqa"


# ----------------------------------------------------------------- 2a. online walk
def test_online_walk_steps_and_final_output(data):
    walk = data["online_walk"]
    assert walk["scores"] == [1, 3, 0, 2] and walk["values"] == [10, 20, 30, 40]
    steps = walk["steps"]
    assert len(steps) == 5  # the start plus one step per key
    assert steps[0]["m_text"] == "\u2212\u221e" and steps[0]["l_text"] == "0"
    # Recompute the walk by hand: running max, rescaled sum and mix.
    m, total, mix = -math.inf, 0.0, 0.0
    for step, score, value in zip(steps[1:], walk["scores"], walk["values"], strict=True):
        m_new = max(m, score)
        alpha = math.exp(m - m_new)
        total = alpha * total + math.exp(score - m_new)
        mix = alpha * mix + math.exp(score - m_new) * value
        assert step["m"] == m_new
        assert step["l"] == pytest.approx(total, rel=1e-12)
        assert step["a"] == pytest.approx(mix, rel=1e-12)
        assert step["o"] == pytest.approx(mix / total, rel=1e-12)
        m = m_new
    # Only key 2 (score 3 > 1) moves the max after the first key.
    assert [s["rescaled"] for s in steps[1:]] == [False, True, False, False]
    assert steps[2]["alpha_text"] == f"{math.exp(-2):.4f}"


def test_online_walk_equals_the_full_row_softmax(data):
    walk = data["online_walk"]
    weights = [math.exp(s) for s in walk["scores"]]
    expected = sum(w * v for w, v in zip(weights, walk["values"], strict=True)) / sum(weights)
    assert walk["output"] == pytest.approx(expected, rel=1e-12)
    assert walk["full_row_output"] == pytest.approx(expected, rel=1e-12)
    assert walk["output_text"] == walk["full_row_text"] == "24.19"
    assert walk["steps"][-1]["o_text"] == f"{expected:.4f}"
    assert walk["matches_full_row"] is True


# ----------------------------------------------------------------- 2b. causal block walk
def test_every_block_plan_is_the_reference_tile_plan(data):
    blocks = data["block_walk"]
    letters = {"F": "full", "M": "masked", "S": "skipped"}
    assert blocks["state_names"] == letters
    for key, plan in blocks["plans"].items():
        block_m, block_n, seqlen = (int(x) for x in key.split(","))
        reference = tile_plan(AttentionShape(seqlen_q=seqlen, seqlen_k=seqlen, causal=True,
                                             block_m=block_m, block_n=block_n))
        assert plan["query_tiles"] == len(reference.query_tiles)
        assert plan["kv_tiles"] == reference.kv_tiles
        for i, row in enumerate(plan["rows"]):
            assert [letters[c] for c in row["states"]] == list(
                reference.query_tile(i).tile_classes)
            assert row["loaded_kv_rows"] == reference.loaded_kv_rows(i)
    assert len(blocks["plans"]) == (len(blocks["block_m_options"]) * len(blocks["block_n_options"])
                                    * len(blocks["seqlen_options"]))


def test_exercise_4_is_tiles_1_to_8_full_9_10_masked_rest_skipped(data):
    blocks = data["block_walk"]
    exercise = blocks["exercise"]
    assert (exercise["block_m"], exercise["block_n"], exercise["seqlen"]) == (128, 64, 4096)
    assert exercise["query_tile_index"] == 4  # the lesson's i = 5, 1-based
    row = blocks["plans"]["128,64,4096"]["rows"][4]
    assert row["states"] == "F" * 8 + "MM" + "S" * 54
    assert row["loaded_kv_rows"] == 640
    assert "9, 10" in row["summary"] and "11\u201364" in row["summary"]
    assert "rows 513\u2013576 see none of it" in exercise["answer"]


def test_ragged_sequence_counts_real_key_rows(data):
    # N = 1000, B_c = 64: 16 KV tiles, the last holding 1000 - 960 = 40 real rows.
    plan = data["block_walk"]["plans"]["128,64,1000"]
    assert plan["kv_tiles"] == 16 and plan["query_tiles"] == 8
    assert plan["rows"][-1]["loaded_kv_rows"] == 1000


# ----------------------------------------------------------------- 3. bytes per kernel
def test_traffic_bars_are_the_lessons_table(data):
    totals = {bar["key"]: bar["total_text"] for bar in data["traffic"]["bars"]}
    assert totals == {"naive-3k": "132.00 MiB", "fa2-forward/unmasked": "66.00 MiB",
                      "naive-causal-half": "68.00 MiB", "fa2-forward/causal": "35.00 MiB"}
    naive = data["traffic"]["bars"][0]
    assert (naive["read_bytes"], naive["write_bytes"]) == (70_254_592, 68_157_440)
    assert max(b["reads_percent"] + b["writes_percent"] for b in data["traffic"]["bars"]) \
        == pytest.approx(100)


def test_matched_ratios_valid_and_cross_condition_invalid(data):
    ratios = data["traffic"]["ratios"]
    assert [(r["text"], r["valid"]) for r in ratios] == [
        ("2.00\u00d7", True), ("1.94\u00d7", True), ("3.77\u00d7", False)]
    assert "Cross-condition" in ratios[2]["why"]


# ----------------------------------------------------------------- 4. measured
def test_no_results_folder_means_no_invented_data(tmp_path):
    for section in (measured_section(None), measured_section(tmp_path / "missing"),
                    measured_section(tmp_path)):
        assert section["record_count"] == 0
        assert section["phases"] == []
        assert section["bytes"]["points"] == [] and section["bytes"]["table"] == []
        assert section["has_latency"] is False
        assert "no measured records" in section["empty_message"].lower() \
            or "no results folder" in section["empty_message"].lower()


def _record(provider, phase, seqlen, p50, *, metric="latency", unit="ms", causal=True,
            kernel="call", batch=1, **extra):
    seqlen_q = 1 if phase == "decode" else seqlen
    shape = AttentionShape(batch=batch, query_heads=24, kv_heads=4, seqlen_q=seqlen_q,
                           seqlen_k=seqlen, head_dim=256, dtype="bf16", causal=causal)
    record = {
        "kernel": kernel, "provider": provider, "phase": phase, "shape": shape.as_dict(),
        "metric": metric, "unit": unit, "p20": None if p50 is None else p50 * 0.98,
        "p50": p50, "p80": None if p50 is None else p50 * 1.03,
        "repeats": 50, "tflops": None, "tbps": None, "kernel_names": ["k"], "gpu": "NVIDIA H200",
        "torch": "2.11.0", "triton": "3.6.0", "driver": "580.1", "git_commit": "abc123def456",
        "timestamp": "2026-11-29T12:00:00+00:00", "command": "bench/x.py", **extra,
    }
    return validate_record(record)


def _write_records(folder, records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _skip(provider, phase, seqlen, reason):
    return _record(provider, phase, seqlen, None, metric="skipped", unit="reason", reason=reason)


def test_latency_charts_group_by_workload_and_provider(tmp_path):
    records = [_record(p, "prefill", n, t * n / 1024)
               for p, t in (("eager", 1.0), ("sdpa_flash", 0.1)) for n in (1024, 4096, 2048)]
    records += [_record("attnlab", "decode", n, 0.01 * n / 1024) for n in (4096, 32768)]
    records.append(_skip("flex", "prefill", 4096, "no kernel for d=256"))
    records.append(_record("sdpa_flash", "prefill", 4096, 2.5, unit="us"))
    _write_records(tmp_path / "results", records)
    section = measured_section(tmp_path / "results")
    assert section["record_count"] == len(records)
    phases = {block["phase"]: block for block in section["phases"]}
    assert list(phases) == ["prefill", "decode"]
    prefill = phases["prefill"]["charts"]
    assert len(prefill) == 1  # one workload family: same shape but the length
    chart = prefill[0]
    assert chart["kind"] == "line"
    assert [t["label"] for t in chart["x_ticks"]] == ["1k", "2k", "4k"]
    eager = next(s for s in chart["series"] if s["provider"] == "eager")
    assert [p["x"] for p in eager["points"]] == [1024, 2048, 4096]
    assert [p["y_ms"] for p in eager["points"]] == [1.0, 2.0, 4.0]
    assert [p["p20_ms"] for p in eager["points"]] == pytest.approx([0.98, 1.96, 3.92])
    assert "4 ms median of 50" in eager["points"][-1]["text"]
    # A record timed in microseconds is plotted in milliseconds; same provider and length as
    # an earlier record, so it replaces it (upsert order: later wins).
    flash = next(s for s in chart["series"] if s["provider"] == "sdpa_flash")
    assert flash["points"][-1]["y_ms"] == pytest.approx(0.0025)
    assert chart["not_measured"] == "Not measured: flex at 4k (no kernel for d=256)."
    decode = phases["decode"]["charts"]
    assert len(decode) == 1 and [p["x"] for p in decode[0]["series"][0]["points"]] == [4096, 32768]
    assert section["has_latency"] is True


def test_headline_is_computed_from_the_records(tmp_path):
    records = []
    for n, ours, eager, cudnn in ((1024, 0.1, 1.0, 0.08), (4096, 0.35, 4.6, 0.27),
                                  (16384, 4.0, 60.0, 3.6)):
        records += [_record("attnlab", "prefill", n, ours, tflops=400.0),
                    _record("eager", "prefill", n, eager), _record("sdpa_cudnn", "prefill", n, cudnn)]
    records.append(validate_record({**_record("attnlab", "prefill", 1024, 1.0), "kernel": "GEMM",
                                    "provider": "ceiling", "metric": "tflops", "unit": "TFLOP/s",
                                    "shape": {}, "p50": 680.0, "p20": 680.0, "p80": 680.0}))
    _write_records(tmp_path / "r", records)
    block = measured_section(tmp_path / "r")["phases"][0]
    assert block["headline"] == (
        f"At 4k tokens, attnlab takes 0.350 ms (400 TFLOP/s, {100 * 400 / 680:.0f}% of the "
        f"measured matrix roof): {4.6 / 0.35:.1f}\u00d7 faster than eager PyTorch (4.60 ms), "
        f"{0.35 / 0.27:.2f}\u00d7 slower than cuDNN (SDPA) (0.270 ms).")
    roof = block["charts"][0]["throughput"]["roof"]
    assert roof["value"] == 680.0 and block["charts"][0]["throughput"]["unit"] == "TFLOP/s"


def test_decode_headline_quotes_the_longest_cache_in_tbps(tmp_path):
    records = [_record("attnlab", "decode", n, ms, tbps=0.2) for n, ms in ((4096, 0.16), (65536, 1.0))]
    records += [_record("sdpa_flash", "decode", n, ms) for n, ms in ((4096, 0.06), (65536, 0.09))]
    _write_records(tmp_path / "r", records)
    block = measured_section(tmp_path / "r")["phases"][0]
    assert block["headline"].startswith("At a 64k KV cache, attnlab takes 1.00 ms (0.2 TB/s")
    assert f"{1.0 / 0.09:.1f}\u00d7 slower than FA2 (SDPA flash) (0.0900 ms)" in block["headline"]
    assert block["charts"][0]["throughput"]["unit"] == "TB/s"  # bandwidth, never TFLOP/s


def test_one_not_measured_line_grouped_by_reason(tmp_path):
    records = [_record("attnlab", "prefill", n, 1.0) for n in (1024, 4096)]
    for n in (1024, 4096):
        for provider in ("flash_attn", "flashinfer"):
            records.append(_skip(provider, "prefill", n, f"{provider} is not importable "
                                 f"(ModuleNotFoundError: No module named '{provider}')"))
    records.append(_skip("sdpa_efficient", "prefill", 4096, "failed: RuntimeError: no kernel"))
    _write_records(tmp_path / "r", records)
    chart = measured_section(tmp_path / "r")["phases"][0]["charts"][0]
    assert chart["not_measured"] == ("Not measured: flashinfer, flash_attn (not importable); "
                                     "sdpa_efficient at 4k (failed: RuntimeError: no kernel).")


def test_single_length_workloads_are_bars_and_constant_token_sweeps_one_curve(tmp_path):
    records = [_record(p, "prefill", 4096, ms) for p, ms in (("attnlab", 0.4), ("eager", 5.0))]
    records += [_record("attnlab", "prefill", n, 1.0, causal=False, batch=16384 // n)
                for n in (1024, 2048, 4096, 8192, 16384)]
    _write_records(tmp_path / "r", records)
    charts = measured_section(tmp_path / "r")["phases"][0]["charts"]
    assert [c["kind"] for c in charts] == ["line", "bars"]  # longest sweep first
    assert "batch \u00d7 N = 16k tokens" in charts[0]["title"]
    assert [p["batch"] for p in charts[0]["series"][0]["points"]] == [16, 8, 4, 2, 1]


def test_colours_are_one_palette_stable_across_workloads(tmp_path):
    providers = ["attnlab", "eager", "eager_typical", "sdpa", "sdpa_cudnn", "sdpa_flash",
                 "sdpa_efficient", "sdpa_math", "flex"]
    records = [_record(p, "prefill", n, 1.0 + k) for k, p in enumerate(providers)
               for n in (1024, 4096)]
    records += [_record(p, "decode", 4096, 1.0) for p in reversed(providers)]
    _write_records(tmp_path / "r", records)
    section = measured_section(tmp_path / "r")
    colours = {p["name"]: p["colour"] for p in section["providers"]}
    assert len(set(colours.values())) == len(providers)  # nine providers, nine colours
    for block in section["phases"]:
        for chart in block["charts"]:
            for series in chart["series"]:
                assert series["colour"] == colours[series["provider"]]
            visible = [s["provider"] for s in chart["series"] if s["visible"]]
            assert visible[0] == "attnlab" and len(visible) == section["default_visible"] == 4
    assert [p["ours"] for p in section["providers"]].count(True) == 1


def test_bytes_chart_sets_ncu_bytes_against_both_models(tmp_path):
    from attnlab.measure import compare, ncu

    shape = AttentionShape(query_heads=32, kv_heads=32, seqlen_q=4096, seqlen_k=4096)
    case = ncu.case_label("sdpa_cudnn", "prefill", shape)
    kernel = ncu.NcuKernel(0, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", case,
                           (132, 1, 1), (384, 1, 1),
                           {"dram__bytes_read.sum": (130_000_000.0, "byte"),
                            "dram__bytes_write.sum": (34_000_000.0, "byte")})
    outside = ncu.NcuKernel(1, "distribution_elementwise_grid_stride_kernel", None, None, None,
                            {"dram__bytes_read.sum": (10.0, "byte")})
    folder = tmp_path / "results"
    (folder / "ncu").mkdir(parents=True)
    ncu.write_long_csv([kernel, outside], folder / "ncu" / "ncu_kernels.csv")
    (folder / "notes.csv").write_text("a,b\n1,2\n")
    section = measured_section(folder)
    expected = compare.compare_case("sdpa_cudnn", shape, [kernel])
    bytes_data = section["bytes"]
    assert len(bytes_data["points"]) == 1 == len(bytes_data["table"])
    point = bytes_data["points"][0]
    assert point["measured_bytes"] == 164_000_000 == expected.measured_total
    assert point["cache_model_bytes"] == expected.predicted_total
    assert point["logical_bytes"] == expected.logical_bytes
    assert bytes_data["table"][0]["cells"][4] == format_bytes(164_000_000)
    within = abs(expected.relative_error) <= 0.15
    assert bytes_data["headline"].startswith(
        f"The cache-aware model is within 15% of the measured DRAM bytes in {int(within)} of 1")
    assert "1 kernel of ncu_kernels.csv ran outside" in bytes_data["caption"]
    assert "notes.csv is not an Nsight Compute CSV" in bytes_data["caption"]
    assert section["phases"] == []  # no JSONL records there


# ----------------------------------------------------------------- 5. profiler
def test_profiler_kernel_lists_and_ncu_rows_come_from_the_files(tmp_path):
    from attnlab.explain.profiler import profiler_section, short_kernel_name
    from attnlab.measure import ncu

    folder = tmp_path / "results"
    (folder / "ncu").mkdir(parents=True)
    shape = AttentionShape(query_heads=32, kv_heads=32, seqlen_q=4096, seqlen_k=4096)
    entries = [
        {"provider": "eager", "phase": "prefill", "shape": shape.as_dict(), "launches": 4,
         "total_us": 1000.0, "gemm_us": 200.0, "outside_gemm_share": 0.8, "kernels": [
             {"name": "gemm", "short_name": "nvjet_gemm", "calls": 2, "total_us": 200.0,
              "is_gemm": True},
             {"name": "softmax", "short_name": "softmax", "calls": 2, "total_us": 800.0,
              "is_gemm": False}]},
        {"provider": "attnlab", "phase": "prefill", "shape": shape.as_dict(), "launches": 1,
         "total_us": 90.0, "gemm_us": 0.0, "outside_gemm_share": 1.0, "kernels": [
             {"name": "_attn_fwd", "short_name": "_attn_fwd", "calls": 1, "total_us": 90.0,
              "is_gemm": False}]}]
    (folder / "kernels.json").write_text(json.dumps(entries))
    metrics = {"gpu__time_duration.sum": (540768.0, "ns"),
               "sm__throughput.avg.pct_of_peak_sustained_elapsed": (53.34, "%"),
               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": (39.61, "%"),
               "sm__warps_active.avg.pct_of_peak_sustained_active": (12.49, "%"),
               "device__attribute_multiprocessor_count": (132.0, ""),
               "smsp__average_warp_latency_per_inst_issued.ratio": (6.26, ""),
               ncu.stall_metric("barrier"): (1.79, ""), ncu.stall_metric("wait"): (1.62, "")}
    kernel = ncu.NcuKernel(0, "_attn_fwd", ncu.case_label("attnlab", "prefill", shape),
                           (1024, 1, 1), (256, 1, 1), metrics)
    ncu.write_long_csv([kernel], folder / "ncu" / "ncu_kernels.csv")
    section = profiler_section(folder)
    assert section["available"]
    default = section["kernel_lists"][section["kernel_list_default"]]
    assert default["provider"] == "eager"
    assert default["sentence"] == ("eager PyTorch launches 4 kernels (2 distinct) in 1.00 ms; "
                                   "80.0% of that time is outside its 2 matrix multiplies, "
                                   "which take 0.200 ms.")
    assert [c["launches"] for c in default["launch_counts"]] == [1, 4]  # attnlab first
    workload = section["workloads"][0]
    row = workload["rows"][0]
    assert (row["sol_compute_pct"], row["sol_memory_pct"], row["occupancy_pct"]) == \
        (53.34, 39.61, 12.49)
    assert row["grid_blocks"] == 1024 and row["blocks_per_sm"] == pytest.approx(1024 / 132)
    assert [s["reason"] for s in row["stall_segments"]][:2] == ["barrier", "wait"]
    assert "attnlab 1,024 blocks of 256 threads on 132 SMs (7.76 per SM)" in \
        workload["occupancy_sentence"]
    assert section["missing"] and section["missing"][0].startswith("Decode is not in")
    assert short_kernel_name("void at::native::<unnamed>::cunn_SoftMaxForwardReg<c10::Half, "
                             "float>(c10::Half*)") == "cunn_SoftMaxForwardReg"


def test_profiler_without_data_says_so(tmp_path):
    from attnlab.explain.profiler import profiler_section

    assert profiler_section(None)["available"] is False
    assert profiler_section(tmp_path)["available"] is False
    html = render_page(build_page_data(None))
    assert 'id="profiler-empty"' in html


# ----------------------------------------------------------------- 5. Amdahl
def test_amdahl_stops_and_defaults(data):
    section = data["amdahl"]
    shares = [s["value"] for s in section["time_share_stops"]]
    speedups = [s["value"] for s in section["kernel_speedup_stops"]]
    assert shares[0] == 0.0 and shares[-1] == 1.0 and len(shares) == 101
    assert speedups[0] == 1.0 and speedups[-1] == 10.0 and 3.5 in speedups
    defaults = section["defaults"]
    assert shares[defaults["time_share_index"]] == 0.15
    assert speedups[defaults["kernel_speedup_index"]] == 3.5
    # The lesson's headline: 15% at 3.5x is 1.120x at the layer.
    assert f"{amdahl.amdahl_speedup(0.15, 3.5):.3f}" == "1.120"


def test_flop_shares_are_the_flop_model(data):
    trap = data["amdahl"]["flop_share"]
    for prompt in trap["prompts"]:
        share = flops.attention_flop_share(trap["preset"], prompt["tokens"])
        assert prompt["share"] == share
        assert prompt["share_text"] == f"{share * 100:.2f}%"
    default = trap["prompts"][trap["default_index"]]
    assert default["tokens"] == 2048 and default["share_text"] == "3.25%"


@pytest.mark.parametrize(("layer_share", "time_share", "speedup"),
                         [(0.76, 0.15, 3.5), (0.5, 0.4, 3.0), (1.0, 0.65, 2.0), (0.3, 1.0, 10.0)])
def test_end_to_end_formula_is_the_boundary_chain(layer_share, time_share, speedup):
    """The page's end-to-end speedup, amdahl(layer share * time share, S), is what
    attnlab.model.amdahl.boundary_chain gives for a layer inside a fixed remainder."""
    chain = amdahl.boundary_chain(
        time_share, speedup,
        [amdahl.Boundary("layer", 1.0 - time_share),
         amdahl.Boundary("end to end", (1.0 - layer_share) / layer_share)])
    assert chain[-1].speedup == pytest.approx(
        amdahl.amdahl_speedup(layer_share * time_share, speedup), rel=1e-12)


# ----------------------------------------------------------------- the page itself
def test_page_embeds_exactly_the_data_and_loads_nothing(data):
    html = render_page(data)
    embedded = re.search(r'<script id="attnlab-data" type="application/json">(.*?)</script>',
                         html, re.S).group(1)
    assert json.loads(embedded) == json.loads(json.dumps(data))
    # Self-contained: no external script, style sheet, image, font or fetch.
    assert not re.search(r"<script[^>]+src=", html)
    assert not re.search(r"<(link|img|iframe|source)[^>]+(href|src)=\"(?!data:|#)", html)
    assert "@import" not in html and "url(" not in html
    assert "fetch(" not in html and "XMLHttpRequest" not in html
    assert "https://" not in html
    # The only http:// is the SVG namespace name, which is never requested.
    assert set(re.findall(r"http://[^\s\"']+", html)) == {"http://www.w3.org/2000/svg"}


def test_embedded_json_cannot_close_its_script_element():
    text = embed_json({"note": "</script><script>alert(1)</script>"})
    assert "</script" not in text and "<" not in text
    assert json.loads(text)["note"].startswith("</script>")


def test_page_shows_the_empty_measured_message(data):
    html = render_page(data)
    assert 'id="measured-empty"' in html
    assert data["measured"]["empty_message"] in html


def test_write_page_rejects_a_path_as_name(tmp_path, data):
    with pytest.raises(ValueError, match="name"):
        write_page(tmp_path, data, "sub/page.html")


# ----------------------------------------------------------------- the verb
def test_explain_verb_writes_the_page_and_prints_json(tmp_path, capsys):
    out = tmp_path / "page"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["explain", "--out", str(out), "--records", str(empty), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["page"] == str(out / "index.html")
    assert (out / "index.html").stat().st_size == summary["page_bytes"]
    sections = {row["section"]: row for row in summary["sections"]}
    assert sections["1 how"]["value"] == "384 MiB vs 32 KiB"
    assert sections["2 tile walk"]["value"] == "o = 24.19"
    assert "3.77\u00d7 (invalid)" in sections["3 bytes"]["value"]


def test_explain_verb_refuses_a_missing_results_folder_and_an_unusable_out(tmp_path, capsys):
    assert cli_main(["explain", "--out", str(tmp_path / "p"), "--records",
                     str(tmp_path / "nonexistent")]) == 2
    err = capsys.readouterr().err
    assert "--records" in err and "does not exist" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p" / "index.html").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker, blocker / "below"):
        assert cli_main(["explain", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and len(err.strip().splitlines()) == 1


def test_explain_verb_table_on_the_committed_results(tmp_path, capsys):
    assert cli_main(["explain", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "o = 24.19" in out and "records" in out


def test_section_list_has_separators(data):
    html = render_page(data)
    nav = re.search(r"<nav.*?</nav>", html, re.S).group(0)
    numbers = re.findall(r'<span class="nav-number">(\d+)\.</span>', nav)
    assert numbers == ["1", "2", "3", "4", "5", "6"]


def test_the_fp8_table_sets_each_caches_modelled_bytes_beside_its_measured_time(tmp_path):
    # bench/fp8_h200.py's pair: the same decode on a bf16 cache and on its e4m3 copy.  The
    # page gives them a table (bytes from the byte model, both times), not decode series.
    records = [_record("attnlab_decode_bf16", "decode", n, 0.04 * n / 32768, batch=b)
               for n in (32768, 131072) for b in (1, 16)]
    records += [_record("attnlab_decode_fp8", "decode", n, 0.025 * n / 32768, batch=b)
                for n in (32768, 131072) for b in (1, 16)]
    records.append(_record("attnlab_decode_fp8", "decode", 8192, 0.01))  # no bf16 partner
    records.append(_record("attnlab", "decode", 4096, 0.01))
    _write_records(tmp_path / "results", records)
    section = measured_section(tmp_path / "results")
    fp8 = section["fp8"]
    assert [row["cells"][1] for row in fp8["rows"]] == ["1 × 32k", "1 × 128k", "16 × 32k",
                                                          "16 × 128k"]
    first = fp8["rows"][0]["cells"]
    shape = AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=1, seqlen_k=32768,
                           head_dim=256, dtype="bf16", causal=True)
    from attnlab.model.cache import decode_kv_bytes
    assert first[2] == format_bytes(decode_kv_bytes(shape))
    assert first[3] == format_bytes(decode_kv_bytes(shape, kv_dtype="fp8", kv_scales="kv-head"))
    assert first[7] == "1.60×" and "1.60×–1.60×" in fp8["headline"]
    # Neither provider of the pair is a series of the decode charts.
    series = {s["provider"] for block in section["phases"] for chart in block["charts"]
              for s in chart["series"]}
    assert series == {"attnlab"}
    assert not {p["name"] for p in section["providers"]} & {"attnlab_decode_bf16",
                                                            "attnlab_decode_fp8"}
    page = render_page(build_page_data(tmp_path / "results"))
    assert 'id="fp8-table"' in page and "16 × 128k" in page
    empty = measured_section(tmp_path / "missing")["fp8"]
    assert not empty["rows"] and empty["empty_message"]
