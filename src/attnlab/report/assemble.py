"""One report from its inputs: a workload, and optionally a trace, records or a speedup.

The one place the report's inputs are combined (``attnlab report`` and ``attnlab
demo`` call it; the CLI only parses arguments and prints).  With ``measure=True``
(CUDA) the workload comes from a real prefill measured by
:mod:`attnlab.measure.end_to_end`.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.report import attribution, speedup
from attnlab.report.workload import default_workload, load_workload


def assemble_report(workload_file: str | Path | None = None, *,
                    trace_file: str | Path | None = None,
                    records_path: str | Path | None = None,
                    kernel_speedup: float | None = None,
                    measure: bool = False, trace_dir: str | Path | None = None) -> dict:
    """The report dict for these inputs (no printing, no files written)."""
    from attnlab.measure.profile import summarize_trace

    if measure:
        if workload_file or trace_file or records_path or kernel_speedup is not None:
            raise ValueError("--measure builds its own workload; drop FILE, --trace, --records "
                             "and --kernel-speedup")
        from attnlab.measure import end_to_end
        from attnlab.report.measurement import measurement_workload

        end_to_end.require_cuda()
        result = end_to_end.run_measurement(trace_dir=Path(trace_dir or "attnlab-measure"))
        workload = measurement_workload(result)
        trace = summarize_trace(result["trace_files"][0])
        # The traces lie beside the report: named relative to its folder, never by the
        # path of the machine that measured.
        result = {**result, "trace_files": [Path(f).name for f in result["trace_files"]]}
        return attribution.build_report(workload, trace=trace, measurement=result)

    if records_path is not None and kernel_speedup is not None:
        raise ValueError("--records and --kernel-speedup both give the kernel speedup; pass one")
    workload = load_workload(workload_file) if workload_file else default_workload()
    trace = found = None
    if trace_file is not None:
        trace = summarize_trace(trace_file, patterns=workload.trace_patterns)
        workload = attribution.with_trace(workload, trace)
    if records_path is not None:
        found = speedup.kernel_speedup_from_records(speedup.load(records_path), workload)
        workload = attribution.with_kernel_speedup(workload, found["kernel_speedup"],
                                                   speedup.speedup_source(found))
    if kernel_speedup is not None:
        workload = attribution.with_kernel_speedup(
            workload, kernel_speedup, "given on the command line (--kernel-speedup)")
    return attribution.build_report(workload, trace=trace, records=found)
