"""The page's profiler section: what Nsight Compute and the kernel lists say, per kernel.

Two committed sources under the results folder, both written on the GPU:

- ``kernels.json`` (``attnlab kernels`` / ``bench/h200_measure.py``): the kernels one
  provider call launched, their time, and the share outside the matrix multiplies;
- Nsight Compute CSVs (``attnlab ncu``): per kernel, speed of light (compute and memory
  as % of peak), warp-stall reasons, achieved occupancy and the launch grid against the
  SM count.

Every chart row and sentence is built here from those files; a metric or a phase the
files do not hold is named in one line, never filled in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from attnlab.explain.units import format_ms, format_tokens, format_us
from attnlab.measure import plots
from attnlab.measure.records import CSV_SUFFIX, source_label

KERNEL_LISTS = "kernels.json"
GEMM_COLOUR = "#1b6ac9"
OTHER_COLOUR = "#e8590c"
SOL_COLOURS = {"compute": "#2b8a3e", "memory": "#e67700"}
# Warp-stall reasons shown by name (the largest of a case, at most this many); the rest
# are summed into "other".
STALL_REASONS_SHOWN = 6
STALL_COLOURS = ("#1b6ac9", "#e67700", "#2b8a3e", "#c2255c", "#862e9c", "#0b7285")
STALL_OTHER_COLOUR = "#ced4da"
# Kernel names in chart labels are cut to this many characters (cuDNN's run to ~100).
SHORT_NAME_CHARS = 40
ROW_NAME_CHARS = 26


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


# The phases the page wants profiled; one it lacks gets a line saying how to add it.
WANTED_PHASES = ("prefill", "decode")
NCU_COMMANDS = {
    "decode": ("attnlab ncu --phase decode --providers attnlab,sdpa_cudnn,sdpa_flash "
               "--seqlens 4096,65536 --kv-heads 8 --causal"),
    "prefill": "attnlab ncu --providers eager,sdpa_flash,sdpa_cudnn,attnlab --seqlens 4096",
}


def short_kernel_name(name: str) -> str:
    """``void at::native::cunn_SoftMaxForwardReg<c10::Half, …>(…)`` -> ``cunn_SoftMaxForwardReg``."""
    text = re.sub(r"^void\s+", "", name.strip())
    text = text.replace("<unnamed>", "").replace("(anonymous namespace)", "")
    depth, cut = 0, len(text)
    for index, char in enumerate(text):
        if char in "<(" and depth == 0:
            cut = index
            break
    text = text[:cut]
    return text.rsplit("::", 1)[-1] or name[:40]


# ----- Nsight Compute cases ---------------------------------------------------------------------
def ncu_cases(folder: Path) -> tuple[list[dict], list[str]]:
    """Profiled attnlab cases from every Nsight Compute CSV under ``folder``.

    Returns ({label, provider, phase, shape, kernels}) dicts, one per case (the first
    CSV that holds a case wins, so a raw twin of a long CSV is not counted twice), and
    notes on what was left out.
    """
    from attnlab.measure import ncu

    cases: dict[str, dict] = {}
    notes: list[str] = []
    for path in sorted(folder.rglob("*.csv")):
        if path.name.endswith(CSV_SUFFIX):
            continue  # the records' own CSV twin (attnlab.measure.records), not ncu's
        try:
            kernels = ncu.join_preceding_case(ncu.parse_csv(path))
        except ValueError:
            notes.append(f"{path.name} is not an Nsight Compute CSV")
            continue
        outside = sum(1 for k in kernels if not k.case)
        if outside:
            notes.append(f"{outside} kernel{'s' if outside != 1 else ''} of {path.name} ran "
                         f"outside an attnlab case range")
        for label, members in ncu.group_by_case(kernels).items():
            if label in cases:
                continue
            try:
                provider, phase, shape = ncu.parse_case_label(label)
            except (ValueError, KeyError):
                notes.append(f"case {label!r} is not an attnlab case label")
                continue
            cases[label] = {"label": label, "provider": provider, "phase": phase,
                            "shape": shape, "kernels": members}
    ordered = sorted(cases.values(), key=lambda c: (c["phase"], c["shape"].seqlen_k,
                                                    c["shape"].query_heads,
                                                    plots.provider_rank(c["provider"])))
    return ordered, notes


def _kernel_row(case: dict, kernel, role: str, colours: dict[str, str]) -> dict:
    summary = kernel.summary()
    label = plots.provider_label(case["provider"])
    short = short_kernel_name(kernel.name)
    short = _cut(short, SHORT_NAME_CHARS)
    grid, sms = summary["grid_size"], summary["sms"]
    return {
        "provider": case["provider"], "label": label, "colour": colours[case["provider"]],
        "ours": plots.is_ours(case["provider"]),
        "row_label": f"{label}: {role}" if role not in ("attention", "other")
        else f"{label}: {_cut(short, ROW_NAME_CHARS)}",
        "kernel": kernel.name, "short_name": short, "role": role,
        "duration_us": None if summary["duration_ns"] is None else summary["duration_ns"] / 1e3,
        "sol_compute_pct": summary["sol_compute_pct"],
        "sol_memory_pct": summary["sol_memory_pct"],
        "occupancy_pct": summary["achieved_occupancy_pct"],
        "grid_blocks": grid, "sms": sms,
        "blocks_per_sm": None if grid is None or not sms else grid / sms,
        "threads_per_block": kernel.threads,
        "registers_per_thread": summary["registers_per_thread"],
        "shared_bytes_per_block": summary["shared_bytes_per_block"],
        "cycles_per_issue": summary["cycles_per_issue"],
        "warp_stalls": summary["warp_stalls"],
    }


def _shape_title(phase: str, shape) -> str:
    heads = (f"{shape.query_heads} heads" if shape.query_heads == shape.kv_heads
             else f"{shape.query_heads} query / {shape.kv_heads} KV heads")
    length = (f"{format_tokens(shape.seqlen_k)} KV cache" if phase == "decode"
              else f"N = {format_tokens(shape.seqlen_q)}")
    mask = "causal" if shape.causal else "no mask"
    return (f"{phase}, {length}, batch {shape.batch}, {heads}, d={shape.head_dim}, "
            f"{shape.dtype}, {mask}")


_ATTENTION_ROLES = ("attention", "split_kv")


def _main_kernels(rows: list[dict]) -> list[dict]:
    """Each provider's main kernel, in provider order: its attention kernel (the fused or
    split-KV one) when it has one, else its longest.  Under ncu's per-kernel cache flush
    a split-KV call's small combine kernel can outlast the split kernel (FA2's at 1 x 4k:
    17 vs 10 us), yet the split kernel is what the call is."""
    def rank(row: dict) -> tuple[bool, float]:
        return row.get("role") in _ATTENTION_ROLES, row["duration_us"] or 0

    best: dict[str, dict] = {}
    for row in rows:
        current = best.get(row["provider"])
        if current is None or rank(row) > rank(current):
            best[row["provider"]] = row
    return [best[p] for p in sorted(best, key=plots.provider_rank)]


def _pct(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.0f}%"


def _stall_summary(rows: list[dict]) -> tuple[list[dict], list[str]]:
    totals: dict[str, float] = {}
    for row in rows:
        for reason, value in row["warp_stalls"].items():
            totals[reason] = totals.get(reason, 0.0) + value
    shown = [r for r, _ in sorted(totals.items(), key=lambda item: -item[1])
             if r != "selected"][:STALL_REASONS_SHOWN]
    legend = [{"reason": r, "label": r.replace("_", " "), "colour": STALL_COLOURS[i]}
              for i, r in enumerate(shown)]
    legend.append({"reason": "other", "label": "other (incl. selected)",
                   "colour": STALL_OTHER_COLOUR})
    return legend, shown


def profiled_workload(phase: str, shape, cases: list[dict], colours: dict[str, str]) -> dict:
    from attnlab.measure import compare

    rows = []
    for case in cases:
        kernels = case["kernels"]
        for role, kernel in zip(compare.measured_roles(kernels), kernels, strict=True):
            rows.append(_kernel_row(case, kernel, role, colours))
    legend, shown = _stall_summary(rows)
    for row in rows:
        stalls = row["warp_stalls"]
        segments = [{"reason": r, "value": stalls.get(r, 0.0)} for r in shown]
        segments.append({"reason": "other",
                         "value": sum(v for r, v in stalls.items() if r not in shown)})
        row["stall_segments"] = segments
    main = _main_kernels(rows)
    sol = "; ".join(f"{r['label']} ({r['short_name']}) {_pct(r['sol_compute_pct'])} compute, "
                    f"{_pct(r['sol_memory_pct'])} memory in {format_ms(r['duration_us'] / 1e3)}"
                    for r in main if r["duration_us"] is not None)
    stall_parts = []
    for r in main:
        if r["cycles_per_issue"] is None:
            continue
        top = next(((k, v) for k, v in r["warp_stalls"].items() if k != "selected"), None)
        stall_parts.append(f"{r['label']} {r['cycles_per_issue']:.2f}"
                           + (f" (most: {top[0].replace('_', ' ')}, {top[1]:.2f})" if top else ""))
    occupancy_parts = []
    for r in main:
        if r["grid_blocks"] is None:
            continue
        part = f"{r['label']} {r['grid_blocks']:,} blocks"
        if r["threads_per_block"]:
            part += f" of {r['threads_per_block']} threads"
        if r["blocks_per_sm"] is not None:
            part += f" on {r['sms']} SMs ({r['blocks_per_sm']:.2f} per SM)"
        if r["occupancy_pct"] is not None:
            part += f", {r['occupancy_pct']:.1f}% achieved occupancy"
        occupancy_parts.append(part)
    sms = sorted({r["sms"] for r in rows if r["sms"]})
    return {
        "key": f"{phase}|{shape.describe()}",
        "title": _shape_title(phase, shape),
        "phase": phase,
        "rows": rows,
        "stall_legend": legend,
        "sms": sms[0] if len(sms) == 1 else None,
        "sol_sentence": f"Speed of light, each call's main kernel: {sol}." if sol else "",
        "stall_sentence": ("Warp cycles between issued instructions: " + "; ".join(stall_parts)
                           + ".") if stall_parts else "",
        "occupancy_sentence": ("Launch: " + "; ".join(occupancy_parts) + ".")
        if occupancy_parts else "",
    }


# ----- kernel lists (attnlab kernels) -----------------------------------------------------------
def _load_kernel_lists(folder: Path) -> list[dict]:
    path = folder / KERNEL_LISTS
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of kernel lists")
    return entries


def _entry_title(entry: dict) -> str:
    from attnlab.shapes import AttentionShape

    shape = AttentionShape.from_dict(entry["shape"])
    return f"{plots.provider_label(entry['provider'])} \u2014 {_shape_title(entry['phase'], shape)}"


def kernel_list(entry: dict, entries: list[dict], colours: dict[str, str]) -> dict:
    """One call's kernels as bars (GEMMs vs the rest), its sentence, and how many kernels
    the other providers launched for the same phase and shape."""
    kernels = sorted(entry["kernels"], key=lambda k: -k["total_us"])
    gemms = [k for k in kernels if k["is_gemm"]]
    label = plots.provider_label(entry["provider"])
    sentence = (f"{label} launches {entry['launches']} kernel"
                f"{'s' if entry['launches'] != 1 else ''} ({len(kernels)} distinct) in "
                f"{format_us(entry['total_us'])}")
    if gemms:
        sentence += (f"; {100 * entry['outside_gemm_share']:.1f}% of that time is outside its "
                     f"{sum(k['calls'] for k in gemms)} matrix multiplies, which take "
                     f"{format_us(entry['gemm_us'])}")
    else:
        sentence += ": " + ", ".join(f"{k['short_name']} ({format_us(k['total_us'])})"
                                     for k in kernels)
    peers = [e for e in entries if e["phase"] == entry["phase"] and e["shape"] == entry["shape"]]
    peers.sort(key=lambda e: plots.provider_rank(e["provider"]))
    return {
        "title": _entry_title(entry),
        "provider": entry["provider"],
        "launches": entry["launches"],
        "distinct": len(kernels),
        "total_us": entry["total_us"],
        "gemm_us": entry["gemm_us"],
        "outside_gemm_share": entry["outside_gemm_share"],
        "sentence": sentence + ".",
        "kernels": [{"name": k["short_name"], "label": _cut(k["short_name"], SHORT_NAME_CHARS),
                     "calls": k["calls"], "total_us": k["total_us"],
                     "is_gemm": k["is_gemm"],
                     "colour": GEMM_COLOUR if k["is_gemm"] else OTHER_COLOUR,
                     "text": (f"{k['short_name']}: {k['calls']} call"
                              f"{'s' if k['calls'] != 1 else ''}, {format_us(k['total_us'])}"
                              f"{' (GEMM)' if k['is_gemm'] else ''}")} for k in kernels],
        "launch_counts": [{"provider": e["provider"], "label": plots.provider_label(e["provider"]),
                           "colour": colours.get(e["provider"], plots.PALETTE[-1]),
                           "launches": e["launches"], "total_us": e["total_us"],
                           "text": (f"{plots.provider_label(e['provider'])}: {e['launches']} "
                                    f"launch{'es' if e['launches'] != 1 else ''}, "
                                    f"{format_us(e['total_us'])}")} for e in peers],
    }


def _default_kernel_list(entries: list[dict]) -> int:
    """The eager baseline with the most launches in prefill (the post's picture), else 0."""
    eager = [i for i, e in enumerate(entries)
             if e["provider"].startswith("eager") and e["phase"] == "prefill"]
    if not eager:
        return 0
    return max(eager, key=lambda i: entries[i]["launches"])


def profiler_section(results_dir: Path | str | None, colours: dict[str, str] | None = None,
                     ncu: tuple[list[dict], list[str]] | None = None) -> dict:
    """Kernel lists and per-kernel Nsight Compute metrics, or why there are none.

    ``colours``: the page's provider colours (others are added); ``ncu``: the folder's
    :func:`ncu_cases`, when the caller already parsed them.
    """
    empty = {"available": False, "kernel_lists": [], "kernel_list_default": 0,
             "workloads": [], "workload_default": 0, "missing": [],
             "source": "none" if results_dir is None else source_label(results_dir)}
    if results_dir is None or not Path(results_dir).is_dir():
        empty["empty_message"] = ("No results folder, so no profiler data: the kernel lists "
                                  "and Nsight Compute metrics come from a GPU run.")
        return empty
    folder = Path(results_dir)
    label = source_label(folder)  # the page never names this machine's paths
    entries = _load_kernel_lists(folder)
    cases, _ = ncu if ncu is not None else ncu_cases(folder)
    providers = {e["provider"] for e in entries} | {c["provider"] for c in cases}
    if colours is None:
        colours = plots.provider_colours(providers)
    else:
        colours = {**plots.provider_colours(providers), **colours}
    lists = [kernel_list(e, entries, colours) for e in entries]
    grouped: dict[tuple, list[dict]] = {}
    for case in cases:
        grouped.setdefault((case["phase"], case["shape"].describe()), []).append(case)
    workloads = [profiled_workload(members[0]["phase"], members[0]["shape"], members, colours)
                 for members in grouped.values()]
    default_workload = 0
    if workloads:
        # The post profiles prefill at 4k with many heads: the largest head count at 4k
        # (prefill before decode), else the first.
        at_4k = [i for i, w in enumerate(workloads)
                 if grouped[list(grouped)[i]][0]["shape"].seqlen_k == 4096]
        if at_4k:
            default_workload = max(at_4k, key=lambda i: (
                workloads[i]["phase"] == "prefill",
                grouped[list(grouped)[i]][0]["shape"].query_heads))
    profiled = {w["phase"] for w in workloads}
    missing = [f"{phase.capitalize()} is not in the committed Nsight Compute data "
               f"({label}/ncu); run `{NCU_COMMANDS.get(phase, 'attnlab ncu --phase ' + phase)}`"
               f" on a GPU to add its speed of light, stalls, occupancy and blocks per SM."
               for phase in WANTED_PHASES if phase not in profiled]
    return {
        "available": bool(lists or workloads),
        "source": label,
        "empty_message": (f"{label} holds no {KERNEL_LISTS} and no Nsight Compute CSV of an "
                          f"attnlab case."),
        "kernel_lists": lists,
        "kernel_list_default": _default_kernel_list(entries),
        "workloads": workloads,
        "workload_default": default_workload,
        "sol_colours": SOL_COLOURS,
        "missing": missing,
    }
