"""Figures from records (PNG): one question per figure, readable at README width.

- ``*_latency.png``: how long does one call take, per provider, as the length grows?
  Log-log, attnlab drawn on top and thicker, every provider's p20-p80 as a band.
- ``*_throughput.png``: how close to the GPU's measured ceiling?  TFLOP/s against the
  matrix roof for compute-bound phases (prefill, forward + backward), TB/s against the
  copy ceiling for decode (bandwidth-bound: a TFLOP/s panel there would read as zero).
- ``forward_tflops.png`` (:func:`plot_tflops_grid`): TFLOP/s of up to four prefill
  workloads in a 2 x 2 grid, for the README.

The ceilings are records too (``provider="ceiling"``, measured on the same GPU); a
datasheet value is used only when none was measured, and is labelled as such.
This module also holds the one provider palette and the one grouping of records into
workload families, so the PNGs and the explainer page agree on both.  Plots only read
records, never measure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from attnlab.measure.records import SKIPPED
from attnlab.shapes import format_tokens

# ----- providers: one palette, one order ------------------------------------------------------
# Known providers in the order a reader looks for them; their colour is fixed by this
# position, so a provider keeps its colour on every chart and page.  attnlab comes first.
PROVIDER_ORDER = ("attnlab", "attnlab_decode", "eager", "sdpa_cudnn", "sdpa_flash", "flex",
                  "flashinfer", "flash_attn", "sdpa", "eager_typical", "sdpa_efficient",
                  "sdpa_math")
# 16 distinguishable colours: the first 12 for PROVIDER_ORDER, the rest for providers this
# table does not know yet (beyond 16 they repeat, each still with its own label).
PALETTE = ("#1b6ac9", "#0b3d91", "#495057", "#2b8a3e", "#e67700", "#862e9c", "#c2255c",
           "#d9480f", "#0b7285", "#adb5bd", "#82c91e", "#a0522d", "#f06595", "#15aabf",
           "#fab005", "#5f3dc4",
           # spares for providers the records add (decode variants, varlen, determinism)
           "#364fc7", "#087f5b", "#e8590c", "#9c36b5", "#5c940d", "#c92a2a", "#1098ad",
           "#f59f00", "#868e96", "#d6336c", "#3b5bdb", "#2f9e44")
PROVIDER_LABELS = {
    "attnlab": "attnlab", "attnlab_decode": "attnlab decode", "eager": "eager PyTorch",
    "eager_typical": "eager (typical)", "sdpa": "SDPA (auto)", "sdpa_cudnn": "cuDNN (SDPA)",
    "sdpa_flash": "FA2 (SDPA flash)", "sdpa_efficient": "SDPA mem-efficient",
    "sdpa_math": "SDPA math", "flex": "FlexAttention", "flash_attn": "flash-attn",
    "flashinfer": "FlashInfer", "fa4": "FlashAttention-4", "fa4_paged16": "FA4 (paged 16)",
    "flashinfer_paged16": "FlashInfer (paged 16)", "attnlab_decode_paged16": "attnlab decode (paged 16)",
}
# How many providers a chart shows before the reader asks for more.
DEFAULT_VISIBLE = 4
CEILING_PROVIDER = "ceiling"
# The ceiling each phase is held against: (record field, ceiling metric, axis label).
PHASE_ROOFS = {
    "prefill": ("tflops", "tflops", "TFLOP/s"),
    "fwdbwd": ("tflops", "tflops", "TFLOP/s"),
    "decode": ("tbps", "tbps", "TB/s"),
}
MS_PER_UNIT = {"ms": 1.0, "us": 1e-3, "s": 1e3}
# Figure sizes in inches at DPI: 960 x 540 px (one panel), 984 x 768 px (2 x 2), one README
# column.
FIGURE_SIZE = (8.0, 4.5)
GRID_SIZE = (8.2, 6.4)
DPI = 120


def is_ours(provider: str) -> bool:
    return provider.startswith("attnlab")


def provider_rank(provider: str) -> tuple[int, str]:
    """Sort key: the known order first, unknown providers after, by name."""
    if provider in PROVIDER_ORDER:
        return (PROVIDER_ORDER.index(provider), provider)
    return (len(PROVIDER_ORDER), provider)


def provider_label(provider: str) -> str:
    return PROVIDER_LABELS.get(provider, provider)


def provider_colours(providers: Iterable[str]) -> dict[str, str]:
    """A colour per provider: fixed for known ones, the next free ones for the rest."""
    colours = {p: PALETTE[PROVIDER_ORDER.index(p)] for p in set(providers) if p in PROVIDER_ORDER}
    spare = PALETTE[len(PROVIDER_ORDER):]
    unknown = sorted(p for p in set(providers) if p not in PROVIDER_ORDER)
    for index, provider in enumerate(unknown):
        colours[provider] = spare[index % len(spare)]
    return colours


# ----- records -> workload families --------------------------------------------------------
def is_latency(record: dict) -> bool:
    """A timed whole call (what the latency charts plot)."""
    return (record.get("metric") == "latency" and record.get("kernel") == "call"
            and record.get("unit") in MS_PER_UNIT and bool(record.get("shape")))


def to_ms(record: dict, key: str = "p50") -> float | None:
    value = record.get(key)
    return None if value is None else value * MS_PER_UNIT[record["unit"]]


def swept_length(record: dict) -> int:
    """The x of a record: the KV length for decode, the sequence length otherwise."""
    shape = record["shape"]
    return shape["seqlen_k"] if record["phase"] == "decode" else shape["seqlen_q"]


def _fixed_key(record: dict) -> str:
    """Phase, GPU and the shape without what a sweep varies (lengths, batch, tiles)."""
    fixed = {k: v for k, v in record["shape"].items()
             if k not in ("seqlen_q", "seqlen_k", "batch", "block_m", "block_n")}
    if record["phase"] == "decode":
        fixed["seqlen_q"] = record["shape"]["seqlen_q"]
    return json.dumps({"phase": record["phase"], "gpu": record["gpu"], **fixed},
                      sort_keys=True)


def workload_families(records: Iterable[dict], phase: str | None = None) -> list[dict]:
    """Latency and skipped records grouped into the workloads one chart can hold.

    A family is one shape but the swept length; the batch may change along the sweep
    (constant tokens: B x N fixed, as the forward benchmark does) as long as each length
    has one batch.  Where lengths repeat with different batches, each batch is its own
    family.  Returns dicts with ``phase, gpu, shape`` (the first record's), ``lengths``,
    ``batches`` ({length: batch}), ``records`` (latency, later records replacing earlier
    ones of the same provider and length) and ``skipped``; longest sweeps first.
    """
    grouped: dict[str, list[dict]] = {}
    for record in records:
        if not record.get("shape") or (phase is not None and record.get("phase") != phase):
            continue
        if is_latency(record) or record.get("metric") == SKIPPED:
            grouped.setdefault(_fixed_key(record), []).append(record)
    families = []
    for members in grouped.values():
        batches: dict[int, set[int]] = {}
        for record in members:
            batches.setdefault(swept_length(record), set()).add(record["shape"]["batch"])
        if all(len(b) == 1 for b in batches.values()):
            splits = [members]
        else:
            by_batch: dict[int, list[dict]] = {}
            for record in members:
                by_batch.setdefault(record["shape"]["batch"], []).append(record)
            splits = [by_batch[b] for b in sorted(by_batch)]
        for split in splits:
            family = _family(split)
            if family["records"]:
                families.append(family)
    families.sort(key=lambda f: (-len(f["lengths"]), f["phase"], family_title(f)))
    return families


def _family(members: list[dict]) -> dict:
    latest: dict[tuple[str, int], dict] = {}
    skipped = []
    for record in members:
        if record["metric"] == SKIPPED:
            skipped.append(record)
        else:
            latest[(record["provider"], swept_length(record))] = record
    timed = sorted(latest.values(), key=lambda r: (provider_rank(r["provider"]), swept_length(r)))
    first = timed[0] if timed else members[0]
    return {
        "phase": first["phase"], "gpu": first["gpu"], "shape": dict(first["shape"]),
        "lengths": sorted({swept_length(r) for r in timed}),
        "batches": {swept_length(r): r["shape"]["batch"] for r in timed},
        "records": timed, "skipped": skipped,
    }


def family_providers(family: dict) -> list[str]:
    return sorted({r["provider"] for r in family["records"]}, key=provider_rank)


def batch_text(family: dict) -> str:
    """``batch 1``; ``batch x N = 16k tokens (B 16 -> 1)`` when the batch shrinks as N grows."""
    batches = family["batches"]
    values = [batches[n] for n in sorted(batches)]
    if len(set(values)) <= 1:
        return f"batch {values[0] if values else family['shape']['batch']}"
    tokens = {n * batches[n] for n in batches}
    if len(tokens) == 1:
        return (f"batch \u00d7 N = {format_tokens(tokens.pop())} tokens "
                f"(B {values[0]} \u2192 {values[-1]})")
    return f"batch {values[0]} \u2192 {values[-1]}"


def family_title(family: dict) -> str:
    s, phase = family["shape"], family["phase"]
    heads = (f"{s['query_heads']} heads" if s["query_heads"] == s["kv_heads"]
             else f"{s['query_heads']} query / {s['kv_heads']} KV heads")
    mask = "causal" if s["causal"] else "no mask"
    if list(s.get("window", [-1, -1])) != [-1, -1]:
        mask += f", window {tuple(s['window'])}"
    queries = ""
    if phase == "decode":
        queries = f", {s['seqlen_q']} query token" + ("s" if s["seqlen_q"] > 1 else "")
    return (f"{batch_text(family)}, {heads}, d={s['head_dim']}, {s['dtype']}, {mask}{queries} "
            f"\u2014 {family['gpu']}")


def family_slug(family: dict) -> str:
    """A file name stem: phase, batch (or tokens), heads, head dim, dtype, mask."""
    s, phase = family["shape"], family["phase"]
    batches = set(family["batches"].values())
    if len(batches) <= 1:
        batch = f"b{batches.pop() if batches else s['batch']}"
    else:
        tokens = {n * b for n, b in family["batches"].items()}
        batch = f"t{tokens.pop()}" if len(tokens) == 1 else "bvar"
    mask = "causal" if s["causal"] else "full"
    window = list(s.get("window", [-1, -1]))
    extra = f"_w{window[0]}-{window[1]}" if window != [-1, -1] else ""
    if phase == "decode" and s["seqlen_q"] != 1:
        extra += f"_q{s['seqlen_q']}"
    return (f"{phase}_{batch}_hq{s['query_heads']}_hkv{s['kv_heads']}_d{s['head_dim']}"
            f"_{s['dtype']}_{mask}{extra}")


# The device-to-device copy a decode benchmark times beside its points (bench/decode_h200.py):
# the bandwidth ceiling of that same run, used where no "ceiling" record exists.
COPY_PROVIDER = "device_copy"


def ceilings(records: Iterable[dict], gpu: str) -> dict[str, tuple[float, str]]:
    """{"tflops"|"tbps": (value, label)}: measured on ``gpu`` if recorded, else datasheet."""
    found: dict[str, tuple[float, str]] = {}
    copies: list[float] = []
    for record in records:
        if record["gpu"] != gpu:
            continue
        if record["provider"] == CEILING_PROVIDER and record["metric"] in ("tflops", "tbps"):
            found[record["metric"]] = (record["p50"], f"measured: {record['kernel']}")
        elif record["provider"] == COPY_PROVIDER and record.get("tbps"):
            copies.append(record["tbps"])  # bench/decode_h200.py's copy, timed in its run
    if "tbps" not in found and copies:
        found["tbps"] = (max(copies), "measured: device copy (read + written)")
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


def with_sibling_ceilings(records: list[dict], path: str | Path) -> list[dict]:
    """``records`` read from the file ``path``, plus the measured ceilings recorded in the
    other record files of its folder when it has none of its own: a phase's file
    (fwdbwd.jsonl) holds no roof, the GEMM and copy ceilings measured on the same GPU
    beside it (measure.jsonl) are its roof (:func:`ceilings` keeps only the same GPU's)."""
    from attnlab.measure.records import load_records

    path = Path(path)
    if not path.is_file() or any(r["provider"] == CEILING_PROVIDER for r in records):
        return records
    return records + [r for r in load_records(path.parent) if r["provider"] == CEILING_PROVIDER]


# ----- drawing --------------------------------------------------------------------------------
def _token_axis(ax, lengths: Sequence[int]) -> None:
    """Log x axis with ticks at the measured lengths, written 1k, 4k, 128k."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(list(lengths)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([format_tokens(n) for n in lengths])
    if lengths:
        ax.set_xlim(min(lengths) / 1.3, max(lengths) * 1.3)


def _style(provider: str, colours: dict[str, str]) -> dict:
    ours = is_ours(provider)
    return {"color": colours[provider], "linewidth": 2.8 if ours else 1.4,
            "markersize": 6 if ours else 4, "zorder": 5 if ours else 3,
            "alpha": 1.0 if ours else 0.85, "label": provider_label(provider)}


def _lines(family: dict) -> dict[str, list[dict]]:
    lines: dict[str, list[dict]] = {}
    for record in family["records"]:
        lines.setdefault(record["provider"], []).append(record)
    return {p: sorted(rs, key=swept_length) for p, rs in lines.items()}


def _legend_outside(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False,
              borderaxespad=0.0)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def _figure(size=FIGURE_SIZE):
    from matplotlib.figure import Figure

    return Figure(figsize=size, layout="constrained")


def plot_latency(family: dict, path: Path) -> Path:
    """Median latency vs length per provider (log-log), each with its p20-p80 band."""
    if len(family["lengths"]) == 1:
        return _plot_latency_bars(family, path)
    fig = _figure()
    ax = fig.add_subplot()
    colours = provider_colours(family_providers(family))
    for provider, points in sorted(_lines(family).items(), key=lambda i: provider_rank(i[0])):
        xs = [swept_length(r) for r in points]
        ax.plot(xs, [to_ms(r) for r in points], marker="o", **_style(provider, colours))
        low = [to_ms(r, "p20") for r in points]
        high = [to_ms(r, "p80") for r in points]
        if None not in low and None not in high:
            ax.fill_between(xs, low, high, color=colours[provider], alpha=0.18, linewidth=0,
                            zorder=2)
    ax.set_yscale("log")
    _token_axis(ax, family["lengths"])
    ax.set_xlabel("KV-cache length (tokens)" if family["phase"] == "decode"
                  else "sequence length (tokens)")
    ax.set_ylabel("latency per call, median (ms)")
    ax.set_title(f"{family['phase']}: {family_title(family)}", fontsize=9, loc="left")
    ax.grid(True, which="major", alpha=0.3)
    _legend_outside(ax)
    return _save(fig, path)


def _plot_latency_bars(family: dict, path: Path) -> Path:
    """One length only: a bar per provider (a lone dot on a log axis answers nothing)."""
    fig = _figure()
    ax = fig.add_subplot()
    records = sorted(family["records"], key=lambda r: provider_rank(r["provider"]))
    colours = provider_colours(family_providers(family))
    rows = range(len(records))
    medians = [to_ms(r) for r in records]
    errors = [[m - (to_ms(r, "p20") or m) for m, r in zip(medians, records, strict=True)],
              [(to_ms(r, "p80") or m) - m for m, r in zip(medians, records, strict=True)]]
    ax.barh(rows, medians, xerr=errors, color=[colours[r["provider"]] for r in records],
            capsize=2)
    ax.set_yticks(list(rows), [provider_label(r["provider"]) for r in records], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("latency per call, median (ms; bars p20-p80)")
    length = format_tokens(family["lengths"][0])
    ax.set_title(f"{family['phase']} at {length}: {family_title(family)}", fontsize=9, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def _draw_throughput(ax, family: dict, roofs: dict, *, legend: bool) -> None:
    field, roof_metric, unit = PHASE_ROOFS.get(family["phase"], PHASE_ROOFS["prefill"])
    colours = provider_colours(family_providers(family))
    peak = 0.0
    for provider, points in sorted(_lines(family).items(), key=lambda i: provider_rank(i[0])):
        points = [r for r in points if r.get(field) is not None]
        if not points:
            continue
        values = [r[field] for r in points]
        peak = max(peak, *values)
        ax.plot([swept_length(r) for r in points], values, marker="o",
                **_style(provider, colours))
    if roof_metric in roofs:
        value, label = roofs[roof_metric]
        ax.axhline(value, color="black", linestyle="--", linewidth=1)
        ax.text(0.99, value, f"{label}: {value:.3g} {unit}", transform=ax.get_yaxis_transform(),
                ha="right", va="bottom", fontsize=7)
        peak = max(peak, value)
    ax.set_ylim(0, peak * 1.12 if peak else 1)
    _token_axis(ax, family["lengths"])
    ax.set_ylabel(f"{unit}, from the median time")
    ax.grid(True, alpha=0.3)
    if legend:
        _legend_outside(ax)


def plot_throughput(family: dict, path: Path, roofs: dict[str, tuple[float, str]]) -> Path:
    """TFLOP/s against the matrix roof (prefill, fwd+bwd) or TB/s against the copy ceiling
    (decode), per provider."""
    fig = _figure()
    ax = fig.add_subplot()
    _draw_throughput(ax, family, roofs, legend=True)
    ax.set_xlabel("KV-cache length (tokens)" if family["phase"] == "decode"
                  else "sequence length (tokens)")
    ax.set_title(f"{family['phase']}: {family_title(family)}", fontsize=9, loc="left")
    return _save(fig, path)


def plot_tflops_grid(records: Sequence[dict], path: Path, phase: str = "prefill") -> Path:
    """Up to four workloads of ``phase`` (longest sweeps first) in a 2 x 2 grid of TFLOP/s
    against the measured roof, one legend for all."""
    families = [f for f in workload_families(records, phase) if len(f["lengths"]) > 1][:4]
    if not families:
        raise ValueError(f"no {phase} sweep with more than one length to plot")
    fig = _figure(GRID_SIZE)
    axes = fig.subplots(2, 2, squeeze=False).ravel()
    for ax, family in zip(axes, families, strict=False):
        _draw_throughput(ax, family, ceilings(records, family["gpu"]), legend=False)
        # Without the GPU (in the suptitle) and the batch steps, so titles fit a half width.
        title = re.sub(r" \(B [^)]*\)", "", family_title(family).rsplit(" \u2014 ", 1)[0])
        ax.set_title(title, fontsize=8, loc="left")
        ax.set_xlabel("sequence length (tokens)", fontsize=8)
    for ax in axes[len(families):]:
        ax.set_visible(False)
    handles: dict[str, object] = {}
    for ax in axes[:len(families)]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncols=min(len(handles), 5), fontsize=8, frameon=False)
    fig.suptitle(f"{phase} TFLOP/s against the measured matrix roof \u2014 {families[0]['gpu']}",
                 fontsize=10)
    return _save(fig, path)


def plot_records(records: Sequence[dict], out_dir: str | Path) -> list[Path]:
    """Every workload family in ``records``: a latency figure and a throughput figure each."""
    out_dir = Path(out_dir)
    families = workload_families(records)
    if not families:
        raise ValueError("no latency records to plot (metric='latency', kernel='call')")
    written: list[Path] = []
    for family in families:
        slug = family_slug(family)
        written.append(plot_latency(family, out_dir / f"{slug}_latency.png"))
        written.append(plot_throughput(family, out_dir / f"{slug}_throughput.png",
                                       ceilings(records, family["gpu"])))
    return written
