"""The exact models' reports: the dicts `attnlab traffic | memory | amdahl | roofline |
exercises` print, built from :mod:`attnlab.model` (and, for the exercises, the
reference's online-softmax walk and :mod:`attnlab.masking`'s tile plan).

Every number carries its scope; bytes are exact integers.  The CLI only parses the
options and prints these dicts (tables, or JSON with ``--json``).
"""

from __future__ import annotations

import json
from pathlib import Path

# A peaks file holds a few JSON lines; anything past this is not one.
MAX_PEAKS_FILE_BYTES = 1 << 20


def traffic_report(shape, *, scope: str = "head", layers: int | None = None,
                   score_dtype: str | None = None, condition: str = "both",
                   write_lse: bool = False, pack_gqa: bool = False,
                   backward: str | None = None, decode_splits: int | None = None,
                   cross_condition: bool = False) -> dict:
    """Rows (Traffic.as_dict) and matched ratios for one shape; ``condition`` in
    {'both', 'unmasked', 'causal'}."""
    from attnlab.model import traffic

    if condition not in ("both", "unmasked", "causal"):
        raise ValueError(f"condition must be 'both', 'unmasked' or 'causal', got {condition!r}")
    kw = {"scope": scope, "layers": layers}
    unmasked = shape.replace(causal=False, window=(-1, -1))
    masked = shape.replace(causal=True) if not shape.has_window else shape
    rows, ratios = [], []
    if condition in ("both", "unmasked"):
        naive3 = traffic.naive_traffic(unmasked, score_dtype=score_dtype, **kw)
        naive4 = traffic.naive_traffic(unmasked, kernels=4, score_dtype=score_dtype, **kw)
        fused = traffic.fused_forward_traffic(unmasked, write_lse=write_lse, pack_gqa=pack_gqa, **kw)
        rows += [naive3, naive4, fused]
        ratios += [traffic.traffic_ratio(naive3, fused), traffic.traffic_ratio(naive4, fused)]
    if condition in ("both", "causal"):
        square = masked.seqlen_q == masked.seqlen_k and not masked.has_window
        naive_c = traffic.naive_causal_traffic(masked, triangle="half" if square else "exact",
                                               score_dtype=score_dtype, **kw)
        fused_c = traffic.fused_forward_traffic(masked, write_lse=write_lse, pack_gqa=pack_gqa, **kw)
        rows += [naive_c, fused_c]
        ratios.append(traffic.traffic_ratio(naive_c, fused_c))
    if cross_condition:
        if condition != "both":
            raise ValueError("--cross-condition needs both conditions (leave out --causal/--no-causal)")
        ratios.append(traffic.traffic_ratio(rows[0], rows[-1], cross_condition=True))
    base = masked if condition == "causal" else unmasked
    if backward is not None:
        rows.append(traffic.backward_traffic(base, variant=backward, **kw))
    if decode_splits is not None:
        rows.append(traffic.flash_decoding_traffic(base, num_splits=decode_splits,
                                                   pack_gqa=pack_gqa or shape.group_size > 1, **kw))
    report = {
        "model": "logical HBM traffic: cold cache, exact bytes, no sector padding, no L2 reuse",
        "scope": scope,
        "scope_label": traffic.SCOPE_LABELS[scope],
        "shape": shape.as_dict(),
        "score_dtype": score_dtype or shape.dtype,
        "rows": [r.as_dict() for r in rows],
        "ratios": [r.as_dict() for r in ratios],
    }
    if shape.group_size > 1:
        gqa_scope = "kv-group" if scope == "head" else scope
        report["gqa_kv_bytes"] = {"scope": gqa_scope, "scope_label": traffic.SCOPE_LABELS[gqa_scope],
                                  "condition": traffic.mask_condition(base),
                                  **traffic.gqa_kv_bytes(base, scope=gqa_scope, layers=layers)}
    return report


def memory_report(shape, *, score_dtype: str | None, layers: int,
                  heads_in_parallel: int | None = None) -> dict:
    from attnlab.model import memory

    items = memory.memory_footprint(shape, score_dtype=score_dtype, layers=layers)
    report = {"shape": shape.as_dict(), "score_dtype": score_dtype or shape.dtype,
              "layers": layers, "items": [item.as_dict() for item in items]}
    if heads_in_parallel is not None:
        report["items"].append({
            "name": "S + P, transient peak", "scope": "per layer",
            "bytes": memory.transient_peak_bytes(shape, score_dtype,
                                                 heads_in_parallel=heads_in_parallel),
            "assumption": f"{heads_in_parallel} heads in parallel (--heads-in-parallel)"})
    return report


def amdahl_report(time_shares: list[float], kernel_speedup: float, flop_share: float,
                  flop_share_preset: str, flop_share_tokens: int, *,
                  chain: dict | None = None) -> dict:
    from attnlab.model import amdahl, flops

    computed_share = flops.attention_flop_share(flop_share_preset, flop_share_tokens)
    chain = chain or {}
    rows = amdahl.prefill_chain(**chain)
    return {
        "formula": "speedup = 1 / ((1 - f_time) + f_time / S_kernel)",
        "sensitivity": [r.as_dict() for r in amdahl.sensitivity_table(time_shares, kernel_speedup)],
        "flop_share_trap": {
            **amdahl.flop_share_trap(time_shares[0], flop_share, kernel_speedup).as_dict(),
            "computed_flop_share": {
                "preset": flop_share_preset, "prompt_tokens": flop_share_tokens,
                "flop_share": computed_share,
                "speedup_if_misused": amdahl.amdahl_speedup(computed_share, kernel_speedup)},
        },
        "chain": {"inputs": {
                      "attention_time": chain.get("attention_time", amdahl.EXIT_TASK_ATTENTION_MS),
                      "prefill_time": chain.get("prefill_time", amdahl.EXIT_TASK_PREFILL_MS),
                      "outside_prefill_time": chain.get("outside_prefill_time",
                                                        amdahl.EXIT_TASK_OUTSIDE_PREFILL_MS),
                      "kernel_speedup": chain.get("kernel_speedup", amdahl.EXIT_TASK_KERNEL_SPEEDUP),
                      "layers": chain.get("layers", amdahl.EXIT_TASK_LAYERS),
                      "unit": "ms"},
                  "assumption": "serial, non-overlapping critical path; identical layers",
                  "boundaries": [r.as_dict() for r in rows]},
    }


def load_peak_records(path: str | Path, name: str = "--peaks-file") -> list[dict]:
    """Peak records ({"kind": "peak", "tflops" | "tbps": ...}) from a small JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{name} must be a JSONL file of peak records, {path} is not a file")
    if path.stat().st_size > MAX_PEAKS_FILE_BYTES:
        raise ValueError(f"{name}: {path} is larger than {MAX_PEAKS_FILE_BYTES:,} bytes; "
                         f"a peaks file holds a few JSON lines")
    records = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{name}: {path} cannot be read ({error})") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError):
                raise ValueError(f"{name} line {number} is not JSON") from None
    return records


def ceilings(gpu_name: str, *, measured_tflops: float | None = None,
             measured_tbps: float | None = None, peaks_file: str | Path | None = None):
    """The GPU's roofline ceilings: datasheet, measured values, or a peaks file."""
    from attnlab.model import hardware

    if peaks_file is not None:
        if measured_tflops is not None or measured_tbps is not None:
            raise ValueError("--peaks-file and --measured-tflops/--measured-tbps exclude each other")
        return hardware.ceilings_from_records(gpu_name, load_peak_records(peaks_file))
    if measured_tflops is not None or measured_tbps is not None:
        return hardware.measured_ceilings(gpu_name, dense_tflops=measured_tflops,
                                          hbm_tbps=measured_tbps)
    return hardware.gpu(gpu_name)


def roofline_report(shape, gpu, *, scope: str = "head", layers: int | None = None,
                    score_dtype: str | None = None) -> dict:
    from attnlab.model import flops, hardware, traffic

    kw = {"scope": scope, "layers": layers}
    if shape.causal or shape.has_window:
        square = shape.seqlen_q == shape.seqlen_k and not shape.has_window
        records = [traffic.naive_causal_traffic(shape, triangle="half" if square else "exact",
                                                score_dtype=score_dtype, **kw)]
    else:
        records = [traffic.naive_traffic(shape, kernels=4, score_dtype=score_dtype, **kw),
                   traffic.naive_traffic(shape, score_dtype=score_dtype, **kw)]
    records.append(traffic.fused_forward_traffic(shape, **kw))
    kernels = []
    for record in records:
        for row in flops.kernel_intensities(record):
            intensity = row["flop_per_byte"]
            kernels.append({"algorithm": record.variant, **row, "bound": gpu.bound(intensity),
                            "attainable_tflops": gpu.attainable_tflops(intensity),
                            "min_time_us": gpu.min_time_s(row["flops"], row["bytes"]) * 1e6})
    return {"gpu": gpu.as_dict(), "scope": scope, "scope_label": traffic.SCOPE_LABELS[scope],
            "shape": shape.as_dict(), "kernels": kernels,
            "flops_note": "useful FLOPs (matmuls 2*d per score each, softmax ~4 per score, scale 1) "
                          "over logical bytes",
            "datasheet_ridge_points": {name: g.ridge_point for name, g in hardware.GPUS.items()}}


def exercises_report() -> dict:
    """The lesson's four exercises, every answer computed by the library."""
    from attnlab.masking import shape_band, tile_plan
    from attnlab.model import amdahl, traffic
    from attnlab.reference.walk import online_softmax_walk
    from attnlab.shapes import LESSON_SHAPE

    # 1. traffic, one head, unmasked
    head = LESSON_SHAPE.replace(causal=False)
    naive = traffic.naive_traffic(head)
    fused = traffic.fused_forward_traffic(head)
    ratio = traffic.traffic_ratio(naive, fused)
    one = {"question": "one head, N=4096, d=128, FP16: naive 3-kernel vs FA-2 unmasked",
           "scope": traffic.SCOPE_LABELS["head"],
           "naive": naive.as_dict(), "fused": fused.as_dict(), "ratio": ratio.as_dict()}

    # 2. the two-tile online softmax trace (the reference's walk)
    walk = online_softmax_walk([8.0, 6.0, 10.0, 7.0], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0],
                                                       [7.0, 8.0]], 2)
    two = {"question": "FA-2 accumulator for one row over two tiles",
           "steps": [{"tile": step.tile + 1, "m_old": step.m_old, "m_new": step.m_new,
                      "alpha": step.alpha, "weights": list(step.weights), "l": step.l,
                      "a": list(step.a)} for step in walk.steps],
           "output": list(walk.output), "full_row_softmax_output": list(walk.softmax_output),
           "max_abs_difference": walk.max_abs_difference, "matches": walk.matches()}

    # 3. Amdahl with a profiled time share vs the FLOP share
    trap = amdahl.flop_share_trap(0.22, amdahl.LESSON_FLOP_SHARE, 2.8)
    three = {"question": "attention 22% of prefill time, kernel 2.8x; and with the 3.2% FLOP share",
             **trap.as_dict(),
             "time_share_reduction": amdahl.latency_reduction(0.22, 2.8),
             "flop_share_reduction": amdahl.latency_reduction(amdahl.LESSON_FLOP_SHARE, 2.8),
             "flop_share_at_lesson_speedup_3_5": amdahl.amdahl_speedup(amdahl.LESSON_FLOP_SHARE, 3.5),
             "capacity_plan": "the time-share projection; it is one profile at one prompt length"}

    # 4. causal tile plan of query tile 5 (1-based)
    causal = LESSON_SHAPE.replace(causal=True)
    plan = tile_plan(causal).query_tile(4)
    first_row = 4 * causal.block_m  # 0-based row 512 = row 513, upper half of the block
    seen_first, seen_stop = shape_band(causal).key_interval(first_row)
    loaded_stop = min(causal.seqlen_k, plan.kv_stop * causal.block_n)
    four = {"question": "causal, B_r=128, B_c=64, N=4096: KV tiles of query tile i=5",
            "numbering": "1-based, as the lesson",
            "rows": [first_row + 1, first_row + len(plan.rows)],
            "loaded": [j + 1 for j in plan.loaded],
            "masked": [j + 1 for j in plan.masked],
            "full": [j + 1 for j in plan.full],
            "example_row": first_row + 1,
            "example_row_sees_keys": [seen_first + 1, seen_stop],
            "future_keys_loaded_for_example_row": loaded_stop - seen_stop,
            "without_the_mask": "those future keys enter the running max and sum: the row "
                                "averages over tokens after it, and nothing raises an error"}
    return {"exercises": [one, two, three, four]}
