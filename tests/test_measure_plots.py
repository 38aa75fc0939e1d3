"""Plots render from records (PNG), one question each, with measured ceilings and one palette."""

from __future__ import annotations

import struct

import pytest

from attnlab.measure import plots
from attnlab.measure import records as rec
from attnlab.shapes import AttentionShape

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "driver": "580",
       "git_commit": "abc", "timestamp": "2026-11-29T12:00:00+00:00", "command": "attnlab bench"}
BASE = AttentionShape(query_heads=32, kv_heads=32, causal=True)


def latency(provider: str, phase: str, n: int, ms: float, batch: int = 1) -> dict:
    shape = BASE.replace(seqlen_q=1, seqlen_k=n) if phase == "decode" else \
        BASE.replace(seqlen_q=n, seqlen_k=n, batch=batch)
    return rec.make_record(kernel="call", provider=provider, phase=phase, shape=shape,
                           metric="latency", unit="ms", p20=0.9 * ms, p50=ms, p80=1.2 * ms,
                           repeats=20, env=ENV, tflops=100.0 * n / 16384, tbps=0.5 * n / 16384,
                           kernel_names=["k"])


def ceiling(metric: str, value: float, kernel: str) -> dict:
    return rec.make_record(kernel=kernel, provider="ceiling", phase="prefill", shape={},
                           metric=metric, unit="TFLOP/s" if metric == "tflops" else "TB/s",
                           p20=value, p50=value, p80=value, repeats=10, env=ENV)


def fixture_records() -> list[dict]:
    out = []
    for n in (1024, 4096, 16384):
        out += [latency("eager", "prefill", n, n / 1000),
                latency("attnlab", "prefill", n, n / 9000),
                latency("sdpa_flash", "prefill", n, n / 8000),
                latency("sdpa_flash", "decode", n, 0.01 + n / 1e6)]
    out.append(rec.skipped_record(provider="flash_attn", phase="prefill",
                                  shape=BASE.replace(seqlen_q=1024, seqlen_k=1024),
                                  reason="flash_attn is not importable", env=ENV))
    out.append(ceiling("tflops", 701.5, "bf16 GEMM 8192^3"))
    return out


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plots_render_one_png_per_question_at_readme_width(tmp_path):
    written = plots.plot_records(fixture_records(), tmp_path)
    assert sorted(p.name for p in written) == sorted([
        "prefill_b1_hq32_hkv32_d128_fp16_causal_latency.png",
        "prefill_b1_hq32_hkv32_d128_fp16_causal_throughput.png",
        "decode_b1_hq32_hkv32_d128_fp16_causal_latency.png",
        "decode_b1_hq32_hkv32_d128_fp16_causal_throughput.png"])
    for path in written:
        width, height = png_size(path)
        assert 800 <= width <= 1000 and height <= width  # one README column, not a strip


def test_tflops_grid_is_2x2_at_readme_width(tmp_path):
    records = fixture_records()
    for d in (64, 256):  # three more families, four in all
        for n in (1024, 4096):
            shape = BASE.replace(seqlen_q=n, seqlen_k=n, head_dim=d)
            records.append(rec.make_record(kernel="call", provider="attnlab", phase="prefill",
                                           shape=shape, metric="latency", unit="ms", p20=1,
                                           p50=1, p80=1, repeats=5, env=ENV, tflops=300.0))
    path = plots.plot_tflops_grid(records, tmp_path / "forward_tflops.png")
    width, height = png_size(path)
    assert 800 <= width <= 1200 and height >= 0.6 * width


def test_throughput_axes_hold_each_phase_against_its_own_ceiling():
    from matplotlib.figure import Figure

    records = fixture_records() + [ceiling("tbps", 4.27, "device copy 2 GiB")]
    roofs = plots.ceilings(records, "NVIDIA H200")
    for phase, unit, roof in (("prefill", "TFLOP/s", 701.5), ("decode", "TB/s", 4.27)):
        family = plots.workload_families(records, phase)[0]
        ax = Figure().add_subplot()
        plots._draw_throughput(ax, family, roofs, legend=True)
        assert ax.get_ylabel().startswith(unit)  # decode is never a TFLOP/s panel
        dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert [line.get_ydata()[0] for line in dashed] == [roof]
        assert ax.get_ylim()[1] > roof  # the roof is inside the panel
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1k", "4k", "16k"]
        legend = ax.get_legend()
        assert legend.get_bbox_to_anchor().x0 > ax.bbox.x1 - 1  # legend off the data


def test_latency_plot_emphasises_attnlab_and_draws_bands():
    from matplotlib.figure import Figure

    family = plots.workload_families(fixture_records(), "prefill")[0]
    colours = plots.provider_colours(plots.family_providers(family))
    assert plots._style("attnlab", colours)["linewidth"] > plots._style("eager", colours)["linewidth"]
    ax = Figure().add_subplot()
    for provider, points in plots._lines(family).items():
        ax.plot([plots.swept_length(r) for r in points], [r["p50"] for r in points],
                **plots._style(provider, colours))
    widths = {line.get_label(): line.get_linewidth() for line in ax.get_lines()}
    assert widths["attnlab"] == max(widths.values())


def test_single_length_workload_is_a_bar_chart(tmp_path):
    records = [latency(p, "prefill", 4096, ms) for p, ms in (("attnlab", 0.3), ("eager", 4.0))]
    family = plots.workload_families(records)[0]
    assert family["lengths"] == [4096]
    path = plots.plot_latency(family, tmp_path / "one.png")
    assert png_size(path)[0] >= 800


def test_ceilings_prefer_measured_and_label_datasheet_fallback():
    records = fixture_records()
    roofs = plots.ceilings(records, "NVIDIA H200")
    assert roofs["tflops"] == (701.5, "measured: bf16 GEMM 8192^3")
    assert roofs["tbps"] == (4.8, "datasheet HBM")
    assert plots.ceilings(records, "Some Unknown GPU") == {}


def test_families_merge_a_constant_token_sweep_and_split_clashing_batches():
    # B x N = 16k tokens: one family of three lengths, titled as such.
    sweep = [latency("attnlab", "prefill", n, 1.0, batch=16384 // n) for n in (1024, 4096, 16384)]
    families = plots.workload_families(sweep)
    assert len(families) == 1 and families[0]["lengths"] == [1024, 4096, 16384]
    assert "batch \u00d7 N = 16k tokens (B 16 \u2192 1)" in plots.family_title(families[0])
    assert plots.family_slug(families[0]) == "prefill_t16384_hq32_hkv32_d128_fp16_causal"
    # The same length at two batches cannot share a chart: one family per batch.
    clash = [latency("attnlab", "prefill", 1024, 1.0, batch=b) for b in (1, 2)]
    assert sorted(f["batches"][1024] for f in plots.workload_families(clash)) == [1, 2]


def test_palette_is_stable_and_distinct():
    everyone = list(plots.PROVIDER_ORDER) + ["new_provider_a", "new_provider_b"]
    colours = plots.provider_colours(everyone)
    assert len(set(colours.values())) == len(everyone)  # no two providers share a colour
    assert len(plots.PALETTE) >= len(plots.PROVIDER_ORDER) + 2
    # A provider's colour does not depend on who else is on the chart.
    assert plots.provider_colours(["sdpa_math"])["sdpa_math"] == colours["sdpa_math"]
    assert plots.provider_colours(["attnlab", "eager"])["attnlab"] == colours["attnlab"]


def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no latency records"):
        plots.plot_records(fixture_records()[-2:], tmp_path)
    with pytest.raises(ValueError, match="no prefill sweep"):
        plots.plot_tflops_grid(fixture_records()[-2:], tmp_path / "grid.png")


def test_a_phase_file_without_a_roof_takes_the_ceilings_beside_it(tmp_path):
    phase_file = tmp_path / "fwdbwd.jsonl"
    rec.upsert_records(phase_file, [latency("attnlab", "fwdbwd", n, n / 9000)
                                    for n in (1024, 4096)])
    rec.upsert_records(tmp_path / "measure.jsonl", [ceiling("tflops", 680.0, "bf16 GEMM")])
    records = plots.with_sibling_ceilings(rec.load_records(phase_file), phase_file)
    assert plots.ceilings(records, "NVIDIA H200")["tflops"] == (680.0, "measured: bf16 GEMM")
    # A file with a roof of its own keeps it; a folder passed as --out is left alone.
    own = rec.load_records(phase_file) + [ceiling("tflops", 701.5, "own")]
    assert plots.with_sibling_ceilings(own, phase_file) == own
    assert plots.with_sibling_ceilings([], tmp_path) == []
