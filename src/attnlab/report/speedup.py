"""A measured kernel speedup from ``bench/results`` records, for the workload's own shape.

``attnlab bench`` writes one record per measurement (see ``attnlab.measure.records``).
The report needs one number from them: how much faster the candidate provider's
attention is than the baseline's, on the shape the workload's prefill runs -- query
heads, KV heads, ``prompt_tokens`` on both sides, head dim, dtype, causal, phase
``prefill``.  Speedup = baseline median / candidate median; the p20/p80 give the range
(baseline p20 / candidate p80 at the low end, baseline p80 / candidate p20 at the high).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlab.report.workload import Workload

# Seconds per unit: records may store their times in any of these.
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
MATCHED_SHAPE_FIELDS = ("query_heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "dtype",
                        "causal")


def load(path: str | Path) -> list[dict]:
    """Records from a file or folder, through the measurement package's own loader."""
    from attnlab.measure.records import load_records

    path = Path(path)
    if not path.exists():
        raise ValueError(f"--records {str(path)!r} does not exist")
    return list(load_records(path))


def wanted_shape(workload: Workload) -> dict[str, Any]:
    model = workload.model
    missing = [f"workload.{name}" for name in ("query_heads", "kv_heads", "head_dim", "dtype",
                                               "prompt_tokens") if getattr(model, name) is None]
    if missing:
        raise ValueError(f"--records needs the prefill's shape: missing {', '.join(missing)}")
    return {"query_heads": model.query_heads, "kv_heads": model.kv_heads,
            "seqlen_q": model.prompt_tokens, "seqlen_k": model.prompt_tokens,
            "head_dim": model.head_dim, "dtype": model.dtype, "causal": True}


def _shape_of(record: dict) -> dict:
    shape = record.get("shape")
    if isinstance(shape, str):
        import json

        try:
            shape = json.loads(shape)
        except json.JSONDecodeError:
            return {}
    return shape if isinstance(shape, dict) else {}


def kernel_speedup_from_records(records: list[dict], workload: Workload) -> dict[str, Any]:
    """The measured speedup for the workload's shape, with everything it was derived from."""
    proposal = workload.proposal
    baseline, candidate = proposal.baseline_provider, proposal.candidate_provider
    shape = wanted_shape(workload)
    # Whole-call timings ("call"; per-kernel rows come from ncu) of an unwindowed shape.
    matching = [r for r in records
                if r.get("phase") == "prefill" and r.get("kernel", "call") == "call"
                and str(r.get("unit")) in TIME_UNITS
                and isinstance(r.get("p50"), (int, float)) and r["p50"] > 0
                and all(_shape_of(r).get(k) == v for k, v in shape.items())
                and list(_shape_of(r).get("window", [-1, -1])) == [-1, -1]]
    described = (f"prefill, {shape['query_heads']}/{shape['kv_heads']} heads, "
                 f"N={shape['seqlen_q']}, d={shape['head_dim']}, {shape['dtype']}, causal")
    if not matching:
        raise ValueError(f"--records: no timed prefill record for this workload's shape ({described}) "
                         f"among {len(records)} records")
    providers = sorted({str(r.get("provider")) for r in matching})
    for role, name in (("baseline_provider", baseline), ("candidate_provider", candidate)):
        if name not in providers:
            raise ValueError(f"proposal.{role} {name!r} has no record for {described}; "
                             f"providers measured there: {', '.join(providers)}")
    metrics = sorted({str(r.get("metric")) for r in matching
                      if r.get("provider") in (baseline, candidate)})
    metric = proposal.records_metric
    if metric is None:
        if len(metrics) > 1:
            raise ValueError(f"--records hold several time metrics for this shape "
                             f"({', '.join(metrics)}); set proposal.records_metric")
        metric = metrics[0]
    elif metric not in metrics:
        raise ValueError(f"proposal.records_metric {metric!r} is not among {', '.join(metrics)}")
    matching = [r for r in matching if r.get("metric") == metric]

    # One GPU and one batch size, measured for both providers.
    groups: dict[tuple, dict[str, dict]] = {}
    for record in matching:
        key = (str(record.get("gpu")), _shape_of(record).get("batch", 1))
        groups.setdefault(key, {})
        if record.get("provider") in (baseline, candidate):
            groups[key][record["provider"]] = record  # later records win (upserted files)
    complete = {key: pair for key, pair in groups.items() if len(pair) == 2}
    if not complete:
        raise ValueError(f"--records: {baseline!r} and {candidate!r} were never measured on the "
                         f"same GPU and batch for {described}")
    gpus = sorted({key[0] for key in complete})
    if len(gpus) > 1:
        raise ValueError(f"--records hold this shape on several GPUs ({', '.join(gpus)}); pass a "
                         f"file or folder of one GPU's records")
    # Batch 1 is one request's prefill; otherwise the smallest batch measured.
    key = min(complete, key=lambda k: (k[1] != 1, k[1]))
    pair = complete[key]

    def seconds(record: dict, stat: str) -> float:
        value = record.get(stat, record["p50"])
        return float(value) * TIME_UNITS[str(record["unit"])]

    base, cand = pair[baseline], pair[candidate]
    speedup = seconds(base, "p50") / seconds(cand, "p50")
    return {
        "kernel_speedup": speedup,
        "kernel_speedup_low": seconds(base, "p20") / seconds(cand, "p80"),
        "kernel_speedup_high": seconds(base, "p80") / seconds(cand, "p20"),
        "gpu": key[0], "batch": key[1], "metric": metric, "shape": described,
        "baseline": {"provider": baseline, "p50_ms": seconds(base, "p50") * 1e3,
                     "kernel_names": base.get("kernel_names"), "repeats": base.get("repeats"),
                     "command": base.get("command")},
        "candidate": {"provider": candidate, "p50_ms": seconds(cand, "p50") * 1e3,
                      "kernel_names": cand.get("kernel_names"), "repeats": cand.get("repeats"),
                      "command": cand.get("command")},
        "records_considered": len(records),
    }


def speedup_source(found: dict[str, Any]) -> str:
    return (f"measured: {found['baseline']['provider']} {found['baseline']['p50_ms']:.3f} ms / "
            f"{found['candidate']['provider']} {found['candidate']['p50_ms']:.3f} ms median "
            f"({found['metric']}, {found['gpu']}, batch {found['batch']})")
