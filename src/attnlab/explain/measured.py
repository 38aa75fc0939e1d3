"""The page's "How much" section: measured latency and bytes, read from result records.

Records are the JSONL lines ``attnlab.measure`` writes under ``bench/results/``;
DRAM bytes come from the Nsight Compute CSVs saved beside them, set against the
models by ``attnlab.measure.compare``.  This module only groups and labels; it
never measures and never fills a gap: no records means the section says so.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from attnlab.explain.units import format_bytes, format_ratio, format_tokens
from attnlab.shapes import AttentionShape

PHASES = ("prefill", "decode")
PHASE_TITLES = {
    "prefill": "Prefill: forward latency vs sequence length",
    "decode": "Decode: one new token vs KV-cache length",
}
X_TITLES = {"prefill": "sequence length (tokens, log scale)",
            "decode": "KV-cache length (tokens, log scale)"}
# A latency is any record timed in one of these units (attnlab.measure writes
# metric "latency", unit "ms"); the page plots milliseconds.
MS_PER_UNIT = {"ms": 1.0, "us": 1e-3, "s": 1e3}
LATENCY_METRIC = "latency"
SKIPPED_METRIC = "skipped"


def _load(results_dir: Path) -> list[dict]:
    from attnlab.measure.records import load_records

    return load_records(results_dir)


def measured_section(results_dir: Path | str | None) -> dict:
    """Charts and the bytes table from the records in ``results_dir`` (or why there are none)."""
    if results_dir is None:
        return _empty("none", "no results folder was given, so there is no measured data "
                              "on this page")
    folder = Path(results_dir)
    if not folder.is_dir():
        return _empty(str(folder), f"no measured records: the folder {folder} does not exist. "
                                   "Run the benchmarks on a GPU (bench/) to fill this section.")
    records = _load(folder)
    if not records and not any(folder.rglob("*.csv")):
        return _empty(str(folder), f"no measured records: {folder} holds no *.jsonl records. "
                                   "Run the benchmarks on a GPU (bench/) to fill this section.")
    charts = {phase: latency_charts(records, phase) for phase in PHASES}
    bytes_rows, bytes_notes = bytes_table(folder)
    gpus = sorted({str(r.get("gpu")) for r in records})
    latency_count = sum(len(series["points"]) for phase in PHASES for chart in charts[phase]
                        for series in chart["series"])
    summary = (f"{len(records)} records on {', '.join(gpus) or 'no GPU'}; {latency_count} "
               f"latency points, {len(bytes_rows)} profiled cases with DRAM bytes")
    return {
        "source": str(folder),
        "record_count": len(records),
        "summary": summary,
        "has_latency": latency_count > 0,
        "empty_message": (f"{folder} holds {len(records)} records but none is a timed "
                          f"prefill or decode call (unit one of {sorted(MS_PER_UNIT)})."),
        "phase_titles": dict(PHASE_TITLES),
        "charts": charts,
        "bytes_headers": ["provider", "phase", "shape", "kernels", "measured DRAM",
                          "cache-aware model (error)", "logical model (\u00d7 measured)"],
        "bytes_caption": ("Whole call, all heads and batch. Measured: Nsight Compute "
                          "dram__bytes_read.sum + dram__bytes_write.sum. Cache-aware: "
                          "attnlab.measure.cache_model (H200 L2). Logical: "
                          "attnlab.model.traffic, cold cache; fused kernels come in far below "
                          "it because L2 serves most K/V re-reads."
                          + (f" Left out: {'; '.join(bytes_notes)}." if bytes_notes else "")),
        "bytes_table": bytes_rows,
        "bytes_empty_message": (f"No Nsight Compute CSV of an attnlab case under {folder}"
                                + (f" ({'; '.join(bytes_notes)})" if bytes_notes else "")
                                + "; the logical prediction is in section 3."),
    }


def _empty(source: str, message: str) -> dict:
    return {
        "source": source,
        "record_count": 0,
        "summary": message,
        "has_latency": False,
        "empty_message": message[0].upper() + message[1:],
        "phase_titles": dict(PHASE_TITLES),
        "charts": {phase: [] for phase in PHASES},
        "bytes_headers": [],
        "bytes_caption": "",
        "bytes_table": [],
        "bytes_empty_message": message[0].upper() + message[1:],
    }


def _shape(record: dict) -> AttentionShape:
    return AttentionShape.from_dict(record["shape"])


def _family_key(record: dict, shape: AttentionShape) -> tuple:
    """Everything but the swept length: the records one chart can hold."""
    fixed = shape.as_dict()
    for swept in ("seqlen_q", "seqlen_k", "block_m", "block_n"):
        fixed.pop(swept)
    if record["phase"] == "decode":
        fixed["seqlen_q"] = shape.seqlen_q
    return (record["gpu"], json.dumps(fixed, sort_keys=True))


def _family_title(shape: AttentionShape, gpu: str, phase: str) -> str:
    mask = "causal" if shape.causal else "no mask"
    if shape.has_window:
        mask += f", window {shape.window}"
    heads = (f"{shape.query_heads} heads" if shape.query_heads == shape.kv_heads
             else f"{shape.query_heads} query / {shape.kv_heads} KV heads")
    queries = f", {shape.seqlen_q} query token" + ("s" if shape.seqlen_q > 1 else "") \
        if phase == "decode" else ""
    return (f"{gpu}: batch {shape.batch}, {heads}, d={shape.head_dim}, "
            f"{shape.dtype}, {mask}{queries}")


def is_latency(record: dict) -> bool:
    return record.get("metric") != SKIPPED_METRIC and record.get("unit") in MS_PER_UNIT


def _ms(record: dict, key: str) -> float:
    return record[key] * MS_PER_UNIT[record["unit"]]


def _point_text(label: str, x: int, record: dict) -> str:
    spread = ""
    if record.get("p20") is not None and record.get("p80") is not None:
        spread = f" (p20\u2013p80 {_ms(record, 'p20'):.4g}\u2013{_ms(record, 'p80'):.4g})"
    rate = ""
    if record.get("tflops") is not None:
        rate = f", {record['tflops']:.0f} TFLOP/s"
    elif record.get("tbps") is not None:
        rate = f", {record['tbps']:.2f} TB/s"
    return (f"{label} \u00b7 {x:,} tokens \u00b7 {_ms(record, 'p50'):.4g} ms median of "
            f"{record['repeats']}{spread}{rate}")


def latency_charts(records: list[dict], phase: str) -> list[dict]:
    """One chart per workload family of ``phase``; one series per provider."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    families: dict[tuple, dict] = {}
    for record in records:
        if record.get("phase") != phase or not record.get("shape"):
            continue
        if not is_latency(record) and record.get("metric") != SKIPPED_METRIC:
            continue
        shape = _shape(record)
        key = _family_key(record, shape)
        family = families.setdefault(key, {"shape": shape, "gpu": record["gpu"],
                                           "series": defaultdict(dict), "records": [],
                                           "skipped": []})
        x = shape.seqlen_k if phase == "decode" else shape.seqlen_q
        if record["metric"] == SKIPPED_METRIC:
            family["skipped"].append(f"{record['provider']} at {format_tokens(x)} "
                                     f"({record.get('reason', 'no reason given')})")
            continue
        # A series is one provider's one kind of timing (a whole call, or one kernel).
        series_key = (record["provider"], record["kernel"], record["metric"])
        # One point per series and length: a later record (upsert order) replaces it.
        family["series"][series_key][x] = record
        family["records"].append(record)
    charts = []
    # Longest sweeps first: the default chart should be a curve, not a single point.
    def order(family):
        lengths = {x for points in family["series"].values() for x in points}
        return (-len(lengths), _family_title(family["shape"], family["gpu"], phase))

    for family in sorted(families.values(), key=order):
        if not family["series"]:
            continue
        xs = sorted({x for points in family["series"].values() for x in points})
        kinds = {(kernel, metric) for _, kernel, metric in family["series"]}
        series = []
        for provider, kernel, metric in sorted(family["series"]):
            points = family["series"][(provider, kernel, metric)]
            # Name the kernel/metric only when the chart mixes several kinds of timing.
            label = provider if len(kinds) == 1 else f"{provider} ({kernel}, {metric})"
            series.append({
                "provider": provider,
                "label": label,
                "points": [{"x": x, "y_ms": _ms(points[x], "p50"),
                            "text": _point_text(label, x, points[x])}
                           for x in sorted(points)],
            })
        versions = sorted({f"torch {r.get('torch')}, Triton {r.get('triton')}, "
                           f"driver {r.get('driver') or 'n/a'}" for r in family["records"]})
        commits = sorted({str(r.get("git_commit"))[:10] for r in family["records"]})
        dates = sorted(str(r.get("timestamp"))[:10] for r in family["records"])
        charts.append({
            "title": _family_title(family["shape"], family["gpu"], phase),
            "x_title": X_TITLES[phase],
            "y_title": "median latency (ms, log scale)",
            "x_ticks": [{"x": x, "label": format_tokens(x)} for x in xs],
            "series": series,
            "note": (f"Median of the stated repeats per point, measured on {family['gpu']} "
                     f"({'; '.join(versions)}), commit {', '.join(commits)}, "
                     f"{dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
                     + ". Hover or focus a point for its value."
                     + (f" Not measured: {'; '.join(family['skipped'])}."
                        if family["skipped"] else "")),
        })
    return charts


def _ncu_cases(folder: Path) -> tuple[list[tuple[str, list]], list[str]]:
    """Profiled attnlab cases from every Nsight Compute CSV under ``folder``.

    Returns (case label, kernels) pairs and notes on what was left out: CSVs this
    parser does not know, and kernels outside an attnlab case (NVTX) range.
    """
    from attnlab.measure import ncu

    cases: list[tuple[str, list]] = []
    notes: list[str] = []
    for path in sorted(folder.rglob("*.csv")):
        try:
            kernels = ncu.parse_csv(path)
        except ValueError:
            notes.append(f"{path.name} is not an Nsight Compute CSV")
            continue
        grouped = ncu.group_by_case(kernels)
        outside = sum(1 for k in kernels if not k.case)
        if outside:
            notes.append(f"{outside} kernel{'s' if outside != 1 else ''} of {path.name} ran "
                         f"outside an attnlab case range")
        cases.extend(grouped.items())
    return cases, notes


def bytes_table(folder: Path) -> tuple[list[dict], list[str]]:
    """Measured DRAM bytes of each profiled case beside the cache-aware and logical models.

    The pairing of kernels with predictions is attnlab.measure.compare's; this only
    formats its result.
    """
    from attnlab.measure import compare, ncu

    cases, notes = _ncu_cases(folder)
    rows = []
    for label, kernels in cases:
        try:
            provider, phase, shape = ncu.parse_case_label(label)
        except (ValueError, KeyError):
            notes.append(f"case {label!r} is not an attnlab case label")
            continue
        try:
            case = compare.compare_case(provider, shape, kernels)
        except ValueError as error:
            notes.append(f"{provider} {shape.describe()}: {error}")
            continue
        logical = "n/a" if case.logical_bytes is None else format_bytes(case.logical_bytes)
        logical_ratio = ("n/a" if case.logical_bytes is None
                         else format_ratio(case.logical_bytes / case.measured_total))
        rows.append({
            "provider": provider,
            "phase": phase,
            "measured_bytes": case.measured_total,
            "cache_model_bytes": case.predicted_total,
            "logical_bytes": case.logical_bytes,
            "cells": [provider, phase, shape.describe(),
                      " + ".join(p.role for p in case.pairs),
                      format_bytes(case.measured_total),
                      f"{format_bytes(case.predicted_total)} "
                      f"({100 * case.relative_error:+.1f}%)",
                      f"{logical} ({logical_ratio} measured)"],
        })
    return rows, notes
