"""The numbers the explainer page shows, computed once in Python and embedded as JSON.

Every value comes from attnlab's own models (``attnlab.model``), its reference
(``attnlab.reference``) or measured records under ``bench/results/``; the page's
JavaScript only picks among them.  Every slider stop is precomputed here, so what a
reader sees at 2k tokens is exactly what ``attnlab.model.memory`` says at 2k tokens.
The one exception is Amdahl's formula, which the page evaluates itself (three sliders
make ~10^6 combinations); tests compare that copy with ``attnlab.model.amdahl`` at
every stop.
"""

from __future__ import annotations

from pathlib import Path

import attnlab
from attnlab.explain import measured, profiler
from attnlab.explain.units import (
    format_bytes,
    format_exact_bytes,
    format_index_ranges,
    format_mib,
    format_number,
    format_percent,
    format_ratio,
    format_tokens,
)
from attnlab.model import amdahl, flops, memory, traffic
from attnlab.reference.tiles import (
    ALL_VISIBLE,
    FULL,
    MASKED,
    NONE_VISIBLE,
    PARTLY_VISIBLE,
    SKIPPED,
    tile_plan,
)
from attnlab.reference.walk import online_softmax_walk
from attnlab.shapes import LESSON_SHAPE, PRESETS, AttentionShape

# ----------------------------------------------------------------- section 1: memory
# Slider stops: powers of two from 512 to 128k tokens, the range of the post's slider.
MEMORY_SEQLENS: tuple[int, ...] = tuple(512 * 2 ** k for k in range(9))
MEMORY_DEFAULT = ("qwen-gqa", 2048)
# The presets in picker order, with the label a reader sees.
MEMORY_PRESET_LABELS = {
    "qwen-gqa": "Qwen-style GQA layer (24 query heads, FP32 scores)",
    "lesson-8b": "The lesson's 8B dense model (32 heads, FP16)",
}

# ----------------------------------------------------------------- section 2: walks
# The post's walk: one query, four already-scaled scores, a one-number value per key.
WALK_SCORES: tuple[float, ...] = (1.0, 3.0, 0.0, 2.0)
WALK_VALUES: tuple[float, ...] = (10.0, 20.0, 30.0, 40.0)
BLOCK_M_OPTIONS: tuple[int, ...] = (64, 128, 256)
BLOCK_N_OPTIONS: tuple[int, ...] = (32, 64, 128)
# 1,000 is there for its ragged last tiles: loaded rows count only real key rows.
BLOCK_SEQLEN_OPTIONS: tuple[int, ...] = (1000, 2048, 4096)
BLOCK_DEFAULT = {"block_m": 128, "block_n": 64, "seqlen": 2048}
# The lesson's exercise 4: B_r = 128, B_c = 64, N = 4,096, causal, query tile i = 5
# (1-based), i.e. index 4 here.
EXERCISE_4 = {"block_m": 128, "block_n": 64, "seqlen": 4096, "query_tile_index": 4}
# One letter per tile class in the embedded plans, to keep a 64 x 128 grid small.
STATE_LETTERS = {FULL: "F", MASKED: "M", SKIPPED: "S"}

# ----------------------------------------------------------------- section 5: Amdahl
TIME_SHARE_PERCENTS: tuple[int, ...] = tuple(range(101))
KERNEL_SPEEDUP_TENTHS: tuple[int, ...] = tuple(range(10, 101))  # 1.0x ... 10.0x
FLOP_SHARE_PRESET = "lesson-8b"
FLOP_SHARE_DEFAULT_TOKENS = 2048


def build_page_data(results_dir: Path | str | None = None) -> dict:
    """Everything the page shows, as JSON-ready Python values.

    ``results_dir``: where measured records live (``bench/results`` by convention);
    ``None`` means no measured data, and the page's "How much" section says so.
    """
    folder = None if results_dir is None else Path(results_dir)
    ncu = profiler.ncu_cases(folder) if folder is not None and folder.is_dir() else None
    measured_data = measured.measured_section(folder, ncu)
    colours = {p["name"]: p["colour"] for p in measured_data["providers"]}
    return {
        "attnlab_version": attnlab.__version__,
        "memory": memory_section(),
        "online_walk": online_walk_section(),
        "block_walk": block_walk_section(),
        "traffic": traffic_section(),
        "measured": measured_data,
        "profiler": profiler.profiler_section(folder, colours, ncu),
        "amdahl": amdahl_section(),
    }


# =================================================================== 1. memory
def memory_section() -> dict:
    presets = []
    for name, label in MEMORY_PRESET_LABELS.items():
        model = PRESETS[name]
        tile_shape = model.shape(MEMORY_SEQLENS[0])
        tile_bytes = memory.score_tile_bytes(tile_shape.block_m, tile_shape.block_n,
                                             model.score_dtype)
        values = []
        for seqlen in MEMORY_SEQLENS:
            layer = memory.score_matrix_bytes(model.shape(seqlen), model.score_dtype)
            one_head = memory.score_matrix_bytes(
                model.shape(seqlen).replace(query_heads=1, kv_heads=1), model.score_dtype)
            values.append({
                "seqlen": seqlen,
                "s_bytes": layer,
                "s_text": format_bytes(layer),
                "s_exact": format_exact_bytes(layer),
                # S and P both live: the naive softmax reads S and writes P beside it.
                "sp_bytes": 2 * layer,
                "sp_text": format_bytes(2 * layer),
                "layers_bytes": layer * model.attention_layers,
                "layers_text": format_bytes(layer * model.attention_layers),
                "head_to_tile": one_head / tile_bytes,
                "tile_ratio_text": format_ratio(one_head / tile_bytes, 0),
            })
        dtype = model.score_dtype.upper()
        presets.append({
            "name": name,
            "label": label,
            "description": model.description,
            "query_heads": model.query_heads,
            "score_dtype": model.score_dtype,
            "attention_layers": model.attention_layers,
            "scope": (f"S of one layer: all {model.query_heads} query heads, batch 1, "
                      f"{dtype} scores, logical bytes"),
            "layers_scope": f"({model.attention_layers} softmax-attention layers, one S each)",
            "tile": {
                "block_m": tile_shape.block_m,
                "block_n": tile_shape.block_n,
                "bytes": tile_bytes,
                "text": format_bytes(tile_bytes),
                "exact": format_exact_bytes(tile_bytes),
                "scope": (f"one {tile_shape.block_m}\u00d7{tile_shape.block_n} {dtype} score "
                          f"tile (B_r \u00d7 B_c), per thread block, whatever the length"),
            },
            "values": values,
        })
    stops = [{"seqlen": n, "label": format_tokens(n)} for n in MEMORY_SEQLENS]
    return {
        "stops": stops,
        "presets": presets,
        "default_preset": MEMORY_DEFAULT[0],
        "default_stop": MEMORY_SEQLENS.index(MEMORY_DEFAULT[1]),
    }


# =================================================================== 2a. online walk
def online_walk_section() -> dict:
    walk = online_softmax_walk(WALK_SCORES, WALK_VALUES, tile=1)
    steps = [{
        "label": "start: no key seen yet",
        "key_index": None,
        "m_text": format_number(float("-inf")),
        "alpha_text": "\u2014",
        "l_text": "0",
        "a_text": "0",
        "o_text": "\u2014",
        "rescaled": False,
        "narration": "Nothing folded in yet: m = \u2212\u221e, \u2113 = 0, O = 0.",
    }]
    for number, step in enumerate(walk.steps, start=1):
        score, value = step.scores[0], step.values[0][0]
        weight = step.weights[0]
        first = step.m_old == float("-inf")
        rescaled = not first and step.m_new > step.m_old
        x, m_new = format_number(score), format_number(step.m_new)
        if first:
            narration = (f"Key {number} is the first score, so m = {m_new} and there is nothing "
                         f"to rescale; it adds weight e^({x}\u2212{m_new}) = "
                         f"{format_number(weight)} times v = {format_number(value)}.")
        elif rescaled:
            narration = (f"Key {number}: x = {x} raises the max from {format_number(step.m_old)} "
                         f"to {m_new}, so \u2113 and O are first multiplied by "
                         f"\u03b1 = e^({format_number(step.m_old)}\u2212{m_new}) = "
                         f"{format_number(step.alpha)}, then the new key adds weight "
                         f"{format_number(weight)}.")
        else:
            narration = (f"Key {number}: x = {x} is below the max {m_new}, so \u03b1 = 1 and "
                         f"the key just adds weight e^({x}\u2212{m_new}) = "
                         f"{format_number(weight)} times v = {format_number(value)}.")
        output = step.a[0] / step.l
        steps.append({
            "label": f"after key {number} of {len(walk.steps)}",
            "key_index": number - 1,
            "m": step.m_new,
            "alpha": step.alpha,
            "l": step.l,
            "a": step.a[0],
            "o": output,
            "m_text": m_new,
            "alpha_text": format_number(step.alpha),
            "l_text": format_number(step.l),
            "a_text": format_number(step.a[0]),
            "o_text": format_number(output),
            "rescaled": rescaled,
            "narration": narration,
        })
    return {
        "scores": list(WALK_SCORES),
        "values": list(WALK_VALUES),
        "key_labels": [f"key {k + 1}" for k in range(len(WALK_SCORES))],
        "score_texts": [format_number(s) for s in WALK_SCORES],
        "value_texts": [format_number(v) for v in WALK_VALUES],
        "steps": steps,
        "output": walk.output[0],
        "output_text": f"{walk.output[0]:.2f}",
        "full_row_output": walk.softmax_output[0],
        "full_row_text": f"{walk.softmax_output[0]:.2f}",
        "matches_full_row": walk.matches(),
    }


# =================================================================== 2b. block walk
def causal_shape(block_m: int, block_n: int, seqlen: int) -> AttentionShape:
    """One head of a square causal prefill with the chosen tile sizes."""
    return AttentionShape(seqlen_q=seqlen, seqlen_k=seqlen, causal=True,
                          block_m=block_m, block_n=block_n)


def _row_summary(plan, query_tile: int) -> dict:
    row = plan.query_tile(query_tile)
    rows = row.rows
    loaded_rows = plan.loaded_kv_rows(query_tile)
    loads = []
    if row.full:
        loads.append(f"{format_index_ranges(row.full)} without a mask")
    if row.masked:
        loads.append(f"{format_index_ranges(row.masked)} with the element mask")
    skips = (f"; it skips {format_index_ranges(row.skipped)}, which lie entirely in its future"
             if row.skipped else "; it skips none")
    summary = (f"Query tile {query_tile + 1} (query rows {rows.start + 1}\u2013{rows.stop}) "
               f"loads KV tiles {format_index_ranges(row.loaded)} ({loaded_rows:,} key rows): "
               f"{' and '.join(loads)}{skips}.")
    counts = (f"{len(row.full)} full \u00b7 {len(row.masked)} masked \u00b7 "
              f"{len(row.skipped)} skipped \u00b7 {loaded_rows:,} key rows loaded "
              f"(attnlab.reference.tile_plan)")
    return {
        "states": "".join(STATE_LETTERS[c] for c in row.tile_classes),
        "loaded_kv_rows": loaded_rows,
        "summary": summary,
        "counts": counts,
    }


def _plan_data(block_m: int, block_n: int, seqlen: int) -> dict:
    shape = causal_shape(block_m, block_n, seqlen)
    plan = tile_plan(shape)
    caption = (f"N = {seqlen:,}, B_r = {block_m}, B_c = {block_n}, causal, one head: "
               f"{shape.query_tiles} query tiles \u00d7 {shape.kv_tiles} KV tiles; whole grid "
               f"{plan.count(FULL):,} full, {plan.count(MASKED):,} masked, "
               f"{plan.count(SKIPPED):,} skipped")
    return {
        "query_tiles": shape.query_tiles,
        "kv_tiles": shape.kv_tiles,
        "caption": caption,
        "rows": [_row_summary(plan, i) for i in range(shape.query_tiles)],
    }


def _exercise_answer(block_m: int, block_n: int, seqlen: int, query_tile: int) -> str:
    plan = tile_plan(causal_shape(block_m, block_n, seqlen))
    row = plan.query_tile(query_tile)
    parts = []
    for kv_tile in row.masked:
        keys = plan.key_rows(kv_tile)
        segments = ", ".join(
            f"{_row_span(s.first_row, s.last_row)} "
            f"{'sees' if s.first_row == s.last_row else 'see'} {SEES[s.visibility]}"
            for s in plan.row_segments(query_tile, kv_tile))
        parts.append(f"In tile {kv_tile + 1} (keys {keys.start + 1}\u2013{keys.stop}), "
                     f"{segments}.")
    return (f"Exercise 4: query tile {query_tile + 1} (rows {row.rows.start + 1}\u2013"
            f"{row.rows.stop}) loads KV tiles {format_index_ranges(row.loaded)}. Tiles "
            f"{format_index_ranges(row.full)} need no mask; tiles "
            f"{format_index_ranges(row.masked)} straddle the diagonal. " + " ".join(parts)
            + " Keep the skip bound but drop the mask, and rows see keys in their future: "
              "the output is a plausible-looking, wrong average, and nothing raises an error.")


# How a row segment of attnlab.reference.tiles reads in a sentence.
SEES = {ALL_VISIBLE: "all of it", PARTLY_VISIBLE: "part of it", NONE_VISIBLE: "none of it"}


def _row_span(first: int, last: int) -> str:
    """0-based inclusive rows as the lesson writes them (1-based)."""
    return f"row {first + 1}" if first == last else f"rows {first + 1}\u2013{last + 1}"


def block_walk_section() -> dict:
    plans = {
        f"{m},{n},{seqlen}": _plan_data(m, n, seqlen)
        for m in BLOCK_M_OPTIONS for n in BLOCK_N_OPTIONS for seqlen in BLOCK_SEQLEN_OPTIONS
    }
    exercise = dict(EXERCISE_4)
    exercise["button"] = (f"Exercise 4: B_r = {exercise['block_m']}, B_c = {exercise['block_n']}, "
                          f"N = {exercise['seqlen']:,}, query tile "
                          f"{exercise['query_tile_index'] + 1}")
    exercise["answer"] = _exercise_answer(exercise["block_m"], exercise["block_n"],
                                          exercise["seqlen"], exercise["query_tile_index"])
    return {
        "block_m_options": list(BLOCK_M_OPTIONS),
        "block_n_options": list(BLOCK_N_OPTIONS),
        "seqlen_options": list(BLOCK_SEQLEN_OPTIONS),
        "default": dict(BLOCK_DEFAULT),
        "exercise": exercise,
        "state_names": {letter: name for name, letter in STATE_LETTERS.items()},
        "plans": plans,
    }


# =================================================================== 3. traffic
# Short bar labels for the four rows of attnlab.model.traffic.lesson_comparison.
TRAFFIC_BAR_LABELS = {
    "naive-3k": "Naive (3 kernels), unmasked",
    "fa2-forward/unmasked": "FlashAttention-2, unmasked",
    "naive-causal-half": "Idealised causal naive",
    "fa2-forward/causal": "FlashAttention-2, causal",
}


def _bar_key(record: traffic.Traffic) -> str:
    return f"{record.variant}/{record.condition}" if record.variant == "fa2-forward" \
        else record.variant


def traffic_section(shape: AttentionShape = LESSON_SHAPE) -> dict:
    """The lesson's four logical-traffic rows for one head, and which ratios are valid."""
    comparison = traffic.lesson_comparison(shape, scope="head")
    naive, fused, naive_causal, fused_causal = comparison["rows"]
    largest = max(r.total_bytes for r in comparison["rows"])
    bars = []
    for record in comparison["rows"]:
        bars.append({
            "key": _bar_key(record),
            "label": TRAFFIC_BAR_LABELS[_bar_key(record)],
            "model_label": record.label,
            "condition": record.condition,
            "read_bytes": record.read_bytes,
            "write_bytes": record.write_bytes,
            "total_bytes": record.total_bytes,
            "reads_text": format_mib(record.read_bytes),
            "writes_text": format_mib(record.write_bytes),
            "total_text": format_mib(record.total_bytes),
            "reads_percent": round(100 * record.read_bytes / largest, 3),
            "writes_percent": round(100 * record.write_bytes / largest, 3),
        })
    unmasked_ratio, causal_ratio = comparison["ratios"]
    cross = traffic.traffic_ratio(naive, fused_causal, cross_condition=True)
    ratios = [
        {"text": format_ratio(unmasked_ratio.ratio), "value": unmasked_ratio.ratio,
         "valid": unmasked_ratio.matched,
         "label": "naive \u00f7 FlashAttention-2, both unmasked",
         "why": "Matched: same masking on both sides, so the ratio is the fusion's alone."},
        {"text": format_ratio(causal_ratio.ratio), "value": causal_ratio.ratio,
         "valid": causal_ratio.matched,
         "label": "idealised causal naive \u00f7 FlashAttention-2 causal",
         "why": "Matched: both sides skip the future, so this is the causal comparison."},
        {"text": format_ratio(cross.ratio), "value": cross.ratio, "valid": cross.matched,
         "label": "unmasked naive \u00f7 causal FlashAttention-2",
         "why": ("Cross-condition: it mixes dropping half the tiles (masking) with fusing the "
                 "kernels, so it measures neither. Not a result.")},
    ]
    return {
        "shape": shape.replace(query_heads=1, kv_heads=1).describe(),
        "scope_short": (f"naive \u00f7 fused, logical HBM bytes per head, N={shape.seqlen_q}, "
                        f"d={shape.head_dim}, {shape.dtype}; the third mixes conditions"),
        "scope": (f"Logical HBM bytes {traffic.SCOPE_LABELS['head']}, N = {shape.seqlen_q:,}, "
                  f"d = {shape.head_dim}, {shape.dtype.upper()}, B_r = {shape.block_m}, "
                  f"B_c = {shape.block_n}; cold cache, no padding (attnlab.model.traffic). "
                  "Real DRAM counters differ: L2 catches many K/V re-reads."),
        "intro": ("The naive path writes S and P to HBM and reads them back; the fused kernel "
                  "reads Q once, writes O once and re-reads K and V once per query tile. "
                  "Bars compare only within one masking condition."),
        "bars": bars,
        "ratios": ratios,
    }


# =================================================================== 5. Amdahl
def amdahl_section() -> dict:
    time_shares = [{"value": p / 100, "label": f"{p}%"} for p in TIME_SHARE_PERCENTS]
    speedups = [{"value": t / 10, "label": f"{t / 10:.1f}\u00d7"} for t in KERNEL_SPEEDUP_TENTHS]
    # The exit task's serial trace: prefill is 290 of 380 ms of client TTFT.
    prefill_share = amdahl.EXIT_TASK_PREFILL_MS / (amdahl.EXIT_TASK_PREFILL_MS
                                                   + amdahl.EXIT_TASK_OUTSIDE_PREFILL_MS)
    default_layer_percent = round(prefill_share * 100)
    prompts = []
    for tokens in MEMORY_SEQLENS:
        share = flops.attention_flop_share(FLOP_SHARE_PRESET, tokens)
        prompts.append({"tokens": tokens, "label": f"{format_tokens(tokens)} tokens",
                        "share": share, "share_text": format_percent(share)})
    return {
        "time_share_stops": time_shares,
        "kernel_speedup_stops": speedups,
        "layer_share_stops": list(time_shares),
        "defaults": {
            "time_share_index": TIME_SHARE_PERCENTS.index(round(amdahl.LESSON_TIME_SHARES[0] * 100)),
            "kernel_speedup_index": KERNEL_SPEEDUP_TENTHS.index(
                round(amdahl.LESSON_KERNEL_SPEEDUP * 10)),
            "layer_share_index": TIME_SHARE_PERCENTS.index(default_layer_percent),
        },
        "layer_share_note": (f"Default {default_layer_percent}%: the exit task's synthetic trace, "
                             f"{amdahl.EXIT_TASK_PREFILL_MS:.0f} ms of prefill in "
                             f"{amdahl.EXIT_TASK_PREFILL_MS + amdahl.EXIT_TASK_OUTSIDE_PREFILL_MS:.0f}"
                             f" ms of client TTFT; everything outside the layers is held fixed."),
        "flop_share": {
            "preset": FLOP_SHARE_PRESET,
            "preset_label": PRESETS[FLOP_SHARE_PRESET].description,
            "prompts": prompts,
            "default_index": MEMORY_SEQLENS.index(FLOP_SHARE_DEFAULT_TOKENS),
            "intro": ("Counted in FLOPs, attention is a small slice of a prefill "
                      "(attnlab.model.flops.attention_flop_share: causal attention matmuls "
                      "against ~2 FLOPs per parameter per token for everything else)."),
            "why": ("FLOPs are not time: the matmuls run on Tensor Cores while softmax, masking "
                    "and the score round-trips run on CUDA cores, special-function units and "
                    "HBM. A kernel that is a few percent of FLOPs can be tens of percent of "
                    "wall-clock time; only a profile gives the time share."),
        },
    }
