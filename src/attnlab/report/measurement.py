"""A ``--measure`` run's record as a report workload (the measurement is in ``measure/``).

:func:`attnlab.measure.end_to_end.run_measurement` profiles and times a real prefill;
this module only reads its record, so the report layer never launches a kernel.
"""

from __future__ import annotations

from typing import Any

from attnlab.report.workload import Workload, parse_workload


def measurement_workload(measurement: dict[str, Any]) -> Workload:
    """The measured prefill as a report workload: one segment, split by the eager trace."""
    config = measurement["config"]
    shares = measurement["traces"]["eager"]["shares"]
    eager_ms = measurement["eager_ms"]
    return parse_workload({
        "title": f"Measured prefill: {measurement['model'].split(',')[0]} decoder, random weights",
        "workload": {
            "model": measurement["model"], "parameters": measurement["parameters"],
            "layers": config["layers"], "query_heads": config["query_heads"],
            "kv_heads": config["kv_heads"], "head_dim": config["head_dim"],
            "dtype": measurement["dtype"],
            "prompt_tokens": config["prompt_tokens"],
        },
        "segments": [{
            "name": "prefill", "ms": eager_ms,
            "source": f"CUDA events, median of {measurement['repeats']} (eager attention)",
            "parts": {name: share * eager_ms for name, share in shares.items()},
            "note": f"split by the profiler trace ({measurement['device']})",
        }],
        "proposal": {
            "change": f"replace eager attention with {measurement['candidate']}",
            "segment": "prefill", "part": "attention",
            "kernel_speedup": measurement["kernel_speedup"],
            "speedup_source": (f"measured: attention alone {measurement['kernel_eager_ms']:.3f} ms "
                               f"eager / {measurement['kernel_candidate_ms']:.3f} ms candidate, "
                               f"median of {measurement['repeats']}"),
        },
    }, origin=f"attnlab report --measure on {measurement['device']}")
