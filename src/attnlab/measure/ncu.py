"""Nsight Compute: the command, a profiling target, and the CSV parser.

How a measurement runs (:func:`run_ncu`):

1. ``ncu --profile-from-start off --clock-control none --cache-control all --nvtx
   --metrics ... --export REPORT python -m attnlab.measure.ncu CASES.json`` — the
   target (this module's ``__main__``) warms each case up *outside* the profiled
   region (compilation, autotuning, input generation), then runs it once between
   ``cudaProfilerStart``/``Stop`` inside an NVTX range named after the case.
   ``--clock-control none`` leaves the GPU's clocks alone; ``--cache-control all``
   (ncu's default, stated so the cache model can rely on it) starts each kernel
   with flushed caches.
2. ``ncu --import REPORT --csv --page raw --print-units base`` twice, with
   ``--print-nvtx-rename none`` (kernel names) and ``kernel`` (case names); the two
   are joined on the kernel ID.
3. The result is saved in the long format of the committed anchors (``id,
   nvtx_range_and_kernel, grid, block, metric, unit, value``), beside ncu's raw CSV.

:func:`parse_csv` reads the long format, ncu's raw page (wide, a units row under
the header) and its details page (long, ``Metric Name``/``Metric Value``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.checks import read_regular_file
from attnlab.shapes import AttentionShape

STALL_REASONS = (
    "barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
    "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc",
    "no_instruction", "not_selected", "selected", "short_scoreboard", "sleeping",
    "tex_throttle", "wait",
)


def stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


# metric -> (what it is, the ncu section it belongs to)
METRICS: dict[str, tuple[str, str]] = {
    "dram__bytes_read.sum": ("DRAM bytes read", "memory workload"),
    "dram__bytes_write.sum": ("DRAM bytes written", "memory workload"),
    "gpu__time_duration.sum": ("duration", "speed of light"),
    "gpc__cycles_elapsed.max": ("GPU cycles elapsed", "speed of light"),
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": ("SOL compute %", "speed of light"),
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed":
        ("SOL memory %", "speed of light"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("DRAM throughput %", "memory workload"),
    "lts__t_sector_hit_rate.pct": ("L2 hit rate %", "memory workload"),
    "smsp__inst_executed.sum": ("instructions executed", "compute workload"),
    "smsp__average_warp_latency_per_inst_issued.ratio":
        ("warp cycles per issued instruction", "warp state"),
    **{stall_metric(r): (f"stall: {r.replace('_', ' ')} (cycles/issue)", "warp state")
       for r in STALL_REASONS},
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("achieved occupancy %", "occupancy"),
    "launch__registers_per_thread": ("registers per thread", "launch"),
    "launch__shared_mem_per_block_static": ("static shared memory per block", "launch"),
    "launch__shared_mem_per_block_dynamic": ("dynamic shared memory per block", "launch"),
    "launch__grid_size": ("grid size (CTAs)", "launch"),
    "launch__block_size": ("threads per block", "launch"),
    "launch__waves_per_multiprocessor": ("waves per SM", "launch"),
    "device__attribute_multiprocessor_count": ("SMs", "launch"),
}
# The set the cache-model comparison needs; used alone if ncu rejects a metric name.
CORE_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
                "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
                "launch__shared_mem_per_block_static", "launch__shared_mem_per_block_dynamic")

LONG_HEADER = ("id", "nvtx_range_and_kernel", "grid", "block", "metric", "unit", "value")
_NAME_COLUMNS = ("Kernel Name", "Function Name", "Name")


# ----- finding and commanding ncu -----------------------------------------------------------
def find_ncu() -> str | None:
    """The ncu executable: $NCU, then PATH, then the usual CUDA install folders."""
    candidates = [os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"]
    candidates += sorted(str(p) for p in Path("/opt/nvidia").glob("nsight-compute/*/ncu"))
    candidates += sorted(str(p) for p in Path("/usr/local").glob("cuda-*/bin/ncu"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def profile_command(ncu: str, report: str | Path, target: Sequence[str],
                    metrics: Iterable[str] = tuple(METRICS),
                    section_set: str | None = None) -> list[str]:
    """Profile ``target`` between cudaProfilerStart/Stop; clocks untouched; caches flushed.
    ``section_set`` (e.g. "full"): ncu's own set of sections, every metric they hold
    (pipe utilisation, shared-memory wavefronts, stall reasons), on top of ``metrics``."""
    sections = ["--set", section_set] if section_set else []
    return [ncu, "--profile-from-start", "off", "--clock-control", "none",
            "--cache-control", "all", "--target-processes", "all", "--nvtx", *sections,
            "--metrics", ",".join(metrics), "--export", str(report), "--force-overwrite",
            *target]


def csv_command(ncu: str, target: Sequence[str],
                metrics: Iterable[str] = tuple(METRICS)) -> list[str]:
    """The one-step form (CSV on stdout), for running by hand."""
    return [ncu, "--clock-control", "none", "--cache-control", "all", "--csv", "--page", "raw",
            "--print-units", "base", "--metrics", ",".join(metrics), *target]


def import_command(ncu: str, report: str | Path, *, nvtx_names: bool) -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base",
            "--print-nvtx-rename", "kernel" if nvtx_names else "none"]


# ----- parsed kernels -------------------------------------------------------------------------------
def _parse_triple(text: str | None) -> tuple[int, int, int] | None:
    if not text:
        return None
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    if len(numbers) != 3:
        return None
    return numbers[0], numbers[1], numbers[2]


def parse_number(text: str | None) -> float | None:
    """ncu prints numbers plain or with thousands separators; n/a and empty are None."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "") if re.fullmatch(r"-?[\d,]+(\.\d+)?",
                                                              text.strip()) else text.strip()
    if cleaned in ("", "n/a", "N/A", "nan"):
        return None
    try:
        return float(cleaned)
    except ValueError:
        return None


@dataclass
class NcuKernel:
    """One profiled kernel launch: its name, the case (NVTX range) it ran in, its metrics."""

    id: int
    name: str
    case: str | None
    grid: tuple[int, int, int] | None
    block: tuple[int, int, int] | None
    metrics: dict[str, tuple[float, str]] = field(default_factory=dict)

    def value(self, metric: str) -> float | None:
        entry = self.metrics.get(metric)
        return None if entry is None else entry[0]

    def _int(self, metric: str) -> int | None:
        value = self.value(metric)
        return None if value is None else int(round(value))

    @property
    def dram_bytes_read(self) -> int | None:
        return self._int("dram__bytes_read.sum")

    @property
    def dram_bytes_write(self) -> int | None:
        return self._int("dram__bytes_write.sum")

    @property
    def duration_ns(self) -> float | None:
        return self.value("gpu__time_duration.sum")

    @property
    def grid_size(self) -> int | None:
        if self.grid is not None:
            return self.grid[0] * self.grid[1] * self.grid[2]
        return self._int("launch__grid_size")

    @property
    def threads(self) -> int | None:
        if self.block is not None:
            return self.block[0] * self.block[1] * self.block[2]
        return self._int("launch__block_size")

    @property
    def shared_bytes(self) -> int | None:
        static, dynamic = (self._int("launch__shared_mem_per_block_static"),
                           self._int("launch__shared_mem_per_block_dynamic"))
        if static is None and dynamic is None:
            return None
        return (static or 0) + (dynamic or 0)

    @property
    def warp_stalls(self) -> dict[str, float]:
        """Cycles per issued instruction by stall reason (those ncu reported), largest first."""
        stalls = {r: self.value(stall_metric(r)) for r in STALL_REASONS}
        present = {r: v for r, v in stalls.items() if v is not None}
        return dict(sorted(present.items(), key=lambda item: -item[1]))

    def summary(self) -> dict:
        sms = self._int("device__attribute_multiprocessor_count")
        return {
            "id": self.id, "case": self.case, "kernel": self.name,
            "grid": list(self.grid) if self.grid else None,
            "block": list(self.block) if self.block else None,
            "grid_size": self.grid_size, "sms": sms,
            "dram_bytes_read": self.dram_bytes_read, "dram_bytes_write": self.dram_bytes_write,
            "duration_ns": self.duration_ns,
            "sol_compute_pct": self.value("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
            "sol_memory_pct": self.value(
                "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
            "achieved_occupancy_pct": self.value(
                "sm__warps_active.avg.pct_of_peak_sustained_active"),
            "registers_per_thread": self._int("launch__registers_per_thread"),
            "shared_bytes_per_block": self.shared_bytes,
            "instructions": self._int("smsp__inst_executed.sum"),
            "cycles_per_issue": self.value("smsp__average_warp_latency_per_inst_issued.ratio"),
            "warp_stalls": self.warp_stalls,
            "l2_hit_rate_pct": self.value("lts__t_sector_hit_rate.pct"),
        }


# ----- CSV formats ------------------------------------------------------------------------------------
def _split_case(text: str) -> tuple[str | None, str]:
    """'case/kernel' (a case name holds '|' and no '/') or a bare kernel name."""
    head, sep, tail = text.partition("/")
    if sep and "|" in head:
        return head, tail
    return None, text


def parse_long_csv(text: str) -> list[NcuKernel]:
    """The anchors' format: one row per (kernel, metric)."""
    kernels: dict[int, NcuKernel] = {}
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in LONG_HEADER if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"long ncu CSV needs columns {list(LONG_HEADER)}; missing {missing}")
    for row in reader:
        kernel_id = int(row["id"])
        if kernel_id not in kernels:
            case, name = _split_case(row["nvtx_range_and_kernel"])
            kernels[kernel_id] = NcuKernel(kernel_id, name, case, _parse_triple(row["grid"]),
                                           _parse_triple(row["block"]))
        value = parse_number(row["value"])
        if value is not None:
            kernels[kernel_id].metrics[row["metric"]] = (value, row["unit"])
    return [kernels[i] for i in sorted(kernels)]


def _csv_rows(text: str) -> list[list[str]]:
    """CSV rows of ncu output, skipping its ==PROF==/==WARNING== log lines."""
    lines = [line for line in text.splitlines() if not line.startswith("==")]
    return [row for row in csv.reader(lines) if row]


def _column(header: list[str], names: Sequence[str]) -> int | None:
    for name in names:
        if name in header:
            return header.index(name)
    return None


def parse_raw_csv(text: str) -> list[NcuKernel]:
    """ncu's ``--page raw`` CSV: one row per kernel, metric columns, a units row."""
    rows = _csv_rows(text)
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None:
        raise ValueError("no ncu raw-page header (a row starting with \"ID\") in this CSV")
    header, body = rows[start], rows[start + 1:]
    units = body[0] if body and not body[0][0].strip().isdigit() else None
    if units is not None:
        body = body[1:]
    name_col = _column(header, _NAME_COLUMNS)
    if name_col is None:
        raise ValueError(f"ncu raw CSV has no kernel-name column ({' / '.join(_NAME_COLUMNS)})")
    grid_col, block_col = _column(header, ("Grid Size",)), _column(header, ("Block Size",))
    fixed = {"ID", "Process ID", "Process Name", "Host Name", "Context", "Stream", "Device",
             "CC", "Grid Size", "Block Size", *_NAME_COLUMNS}
    kernels = []
    for row in body:
        if len(row) != len(header) or not row[0].strip().isdigit():
            continue
        case, name = _split_case(row[name_col])
        kernel = NcuKernel(int(row[0]), name, case,
                           _parse_triple(row[grid_col]) if grid_col is not None else None,
                           _parse_triple(row[block_col]) if block_col is not None else None)
        for i, column in enumerate(header):
            if column in fixed:
                continue
            value = parse_number(row[i])
            if value is not None:
                kernel.metrics[column] = (value, units[i] if units else "")
        kernels.append(kernel)
    return kernels


def parse_details_csv(text: str) -> list[NcuKernel]:
    """ncu's ``--page details`` CSV: one row per (kernel, metric)."""
    rows = _csv_rows(text)
    start = next((i for i, r in enumerate(rows) if "Metric Name" in r and "Metric Value" in r),
                 None)
    if start is None:
        raise ValueError("no ncu details-page header (Metric Name, Metric Value) in this CSV")
    header = rows[start]
    name_col = _column(header, _NAME_COLUMNS)
    col = {n: header.index(n) for n in ("ID", "Metric Name", "Metric Unit", "Metric Value")
           if n in header}
    grid_col, block_col = _column(header, ("Grid Size",)), _column(header, ("Block Size",))
    kernels: dict[int, NcuKernel] = {}
    for row in rows[start + 1:]:
        if len(row) != len(header) or not row[col["ID"]].strip().isdigit():
            continue
        kernel_id = int(row[col["ID"]])
        if kernel_id not in kernels:
            case, name = _split_case(row[name_col] if name_col is not None else "")
            kernels[kernel_id] = NcuKernel(
                kernel_id, name, case,
                _parse_triple(row[grid_col]) if grid_col is not None else None,
                _parse_triple(row[block_col]) if block_col is not None else None)
        value = parse_number(row[col["Metric Value"]])
        if value is not None:
            unit = row[col["Metric Unit"]] if "Metric Unit" in col else ""
            kernels[kernel_id].metrics[row[col["Metric Name"]]] = (value, unit)
    return [kernels[i] for i in sorted(kernels)]


def parse_csv(source: str | Path) -> list[NcuKernel]:
    """Parse an ncu CSV (a path or its text) in any of the three formats."""
    is_path = isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                           and Path(source).exists())
    text = (read_regular_file(source, "ncu CSV").decode("utf-8", errors="replace") if is_path
            else source)
    first = next((line for line in text.splitlines() if line and not line.startswith("==")), "")
    if first.startswith("id,nvtx_range_and_kernel"):
        return parse_long_csv(text)
    if "Metric Name" in first and "Metric Value" in first:
        return parse_details_csv(text)
    if first.startswith('"ID"') or first.startswith("ID,"):
        return parse_raw_csv(text)
    raise ValueError("not an ncu CSV this parser knows: expected the long format "
                     f"({','.join(LONG_HEADER)}), ncu's raw page or its details page")


def write_long_csv(kernels: Sequence[NcuKernel], path: str | Path) -> None:
    """Save kernels in the anchors' long format (one row per kernel and metric)."""
    with Path(path).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(LONG_HEADER)
        for k in kernels:
            label = f"{k.case}/{k.name}" if k.case else k.name
            grid = f"({k.grid[0]}, {k.grid[1]}, {k.grid[2]})" if k.grid else ""
            block = f"({k.block[0]}, {k.block[1]}, {k.block[2]})" if k.block else ""
            for metric, (value, unit) in k.metrics.items():
                text = str(int(value)) if float(value).is_integer() else repr(value)
                writer.writerow([k.id, label, grid, block, metric, unit, text])


def attach_cases(kernels: list[NcuKernel], renamed: list[NcuKernel],
                 labels: Sequence[str] = ()) -> list[NcuKernel]:
    """Case names from the NVTX-renamed import, joined on kernel ID.

    With ``labels`` (the ranges we pushed), the case is the label the renamed name
    contains, whatever decoration ncu adds around it (a domain, a trailing '/').
    """
    by_id = {k.id: k for k in renamed}
    for kernel in kernels:
        other = by_id.get(kernel.id)
        if other is None:
            continue
        # the parser may already have split "case/kernel"; look at the whole renamed text
        text = f"{other.case}/{other.name}" if other.case else other.name
        if text == kernel.name:
            continue  # not renamed: this kernel ran outside any range
        known = [label for label in labels if label in text]
        if known:
            kernel.case = max(known, key=len)
            continue
        if labels:
            # None of our ranges: a kernel launched outside them whose renamed name is
            # just spelled differently (session 17: a demangled FillFunctor zeroing the
            # backward's counters became a "case" and cut the fwd+bwd case's tail).
            continue
        case, _ = _split_case(text)
        kernel.case = case if case is not None else (text.rstrip("/") or None)
    return kernels


def assign_by_launch_order(kernels: list[NcuKernel],
                           expected: Sequence[tuple[str, int]]) -> bool:
    """Fallback when NVTX names are missing: cases ran in order, each launching the
    given number of kernels.  Assigns only when the counts add up exactly."""
    if sum(count for _, count in expected) != len(kernels):
        return False
    position = 0
    for label, count in expected:
        for kernel in kernels[position:position + count]:
            kernel.case = label
        position += count
    return True


# ----- case names ------------------------------------------------------------------------------------
def case_label(provider: str, phase: str, shape: AttentionShape) -> str:
    """An NVTX range name that identifies the case (no '/': it separates case and kernel)."""
    left, right = shape.window
    return (f"{provider}|{phase}|B={shape.batch}|Hq={shape.query_heads}|Hkv={shape.kv_heads}"
            f"|Nq={shape.seqlen_q}|Nk={shape.seqlen_k}|d={shape.head_dim}|{shape.dtype}"
            f"|causal={int(shape.causal)}|window={left}:{right}")


def parse_case_label(label: str) -> tuple[str, str, AttentionShape]:
    """(provider, phase, shape) back from :func:`case_label`."""
    parts = label.split("|")
    if len(parts) != 11:
        raise ValueError(f"not an attnlab case label: {label!r}")
    provider, phase, *fields = parts
    values = dict(f.split("=", 1) for f in fields if "=" in f)
    dtype = next(f for f in fields if "=" not in f)
    left, right = (int(x) for x in values["window"].split(":"))
    shape = AttentionShape(batch=int(values["B"]), query_heads=int(values["Hq"]),
                           kv_heads=int(values["Hkv"]), seqlen_q=int(values["Nq"]),
                           seqlen_k=int(values["Nk"]), head_dim=int(values["d"]), dtype=dtype,
                           causal=values["causal"] == "1", window=(left, right))
    return provider, phase, shape


FWDBWD_PHASE = "fwdbwd"


def join_preceding_case(kernels: list[NcuKernel]) -> list[NcuKernel]:
    """Kernels outside any range take the fwd+bwd case of the ranged kernel launched
    before them (by ncu's kernel ID): autograd runs a backward on its own device thread,
    outside the NVTX range the forward's thread pushed, so a fwd+bwd case's backward
    kernels come back unnamed.  Only a fwd+bwd case has such a tail: kernels after any
    other case, or before the first ranged one, stay outside every case."""
    case = None
    for kernel in sorted(kernels, key=lambda k: k.id):
        if kernel.case:
            case = kernel.case if f"|{FWDBWD_PHASE}|" in kernel.case else None
        elif case is not None:
            kernel.case = case
    return kernels


def group_by_case(kernels: Iterable[NcuKernel]) -> dict[str, list[NcuKernel]]:
    """Kernels of each case in launch order; kernels outside any case are dropped."""
    cases: dict[str, list[NcuKernel]] = {}
    for kernel in kernels:
        if kernel.case:
            cases.setdefault(kernel.case, []).append(kernel)
    return cases


# ----- running ncu ----------------------------------------------------------------------------------
@dataclass
class NcuRun:
    kernels: list[NcuKernel]
    long_csv: Path
    raw_csv: Path
    command: list[str]
    metrics: tuple[str, ...]
    failed_cases: dict[str, str]
    notes: list[str]


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"ncu did not finish within {timeout_s:.0f} s: "
                           f"{shlex.join(argv[:8])} ...") from None


def run_ncu(cases: Sequence[tuple[str, str, AttentionShape]], out_dir: str | Path, *,
            ncu: str | None = None, metrics: Sequence[str] = tuple(METRICS),
            timeout_s: float = 600.0, python: str = sys.executable,
            device: str = "cuda", section_set: str | None = None,
            kernel_counts: Callable[[str, AttentionShape], int | None] | None = None) -> NcuRun:
    """Profile (provider, phase, shape) cases in one ncu session; parse and save its CSVs.

    ``device`` is where the target runs the cases ("cpu" only for testing this
    orchestration with a stand-in for ncu).  ``kernel_counts(provider, shape)``: how
    many kernels a case launches (None: unknown), used only when ncu gives no NVTX
    names, to assign kernels to cases by launch order
    (:func:`attnlab.measure.compare.predicted_kernel_count` is the cache model's).
    ``section_set``: also ncu's named section set (:func:`profile_command`); the raw CSV
    saved beside the parsed one then holds every metric it collected."""
    ncu = ncu or find_ncu()
    if ncu is None:
        raise RuntimeError("ncu (Nsight Compute) is not on PATH, in $NCU or in /usr/local/cuda/bin")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases_path, status_path = out_dir / "ncu_cases.json", out_dir / "ncu_status.json"
    cases_path.write_text(json.dumps([
        {"label": case_label(p, ph, s), "provider": p, "phase": ph, "shape": s.as_dict(),
         "device": device} for p, ph, s in cases], indent=1), encoding="utf-8")
    report = out_dir / "ncu_report"
    target = [python, "-m", "attnlab.measure.ncu", str(cases_path), str(status_path)]
    notes: list[str] = []
    command = profile_command(ncu, report, target, metrics, section_set)
    done = _run(command, timeout_s)
    if done.returncode != 0 and tuple(metrics) != CORE_METRICS and "metric" in (
            done.stdout + done.stderr).lower():
        notes.append("ncu rejected the full metric list; measured the core set only: "
                     + (done.stdout + done.stderr).strip().splitlines()[-1][:300])
        metrics = CORE_METRICS
        command = profile_command(ncu, report, target, metrics, section_set)
        done = _run(command, timeout_s)
    log = (done.stdout + "\n" + done.stderr).strip()
    (out_dir / "ncu_log.txt").write_text(shlex.join(command) + "\n\n" + log + "\n",
                                         encoding="utf-8")
    if done.returncode != 0:
        tail = " | ".join(log.splitlines()[-5:])
        raise RuntimeError(f"ncu failed (exit {done.returncode}): {tail}")
    report_file = report.with_suffix(".ncu-rep")
    plain = _run(import_command(ncu, report_file, nvtx_names=False), timeout_s)
    named = _run(import_command(ncu, report_file, nvtx_names=True), timeout_s)
    for result in (plain, named):
        if result.returncode != 0:
            raise RuntimeError(f"ncu --import failed: {result.stderr.strip()[-300:]}")
    raw_csv = out_dir / "ncu_raw.csv"
    raw_csv.write_text(plain.stdout, encoding="utf-8")
    labels = [case_label(p, ph, s) for p, ph, s in cases]
    kernels = attach_cases(parse_raw_csv(plain.stdout), parse_raw_csv(named.stdout), labels)
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    failed = {label: s for label, s in status.items() if s != "ok"}
    if kernels and not any(k.case for k in kernels):
        ran = [(label, (p, s)) for label, (p, _, s) in zip(labels, cases, strict=True)
               if status.get(label) == "ok"]
        counts = [(label, kernel_counts(p, s) if kernel_counts else None)
                  for label, (p, s) in ran]
        expected = counts if all(count is not None for _, count in counts) else []
        if expected and assign_by_launch_order(kernels, expected):
            notes.append("ncu gave no NVTX range names; kernels were assigned to cases by "
                         "launch order, using the kernel counts the cache model predicts")
        else:
            notes.append("ncu gave no NVTX range names and launch order could not be matched "
                         "to the cases: kernels are listed without cases")
    long_csv = out_dir / "ncu_kernels.csv"
    write_long_csv(kernels, long_csv)
    return NcuRun(kernels, long_csv, raw_csv, command, tuple(metrics), failed, notes)


# ----- the profiling target (runs under ncu) -------------------------------------------------------
def main_target(argv: Sequence[str] | None = None) -> int:
    """Run each case once inside its NVTX range, between cudaProfilerStart and Stop."""
    import torch

    from attnlab.measure.providers import prepare, provider

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m attnlab.measure.ncu CASES.json STATUS.json", file=sys.stderr)
        return 2
    cases = json.loads(Path(args[0]).read_text())
    status: dict[str, str] = {}
    for case in cases:
        label = case["label"]
        device = case.get("device", "cuda")
        profiling = False
        try:
            shape = AttentionShape.from_dict(case["shape"])
            call = prepare(provider(case["provider"]), shape, case["phase"], device)
            inputs = call.inputs(seed=0)
            call.call(*inputs)   # warm-up: compile, autotune, allocate
            call.call(*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                torch.cuda.nvtx.range_push(label)
                profiling = True
            call.call(*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
            status[label] = "ok"
        except Exception as error:  # one case failing must not lose the others
            status[label] = f"{type(error).__name__}: {error}"[:500]
            print(f"attnlab ncu target: {label}: {status[label]}", file=sys.stderr)
        finally:
            if profiling:
                torch.cuda.nvtx.range_pop()
                torch.cuda.profiler.stop()
            if device == "cuda":
                torch.cuda.empty_cache()
    Path(args[1]).write_text(json.dumps(status, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main_target())
