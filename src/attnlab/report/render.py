"""The report dict as a one-page HTML page, Markdown, JSON and a waterfall SVG.

Renderers read only the dict from :func:`attnlab.report.attribution.build_report`
(or the same dict loaded back from the JSON), so every number on the page is one
that ``--json`` carries.  The sentences are written once, in :func:`narrative`, and
both templates print them.  The HTML has no script and no external asset: its CSS
puts the page on one A4 or Letter sheet when printed.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import jinja2

from attnlab.report.workload import WRITTEN_HEADER, YAML_DOCUMENT_END

TEMPLATES = Path(__file__).with_name("templates")
# Trace classification rows shown on the page (all of them are in the JSON).
TRACE_ROWS_ON_PAGE = 1


# ----------------------------------------------------------------------------------
# Number formats.  Inputs keep the precision they were written with (15.0 ms);
# derived times get two decimals (212.67 ms), as the lesson prints them.
# ----------------------------------------------------------------------------------
def ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    tenths = value * 10
    if abs(tenths - round(tenths)) < 1e-6:
        return f"{value:,.1f} ms"
    return f"{value:,.2f} ms"


def pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def times(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}×"


def speedup(value: float) -> str:
    """Kernel speedups as stated: 3.00×."""
    return f"{value:.2f}×"


def num(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}"


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


# ----------------------------------------------------------------------------------
# Sentences
# ----------------------------------------------------------------------------------
def _workload_line(report: dict) -> str:
    w = report["workload"]
    bits = []
    if w.get("model"):
        bits.append(w["model"])
    geometry = []
    if w.get("parameters"):
        count = w["parameters"]
        geometry.append(f"{count / 1e9:g}B parameters" if count >= 10**9
                        else f"{count / 1e6:.3g}M parameters")
    if w.get("layers"):
        geometry.append(f"{w['layers']} layers")
    if w.get("query_heads"):
        geometry.append(f"{w['query_heads']} query / {w.get('kv_heads') or '?'} KV heads")
    if w.get("head_dim"):
        geometry.append(f"d = {w['head_dim']}")
    if w.get("dtype"):
        geometry.append(w["dtype"].upper())
    if geometry:
        bits.append(", ".join(geometry))
    load = []
    if w.get("concurrency"):
        load.append(f"C = {w['concurrency']} closed-loop")
    if w.get("prompt_tokens"):
        load.append(f"P = {_count(w['prompt_tokens'])}")
    if w.get("output_tokens"):
        load.append(f"O = {_count(w['output_tokens'])}")
    if load:
        bits.append(", ".join(load))
    return "; ".join(bits) + "." if bits else "Workload not described."


def _targets_line(report: dict) -> str:
    t = report["targets"]
    bits = []
    if t.get("ttft_p95_ms") is not None:
        bits.append(f"client p95 TTFT ≤ {ms(t['ttft_p95_ms'])}")
    if t.get("tpot_ms") is not None:
        bits.append(f"decode TPOT ≤ {ms(t['tpot_ms'])} (≥ {1000 / t['tpot_ms']:.1f} tokens/s)")
    return ("Targets: " + "; ".join(bits) + ".") if bits else "No targets given."


def _observations(report: dict) -> list[str]:
    obs = report["observations"]
    lines = []
    ttft = obs["ttft_this_trace"]
    tpot = obs["tpot_this_trace"]
    first = f"In this trace, client TTFT is {ms(ttft['value_ms'])}"
    if ttft["verdict"] == "exceeds":
        first += f", above the {ms(ttft['target_ms'])} target by {ms(-ttft['margin_ms'])}"
    elif ttft["verdict"] == "meets":
        first += f", within the {ms(ttft['target_ms'])} target"
    if tpot is not None:
        if tpot["verdict"] == "meets":
            first += f"; decode TPOT {ms(tpot['value_ms'])} is within the {ms(tpot['target_ms'])} budget"
        elif tpot["verdict"] == "exceeds":
            first += f"; decode TPOT {ms(tpot['value_ms'])} exceeds the {ms(tpot['target_ms'])} budget"
        else:
            first += f"; decode TPOT is {ms(tpot['value_ms'])}"
    lines.append(first + ".")
    p95 = report.get("p95")
    if p95 is None:
        lines.append("One trace is not a p95: whether the service meets its p95 TTFT target is "
                     "unknown without a distribution of client-observed requests.")
    else:
        lines.append(_p95_sentence(p95, report.get("samples_source")))
    largest = obs["largest_segment"]
    line = f"The largest segment is {largest['name']}: {pct(largest['share_of_ttft'])} of TTFT"
    proposal, boundary = report["proposal"], report["segment_boundary"]
    if proposal["part"]:
        line += (f"; inside {proposal['segment']}, {proposal['part']} takes "
                 f"{pct(boundary['time_share'])} ({ms(boundary['affected_ms'])})")
    lines.append(line + ".")
    return lines


def _p95_sentence(p95: dict, source: str | None) -> str:
    text = (f"From {p95['count']} client samples{f' ({source})' if source else ''}: p95 TTFT "
            f"{ms(p95['p95_ms'])}, {pct(p95['confidence'], 0)} bootstrap interval "
            f"[{ms(p95['ci_low_ms'])}, {ms(p95['ci_high_ms'])}]")
    verdict = p95["verdict"]
    if verdict == "meets":
        text += f": meets the {ms(p95['target_ms'])} target"
    elif verdict == "misses":
        text += f": misses the {ms(p95['target_ms'])} target"
    elif verdict == "unknown":
        text += f": verdict unknown ({p95['reason']})"
        if p95.get("samples_needed_estimate"):
            text += f"; roughly {_count(p95['samples_needed_estimate'])} samples would settle it"
    return text + "."


def _proposal_line(report: dict) -> str:
    p = report["proposal"]
    text = (f"{p['change']}: S_kernel = {speedup(p['kernel_speedup'])} applied to "
            f"{p['affected']} ({ms(p['affected_ms'])})")
    if p.get("speedup_source"):
        text += f"; speedup {p['speedup_source']}"
    return text + "."


def _amdahl_lines(report: dict) -> dict[str, list[str]]:
    seg, cli, p = report["segment_boundary"], report["client_boundary"], report["proposal"]
    s = p["kernel_speedup"]
    f = seg["time_share"]
    name = seg["name"]
    inside = [
        f"Time share f = {ms(seg['affected_ms'])} / {ms(seg['before_ms'])} = {num(f)}; "
        f"untouched {num(1 - f)}.",
        f"S_{name} = 1 / ((1 − f) + f / S_kernel) = 1 / ({num(1 - f)} + {num(f)} / {s:.2f}) "
        f"= 1 / {(1 - f) + f / s:.6f} = {times(seg['speedup'])}",
        f"T_{name} = {ms(seg['before_ms'] - seg['affected_ms'])} + {ms(seg['affected_ms'])} / "
        f"{s:.2f} = {ms(seg['after_ms'])} ({pct(seg['reduction'], 2)} less)",
    ]
    sum_terms = " + ".join(
        ms(seg["after_ms"]).removesuffix(" ms") if b["name"] == name else ms(b["ms"]).removesuffix(" ms")
        for b in report["segments"])
    client = [
        f"Holding every other segment fixed ({sum_terms}): T_client = {ms(cli['after_ms'])}.",
        f"S_client = {ms(cli['before_ms'])} / {ms(cli['after_ms'])} = {times(cli['speedup'])} "
        f"({pct(cli['reduction'], 2)} less); the same as Amdahl with f_client = "
        f"{ms(cli['affected_ms'])} / {ms(cli['before_ms'])} = {num(cli['time_share'])}.",
        "A conditional projection for this single trace: p95 compliance stays unverified until "
        "a post-change distribution is collected.",
    ]
    return {"inside": inside, "client": client}


def _error_lines(report: dict) -> list[dict[str, str]]:
    errors = report["boundary_errors"]
    s = report["proposal"]["kernel_speedup"]
    cli = report["client_boundary"]
    k = errors["kernel_speedup_on_ttft"]
    items = [{
        "title": "Kernel vs end-to-end",
        "text": (f"applying {speedup(s)} to TTFT predicts {ms(cli['before_ms'])} / {s:.2f} = "
                 f"{ms(k['wrong_ttft_ms'])} instead of {ms(k['projected_ttft_ms'])}: "
                 f"{ms(k['overstated_saving_ms'])} of saving that does not exist, because the "
                 f"untouched compute and every other segment do not get faster."),
    }]
    fl = errors["flop_share_for_time_share"]
    if fl["applicable"]:
        text = (f"attention is {pct(fl['flop_share'])} of the prefill's FLOPs at "
                f"P = {_count(fl['prompt_tokens'])} but {pct(fl['time_share'])} of its time "
                f"({fl['time_to_flop_share_ratio']:.1f}× more). The FLOP share would project "
                f"{times(fl['wrong_segment_speedup'])} and {ms(fl['wrong_segment_ms'])} "
                f"(TTFT {ms(fl['wrong_ttft_ms'])}), understating the saving by "
                f"{ms(fl['understated_saving_ms'])}: softmax, masking and memory stalls take "
                f"time without taking FLOPs.")
    else:
        text = f"not computed: {fl['reason']}. Use a measured time share, never a FLOP share."
    items.append({"title": "FLOP share vs time share", "text": text})
    u = errors["unmeasured_held_fixed"]
    held = ", ".join(f"{h['name']} {ms(h['ms'])}" for h in u["held_fixed"]) or "nothing"
    text = (f"the projection holds {held} fixed ({ms(u['held_fixed_ms'])}, "
            f"{pct(u['share_of_projected_ttft'])} of the projected TTFT), plus "
            f"{ms(u['untouched_in_segment_ms'])} of untouched work inside "
            f"{report['segment_boundary']['name']}.")
    scaled = u.get("load_dependent_scaled")
    if scaled:
        names = ", ".join(item["name"] for item in scaled["segments"])
        text += (f" If {names} scaled with {report['segment_boundary']['name']} time "
                 f"(×{scaled['scale']:.4f}, a saturated closed loop), TTFT would be "
                 f"{ms(scaled['ttft_ms'])}, not {ms(cli['after_ms'])}: queuing under load "
                 f"must be measured, not assumed.")
    items.append({"title": "Unmeasured components held fixed", "text": text})
    return items


def _plan_lines(report: dict) -> list[str]:
    plan = report["plan"]
    segment = plan["segment"]
    lines = []
    if plan["targets_attention"]:
        lines.append("Confirm which attention kernel runs: kernel names in torch.profiler "
                     "(attnlab kernels), or pin SDPA with sdpa_kernel(SDPBackend.FLASH_ATTENTION); "
                     "a silent fallback changes both bytes and time.")
    if not plan["kernel_speedup_measured"]:
        lines.append("Measure S_kernel on the same shape, dtype and clocks for both kernels "
                     "(attnlab bench), instead of the stated value.")
    lines.append(f"Validate {segment} against the {ms(plan['projected_segment_ms'])} projection "
                 f"with matched profiler spans (CUDA events / torch.profiler) before and after.")
    if plan["load_dependent_segments"]:
        lines.append(f"Measure {', '.join(plan['load_dependent_segments'])} under the same load "
                     f"after the change (server histograms such as request_queue_time_seconds, "
                     f"request_prefill_time_seconds).")
    p95 = report.get("p95")
    if p95 is None or p95["verdict"] == "unknown":
        need = (p95 or {}).get("samples_needed_estimate")
        lines.append("Collect client-observed TTFT samples before and after the change to accept "
                     "or reject the p95 target" + (f" (about {_count(need)} samples)" if need else "")
                     + ".")
    if plan["targets_attention"]:
        lines.append("Measure DRAM traffic with Nsight Compute (dram__bytes_read.sum, "
                     "dram__bytes_write.sum; attnlab ncu): the logical byte model is an "
                     "algorithmic count, not a hardware guarantee.")
    return lines


def narrative(report: dict) -> dict[str, Any]:
    """Every sentence of the page, from the report dict."""
    return {
        "workload": _workload_line(report),
        "targets": _targets_line(report),
        "observations": _observations(report),
        "proposal": _proposal_line(report),
        "amdahl": _amdahl_lines(report),
        "errors": _error_lines(report),
        "plan": _plan_lines(report),
        "measurement": _measurement_lines(report.get("measurement")),
    }


def _measurement_lines(measurement: dict | None) -> list[str]:
    if not measurement:
        return []
    m = measurement
    lines = [
        f"Model: {m['model']}; {m['device']}.",
        f"Eager prefill {ms(m['eager_ms'])}; attention share f = {num(m['time_share'])} from the "
        f"profiler trace; attention alone {speedup(m['kernel_speedup'])} faster with "
        f"{m['candidate']} on the same shape.",
        f"Predicted end-to-end {times(m['predicted_speedup'])} ({ms(m['predicted_ms'])}); "
        f"measured {times(m['measured_speedup'])} ({ms(m['candidate_ms'])}): the measured "
        f"speedup is {pct(abs(m['gap']), 1)} {'below' if m['gap'] < 0 else 'above'} the "
        f"prediction ({m['gap_ms']:+.2f} ms against the projected time).",
    ]
    lines.extend(m.get("gap_causes", []))
    return lines


# ----------------------------------------------------------------------------------
# Waterfall chart: inline SVG, no script.
# ----------------------------------------------------------------------------------
def waterfall_svg(report: dict, *, width: int = 700) -> str:
    """Before/after waterfall of the critical path: each step starts where the last ended."""
    chart = report["waterfall"]
    bars = chart["bars"]
    target = chart.get("target_ms")
    label_width, right_pad, row, top = 150, 60, 15, 18
    plot = width - label_width - right_pad
    extent = max(chart["before_total_ms"], target or 0.0) * 1.04
    scale = plot / extent if extent > 0 else 1.0
    height = top + row * (len(bars) + 1) + 30

    def x(value: float) -> float:
        return label_width + value * scale

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
             f'width="100%" role="img" aria-label="Before and after waterfall of client TTFT" '
             f'font-family="Helvetica, Arial, sans-serif" font-size="10">',
             '<title>Client TTFT waterfall, before (grey) and after (blue) the change</title>']
    # Axis ticks every "nice" step.
    step = _nice_step(extent / 6)
    tick = 0.0
    while tick <= extent + 1e-9:
        parts.append(f'<line x1="{x(tick):.1f}" y1="{top - 4}" x2="{x(tick):.1f}" '
                     f'y2="{height - 26}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{x(tick):.1f}" y="{height - 14}" text-anchor="middle" '
                     f'fill="#555">{tick:g}</text>')
        tick += step
    parts.append(f'<text x="{label_width + plot / 2:.1f}" y="{height - 2}" text-anchor="middle" '
                 f'fill="#555">milliseconds since the request left the client</text>')
    before_start = after_start = 0.0
    for i, bar in enumerate(bars):
        y = top + i * row
        parts.append(f'<text x="{label_width - 6}" y="{y + 10}" text-anchor="end">'
                     f'{html.escape(bar["label"])}</text>')
        parts.append(f'<rect x="{x(before_start):.1f}" y="{y + 1}" '
                     f'width="{max(bar["before_ms"] * scale, 0.5):.1f}" height="5" fill="#b9b9b9"/>')
        colour = "#1f6fb4" if bar["changed"] else "#7fa7cc"
        parts.append(f'<rect x="{x(after_start):.1f}" y="{y + 7}" '
                     f'width="{max(bar["after_ms"] * scale, 0.5):.1f}" height="5" fill="{colour}"/>')
        if bar["changed"]:
            parts.append(f'<text x="{x(after_start + bar["after_ms"]) + 4:.1f}" y="{y + 12}" '
                         f'fill="#1f6fb4">{ms(bar["before_ms"])} → {ms(bar["after_ms"])}</text>')
        before_start += bar["before_ms"]
        after_start += bar["after_ms"]
    y = top + len(bars) * row
    parts.append(f'<text x="{label_width - 6}" y="{y + 11}" text-anchor="end" '
                 f'font-weight="bold">client TTFT</text>')
    parts.append(f'<rect x="{x(0):.1f}" y="{y + 1}" width="{before_start * scale:.1f}" height="6" '
                 f'fill="#8c8c8c"/>')
    parts.append(f'<rect x="{x(0):.1f}" y="{y + 8}" width="{after_start * scale:.1f}" height="6" '
                 f'fill="#1f6fb4"/>')
    parts.append(f'<text x="{x(before_start) + 4:.1f}" y="{y + 7}" fill="#555">'
                 f'{ms(chart["before_total_ms"])}</text>')
    parts.append(f'<text x="{x(after_start) + 4:.1f}" y="{y + 15}" fill="#1f6fb4">'
                 f'{ms(chart["after_total_ms"])}</text>')
    if target is not None:
        parts.append(f'<line x1="{x(target):.1f}" y1="{top - 8}" x2="{x(target):.1f}" '
                     f'y2="{height - 26}" stroke="#c0392b" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{x(target):.1f}" y="{top - 10}" text-anchor="middle" '
                     f'fill="#c0392b">target {ms(target)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if raw <= factor * magnitude:
            return factor * magnitude
    return 10 * magnitude


# ----------------------------------------------------------------------------------
# Documents
# ----------------------------------------------------------------------------------
def _markdown_safe(value: Any) -> Any:
    """Every value a Markdown template prints, with HTML's &, < and > escaped: Markdown
    passes raw HTML through, and a workload's title or note must never become markup."""
    if isinstance(value, str):
        return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return value


def _environment(autoescape: bool) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)),
                             autoescape=autoescape, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             finalize=None if autoescape else _markdown_safe)
    env.filters.update(ms=ms, pct=pct, times=times, speedup=speedup, num=num,
                       cell=lambda text: str(text).replace("|", "\\|").replace("\n", " "))
    return env


def _context(report: dict) -> dict[str, Any]:
    trace = report.get("trace")
    trace_rows = []
    if trace:
        by_class: dict[str, list[dict]] = {}
        for row in trace["top_names"]:
            by_class.setdefault(row["class"], []).append(row)
        for rows in by_class.values():
            trace_rows.extend(rows[:TRACE_ROWS_ON_PAGE])
    return {"r": report, "n": narrative(report), "trace_rows": trace_rows}


def render_html(report: dict) -> str:
    svg = waterfall_svg(report)
    return _environment(True).get_template("report.html.j2").render(
        **_context(report), waterfall=jinja2.utils.markupsafe.Markup(svg))


def render_markdown(report: dict, *, waterfall_path: str | None = "waterfall.svg") -> str:
    return _environment(False).get_template("report.md.j2").render(
        **_context(report), waterfall_path=waterfall_path)


def render_json(report: dict) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_report(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """report.html, report.md, report.json, waterfall.svg and workload.yaml in ``out_dir``."""
    import yaml

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in
             ("report.html", "report.md", "report.json", "waterfall.svg", "workload.yaml")}
    paths["report.html"].write_text(render_html(report), encoding="utf-8")
    paths["report.md"].write_text(render_markdown(report), encoding="utf-8")
    paths["report.json"].write_text(render_json(report), encoding="utf-8")
    paths["waterfall.svg"].write_text(waterfall_svg(report) + "\n", encoding="utf-8")
    # The input as parsed: edit it and run `attnlab report workload.yaml` again.
    # Its header and the final "..." let the reader tell a complete copy from a cut one.
    paths["workload.yaml"].write_text(
        f"{WRITTEN_HEADER} (schema: docs/report.md)\n"
        + yaml.safe_dump(report["input"], sort_keys=False, allow_unicode=True, width=100)
        + f"{YAML_DOCUMENT_END}\n", encoding="utf-8")
    return paths
