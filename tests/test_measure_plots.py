"""Plots render from records (PNG + SVG), with measured ceilings preferred to datasheets."""

from __future__ import annotations

import pytest

from attnlab.measure import plots
from attnlab.measure import records as rec
from attnlab.shapes import AttentionShape

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "driver": "580",
       "git_commit": "abc", "timestamp": "2026-11-29T12:00:00+00:00", "command": "attnlab bench"}
BASE = AttentionShape(query_heads=32, kv_heads=32, causal=True)


def latency(provider: str, phase: str, n: int, ms: float) -> dict:
    shape = BASE.replace(seqlen_q=1, seqlen_k=n) if phase == "decode" else \
        BASE.replace(seqlen_q=n, seqlen_k=n)
    return rec.make_record(kernel="call", provider=provider, phase=phase, shape=shape,
                           metric="latency", unit="ms", p20=0.9 * ms, p50=ms, p80=1.2 * ms,
                           repeats=20, env=ENV, tflops=100.0 * n / 16384, tbps=0.5,
                           kernel_names=["k"])


def fixture_records() -> list[dict]:
    out = []
    for n in (1024, 4096, 16384):
        out += [latency("eager", "prefill", n, n / 1000), latency("sdpa_flash", "prefill", n,
                                                                   n / 8000),
                latency("sdpa_flash", "decode", n, 0.01 + n / 1e6)]
    out.append(rec.skipped_record(provider="flash_attn", phase="prefill",
                                  shape=BASE.replace(seqlen_q=1024, seqlen_k=1024),
                                  reason="flash_attn is not importable", env=ENV))
    out.append(rec.make_record(kernel="bf16 GEMM 8192^3", provider="ceiling", phase="prefill",
                               shape={}, metric="tflops", unit="TFLOP/s", p20=700.0, p50=701.5,
                               p80=702.0, repeats=10, env=ENV))
    return out


def test_plots_render_png_and_svg_per_sweep(tmp_path):
    written = plots.plot_records(fixture_records(), tmp_path)
    names = sorted(p.name for p in written)
    assert names == sorted([
        "prefill_b1_hq32_hkv32_d128_fp16_causal_latency.png",
        "prefill_b1_hq32_hkv32_d128_fp16_causal_latency.svg",
        "prefill_b1_hq32_hkv32_d128_fp16_causal_throughput.png",
        "prefill_b1_hq32_hkv32_d128_fp16_causal_throughput.svg",
        "decode_b1_hq32_hkv32_d128_fp16_causal_latency.png",
        "decode_b1_hq32_hkv32_d128_fp16_causal_latency.svg",
        "decode_b1_hq32_hkv32_d128_fp16_causal_throughput.png",
        "decode_b1_hq32_hkv32_d128_fp16_causal_throughput.svg"])
    for path in written:
        assert path.stat().st_size > 2000
    svg = (tmp_path / "prefill_b1_hq32_hkv32_d128_fp16_causal_throughput.svg").read_text()
    assert "701" in svg and "measured" in svg  # the measured ceiling is drawn and labelled
    assert (tmp_path / "decode_b1_hq32_hkv32_d128_fp16_causal_latency.png").read_bytes()[:4] \
        == b"\x89PNG"


def test_ceilings_prefer_measured_and_label_datasheet_fallback():
    records = fixture_records()
    roofs = plots.ceilings(records, "NVIDIA H200")
    assert roofs["tflops"] == (701.5, "measured: bf16 GEMM 8192^3")
    assert roofs["tbps"] == (4.8, "datasheet HBM")
    assert plots.ceilings(records, "Some Unknown GPU") == {}


def test_sweeps_group_by_phase_and_shape():
    groups = plots.sweeps(fixture_records())
    assert sorted(len(g) for g in groups.values()) == [3, 6]


def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no latency records"):
        plots.plot_records(fixture_records()[-2:], tmp_path)
