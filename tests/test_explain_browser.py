"""The explainer page in a real browser: Debian's headless Chromium, driven by Playwright.

What a reader sees must be what Python computed: the slider shows the memory model's
strings, the walk ends at the reference's output, the causal grid is the reference
tile plan, and the page's one formula (Amdahl) equals attnlab.model.amdahl at every
slider stop.  The page must load nothing but itself and log no console error.

Screenshots of every section go to tests/artifacts/ (git-ignored); with
ATTNLAB_UPDATE_DOCS_IMG=1 they are also copied to docs/img/ for the README.
Needs /usr/bin/chromium (``apt-get install -y chromium``) and the ``playwright`` pip
package; never ``playwright install`` (no browser download).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from attnlab.explain import build_page_data, write_page
from attnlab.explain.units import format_bytes
from attnlab.measure import ncu, plots
from attnlab.measure.records import committed_results, load_records
from attnlab.model import amdahl, memory
from attnlab.shapes import PRESETS, AttentionShape

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
REPOSITORY = Path(__file__).resolve().parents[1]
# The full runs the shipped cut was made from (the page reads the cut).
REPO_RESULTS = REPOSITORY / "bench" / "results"
ARTIFACTS = REPOSITORY / "tests" / "artifacts"
DOCS_IMG = REPOSITORY / "docs" / "img"
SECTIONS = ("how", "tile-walk", "bytes", "how-much", "profiler", "amdahl")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="Debian's chromium is not at /usr/bin/chromium "
                              "(apt-get install -y chromium)"),
]


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def browser():
    # Imported here so that a machine without Chromium skips before needing Playwright;
    # with Chromium present, a missing playwright package is an error, not a skip.
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page_data() -> dict:
    # The committed records, exactly as `attnlab explain` reads them by default.
    return build_page_data(committed_results())


@pytest.fixture(scope="module")
def page_url(tmp_path_factory, page_data) -> str:
    return write_page(tmp_path_factory.mktemp("explain"), page_data).as_uri()


class OpenPage:
    """A browser tab on one page, recording console messages, page errors and requests."""

    def __init__(self, browser, url: str):
        self.url = url
        self.context = browser.new_context(viewport={"width": 1100, "height": 900})
        self.page = self.context.new_page()
        self.console: list[tuple[str, str]] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.console.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.console.append(("pageerror", str(e))))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(url)

    def text(self, selector: str) -> str:
        return self.page.locator(selector).inner_text()

    def problems(self) -> list[tuple[str, str]]:
        return [m for m in self.console if m[0] in ("error", "warning", "pageerror")]


@pytest.fixture()
def tab(browser, page_url):
    opened = OpenPage(browser, page_url)
    yield opened
    assert opened.problems() == [], "the page logged errors"
    assert set(opened.requests) == {page_url}, "the page requested something besides itself"
    opened.context.close()


def _slider_to(tab: OpenPage, selector: str, index: int) -> None:
    """Move a range slider with the keyboard, as a reader would."""
    slider = tab.page.locator(selector)
    slider.focus()
    slider.press("Home")
    for _ in range(index):
        slider.press("ArrowRight")
    assert slider.input_value() == str(index)


def _slider_set(tab: OpenPage, selector: str, index: int) -> None:
    """Set a range slider directly (fires the same input event as dragging)."""
    slider = tab.page.locator(selector)
    slider.fill(str(index))
    assert slider.input_value() == str(index)


# ----------------------------------------------------------------- loading
def test_page_loads_with_no_errors_and_no_requests(browser, page_url):
    opened = OpenPage(browser, page_url)
    opened.page.wait_for_load_state("networkidle")
    assert opened.problems() == []
    assert opened.requests == [page_url]
    assert opened.page.title().startswith("Where FlashAttention")
    opened.context.close()


# ----------------------------------------------------------------- 1. memory slider
@pytest.mark.parametrize(("seqlen", "expected"), [(2048, "384 MiB"), (8192, "6 GiB")])
def test_memory_slider_shows_the_memory_model(tab, seqlen, expected):
    gqa = PRESETS["qwen-gqa"]
    model_text = format_bytes(memory.score_matrix_bytes(gqa.shape(seqlen), gqa.score_dtype))
    assert model_text == expected  # the post's numbers, from the Python model
    tab.page.select_option("#memory-preset", "qwen-gqa")
    stops = [512 * 2 ** k for k in range(9)]
    _slider_to(tab, "#memory-seqlen", stops.index(seqlen))
    assert tab.text("#memory-s-text") == model_text
    assert tab.text("#memory-seqlen-label") == f"{seqlen // 1024}k"
    assert tab.text("#memory-tile-text") == "32 KiB"


def test_memory_slider_every_stop_every_preset(tab, page_data):
    for preset in page_data["memory"]["presets"]:
        tab.page.select_option("#memory-preset", preset["name"])
        model = PRESETS[preset["name"]]
        _slider_to(tab, "#memory-seqlen", 0)
        for index, stop in enumerate(page_data["memory"]["stops"]):
            if index:
                tab.page.locator("#memory-seqlen").press("ArrowRight")
            layer = memory.score_matrix_bytes(model.shape(stop["seqlen"]), model.score_dtype)
            assert tab.text("#memory-s-text") == format_bytes(layer)
            assert tab.text("#memory-sp-text") == format_bytes(2 * layer)
            assert tab.text("#memory-layers-text") == format_bytes(layer * model.attention_layers)
            assert tab.text("#memory-tile-text") == format_bytes(
                memory.score_tile_bytes(128, 64, model.score_dtype))


# ----------------------------------------------------------------- 2a. online walk
def _full_row_output(scores, values) -> float:
    weights = [math.exp(s) for s in scores]
    return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)


def test_walk_reaches_the_full_row_softmax_and_resets(tab):
    expected = _full_row_output([1, 3, 0, 2], [10, 20, 30, 40])
    start = {cell: tab.text(f"#walk-{cell}") for cell in ("m", "l", "a", "o")}
    assert start == {"m": "\u2212\u221e", "l": "0", "a": "0", "o": "\u2014"}
    assert tab.page.locator("#walk-result").is_hidden()
    for _ in range(4):
        tab.page.click('#walk [data-action="forward"]')
    assert tab.text("#walk-o") == f"{expected:.4f}"
    assert float(tab.text("#walk-o")) == pytest.approx(24.19, abs=0.005)
    assert tab.page.locator("#walk-result").is_visible()
    assert "24.19" in tab.text("#walk-result")
    assert tab.page.locator('#walk [data-action="forward"]').is_disabled()
    assert tab.page.locator('#walk-keys [data-state="folded"]').count() == 3
    tab.page.click('#walk [data-action="reset"]')
    assert {cell: tab.text(f"#walk-{cell}") for cell in ("m", "l", "a", "o")} == start
    assert tab.page.locator("#walk-result").is_hidden()
    assert tab.page.locator('#walk-keys [data-state="waiting"]').count() == 4


def test_walk_is_keyboard_operable(tab):
    walk = tab.page.locator("#walk")
    walk.focus()
    for _ in range(2):
        walk.press("ArrowRight")
    # Key 2 raised the max from 1 to 3: rescale by e^-2.
    assert tab.text("#walk-m") == "3"
    assert tab.text("#walk-alpha") == f"{math.exp(-2):.4f}"
    walk.press("ArrowLeft")
    assert tab.text("#walk-m") == "1"
    walk.press("End")
    assert tab.text("#walk-o") == f"{_full_row_output([1, 3, 0, 2], [10, 20, 30, 40]):.4f}"
    walk.press("Home")
    assert tab.text("#walk-m") == "\u2212\u221e"


def test_walk_play_runs_to_the_end(tab):
    tab.page.click('#walk [data-action="play"]')
    assert tab.text('#walk [data-action="play"]') == "Pause"
    tab.page.wait_for_selector("#walk-result", state="visible", timeout=10_000)
    assert tab.text('#walk [data-action="play"]') == "Play"
    assert "24.19" in tab.text("#walk-result")


# ----------------------------------------------------------------- 2b. causal grid
def test_exercise_4_marks_tiles_9_and_10_masked(tab):
    tab.page.click("#exercise-4")
    assert tab.text("#block-step-label") == "query tile 5 of 32"
    states = tab.page.eval_on_selector_all(
        '#block-grid rect[data-q="5"]', "cells => cells.map(c => c.dataset.state)")
    assert len(states) == 64
    assert states[8:10] == ["masked", "masked"]  # tiles 9 and 10, 1-based
    assert states[:8] == ["full"] * 8 and states[10:] == ["skipped"] * 54
    assert tab.page.locator('#block-grid g.current[data-q="5"]').count() == 1
    assert "9, 10" in tab.text("#block-row-summary")
    assert tab.page.locator("#exercise-answer").is_visible()


def test_block_walk_steps_with_the_keyboard_and_new_tile_sizes(tab):
    tab.page.select_option("#block-m", "64")
    tab.page.select_option("#block-n", "128")
    tab.page.select_option("#block-seqlen", "1000")
    grid = tab.page.locator("#block-walk")
    grid.focus()
    grid.press("End")
    # N = 1000, B_r = 64: 16 query tiles; B_c = 128: 8 KV tiles, the last one ragged.
    assert tab.text("#block-step-label") == "query tile 16 of 16"
    assert "1,000 key rows" in tab.text("#block-row-counts")
    assert tab.page.locator("#block-grid rect.tile").count() == 16 * 8
    grid.press("Home")
    assert tab.text("#block-step-label") == "query tile 1 of 16"


# ----------------------------------------------------------------- 3. bytes
def test_bytes_section_labels_the_cross_condition_ratio_invalid(tab):
    ratios = tab.page.locator("#bytes .ratio")
    assert ratios.count() == 3
    assert ratios.nth(0).locator(".ratio-value").inner_text() == "2.00\u00d7"
    assert ratios.nth(1).locator(".ratio-value").inner_text() == "1.94\u00d7"
    invalid = tab.page.locator('#bytes .ratio[data-valid="false"]')
    assert invalid.count() == 1
    assert invalid.locator(".ratio-value").inner_text() == "3.77\u00d7"
    assert invalid.locator(".invalid-badge").is_visible()
    assert invalid.locator(".invalid-badge").inner_text().lower() == "invalid"
    bars = tab.page.locator("#bytes .bar-row .bar-value")
    assert [bars.nth(k).inner_text().split(" (")[0] for k in range(4)] == [
        "132.00 MiB", "66.00 MiB", "68.00 MiB", "35.00 MiB"]


# ----------------------------------------------------------------- 5. Amdahl
def test_amdahl_formula_in_js_equals_python_at_every_stop(tab, page_data):
    section = page_data["amdahl"]
    shares = [s["value"] for s in section["time_share_stops"]]
    speedups = [s["value"] for s in section["kernel_speedup_stops"]]
    layers = [s["value"] for s in section["layer_share_stops"]]
    flop_shares = [p["share"] for p in section["flop_share"]["prompts"]]
    # One string per formula: fast to carry back, and repr-exact for doubles.
    computed = tab.page.evaluate("""() => {
        const page = window.attnlabExplain, d = page.data.amdahl;
        const shares = d.time_share_stops.map(s => s.value);
        const speedups = d.kernel_speedup_stops.map(s => s.value);
        const layers = d.layer_share_stops.map(s => s.value);
        const flops = d.flop_share.prompts.map(p => p.share);
        const layer = [], reduction = [], whole = [], trap = [];
        for (const f of shares) for (const s of speedups) {
            const x = page.amdahlSpeedup(f, s);
            layer.push(x); reduction.push(page.latencyReductionPercent(x));
        }
        for (const g of layers) for (const f of shares) for (const s of speedups)
            whole.push(page.endToEndSpeedup(g, f, s));
        for (const f of flops) for (const s of speedups) trap.push(page.amdahlSpeedup(f, s));
        return [layer, reduction, whole, trap].map(a => a.join(","));
    }""")
    layer, reduction, whole, trap = (np.array([float(x) for x in text.split(",")])
                                     for text in computed)
    python_layer = np.array([amdahl.amdahl_speedup(f, s) for f in shares for s in speedups])
    python_reduction = 100 * np.array([amdahl.latency_reduction(f, s)
                                       for f in shares for s in speedups])
    python_whole = np.array([amdahl.amdahl_speedup(g * f, s)
                             for g in layers for f in shares for s in speedups])
    python_trap = np.array([amdahl.amdahl_speedup(f, s) for f in flop_shares for s in speedups])
    assert layer.shape == (101 * 91,) and whole.shape == (101 * 101 * 91,)
    # Same expression, same operation order: equal to the last bits, allow 1e-12 anyway.
    for js, python in ((layer, python_layer), (whole, python_whole), (trap, python_trap)):
        assert js.shape == python.shape
        np.testing.assert_allclose(js, python, rtol=1e-12, atol=0)
    # 1 - 1/speedup and f (1 - 1/S) are the same number by different roundings.
    np.testing.assert_allclose(reduction, python_reduction, rtol=1e-9, atol=1e-9)


def test_amdahl_sliders_show_python_values(tab, page_data):
    section = page_data["amdahl"]
    # The lesson's defaults: 15% at 3.5x is 1.120x at the layer, 10.71% less time.
    assert tab.text("#amdahl-layer-speedup") == f"{amdahl.amdahl_speedup(0.15, 3.5):.3f}\u00d7"
    assert tab.text("#amdahl-layer-reduction") == f"{100 * amdahl.latency_reduction(0.15, 3.5):.2f}%"
    # The exit task: 40% attention, 3.0x kernel -> 1.364x at the layer.
    _slider_set(tab, "#amdahl-time-share", 40)
    _slider_set(tab, "#amdahl-kernel-speedup", 20)  # stops start at 1.0x in steps of 0.1x
    assert tab.text("#amdahl-kernel-speedup-label") == "3.0\u00d7"
    assert tab.text("#amdahl-layer-speedup") == f"{amdahl.amdahl_speedup(0.40, 3.0):.3f}\u00d7"
    _slider_set(tab, "#amdahl-layer-share", 50)
    assert tab.text("#amdahl-e2e-speedup") == f"{amdahl.amdahl_speedup(0.5 * 0.4, 3.0):.3f}\u00d7"
    # The trap: the FLOP share at 2k pushed through the same formula.
    trap = section["flop_share"]
    prompt = trap["prompts"][trap["default_index"]]
    assert tab.text("#flop-share") == prompt["share_text"]
    assert tab.text("#flop-share-speedup") == f"{amdahl.amdahl_speedup(prompt['share'], 3.0):.3f}\u00d7"


# ----------------------------------------------------------------- 4. measured charts
def _committed() -> list[dict]:
    return load_records(committed_results())


def _family_records(chart: dict, phase: str) -> dict:
    """{(provider, length): record} of the committed family a chart was built from."""
    family = next(f for f in plots.workload_families(_committed(), phase)
                  if plots.family_title(f) == chart["title"])
    return {(r["provider"], plots.swept_length(r)): r for r in family["records"]}


def test_section_list_reads_with_separators(tab):
    nav = tab.text("nav")
    assert "matrix2" not in nav
    assert [line.split(" ", 1)[0] for line in nav.splitlines()] == [f"{k}." for k in range(1, 7)]


def test_headlines_are_the_records_numbers(tab, page_data):
    blocks = {b["phase"]: b for b in page_data["measured"]["phases"]}
    assert {"prefill", "decode"} <= set(blocks)
    for phase, block in blocks.items():
        assert tab.text(f"#headline-{phase}") == block["charts"][0]["headline"]
    # Recompute a prefill headline's numbers from the committed records themselves, on
    # the first workload measured against eager and cuDNN at 4k (selected in the page).
    charts = blocks["prefill"]["charts"]
    index, chart = next((i, c) for i, c in enumerate(charts)
                        if {("attnlab", 4096), ("eager", 4096), ("sdpa_cudnn", 4096)}
                        <= set(_family_records(c, "prefill")))
    tab.page.locator("#family-prefill").select_option(str(index))
    by_key = _family_records(chart, "prefill")
    ours, eager = by_key[("attnlab", 4096)], by_key[("eager", 4096)]
    cudnn = by_key[("sdpa_cudnn", 4096)]
    text = tab.text("#headline-prefill")
    assert text == chart["headline"]
    assert text.startswith(f"At 4k tokens, attnlab takes {ours['p50']:#.3g} ms "
                           f"({ours['tflops']:.3g} TFLOP/s")
    speedup = eager["p50"] / ours["p50"]  # the headline's rule: 2 decimals below 10x, 1 above
    assert f"{speedup:.{1 if speedup >= 10 else 2}f}\u00d7 faster than eager PyTorch" in text
    assert f"{ours['p50'] / cudnn['p50']:.2f}\u00d7 slower than cuDNN (SDPA)" in text
    decode = blocks["decode"]["charts"][0]
    longest = max(n for (p, n) in _family_records(decode, "decode")
                  if p in ("attnlab", "attnlab_decode"))
    assert tab.text("#headline-decode").startswith(
        (f"At a {longest // 1024}k KV cache, attnlab takes",
         f"At a {longest // 1024}k KV cache, attnlab decode takes"))


def test_one_not_measured_line_per_chart(tab, page_data):
    for block in page_data["measured"]["phases"]:
        line = tab.page.locator(f"#not-measured-{block['phase']}")
        text = line.inner_text()
        assert text == block["charts"][0]["not_measured"]
        if text:
            assert text.startswith("Not measured: ") and "\n" not in text
            assert "ModuleNotFoundError" not in text
            assert len(re.findall(r"\bflash_attn\b(?!_)", text)) <= 1  # each provider once


def test_four_providers_by_default_attnlab_emphasised_with_stable_colours(tab, page_data):
    colours = {p["name"]: p["colour"] for p in page_data["measured"]["providers"]}
    assert len(set(colours.values())) == len(colours)
    for block in page_data["measured"]["phases"]:
        phase = block["phase"]
        select = tab.page.locator(f"#family-{phase}")
        for index, chart in enumerate(block["charts"]):
            select.select_option(str(index))
            chart_box = f"#chart-{phase}"
            drawn = tab.page.eval_on_selector_all(
                f"{chart_box} circle.series-point",
                "dots => dots.map(d => [d.dataset.provider, d.getAttribute('fill')])")
            shown = {provider for provider, _ in drawn}
            defaults = [s["provider"] for s in chart["series"]][:4]
            if chart["kind"] == "line":
                assert shown == set(defaults)
                assert all(fill == colours[provider] for provider, fill in drawn)
                # attnlab's series of this chart: attnlab, or attnlab_decode in a decode chart
                mine = next(s for s in chart["series"] if s["provider"] in ("attnlab", "attnlab_decode"))
                ours = tab.page.locator(
                    f'{chart_box} circle.series-ours[data-provider="{mine["provider"]}"]')
                assert ours.count() == len(mine["points"])
                legend = tab.page.eval_on_selector_all(
                    f"{chart_box} .legend-entry", "g => g.map(e => e.dataset.provider)")
                assert legend == defaults
            toggles = tab.page.locator(f"#toggles-{phase} input[type=checkbox]")
            assert toggles.count() == len(chart["series"])


def test_points_show_the_records_values(tab, page_data):
    block = next(b for b in page_data["measured"]["phases"] if b["phase"] == "prefill")
    chart = block["charts"][0]
    by_key = _family_records(chart, "prefill")
    drawn = tab.page.eval_on_selector_all(
        "#chart-prefill circle.series-point",
        "dots => dots.map(d => [d.dataset.provider, Number(d.dataset.x), Number(d.dataset.value)])")
    assert drawn
    for provider, x, value in drawn:
        assert value == pytest.approx(by_key[(provider, x)]["p50"], rel=1e-12)
    point = tab.page.locator('#chart-prefill circle[data-provider="attnlab"][data-x="4096"]')
    point.hover()
    tooltip = tab.text("#tooltip-prefill")
    record = by_key[("attnlab", 4096)]
    assert f"{record['p50']:.4g} ms median of {record['repeats']}" in tooltip


def test_provider_toggles_all_and_default(tab, page_data):
    charts = next(b for b in page_data["measured"]["phases"] if b["phase"] == "prefill")["charts"]
    # A workload with more providers than the four shown by default (selected in the page).
    index, chart = next((i, c) for i, c in enumerate(charts)
                        if c["kind"] == "line" and len(c["series"]) > 4)
    tab.page.locator("#family-prefill").select_option(str(index))
    hidden = chart["series"][4]["provider"]
    lines = "#chart-prefill path.series-line"
    assert tab.page.locator(lines).count() == 4
    tab.page.locator(f'#toggles-prefill input[value="{hidden}"]').check()
    assert tab.page.locator(f'#chart-prefill path.series-line[data-provider="{hidden}"]').count() == 1
    tab.page.locator('#toggles-prefill input[value="attnlab"]').uncheck()
    assert tab.page.locator('#chart-prefill [data-provider="attnlab"]').count() == 0
    tab.page.click('#toggles-prefill [data-toggle="all"]')
    assert tab.page.locator(lines).count() == len(chart["series"])
    tab.page.click('#toggles-prefill [data-toggle="default"]')
    assert tab.page.locator(lines).count() == 4
    assert tab.page.locator('#chart-prefill circle.series-ours').count() > 0


def test_throughput_mode_holds_prefill_to_the_matrix_roof_and_decode_to_the_copy_ceiling(tab):
    committed = _committed()
    roofs = plots.ceilings(committed, "NVIDIA H200")
    for phase, field, metric in (("prefill", "tflops", "tflops"), ("decode", "tbps", "tbps")):
        tab.page.check(f'input[name="metric-{phase}"][value="throughput"]')
        svg = tab.page.locator(f"#chart-{phase} svg")
        assert svg.get_attribute("data-mode") == "throughput"
        roof = float(tab.page.locator(f"#chart-{phase} .roof-line").get_attribute("data-value"))
        assert roof == roofs[metric][0]
        unit = "TFLOP/s" if field == "tflops" else "TB/s"
        assert unit in tab.page.locator(f"#chart-{phase} .roof-label").text_content()
        assert tab.page.locator(f"#chart-{phase} text.axis-title").nth(1).text_content() \
            .startswith(unit)
        data = tab.page.evaluate("() => window.attnlabExplain.data.measured.phases")
        chart = next(b for b in data if b["phase"] == phase)["charts"][0]
        by_key = _family_records(chart, phase)
        drawn = tab.page.eval_on_selector_all(
            f"#chart-{phase} circle.series-point",
            "dots => dots.map(d => [d.dataset.provider, Number(d.dataset.x), Number(d.dataset.value)])")
        for provider, x, value in drawn:
            assert value == pytest.approx(by_key[(provider, x)][field], rel=1e-12)
        tab.page.check(f'input[name="metric-{phase}"][value="latency"]')
        assert svg.get_attribute("data-mode") == "latency"


def test_bytes_chart_matches_the_committed_ncu_comparisons(tab, page_data):
    points = page_data["measured"]["bytes"]["points"]
    # The measurement itself: every kernel Nsight Compute profiled in the case, summed,
    # over every committed ncu run (prefill's summary.json, decode/ncu_summary.json); a
    # kernel the cache model lacks (cuDNN's decode reduction) is named, not compared.
    kernels = [kernel for path in sorted((REPO_RESULTS / "ncu").rglob("*summary.json"))
               for kernel in json.loads(path.read_text())["kernels"]]
    assert {"prefill", "decode"} <= {ncu.parse_case_label(k["case"])[1] for k in kernels}
    measured: dict[tuple[str, str], int] = {}
    for kernel in kernels:
        provider, phase, shape = ncu.parse_case_label(kernel["case"])
        key = (provider, phase, shape.describe())
        measured[key] = measured.get(key, 0) + kernel["dram_bytes_read"] + kernel["dram_bytes_write"]
    # The backward's ncu run writes no summary: its per-kernel rows (one per profiled
    # kernel of an attnlab fwd+bwd call) carry the measured bytes instead.
    for path in sorted((REPO_RESULTS / "ncu").rglob("*_ncu_vs_model.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            key = ("attnlab", ncu.FWDBWD_PHASE, AttentionShape.from_dict(row["shape"]).describe())
            measured[key] = measured.get(key, 0) + row["measured_read"] + row["measured_write"]
    assert len(points) == len(measured)
    for point in points:
        whole_call = measured[(point["provider"], point["phase"], point["shape"])]
        assert point["measured_bytes"] + point["unmodelled_bytes"] == whole_call
        assert ("not compared" in point["text"]) == (point["unmodelled_bytes"] > 0)
    dots = tab.page.eval_on_selector_all(
        "#bytes-chart circle.bytes-cache", "c => c.map(d => Number(d.dataset.value))")
    assert dots == [p["cache_model_bytes"] for p in points]
    assert tab.page.locator("#bytes-chart rect.bytes-logical[data-case]").count() == \
        sum(p["logical_bytes"] is not None for p in points)
    assert tab.text("#bytes-headline") == page_data["measured"]["bytes"]["headline"]
    tab.page.click(".bytes-details summary")
    assert tab.page.locator(".bytes-details .bytes-table tbody tr").count() == len(points)


def test_fp8_table_shows_every_committed_fp8_shape(tab, page_data):
    fp8 = page_data["measured"]["fp8"]
    assert fp8["rows"], "the committed records hold the fp8 decode pair"
    cells = tab.page.eval_on_selector_all(
        "#fp8-table tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    assert cells == [row["cells"] for row in fp8["rows"]]
    assert tab.text("#fp8-headline") == fp8["headline"]


# ----------------------------------------------------------------- 5. profiler
def test_kernel_lists_match_kernels_json(tab, page_data):
    entries = json.loads((committed_results() / "kernels.json").read_text())
    eager = max((e for e in entries if e["provider"].startswith("eager")
                 and e["phase"] == "prefill"), key=lambda e: e["launches"])
    sentence = tab.text("#kernel-list-sentence")
    assert sentence.startswith(f"{plots.provider_label(eager['provider'])} launches "
                               f"{eager['launches']} kernels")
    assert f"{100 * eager['outside_gemm_share']:.1f}% of that time is outside" in sentence
    bars = tab.page.eval_on_selector_all(
        "#kernel-list-chart rect.bar-rect", "r => r.map(b => Number(b.dataset.value))")
    assert sorted(bars) == sorted(k["total_us"] for k in eager["kernels"])
    counts = tab.page.eval_on_selector_all(
        "#launch-count-chart rect.bar-rect", "r => r.map(b => Number(b.dataset.value))")
    same = [e["launches"] for e in entries
            if e["phase"] == eager["phase"] and e["shape"] == eager["shape"]]
    assert sorted(counts) == sorted(same)
    # Decode: the split kernels of FA2 next to attnlab's one launch.
    titles = [e["title"] for e in page_data["profiler"]["kernel_lists"]]
    split = next(i for i, e in enumerate(entries)
                 if e["provider"] == "sdpa_flash" and e["phase"] == "decode")
    tab.page.select_option("#kernel-list", str(split))
    assert "flash_fwd_splitkv" in tab.text("#kernel-list-sentence")
    assert titles[split] in tab.page.locator("#kernel-list option:checked").inner_text()


def test_ncu_charts_match_the_committed_nsight_compute_rows(tab, page_data):
    profiler = page_data["profiler"]
    workload = profiler["workloads"][profiler["workload_default"]]
    assert workload["phase"] == "prefill"  # the post's own profile comes first
    summary = json.loads((REPO_RESULTS / "ncu" / "summary.json").read_text())
    attnlab_row = next(r for r in workload["rows"] if r["provider"] == "attnlab")
    shape_key = workload["key"].split("|", 1)[1]
    kernel = next(k for k in summary["kernels"] if k["case"].startswith("attnlab|prefill")
                  and ncu.parse_case_label(k["case"])[2].describe() == shape_key)
    sol = tab.page.eval_on_selector_all(
        '#sol-chart g[data-provider="attnlab"] rect.bar-rect',
        "r => r.map(b => [b.dataset.key, Number(b.dataset.value)])")
    assert sol == [["compute", kernel["sol_compute_pct"]], ["memory", kernel["sol_memory_pct"]]]
    occupancy = tab.page.eval_on_selector_all(
        '#occupancy-chart g[data-provider="attnlab"] rect.bar-rect',
        "r => r.map(b => Number(b.dataset.value))")
    assert occupancy == [kernel["achieved_occupancy_pct"]]
    blocks = tab.page.eval_on_selector_all(
        '#blocks-chart g[data-provider="attnlab"] rect.bar-rect',
        "r => r.map(b => Number(b.dataset.value))")
    assert blocks == [pytest.approx(min(kernel["grid_size"] / kernel["sms"], 16))]
    stalls = tab.page.eval_on_selector_all(
        '#stall-chart g[data-provider="attnlab"] rect.bar-rect',
        "r => r.map(b => Number(b.dataset.value))")
    assert sum(stalls) == pytest.approx(sum(kernel["warp_stalls"].values()))
    assert f"{kernel['grid_size']:,} blocks" in tab.text("#occupancy-sentence")
    assert attnlab_row["grid_blocks"] == kernel["grid_size"]
    # Another workload redraws every chart.
    other = next(i for i, w in enumerate(profiler["workloads"]) if len(w["rows"]) !=
                 len(workload["rows"]))
    tab.page.select_option("#ncu-workload", str(other))
    assert tab.page.locator("#sol-chart g.bar-row-svg").count() == \
        len(profiler["workloads"][other]["rows"])
    missing = tab.page.locator("#profiler .missing-phase")
    assert missing.count() == len(profiler["missing"]) == 0  # prefill and decode both profiled
    # Decode: attnlab's split-KV blocks next to cuDNN's and FA2's split kernels.
    decode = next(i for i, w in enumerate(profiler["workloads"]) if w["phase"] == "decode")
    tab.page.select_option("#ncu-workload", str(decode))
    shown = tab.page.eval_on_selector_all(
        '#blocks-chart g.bar-row-svg', "g => g.map(r => r.dataset.provider)")
    assert {"attnlab", "sdpa_cudnn", "sdpa_flash"} <= set(shown)
    decode_rows = profiler["workloads"][decode]["rows"]
    assert any(r["kernel"] == "_split_kv_decode" and r["grid_blocks"] == 128 for r in decode_rows)
    assert "attnlab 128 blocks" in tab.text("#occupancy-sentence")


# ----------------------------------------------------------------- synthetic records
SYNTHETIC_NOTE = "synthetic records written by this test, never shown in docs"


def _synthetic_records(folder: Path) -> None:
    """Test-only records (marked as such) to drive the chart code; never a screenshot for docs."""
    lines = []
    for provider, ms_per_4k in (("eager", 4.0), ("sdpa_flash", 0.5)):
        for seqlen in (1024, 2048, 4096, 8192):
            p50 = ms_per_4k * (seqlen / 4096) ** 2
            shape = AttentionShape(query_heads=24, kv_heads=4, seqlen_q=seqlen, seqlen_k=seqlen,
                                   head_dim=256, dtype="bf16", causal=True)
            lines.append({
                "kernel": "call", "provider": provider, "phase": "prefill",
                "shape": shape.as_dict(), "metric": "latency", "unit": "ms",
                "p20": p50, "p50": p50, "p80": p50, "repeats": 10, "tflops": None, "tbps": None,
                "kernel_names": [], "gpu": "test GPU", "torch": "test", "triton": "test",
                "driver": None, "git_commit": "test", "timestamp": "2026-01-01T00:00:00+00:00",
                "command": SYNTHETIC_NOTE})
    # One more workload measured at one length only: drawn as bars, not a lonely dot.
    for provider, p50 in (("attnlab", 0.2), ("eager", 3.0)):
        shape = AttentionShape(query_heads=8, kv_heads=8, seqlen_q=4096, seqlen_k=4096,
                               head_dim=64, dtype="bf16", causal=False)
        lines.append({**lines[0], "provider": provider, "shape": shape.as_dict(), "p20": p50,
                      "p50": p50, "p80": p50})
    folder.mkdir(parents=True)
    (folder / "synthetic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_latency_chart_log_axis_and_hover(browser, tmp_path):
    _synthetic_records(tmp_path / "results")
    data = build_page_data(tmp_path / "results")
    url = write_page(tmp_path / "page", data).as_uri()
    opened = OpenPage(browser, url)
    try:
        points = opened.page.locator('#chart-prefill circle[data-provider="eager"]')
        assert points.count() == 4
        ys = [float(points.nth(k).get_attribute("cy")) for k in range(4)]
        # Latency grows 4x per doubling: on a log axis the steps are equal.
        steps = [a - b for a, b in zip(ys, ys[1:], strict=False)]
        assert max(steps) - min(steps) < 0.01 and steps[0] > 0
        charts = data["measured"]["phases"][0]["charts"]
        series = charts[0]["series"]
        expected = next(s for s in series if s["provider"] == "eager")["points"][1]["text"]
        points.nth(1).hover()
        tooltip = opened.page.locator("#tooltip-prefill")
        assert tooltip.is_visible()
        assert tooltip.inner_text() == expected
        assert "2,048 tokens \u00b7 B=1 \u00b7 1 ms median of 10" in expected  # 4.0 * (1/2)^2
        opened.page.mouse.move(0, 0)
        assert tooltip.is_hidden()
        points.nth(3).focus()  # keyboard users get the same value
        assert tooltip.inner_text() == next(
            s for s in series if s["provider"] == "eager")["points"][3]["text"]
        # The one-length workload: bars with the records' medians, attnlab outlined.
        assert [c["kind"] for c in charts] == ["line", "bars"]
        opened.page.select_option("#family-prefill", "1")
        assert opened.page.locator("#chart-prefill").get_attribute("data-kind") == "bars"
        bars = opened.page.eval_on_selector_all(
            "#chart-prefill rect.bar-rect", "r => r.map(b => [b.getAttribute('fill'), "
            "Number(b.dataset.value), b.classList.contains('bar-ours')])")
        colours = {p["name"]: p["colour"] for p in data["measured"]["providers"]}
        assert bars == [[colours["attnlab"], 0.2, True], [colours["eager"], 3.0, False]]
        assert opened.page.locator("#chart-prefill circle").count() == 0
        opened.page.locator("#how-much").screenshot(
            path=str(_artifact("explain-how-much-synthetic.png")))
        assert opened.problems() == []
        assert opened.requests == [url]
    finally:
        opened.context.close()


# ----------------------------------------------------------------- screenshots
def _artifact(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


def test_screenshot_every_section(tab, page_data):
    # Show each section in a telling state: the walk finished, the grid on exercise 4.
    for _ in range(4):
        tab.page.click('#walk [data-action="forward"]')
    tab.page.click("#exercise-4")
    tab.page.locator("#how-much").scroll_into_view_if_needed()
    update_docs = os.environ.get("ATTNLAB_UPDATE_DOCS_IMG") == "1"
    for section in SECTIONS:
        path = _artifact(f"explain-{section}.png")
        tab.page.locator(f"#{section}").screenshot(path=str(path))
        assert path.stat().st_size > 2_000  # a real image, not a blank one
        if update_docs:
            DOCS_IMG.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, DOCS_IMG / path.name)
