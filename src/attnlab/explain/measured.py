"""The page's "How much" section: measured latency, throughput and bytes, from records.

Records are the JSONL lines ``attnlab.measure`` writes under ``bench/results/``
(read through :mod:`attnlab.measure.records`); DRAM bytes come from the Nsight Compute
CSVs saved beside them, set against the models by ``attnlab.measure.compare``.  The
grouping into workloads and the provider palette are :mod:`attnlab.measure.plots`'s, so
the page and the PNGs agree.  This module only groups, labels and writes sentences; it
never measures and never fills a gap: no records means the section says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from attnlab.explain.units import format_bytes, format_ms, format_ratio, format_tokens
from attnlab.measure import plots
from attnlab.measure.records import load_records, source_label

# Phases in reading order; a phase the records add later is appended after these.
PHASE_ORDER = ("prefill", "fwdbwd", "decode")
PHASE_TITLES = {
    "prefill": "Prefill: forward latency vs sequence length",
    "fwdbwd": "Training: forward + backward vs sequence length",
    "decode": "Decode: one new token vs KV-cache length",
}
X_TITLES = {"decode": "KV-cache length (tokens, log scale)"}
DEFAULT_X_TITLE = "sequence length (tokens, log scale)"
ROOF_NAMES = {"tflops": "the measured matrix roof", "tbps": "the measured copy ceiling"}
# The peers a headline sentence names, when measured at its length: the eager
# baseline and the two fused SDPA backends.
HEADLINE_PEERS = ("eager", "sdpa_cudnn", "sdpa_flash")
# The length a prefill headline quotes when measured (the post's 4k); decode quotes the
# longest cache, where the split-KV question matters most.
HEADLINE_LENGTH = 4096
# Within this of measured, the cache-aware model counts as right (attnlab.measure.compare).
BYTES_GOAL = 0.15
# One decode call on a bf16 cache and on its e4m3 copy (bench/fp8_h200.py): a table of
# their bytes and times of its own, not series of the decode charts (whose providers
# all read one cache).
FP8_PAIR = ("attnlab_decode_bf16", "attnlab_decode_fp8")


def measured_section(results_dir: Path | str | None,
                     ncu: tuple[list[dict], list[str]] | None = None) -> dict:
    """Charts, headlines and the bytes chart from the records in ``results_dir``.

    ``ncu``: the folder's parsed Nsight Compute cases and notes
    (:func:`attnlab.explain.profiler.ncu_cases`), when the caller already has them.
    """
    if results_dir is None:
        return _empty("none", "no results folder was given, so there is no measured data "
                              "on this page")
    folder = Path(results_dir)
    label = source_label(folder)  # the page never names this machine's paths
    if not folder.is_dir():
        return _empty(label, f"no measured records: the folder {label} does not exist. "
                             "Run the benchmarks on a GPU (bench/) to fill this section.")
    records = load_records(folder)
    if not records and not any(folder.rglob("*.csv")):
        return _empty(label, f"no measured records: {label} holds no *.jsonl records. "
                             "Run the benchmarks on a GPU (bench/) to fill this section.")
    providers = sorted({r["provider"] for r in records if r["provider"] != plots.CEILING_PROVIDER},
                       key=plots.provider_rank)
    from attnlab.explain.profiler import ncu_cases

    cases, ncu_notes = ncu if ncu is not None else ncu_cases(folder)
    providers += sorted({c["provider"] for c in cases} - set(providers), key=plots.provider_rank)
    colours = plots.provider_colours(providers)
    fp8 = fp8_cache_section(records)
    records = [r for r in records if r.get("provider") not in FP8_PAIR]
    providers = [p for p in providers if p not in FP8_PAIR]
    phases = [phase_block(records, phase, colours) for phase in _phases(records)]
    bytes_chart = bytes_section(cases, ncu_notes, colours, folder)
    gpus = sorted({str(r.get("gpu")) for r in records})
    latency_count = sum(len(s["points"]) for block in phases for chart in block["charts"]
                        for s in chart["series"])
    summary = (f"{len(records)} records on {', '.join(gpus) or 'no GPU'}; {latency_count} "
               f"latency points, {len(bytes_chart['points'])} profiled cases with DRAM bytes")
    return {
        "source": label,
        "record_count": len(records),
        "summary": summary,
        "has_latency": latency_count > 0,
        "empty_message": (f"{label} holds {len(records)} records but none is a timed call "
                          f"(metric latency, unit one of {sorted(plots.MS_PER_UNIT)})."),
        "providers": [{"name": p, "label": plots.provider_label(p), "colour": colours[p],
                       "ours": plots.is_ours(p)} for p in providers],
        "default_visible": plots.DEFAULT_VISIBLE,
        "phases": phases,
        "fp8": fp8,
        "bytes": bytes_chart,
    }


def _empty(source: str, message: str) -> dict:
    text = message[0].upper() + message[1:]
    return {
        "source": source, "record_count": 0, "summary": message, "has_latency": False,
        "empty_message": text, "providers": [], "default_visible": plots.DEFAULT_VISIBLE,
        "phases": [],
        "fp8": fp8_cache_section([]),
        "bytes": {"points": [], "table": [], "headers": [], "caption": "", "headline": "",
                  "empty_message": text},
    }


def fp8_cache_section(records: list[dict]) -> dict:
    """The fp8 KV cache against bf16, per measured decode shape: the bytes the byte model
    says each reads (:func:`attnlab.model.cache.decode_kv_bytes`: an e4m3 element is one
    byte, plus the (batch, kv_head) descales) beside the measured time of each, from
    records of both providers at one shape (the newest of each)."""
    from attnlab.model import cache as cache_model
    from attnlab.shapes import AttentionShape

    newest: dict[str, dict[str, dict]] = {}
    for record in records:
        if record.get("provider") in FP8_PAIR and plots.is_latency(record):
            cell = newest.setdefault(json.dumps(record["shape"], sort_keys=True), {})
            kept = cell.get(record["provider"])
            if kept is None or (record.get("timestamp") or "") >= (kept.get("timestamp") or ""):
                cell[record["provider"]] = record
    rows, speedups = [], []
    for cell in newest.values():
        if len(cell) < len(FP8_PAIR):
            continue
        bf16, fp8 = (cell[name] for name in FP8_PAIR)
        shape = AttentionShape.from_dict(bf16["shape"])
        bf16_bytes = cache_model.decode_kv_bytes(shape)
        fp8_bytes = cache_model.decode_kv_bytes(shape, kv_dtype="fp8", kv_scales="kv-head")
        bf16_ms, fp8_ms = plots.to_ms(bf16), plots.to_ms(fp8)
        speedups.append(bf16_ms / fp8_ms)
        rows.append({"sort": (shape.head_dim, shape.batch, shape.seqlen_k), "cells": [
            f"{shape.query_heads}q/{shape.kv_heads}kv d={shape.head_dim}",
            f"{shape.batch} × {format_tokens(shape.seqlen_k)}",
            format_bytes(bf16_bytes), format_bytes(fp8_bytes),
            format_ratio(bf16_bytes / fp8_bytes),
            format_ms(bf16_ms), format_ms(fp8_ms), format_ratio(bf16_ms / fp8_ms)]})
    rows.sort(key=lambda row: row["sort"])
    if not rows:
        return {"rows": [], "headers": [], "headline": "", "caption": "",
                "empty_message": "No fp8 cache records: bench/fp8_h200.py measures them."}
    gpus = sorted({str(r.get("gpu")) for cell in newest.values() for r in cell.values()})
    return {
        "rows": rows,
        "headers": ["heads", "batch × cache", "bf16 cache bytes", "fp8 cache bytes",
                    "bytes ratio", "bf16 time", "fp8 time", "speedup"],
        "headline": (f"An e4m3 cache reads half the bytes of a bf16 one; measured, its decode "
                     f"is {format_ratio(min(speedups))}–{format_ratio(max(speedups))} faster "
                     f"over these {len(rows)} shapes."),
        "caption": (f"One decode call (one query, causal) on {', '.join(gpus)}, median under "
                    "CUDA-graph replay; bytes from the byte model (model.cache.decode_kv_bytes)."),
        "empty_message": "",
    }


def _phases(records: list[dict]) -> list[str]:
    present = {r["phase"] for r in records if plots.is_latency(r)}
    return [p for p in PHASE_ORDER if p in present] + sorted(present - set(PHASE_ORDER))


# ----- latency and throughput per phase --------------------------------------------------------
def phase_block(records: list[dict], phase: str, colours: dict[str, str]) -> dict:
    """One phase: a chart per workload family, the default one's headline first."""
    # Newest measurement first: the headline must describe today's kernels, not rows a
    # later kernel superseded (the 2026-11-29 decode rows timed the prefill kernel before
    # Flash-Decoding existed).  The sort is stable: same-run families keep their order.
    families = sorted(plots.workload_families(records, phase),
                      key=lambda f: max(r.get("timestamp") or "" for r in f["records"]),
                      reverse=True)
    charts = [family_chart(f, colours, plots.ceilings(records, f["gpu"])) for f in families]
    return {
        "phase": phase,
        "title": PHASE_TITLES.get(phase, f"{phase}: latency vs length"),
        "charts": charts,
        "headline": charts[0]["headline"] if charts else "",
    }


def _point(record: dict, label: str) -> dict:
    x = plots.swept_length(record)
    p50, p20, p80 = (plots.to_ms(record, k) for k in ("p50", "p20", "p80"))
    spread = "" if p20 is None or p80 is None else \
        f" (p20\u2013p80 {p20:.4g}\u2013{p80:.4g})"
    rate = ""
    if record.get("tflops") is not None:
        rate = f", {record['tflops']:.0f} TFLOP/s"
    elif record.get("tbps") is not None:
        rate = f", {record['tbps']:.2f} TB/s"
    return {
        "x": x, "batch": record["shape"]["batch"], "y_ms": p50, "p20_ms": p20, "p80_ms": p80,
        "tflops": record.get("tflops"), "tbps": record.get("tbps"),
        "text": (f"{label} \u00b7 {x:,} tokens \u00b7 B={record['shape']['batch']} \u00b7 "
                 f"{p50:.4g} ms median of {record['repeats']}{spread}{rate}"),
    }


def family_chart(family: dict, colours: dict[str, str], roofs: dict) -> dict:
    phase = family["phase"]
    providers = plots.family_providers(family)
    series = []
    for rank, provider in enumerate(providers):
        label = plots.provider_label(provider)
        points = [_point(r, label) for r in family["records"] if r["provider"] == provider]
        series.append({"provider": provider, "label": label, "colour": colours[provider],
                       "ours": plots.is_ours(provider),
                       "visible": rank < plots.DEFAULT_VISIBLE, "points": points})
    field, roof_metric, unit = plots.PHASE_ROOFS.get(phase, plots.PHASE_ROOFS["prefill"])
    roof = None
    if roof_metric in roofs:
        value, label = roofs[roof_metric]
        roof = {"value": value, "label": f"{label}: {value:.3g} {unit}",
                "name": ROOF_NAMES[roof_metric]}
    records = family["records"]
    versions = sorted({f"torch {r.get('torch')}, Triton {r.get('triton')}, "
                       f"driver {r.get('driver') or 'n/a'}" for r in records})
    commits = sorted({str(r.get("git_commit"))[:10] for r in records})
    dates = sorted(str(r.get("timestamp"))[:10] for r in records)
    return {
        "title": plots.family_title(family),
        "slug": plots.family_slug(family),
        "kind": "line" if len(family["lengths"]) > 1 else "bars",
        "x_title": X_TITLES.get(phase, DEFAULT_X_TITLE),
        "y_title": "median latency (ms, log scale)",
        "x_ticks": [{"x": n, "label": format_tokens(n)} for n in family["lengths"]],
        "throughput": {"field": field, "unit": unit, "roof": roof,
                       "y_title": f"{unit} from the median time (linear)"},
        "series": series,
        "headline": headline(family, roof, field, unit),
        "not_measured": not_measured_line(family),
        "note": (f"Median of the stated repeats per point, measured on {family['gpu']} "
                 f"({'; '.join(versions)}), commit {', '.join(commits)}, {dates[0]}"
                 + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
                 + ". Bands: p20\u2013p80. Hover or focus a point for its value."),
    }


def _ratio_clause(ours_ms: float, peer_ms: float, label: str) -> str:
    ratio = peer_ms / ours_ms
    factor = ratio if ratio >= 1 else 1 / ratio
    text = format_ratio(factor, 1 if factor >= 10 else 2)
    return f"{text} {'faster' if ratio >= 1 else 'slower'} than {label} ({format_ms(peer_ms)})"


def headline(family: dict, roof: dict | None, field: str, unit: str) -> str:
    """'At 4k tokens, attnlab takes X ms: Y× faster than eager (…), Z× slower than cuDNN (…).'"""
    by_length: dict[int, dict[str, dict]] = {}
    for record in family["records"]:
        by_length.setdefault(plots.swept_length(record), {})[record["provider"]] = record
    ours = [p for p in plots.family_providers(family) if plots.is_ours(p)]
    if not ours:
        return ""
    primary = max(ours, key=lambda p: sum(p in row for row in by_length.values()))
    common = [n for n, row in sorted(by_length.items())
              if primary in row and any(not plots.is_ours(p) for p in row)]
    if not common:
        return ""
    if family["phase"] != "decode" and HEADLINE_LENGTH in common:
        length = HEADLINE_LENGTH
    else:
        length = common[-1]
    row = by_length[length]
    mine = row[primary]
    ours_ms = plots.to_ms(mine)
    peers = [p for p in HEADLINE_PEERS if p in row]
    others = [p for p in row if not plots.is_ours(p)]
    fastest = min(others, key=lambda p: plots.to_ms(row[p]))
    if fastest not in peers:
        peers.append(fastest)
    clauses = [_ratio_clause(ours_ms, plots.to_ms(row[p]), plots.provider_label(p))
               for p in peers]
    where = (f"a {format_tokens(length)} KV cache" if family["phase"] == "decode"
             else f"{format_tokens(length)} tokens")
    rate = ""
    if mine.get(field) is not None:
        rate = f" ({mine[field]:.3g} {unit}"
        if roof:
            rate += f", {100 * mine[field] / roof['value']:.0f}% of {roof['name']}"
        rate += ")"
    return (f"At {where}, {plots.provider_label(primary)} takes {format_ms(ours_ms)}{rate}: "
            + ", ".join(clauses) + ".")


_IMPORT_DETAIL = re.compile(r"\s*\((?:ModuleNotFoundError|ImportError)[^)]*\)")


def _reason(record: dict) -> str:
    reason = str(record.get("reason") or "no reason given")
    provider = record["provider"]
    if reason.startswith(provider + " "):
        reason = reason[len(provider) + 1:]
        reason = reason[3:] if reason.startswith("is ") else reason
    return _IMPORT_DETAIL.sub("", reason).strip()


def not_measured_line(family: dict) -> str:
    """One line for every skipped provider of a family, grouped by reason."""
    measured = {(r["provider"], plots.swept_length(r)) for r in family["records"]}
    lengths = set(family["lengths"]) | {plots.swept_length(r) for r in family["skipped"]}
    missing: dict[str, set[int]] = {}
    reasons: dict[str, str] = {}
    for record in family["skipped"]:
        x = plots.swept_length(record)
        if (record["provider"], x) in measured:
            continue
        missing.setdefault(record["provider"], set()).add(x)
        reasons.setdefault(record["provider"], _reason(record))
    if not missing:
        return ""
    grouped: dict[str, list[str]] = {}
    for provider in sorted(missing, key=plots.provider_rank):
        where = "" if missing[provider] >= lengths else \
            " at " + ", ".join(format_tokens(n) for n in sorted(missing[provider]))
        grouped.setdefault(reasons[provider], []).append(provider + where)
    parts = [f"{', '.join(names)} ({reason})" for reason, names in grouped.items()]
    return "Not measured: " + "; ".join(parts) + "."


# ----- bytes: Nsight Compute vs the models -----------------------------------------------------
def bytes_section(cases: list[dict], notes: list[str], colours: dict[str, str],
                  folder: Path) -> dict:
    """Measured DRAM bytes of each profiled case against the cache-aware and logical models.

    The pairing of kernels with predictions is attnlab.measure.compare's; this only
    formats its result, as chart points and as the table under the chart.
    """
    from attnlab.explain.profiler import short_kernel_name
    from attnlab.measure import compare

    points, table = [], []
    notes = list(notes)
    for case in cases:
        provider, shape = case["provider"], case["shape"]
        try:
            comparison = compare.compare_case(provider, shape, case["kernels"], phase=case["phase"])
        except ValueError as error:
            notes.append(f"{provider} {shape.describe()}: {error}")
            continue
        measured, predicted = comparison.measured_total, comparison.predicted_total
        logical = comparison.logical_bytes
        error = comparison.relative_error
        label = plots.provider_label(provider)
        unmodelled = sum((k.dram_bytes_read or 0) + (k.dram_bytes_write or 0)
                         for k in comparison.unmodelled)
        text = (f"{label} \u00b7 {case['phase']} \u00b7 {shape.describe()} \u00b7 "
                f"measured {format_bytes(measured)}, cache-aware {format_bytes(predicted)} "
                f"({100 * error:+.1f}%)"
                + ("" if logical is None else f", logical {format_bytes(logical)} "
                   f"({format_ratio(logical / measured)} measured)")
                + ("" if not comparison.unmodelled else
                   f"; not compared: {len(comparison.unmodelled)} kernel"
                   f"{'s' if len(comparison.unmodelled) != 1 else ''} the model lacks "
                   f"({format_bytes(unmodelled)}: "
                   f"{', '.join(short_kernel_name(k.name) for k in comparison.unmodelled)})"))
        points.append({"provider": provider, "label": label, "colour": colours[provider],
                       "phase": case["phase"], "shape": shape.describe(),
                       "measured_bytes": measured, "cache_model_bytes": predicted,
                       "logical_bytes": logical, "relative_error": error,
                       "unmodelled_bytes": unmodelled, "text": text})
        logical_text = "n/a" if logical is None else \
            f"{format_bytes(logical)} ({format_ratio(logical / measured)} measured)"
        table.append({"provider": provider, "phase": case["phase"], "cells": [
            label, case["phase"], shape.describe(), " + ".join(p.role for p in comparison.pairs),
            format_bytes(measured), f"{format_bytes(predicted)} ({100 * error:+.1f}%)",
            logical_text]})
    # attnlab last, so the chart draws it on top of the peers it overlaps.
    points.sort(key=lambda p: plots.is_ours(p["provider"]))
    within = sum(abs(p["relative_error"]) <= BYTES_GOAL for p in points)
    fused = [p["logical_bytes"] / p["measured_bytes"] for p in points
             if p["logical_bytes"] is not None and not p["provider"].startswith("eager")]
    headline_text = ""
    if points:
        headline_text = (f"The cache-aware model is within {BYTES_GOAL:.0%} of the measured "
                         f"DRAM bytes in {within} of {len(points)} profiled cases"
                         + (f"; the logical (cold-cache) model is up to "
                            f"{format_ratio(max(fused), 0)} too high for fused kernels, whose "
                            f"K/V re-reads L2 serves" if fused else "") + ".")
    return {
        "points": points,
        "headline": headline_text,
        "table": table,
        "headers": ["provider", "phase", "shape", "kernels", "measured DRAM",
                    "cache-aware model (error)", "logical model (\u00d7 measured)"],
        "caption": ("Whole call, all heads and batch. Measured: Nsight Compute "
                    "dram__bytes_read.sum + dram__bytes_write.sum. Cache-aware: "
                    "attnlab.model.cache (H200 L2). Logical: attnlab.model.traffic, "
                    "cold cache." + (f" Left out: {'; '.join(notes)}." if notes else "")),
        "empty_message": (f"No Nsight Compute CSV of an attnlab case under "
                          f"{source_label(folder)}"
                          + (f" ({'; '.join(notes)})" if notes else "")
                          + "; the logical prediction is in section 3."),
    }
