"""The one Chrome-trace reader and kernel classifier: what ran, and attention's time share.

``torch.profiler`` traces are read here and nowhere else: :func:`load_trace` (size-,
depth- and gzip-bomb-safe), :func:`parse_chrome_trace` (the kernels one call launched,
for ``attnlab kernels`` and the sweeps) and :func:`classify_trace` (attention's time
share of a prefill, for ``attnlab report``).  One name classifier decides what a GEMM
is for both: :func:`is_gemm` is the class table below applied to a kernel's name.

``torch.profiler.profile(...).export_chrome_trace(path)`` writes one JSON object whose
``traceEvents`` hold complete events (``"ph": "X"``, ``ts``/``dur`` in microseconds).
This module sorts the time in them into three classes -- **attention**, **gemm**,
**other** -- plus **idle** (time inside the span when nothing ran), and returns the
attention time share ``f`` that Amdahl's law needs.

Two kinds of trace, detected automatically:

* **device kernels** (a CUDA/ROCm trace: events of category ``kernel``, ``gpu_memcpy``,
  ``gpu_memset``): each kernel's duration is classified.  The span runs from the first
  kernel's start to the last one's end; idle is the span minus the union of kernels.
* **CPU ops** (a CPU-only trace: events of category ``cpu_op``): ops nest (``aten::matmul``
  calls ``aten::bmm``), so each op's *self* time (its duration minus its direct child
  ops) is classified, and nothing is counted twice.  Idle is host time between ops
  (Python between calls).

``f = attention / (attention + gemm + other + idle)``; on a single CUDA stream the
denominator is exactly the span, so ``f`` is the share Amdahl's law applies to.

How an event is classified -- the first rule that matches wins; every pattern is plain
text found in the name, case-insensitively: ``softmax`` matches ``cunn_SoftMaxForward``;
a leading ``^`` ties it to the name's start and a trailing ``$`` to its end
(``^attention$`` is the whole name).  Patterns are not regular expressions: a
user-supplied one such as ``(a+)+$`` could take hours on one long kernel name, while a
substring test is linear.  Regex syntax (``\\ * + ? | ( ) [ ] { }``) is refused by name,
so a pattern written as a regex is never silently read as text.

1. its own name, or the name of a CPU op it runs inside, matches ``attention``;
2. it runs inside a scope whose name matches ``attention_scopes``: a
   ``record_function`` range, a CPU op or a Python function enclosing the kernel's
   launch (found by the launch's ``correlation`` id) or enclosing the CPU op, or a
   ``gpu_user_annotation`` range around the kernel;
3. its own name, or the name of a CPU op it runs inside, matches ``gemm``;
4. otherwise **other**.

Default pattern table (``DEFAULT_PATTERNS``; replace any list through the workload
file's ``trace_patterns`` or the ``patterns`` argument):

============== ==================================================== ==========================
class          patterns                                              catches
============== ==================================================== ==========================
attention      ``flash``, ``fmha``, ``sdpa``, ``attn``,              flash_fwd_kernel,
               ``attention``, ``softmax``,                           fmha_cutlassF_*, cuDNN
               ``scaled_dot_product``                                ``*_sdpa_*``, Triton
                                                                     ``_attn_fwd``,
                                                                     cunn_SoftMaxForward,
                                                                     aten::_softmax,
                                                                     aten::_scaled_dot_product_*
attention      ``^attention$``, ``^core_attention$``,                ``record_function``
scopes         ``^self attention$`` ... (core, self, sdpa, flash,   ranges named attention;
               each with ``_``, a space or nothing before           SDPA's math path (bmm
               ``attention``), ``scaled_dot_product``,              kernels under it);
               ``flash_attn``, ``^attnlab::``                        flash-attn / attnlab ops
gemm           ``gemm``, ``gemv``, ``cutlass``, ``cublas``,          sm90_xmma_gemm_*,
               ``xmma``, ``wgmma``, ``nvjet``, ``matmul``,           cutlass::Kernel,
               ``^aten::mm$``, ``^aten::bmm$``, ``^aten::addmm$``    nvjet_* (cuBLAS on
               ... (mm, bmm, addmm, baddbmm, addbmm, mv, dot,       Hopper), aten::mm ...
               linear, _addmm_activation, _scaled_mm)
============== ==================================================== ==========================

Why a scope rule: eager attention's ``Q K^T`` and ``P V`` are batched matrix
multiplies whose kernels have GEMM names; only the code around them says they are
attention.  Wrap the attention core (not the Q/K/V/O projections) in
``torch.profiler.record_function("attention")`` -- :mod:`attnlab.measure.decoder` does --
and they count as attention.  Module scopes such as ``nn.Module: LlamaAttention`` are
deliberately *not* matched: they include the projections, which the lesson counts
outside attention.  ``softmax`` assumes the prefill's only softmax is attention's
(a sampler's softmax over one position is negligible).
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import io
import json
import math
import re
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.checks import open_regular_file, quote

CLASSES = ("attention", "gemm", "other")
TRACE_PARTS = ("attention", "gemm", "other", "idle")
PATTERN_KEYS = ("attention", "attention_scopes", "gemm")

DEFAULT_PATTERNS: dict[str, tuple[str, ...]] = {
    "attention": (
        r"flash", r"fmha", r"sdpa", r"attn", r"attention", r"softmax", r"scaled_dot_product",
    ),
    "attention_scopes": (
        "^attention$",
        *(f"^{who}{joint}attention$" for who in ("core", "self", "sdpa", "flash")
          for joint in ("_", " ", "")),
        "scaled_dot_product",
        "flash_attn",
        "^attnlab::",
    ),
    "gemm": (
        "gemm", "gemv", "cutlass", "cublas", "xmma", "wgmma", "nvjet", "matmul",
        "_mm_", "bmm", "triton_tem_fused_mm",
        *(f"^aten::{op}$" for op in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "dot",
                                     "linear", "_addmm_activation", "_scaled_mm")),
    ),
}
# Characters that mean something in a regular expression and never in attnlab's plain
# patterns (^ and $ are taken at the ends only): refused, so a regex is not read as text.
REGEX_SYNTAX = frozenset("\\*+?|()[]{}")
MAX_PATTERN_LENGTH = 200

# Reading limits: a trace is a profiler export of seconds of work, tens of MB at most.
# Past these it is refused before it is expanded (a 2 MB gzip can hold 4 GB of JSON).
MAX_TRACE_BYTES = 256 << 20         # decompressed: a long profiled prefill is tens of MB
# One gap between kernels longer than this share of the span is worth a warning: the
# share f is taken over the span, and a stray event far away makes idle swallow it.
STRAY_GAP_SHARE = 0.5

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# Host events that can enclose a kernel launch or an op: ranges, ops, Python frames.
SCOPE_CATEGORIES = frozenset({"cpu_op", "user_annotation", "python_function"})
MODE_DEVICE = "device kernels"
MODE_CPU = "CPU ops"
TOP_NAMES_PER_CLASS = 6


@dataclass(frozen=True)
class _Interval:
    start: float  # microseconds
    end: float
    name: str
    category: str
    index: int


@dataclass(frozen=True)
class NameTotal:
    """All time of one event name in one class, and why it landed there."""

    name: str
    category: str
    count: int
    ms: float
    reason: str

    def as_dict(self) -> dict:
        return {"name": self.name, "class": self.category, "count": self.count, "ms": self.ms,
                "reason": self.reason}


@dataclass(frozen=True)
class TraceSummary:
    """Classified time of one profiler trace.  Times in milliseconds."""

    source: str
    mode: str
    span_ms: float
    class_ms: dict[str, float]  # attention, gemm, other, idle
    events: int
    top_names: tuple[NameTotal, ...]
    patterns: dict[str, tuple[str, ...]]
    overlap_ms: float = 0.0  # kernel time that ran concurrently with other kernels
    notes: tuple[str, ...] = field(default=())
    # Problems with the trace itself that change the numbers: the report prints them.
    warnings: tuple[str, ...] = field(default=())

    @property
    def total_ms(self) -> float:
        return math.fsum(self.class_ms.values())

    @property
    def attention_time_share(self) -> float:
        return self.class_ms["attention"] / self.total_ms

    def shares(self) -> dict[str, float]:
        total = self.total_ms
        return {name: self.class_ms[name] / total for name in TRACE_PARTS}

    def segment_parts(self, segment_ms: float) -> dict[str, float]:
        """The trace's time shares applied to a segment measured at another boundary."""
        return {name: share * segment_ms for name, share in self.shares().items()}

    def as_dict(self) -> dict:
        return {
            "source": self.source, "mode": self.mode, "span_ms": self.span_ms,
            "total_ms": self.total_ms, "overlap_ms": self.overlap_ms, "events": self.events,
            "class_ms": dict(self.class_ms), "shares": self.shares(),
            "attention_time_share": self.attention_time_share,
            "top_names": [t.as_dict() for t in self.top_names],
            "patterns": {k: list(v) for k, v in self.patterns.items()},
            "notes": list(self.notes), "warnings": list(self.warnings),
        }


# ----------------------------------------------------------------------------------
# Patterns
# ----------------------------------------------------------------------------------
def resolve_patterns(overrides: dict[str, Any] | None = None) -> dict[str, tuple[str, ...]]:
    """The default table with any class's list replaced by ``overrides[class]``."""
    patterns = dict(DEFAULT_PATTERNS)
    for key, value in (overrides or {}).items():
        if key not in PATTERN_KEYS:
            raise ValueError(f"trace_patterns: unknown class {key!r}; allowed: "
                             f"{', '.join(PATTERN_KEYS)}")
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"trace_patterns.{key} must be a non-empty list of plain-text "
                             f"patterns")
        patterns[key] = tuple(check_pattern(p, f"trace_patterns.{key}[{i}]")
                              for i, p in enumerate(value))
    return patterns


def check_pattern(pattern: Any, where: str) -> str:
    """A plain-text pattern (module docstring): a non-empty string of at most
    ``MAX_PATTERN_LENGTH`` characters with no regex syntax, ``^``/``$`` only at its ends."""
    if not isinstance(pattern, str) or not pattern.strip("^$"):
        raise ValueError(f"{where} must be a non-empty text pattern, got {quote(pattern)}")
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(f"{where} must be at most {MAX_PATTERN_LENGTH} characters, got "
                         f"{len(pattern):,}")
    body = pattern[pattern.startswith("^"):len(pattern) - pattern.endswith("$")]
    syntax = sorted({c for c in body if c in REGEX_SYNTAX or c in "^$"})
    if syntax:
        raise ValueError(f"{where} {quote(pattern)} holds {' '.join(syntax)}: patterns are "
                         f"plain text found in the name (case-insensitive; ^ at the start and "
                         f"$ at the end anchor), not regular expressions; list alternatives "
                         f"as separate patterns")
    return pattern


def _plain_matcher(pattern: str) -> Callable[[str], bool]:
    """``pattern`` as a test on a lower-cased name: a substring, prefix, suffix or whole."""
    start, end = pattern.startswith("^"), pattern.endswith("$")
    text = pattern[start:len(pattern) - end].lower()
    if start and end:
        return lambda name: name == text
    if start:
        return lambda name: name.startswith(text)
    if end:
        return lambda name: name.endswith(text)
    return lambda name: text in name


class _Matcher:
    def __init__(self, patterns: dict[str, tuple[str, ...]]) -> None:
        self.compiled = {key: [(p, _plain_matcher(p)) for p in patterns[key]]
                         for key in PATTERN_KEYS}
        self._cache: dict[tuple[str, str], str | None] = {}

    def match(self, key: str, name: str) -> str | None:
        """The first pattern of ``key`` found in ``name``, or None."""
        cached = self._cache.get((key, name), "")
        if cached != "":
            return cached
        lowered = name.lower()
        found = next((p for p, test in self.compiled[key] if test(lowered)), None)
        self._cache[(key, name)] = found
        return found

    def _by_name_or_op(self, key: str, name: str, ops: list[_Interval]) -> str | None:
        """Why ``name`` belongs to class ``key``: its own name, or an enclosing CPU op's."""
        pattern = self.match(key, name)
        if pattern:
            return f"name matches /{pattern}/"
        for op in ops:
            pattern = self.match(key, op.name)
            if pattern:
                return f"inside {op.name} (matches /{pattern}/)"
        return None

    def name_class(self, name: str) -> str:
        """The class of a name on its own (no scopes): attention, gemm or other."""
        if self.match("attention", name):
            return "attention"
        return "gemm" if self.match("gemm", name) else "other"

    def classify(self, name: str, scopes: list[_Interval]) -> tuple[str, str]:
        """(class, reason) of an event named ``name`` running inside ``scopes`` (innermost first)."""
        ops = [s for s in scopes if s.category == "cpu_op"]
        reason = self._by_name_or_op("attention", name, ops)
        if reason:
            return "attention", reason
        for scope in scopes:
            pattern = self.match("attention_scopes", scope.name)
            if pattern:
                return "attention", f"inside scope {scope.name!r} (matches /{pattern}/)"
        reason = self._by_name_or_op("gemm", name, ops)
        if reason:
            return "gemm", reason
        return "other", "no pattern matches"


_NAME_CLASSIFIER = _Matcher(DEFAULT_PATTERNS)


# ----------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------
def load_trace(path: str | Path) -> dict | list:
    """A Chrome trace file (``.json`` or gzip-compressed) as parsed JSON.

    Refused with a ValueError naming the file: unreadable, larger than
    ``MAX_TRACE_BYTES`` once decompressed, a corrupt gzip stream, not JSON, or nested
    too deeply for the parser.
    """
    path = Path(path)
    try:
        with open_regular_file(path, "trace file") as handle:
            head = handle.read(2)
            handle.seek(0)
            if head == b"\x1f\x8b":
                raw = _read_capped(gzip.GzipFile(fileobj=handle), path)
            else:
                raw = _read_capped(handle, path)
    except OSError as error:
        if isinstance(error, (gzip.BadGzipFile,)):
            raise ValueError(f"trace {path.name}: not a valid gzip file ({error})") from None
        raise ValueError(f"trace file {str(path)!r} cannot be read: "
                         f"{error.strerror or error}") from error
    except (EOFError, zlib.error) as error:
        raise ValueError(f"trace {path.name}: corrupt gzip stream ({error})") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"trace {path.name}: not a Chrome trace JSON file "
                         f"({str(error)[:120]})") from None
    except RecursionError:
        raise ValueError(f"trace {path.name}: JSON nested too deeply") from None


def _read_capped(stream: io.RawIOBase | io.BufferedIOBase, path: Path) -> bytes:
    raw = stream.read(MAX_TRACE_BYTES + 1)
    if len(raw) > MAX_TRACE_BYTES:
        raise ValueError(f"trace {path.name}: more than {MAX_TRACE_BYTES:,} bytes of JSON "
                         f"(decompressed); refusing to read it")
    return raw


def _events(trace: dict | list, source: str) -> list[dict]:
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ValueError(f"trace {source}: no traceEvents list (is it a torch.profiler Chrome "
                         f"trace from export_chrome_trace?)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and _is_number(e.get("ts")) and _is_number(e.get("dur"))]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _duration_warnings(events: list[dict]) -> tuple[list[dict], list[str]]:
    """Events with a usable time, and a warning for each kind left out or clamped."""
    usable, warnings = [], []
    negative = non_finite = 0
    for event in events:
        start, duration = float(event["ts"]), float(event["dur"])
        if not (math.isfinite(start) and math.isfinite(duration)):
            non_finite += 1
            continue
        if duration < 0:
            negative += 1
        usable.append(event)
    if negative:
        warnings.append(f"{negative} event(s) have negative durations; counted as 0 ms "
                        f"(a clock or export problem: check the profiler run)")
    if non_finite:
        warnings.append(f"{non_finite} event(s) have a non-finite start or duration; left out")
    return usable, warnings


def _category(event: dict) -> str:
    return str(event.get("cat", "")).lower()


def _ancestors(items: list[tuple[_Interval, bool]]) -> dict[int, list[_Interval]]:
    """For one host thread: every item's enclosing scopes, innermost first.

    ``items`` pairs each interval with whether it can enclose others.  A sweep in start
    order with a stack of open scopes: O(n log n) for properly nested profiler ranges.
    """
    items = sorted(items, key=lambda item: (item[0].start, -(item[0].end - item[0].start)))
    stack: list[_Interval] = []
    result: dict[int, list[_Interval]] = {}
    for interval, is_scope in items:
        while stack and stack[-1].end <= interval.start:
            stack.pop()
        result[interval.index] = stack[::-1]
        if is_scope:
            stack.append(interval)
    return result


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals, in milliseconds."""
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total / 1000.0


def _interval(event: dict, index: int) -> _Interval:
    start = float(event["ts"])
    return _Interval(start, start + max(float(event["dur"]), 0.0), str(event.get("name", "")),
                     _category(event), index)


# ----------------------------------------------------------------------------------
# Classification
# ----------------------------------------------------------------------------------
def classify_trace(trace: dict | list, *, patterns: dict[str, Any] | None = None,
                   source: str = "trace") -> TraceSummary:
    """Classify a parsed Chrome trace; ``patterns`` replaces lists of the default table."""
    table = resolve_patterns(patterns)
    matcher = _Matcher(table)
    events, warnings = _duration_warnings(_events(trace, source))
    if any(_category(e) in DEVICE_CATEGORIES for e in events):
        summary = _classify_device(events, matcher, table, source)
    elif any(_category(e) == "cpu_op" for e in events):
        summary = _classify_cpu(events, matcher, table, source)
    else:
        summary = None
    if summary is not None:
        warnings += _stray_gap_warning(events, summary)
        return dataclasses.replace(summary, warnings=tuple(warnings))
    raise ValueError(f"trace {source}: holds no kernel or CPU-op events (categories kernel, "
                     f"gpu_memcpy, gpu_memset or cpu_op); profile with torch.profiler and "
                     f"export_chrome_trace")


def _stray_gap_warning(events: list[dict], summary: TraceSummary) -> list[str]:
    """A warning when one idle gap is most of the span: a stray event far from the rest."""
    if summary.span_ms <= 0:
        return []
    kinds = DEVICE_CATEGORIES if summary.mode == MODE_DEVICE else frozenset({"cpu_op"})
    spans = sorted((float(e["ts"]), float(e["ts"]) + max(float(e["dur"]), 0.0))
                   for e in events if _category(e) in kinds)
    widest, reach = 0.0, spans[0][1]
    for start, end in spans[1:]:
        widest = max(widest, start - reach)
        reach = max(reach, end)
    if widest / 1000.0 <= STRAY_GAP_SHARE * summary.span_ms:
        return []
    return [f"one idle gap of {widest / 1000.0:.3f} ms is {widest / 1000.0 / summary.span_ms:.0%} "
            f"of the {summary.span_ms:.3f} ms span: a stray event far from the others makes "
            f"idle swallow the attention share ({summary.attention_time_share:.1%}); trim the "
            f"trace to the prefill"]


def summarize_trace(path: str | Path, patterns: dict[str, Any] | None = None) -> TraceSummary:
    """Load and classify a Chrome trace file."""
    path = Path(path)
    return classify_trace(load_trace(path), patterns=patterns, source=path.name)


def _classify_device(events: list[dict], matcher: _Matcher, table: dict,
                     source: str) -> TraceSummary:
    intervals = [_interval(e, i) for i, e in enumerate(events)]
    kernels = [iv for iv in intervals if iv.category in DEVICE_CATEGORIES]

    # Host side: launches (anything carrying a correlation id) nested in scopes, per thread.
    launch_by_correlation: dict[Any, int] = {}
    per_thread: dict[tuple, list[tuple[_Interval, bool]]] = defaultdict(list)
    for event, interval in zip(events, intervals, strict=True):
        category = interval.category
        if category in DEVICE_CATEGORIES:
            continue
        thread = (event.get("pid"), event.get("tid"))
        if category in SCOPE_CATEGORIES:
            per_thread[thread].append((interval, True))
        correlation = (event.get("args") or {}).get("correlation")
        if correlation is not None and category not in SCOPE_CATEGORIES:
            launch_by_correlation[correlation] = interval.index
            per_thread[thread].append((interval, False))
    enclosing: dict[int, list[_Interval]] = {}
    for items in per_thread.values():
        enclosing.update(_ancestors(items))

    # Device side: gpu_user_annotation ranges that are attention scopes.
    annotation_ranges = sorted(
        (iv.start, iv.end, iv.name) for iv in intervals
        if iv.category == "gpu_user_annotation" and matcher.match("attention_scopes", iv.name))
    annotation_starts = [start for start, _, _ in annotation_ranges]

    totals: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    class_us = dict.fromkeys(CLASSES, 0.0)
    unlinked = 0
    for kernel in kernels:
        correlation = (events[kernel.index].get("args") or {}).get("correlation")
        launch = launch_by_correlation.get(correlation)
        scopes = list(enclosing.get(launch, [])) if launch is not None else []
        if launch is None:
            unlinked += 1
        position = bisect.bisect_right(annotation_starts, kernel.start) - 1
        while position >= 0:
            start, end, name = annotation_ranges[position]
            if start <= kernel.start and kernel.end <= end:
                scopes.append(_Interval(start, end, name, "gpu_user_annotation", -1))
                break
            position -= 1
        category, reason = matcher.classify(kernel.name, scopes)
        duration = kernel.end - kernel.start
        class_us[category] += duration
        entry = totals[(kernel.name, category, reason)]
        entry[0] += 1
        entry[1] += duration

    span_us = max(k.end for k in kernels) - min(k.start for k in kernels)
    busy_ms = _union_ms([(k.start, k.end) for k in kernels])
    kernel_ms = math.fsum(class_us.values()) / 1000.0
    notes = []
    if unlinked:
        notes.append(f"{unlinked} of {len(kernels)} kernels have no launch event in the trace; "
                     f"only their names classify them")
    overlap_ms = max(kernel_ms - busy_ms, 0.0)
    if overlap_ms > 1e-6:
        notes.append(f"{overlap_ms:.3f} ms of kernel time overlapped other kernels (several "
                     f"streams); shares are of kernel time plus idle, not of the span")
    return _summary(source, MODE_DEVICE, span_us / 1000.0, class_us,
                    idle_ms=span_us / 1000.0 - busy_ms, events=len(kernels), totals=totals,
                    table=table, overlap_ms=overlap_ms, notes=notes, unit="kernels")


def _classify_cpu(events: list[dict], matcher: _Matcher, table: dict, source: str) -> TraceSummary:
    intervals = [_interval(e, i) for i, e in enumerate(events)]
    per_thread: dict[tuple, list[tuple[_Interval, bool]]] = defaultdict(list)
    for event, interval in zip(events, intervals, strict=True):
        if interval.category in SCOPE_CATEGORIES:
            per_thread[(event.get("pid"), event.get("tid"))].append((interval, True))
    enclosing: dict[int, list[_Interval]] = {}
    for items in per_thread.values():
        enclosing.update(_ancestors(items))

    ops = [iv for iv in intervals if iv.category == "cpu_op"]
    child_us: dict[int, float] = defaultdict(float)
    top_level: list[tuple[float, float]] = []
    for op in ops:
        parent = next((s for s in enclosing[op.index] if s.category == "cpu_op"), None)
        if parent is None:
            top_level.append((op.start, op.end))
        else:
            child_us[parent.index] += op.end - op.start

    totals: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    class_us = dict.fromkeys(CLASSES, 0.0)
    for op in ops:
        self_us = max(op.end - op.start - child_us[op.index], 0.0)
        category, reason = matcher.classify(op.name, enclosing[op.index])
        class_us[category] += self_us
        entry = totals[(op.name, category, reason)]
        entry[0] += 1
        entry[1] += self_us
    span_us = max(op.end for op in ops) - min(op.start for op in ops)
    busy_ms = _union_ms(top_level)
    notes = ["CPU trace: each op's self time (its duration minus its child ops) is classified; "
             "idle is host time between top-level ops"]
    return _summary(source, MODE_CPU, span_us / 1000.0, class_us,
                    idle_ms=span_us / 1000.0 - busy_ms, events=len(ops), totals=totals,
                    table=table, overlap_ms=0.0, notes=notes, unit="CPU ops")


def _summary(source: str, mode: str, span_ms: float, class_us: dict[str, float], *,
             idle_ms: float, events: int, totals: dict, table: dict, overlap_ms: float,
             notes: list[str], unit: str) -> TraceSummary:
    class_ms = {name: class_us[name] / 1000.0 for name in CLASSES}
    class_ms["idle"] = max(idle_ms, 0.0)
    if class_ms["attention"] <= 0.0:
        raise ValueError(
            f"trace {source}: no attention {unit} among {events} (attention patterns: "
            f"{', '.join(table['attention'])}; scopes: {', '.join(table['attention_scopes'])}); "
            f"profile a prefill that runs attention, or set trace_patterns.attention")
    by_class: dict[str, list[NameTotal]] = defaultdict(list)
    for (name, category, reason), (count, duration_us) in totals.items():
        by_class[category].append(NameTotal(name, category, int(count), duration_us / 1000.0,
                                            reason))
    top: list[NameTotal] = []
    for category in CLASSES:
        top.extend(sorted(by_class[category], key=lambda t: -t.ms)[:TOP_NAMES_PER_CLASS])
    return TraceSummary(source=source, mode=mode, span_ms=span_ms, class_ms=class_ms,
                        events=events, top_names=tuple(top), patterns=table,
                        overlap_ms=overlap_ms, notes=tuple(notes))


# ----------------------------------------------------------------------------------
# Kernel names and the kernels one call launched (``attnlab kernels``, the sweeps)
# ----------------------------------------------------------------------------------
def base_name(name: str) -> str:
    """A kernel's name without return type, template arguments or parameters."""
    text = name.strip()
    if text.startswith("void "):
        text = text[5:]
    # Anonymous namespaces are part of the name, not template arguments or parameters.
    protected = {"<unnamed>": "\x00u", "(anonymous namespace)": "\x00a"}
    for original, stand_in in protected.items():
        text = text.replace(original, stand_in)
    for stop in ("<", "("):
        cut = text.find(stop)
        if cut > 0:
            text = text[:cut]
    for original, stand_in in protected.items():
        text = text.replace(stand_in, original)
    return text.strip()


def is_gemm(name: str) -> bool:
    """True for matrix-multiply kernels, False for attention and elementwise kernels.

    The class table's default patterns (``DEFAULT_PATTERNS``) on the name alone: a
    name matching an attention pattern is attention even when its template arguments
    mention CUTLASS or wgmma; otherwise a GEMM pattern makes it a GEMM.
    """
    return _NAME_CLASSIFIER.name_class(name) == "gemm"


_ELEMENTWISE = ("vectorized_elementwise_kernel", "elementwise_kernel",
                "unrolled_elementwise_kernel", "distribution_elementwise_grid_stride_kernel")
_FUNCTOR = re.compile(r"(\w*Functor\w*|masked_fill\w*|bitwise_not\w*|copy_kernel\w*|"
                      r"\w+_kernel_cuda|normal_kernel)")
_WRAPPER = re.compile(r"(A|B)?Unary\w*Functor|Binary\w*Functor")


def short_name(name: str, width: int = 72) -> str:
    """The kernel's own name without namespaces; a generic elementwise kernel also says
    which operation it applies (``vectorized_elementwise_kernel[MulFunctor]``)."""
    base = base_name(name)
    tail = base.split("::")[-1] or base
    if tail in _ELEMENTWISE:
        found = _FUNCTOR.findall(name)
        # AUnaryFunctor/BinaryFunctor wrap the operation (MulFunctor): name the operation
        specific = [f for f in found if not _WRAPPER.match(f)]
        if found:
            tail = f"{tail}[{(specific or found)[0]}]"
    return tail if len(tail) <= width else tail[: width - 1] + "…"


@dataclass(frozen=True)
class KernelStat:
    name: str
    calls: int
    total_us: float

    @property
    def mean_us(self) -> float:
        return self.total_us / self.calls

    @property
    def is_gemm(self) -> bool:
        return is_gemm(self.name)


@dataclass(frozen=True)
class KernelList:
    """GPU work of one call, aggregated by kernel name in first-launch order."""

    kernels: tuple[KernelStat, ...]

    @property
    def launches(self) -> int:
        return sum(k.calls for k in self.kernels)

    @property
    def total_us(self) -> float:
        return sum(k.total_us for k in self.kernels)

    @property
    def gemm_us(self) -> float:
        return sum(k.total_us for k in self.kernels if k.is_gemm)

    @property
    def outside_gemm_share(self) -> float:
        """Fraction of GPU time in kernels that are not matrix multiplies."""
        total = self.total_us
        return (total - self.gemm_us) / total if total > 0 else 0.0

    def names(self) -> list[str]:
        return [k.name for k in self.kernels]

    def as_dict(self) -> dict:
        return {
            "launches": self.launches, "total_us": self.total_us, "gemm_us": self.gemm_us,
            "outside_gemm_share": self.outside_gemm_share,
            "kernels": [{"name": k.name, "short_name": short_name(k.name), "calls": k.calls,
                         "total_us": k.total_us, "mean_us": k.mean_us, "is_gemm": k.is_gemm}
                        for k in self.kernels],
        }


def summarize(activities: Iterable[tuple[str, float]]) -> KernelList:
    """Aggregate (name, duration in µs) pairs, in launch order, by name."""
    order: list[str] = []
    calls: dict[str, int] = {}
    total: dict[str, float] = {}
    for name, duration in activities:
        if name not in calls:
            order.append(name)
            calls[name], total[name] = 0, 0.0
        calls[name] += 1
        total[name] += float(duration)
    return KernelList(tuple(KernelStat(n, calls[n], total[n]) for n in order))


def gpu_activities(trace: dict) -> list[tuple[str, float]]:
    """(name, duration µs) of the GPU work in a Chrome trace, sorted by start time."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list")
    events, _ = _duration_warnings(_events(trace, "trace"))
    events = [e for e in events if _category(e) in DEVICE_CATEGORIES]
    events.sort(key=lambda e: float(e["ts"]))
    return [(str(e.get("name", "")), max(float(e["dur"]), 0.0)) for e in events]


def parse_chrome_trace(path: str | Path) -> KernelList:
    """The kernel list of a trace written by ``torch.profiler``'s ``export_chrome_trace``."""
    return summarize(gpu_activities(load_trace(path)))
