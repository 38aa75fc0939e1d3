"""Figures from records (PNG and SVG): plots only read records, never measure.

- latency vs sequence length, per provider, log-log (prefill and decode, like the
  post's two figures);
- achieved TFLOP/s (prefill, fwd+bwd) or TB/s (decode) against the ceilings
  measured on the same GPU (``provider="ceiling"`` records), or — labelled as
  such — the datasheet's when none were measured.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from attnlab.measure.records import SKIPPED

_MARKERS = "osD^v<>PX*hd"


def _base_key(record: dict) -> str:
    """The sweep a latency record belongs to: its shape without the swept lengths."""
    shape = {k: v for k, v in record["shape"].items() if k not in ("seqlen_q", "seqlen_k")}
    return json.dumps({"phase": record["phase"], "gpu": record["gpu"], **shape}, sort_keys=True)


def _x(record: dict) -> int:
    shape = record["shape"]
    return shape["seqlen_k"] if record["phase"] == "decode" else shape["seqlen_q"]


def sweeps(records: Iterable[dict]) -> dict[str, list[dict]]:
    """Latency records grouped by sweep (phase, GPU, shape without lengths)."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        if record["metric"] == "latency" and record["kernel"] == "call":
            groups.setdefault(_base_key(record), []).append(record)
    return groups


def ceilings(records: Iterable[dict], gpu: str) -> dict[str, tuple[float, str]]:
    """{"tflops"|"tbps": (value, label)}: measured on ``gpu`` if recorded, else datasheet."""
    found: dict[str, tuple[float, str]] = {}
    for record in records:
        if record["provider"] == "ceiling" and record["gpu"] == gpu and \
                record["metric"] in ("tflops", "tbps"):
            found[record["metric"]] = (record["p50"], f"measured: {record['kernel']}")
    if len(found) < 2:
        from attnlab.model.hardware import gpu as datasheet

        try:
            sheet = datasheet(gpu.replace("NVIDIA ", ""))
        except ValueError:
            sheet = None
        if sheet is not None:
            found.setdefault("tflops", (sheet.dense_tflops, "datasheet dense FP16/BF16"))
            found.setdefault("tbps", (sheet.hbm_tbps, "datasheet HBM"))
    return found


def _slug(group: list[dict]) -> str:
    s, phase = group[0]["shape"], group[0]["phase"]
    mask = "causal" if s["causal"] else "full"
    return (f"{phase}_b{s['batch']}_hq{s['query_heads']}_hkv{s['kv_heads']}_d{s['head_dim']}"
            f"_{s['dtype']}_{mask}")


def _title(group: list[dict]) -> str:
    s, phase = group[0]["shape"], group[0]["phase"]
    lengths = "KV length" if phase == "decode" else "sequence length"
    mask = "causal" if s["causal"] else "no mask"
    return (f"{phase}: batch {s['batch']}, {s['query_heads']} query / {s['kv_heads']} KV heads, "
            f"d={s['head_dim']}, {s['dtype']}, {mask} — {group[0]['gpu']} (x: {lengths})")


def _by_provider(group: list[dict]) -> dict[str, list[dict]]:
    lines: dict[str, list[dict]] = {}
    for record in sorted(group, key=_x):
        lines.setdefault(record["provider"], []).append(record)
    return lines


def _save(fig, stem: Path) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    fig.savefig(paths[0], dpi=150, metadata={"Software": None})
    fig.savefig(paths[1], metadata={"Date": None})
    return paths


def plot_latency(group: list[dict], stem: Path) -> list[Path]:
    """Median latency vs length per provider, log-log, with the p20-p80 band as error bars."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot()
    for i, (provider, points) in enumerate(sorted(_by_provider(group).items())):
        xs = [_x(r) for r in points]
        medians = [r["p50"] for r in points]
        spread = [[r["p50"] - r["p20"] for r in points], [r["p80"] - r["p50"] for r in points]]
        ax.errorbar(xs, medians, yerr=spread, marker=_MARKERS[i % len(_MARKERS)], capsize=2,
                    label=provider)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV length (tokens)" if group[0]["phase"] == "decode" else
                  "sequence length (tokens)")
    ax.set_ylabel("latency per call, median (ms)")
    ax.set_title(_title(group), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, stem)


def plot_throughput(group: list[dict], stem: Path,
                    roofs: dict[str, tuple[float, str]]) -> list[Path]:
    """TFLOP/s and TB/s vs length per provider, with the ceilings as horizontal lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    lines = _by_provider(group)
    for ax, metric, unit in ((axes[0], "tflops", "TFLOP/s (exact FLOPs)"),
                             (axes[1], "tbps", "TB/s (compulsory bytes)")):
        for i, (provider, points) in enumerate(sorted(lines.items())):
            ax.plot([_x(r) for r in points], [r[metric] for r in points],
                    marker=_MARKERS[i % len(_MARKERS)], label=provider)
        if metric in roofs:
            value, label = roofs[metric]
            ax.axhline(value, color="black", linestyle="--", linewidth=1)
            ax.annotate(f"{value:.3g} {unit.split()[0]} ({label})", (0.01, value),
                        xycoords=("axes fraction", "data"), fontsize=7, va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV length" if group[0]["phase"] == "decode" else "sequence length")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(_title(group), fontsize=9)
    return _save(fig, stem)


def plot_records(records: Sequence[dict], out_dir: str | Path) -> list[Path]:
    """Every sweep in ``records``: a latency figure and a throughput figure each."""
    out_dir = Path(out_dir)
    written: list[Path] = []
    groups = sweeps(r for r in records if r["metric"] != SKIPPED)
    if not groups:
        raise ValueError("no latency records to plot (metric='latency', kernel='call')")
    for group in groups.values():
        slug = _slug(group)
        written += plot_latency(group, out_dir / f"{slug}_latency")
        written += plot_throughput(group, out_dir / f"{slug}_throughput",
                                   ceilings(records, group[0]["gpu"]))
    return written
