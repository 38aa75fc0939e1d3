"""The page: HTML that parses and prints on one sheet, Markdown, JSON round trip, SVG."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from attnlab.measure.profile import summarize_trace
from attnlab.report.attribution import build_report, with_kernel_speedup, with_trace
from attnlab.report.render import (
    narrative,
    render_html,
    render_json,
    render_markdown,
    waterfall_svg,
    write_report,
)
from attnlab.report.workload import (
    LESSON_DOCUMENT_QA,
    default_workload,
    load_workload,
    parse_workload,
)

CPU_TRACE = Path(__file__).parent / "data" / "report_cpu_prefill_trace.json"
VOID_TAGS = {"meta", "br", "hr", "img", "link", "input", "col", "area", "base", "source", "wbr"}
# SVG elements written self-closing; html.parser reports them through handle_startendtag.


class PageParser(HTMLParser):
    """Collects text, tags and style, and checks that every element is closed in order."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.errors: list[str] = []
        self.text: list[str] = []
        self.style = ""
        self.h2: list[str] = []
        self._in = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in VOID_TAGS:
            self.stack.append(tag)
        self._in = tag

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] == "style":
            self.style += data
        elif self.stack and self.stack[-1] == "h2":
            self.h2.append(data.strip())
        self.text.append(data)


def parse(page: str) -> PageParser:
    parser = PageParser()
    parser.feed(page)
    parser.close()
    return parser


@pytest.fixture(scope="module")
def lesson_report():
    return build_report(default_workload())


def full_report() -> dict:
    """Every optional section at once: trace, samples, warnings, a measured speedup."""
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["samples"] = {"ttft_ms": [float(v) for v in np.random.default_rng(3).normal(330, 15, 200)],
                       "source": "load generator"}
    data["client"]["ttft_ms"] = 395.0
    del data["segments"][0]["source"]
    workload = with_trace(parse_workload(data), summarize_trace(CPU_TRACE))
    workload = with_kernel_speedup(workload, 2.5, "measured: test records")
    report = build_report(workload, trace=summarize_trace(CPU_TRACE), records={
        "kernel_speedup": 2.5, "kernel_speedup_low": 2.4, "kernel_speedup_high": 2.6,
        "gpu": "NVIDIA H200", "batch": 1, "metric": "latency", "shape": "prefill, 32/32 heads",
        "baseline": {"provider": "eager", "p50_ms": 5.0}, "candidate": {"provider": "attnlab",
                                                                        "p50_ms": 2.0}})
    assert len(report["warnings"]) == 2
    return report


def test_html_parses_balanced_with_every_section(lesson_report):
    page = parse(render_html(lesson_report))
    assert page.errors == [] and page.stack == []
    assert "script" not in page.tags  # no JS needed
    assert page.tags.count("svg") == 1 and page.tags.count("table") == 1
    numbered = [h for h in page.h2 if re.match(r"\d ·", h)]
    assert [h.split(" · ")[1] for h in numbered] == [
        "Workload and targets", "Trace timings (this trace)", "Observations", "Proposed change",
        "Projected impact (Amdahl's law)", "Boundary errors to avoid", "Next measurement plan",
        "Before / after waterfall"]


def test_html_carries_the_lessons_numbers(lesson_report):
    text = " ".join(parse(render_html(lesson_report)).text)
    for expected in ("212.67 ms", "26.67% less", "1.3636×", "302.67 ms", "1.2555×",
                     "20.35% less", "126.67 ms", "6.3% of the prefill's FLOPs", "40.0% of its time",
                     "15.0 + 65.0 + 212.67 + 10.0", "1 / 0.733333", "76.3%", "380.0 ms"):
        assert expected in text, expected


def test_print_css_fits_one_sheet(lesson_report):
    style = parse(render_html(lesson_report)).style
    assert re.search(r"@page\s*{[^}]*margin:\s*10mm", style)
    print_rules = style[style.index("@media print"):]
    assert re.search(r"body\s*{[^}]*font-size:\s*[\d.]+pt", print_rules)
    # 190 mm of content: the width A4 leaves inside 10 mm margins (Letter is wider).
    assert "max-width: 190mm" in style
    assert "break-inside: avoid" in style


def test_json_round_trips_and_renders_identically(lesson_report):
    text = render_json(lesson_report)
    loaded = json.loads(text)
    assert loaded == lesson_report
    assert render_html(loaded) == render_html(lesson_report)
    assert render_markdown(loaded) == render_markdown(lesson_report)
    assert loaded["schema"] == "attnlab.report/1"
    for key in ("segments", "segment_boundary", "client_boundary", "boundary_errors", "plan",
                "waterfall", "observations", "proposal", "input"):
        assert key in loaded


def test_full_report_round_trips(tmp_path):
    report = full_report()
    loaded = json.loads(render_json(report))
    assert loaded == report and render_html(loaded) == render_html(report)
    page = parse(render_html(report))
    assert page.errors == []
    text = " ".join(page.text)
    assert "Profiler trace: report_cpu_prefill_trace.json (CPU ops)" in text
    assert "Input warnings" in text and "bootstrap interval" in text


def test_markdown_tables_and_sections(lesson_report):
    markdown = render_markdown(lesson_report)
    headings = re.findall(r"^## (\d)\. ", markdown, flags=re.MULTILINE)
    assert headings == [str(i) for i in range(1, 9)]
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    for line in table:  # every row has its table's column count: 6 (trace) or 3 (waterfall)
        assert len(re.findall(r"(?<!\\)\|", line)) in (7, 4), line
    assert "| 3 | prefill | hypothetical CUDA profiler span | 290.0 ms | 76.3% |" in markdown
    assert "| prefill: attention | 116.0 ms | **38.67 ms** |" in markdown
    assert "T_prefill = 174.0 ms + 116.0 ms / 3.00 = 212.67 ms (26.67% less)" in markdown


def test_markdown_escapes_pipes():
    data = copy.deepcopy(LESSON_DOCUMENT_QA)
    data["segments"][0]["source"] = "tcpdump | awk"
    markdown = render_markdown(build_report(parse_workload(data)))
    assert "tcpdump \\| awk" in markdown


def test_waterfall_svg_is_valid_and_proportional(lesson_report):
    svg = waterfall_svg(lesson_report)
    root = ElementTree.fromstring(svg)
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    bars = lesson_report["waterfall"]["bars"]
    assert len(rects) == 2 * len(bars) + 2
    widths = [float(r.get("width")) for r in rects]
    # The TTFT bars: 380 ms before and 302.67 ms after, drawn to one scale.
    assert widths[-1] / widths[-2] == pytest.approx(302.6667 / 380.0, rel=1e-2)
    assert "target 350.0 ms" in svg


def test_narrative_handles_missing_pieces():
    workload = parse_workload({"segments": [{"name": "prefill", "ms": 100.0, "source": "s"}],
                               "proposal": {"change": "c", "segment": "prefill",
                                            "time_share": 0.3, "kernel_speedup": 2.0}})
    text = narrative(build_report(workload))
    assert text["workload"] == "Workload not described."
    assert text["targets"] == "No targets given."
    assert "not computed" in text["errors"][1]["text"]
    page = parse(render_html(build_report(workload)))
    assert page.errors == []


def test_write_report_files_and_workload_round_trip(tmp_path, lesson_report):
    paths = write_report(lesson_report, tmp_path)
    assert sorted(p.name for p in paths.values()) == [
        "report.html", "report.json", "report.md", "waterfall.svg", "workload.yaml"]
    assert json.loads(paths["report.json"].read_text()) == lesson_report
    # The written workload reproduces the report.
    again = build_report(load_workload(paths["workload.yaml"]))
    assert again["client_boundary"] == lesson_report["client_boundary"]
    assert again["boundary_errors"] == lesson_report["boundary_errors"]


# ----------------------------------------------------------------------------------
# One printed page, checked by printing it (Chromium headless, when installed)
# ----------------------------------------------------------------------------------
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


def printed_pages(html: str, paper: str, tmp_path: Path) -> int:
    page = tmp_path / f"page-{paper}.html"
    page.write_text(html.replace("</style>", f"@page {{ size: {paper}; }}\n</style>", 1))
    pdf = tmp_path / f"page-{paper}.pdf"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                    "--no-pdf-header-footer", f"--print-to-pdf={pdf}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    return len(re.findall(rb"/Type\s*/Page[^s]", pdf.read_bytes()))


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="needs a Chromium binary to print the page")
def test_report_prints_on_one_page(tmp_path, lesson_report):
    long_report = copy.deepcopy(LESSON_DOCUMENT_QA)
    long_report["segments"] += [{"name": f"hop {i}", "ms": 1.0, "source": "s"} for i in range(60)]
    # The page counter itself: a report with 64 segments does not fit.
    assert printed_pages(render_html(build_report(parse_workload(long_report))), "A4",
                         tmp_path) > 1
    for paper in ("A4", "letter"):
        assert printed_pages(render_html(lesson_report), paper, tmp_path) == 1, paper
        assert printed_pages(render_html(full_report()), paper, tmp_path) == 1, paper
