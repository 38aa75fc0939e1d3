"""The workload file of ``attnlab report``: schema, parsing, validation.

A workload file (YAML or JSON) describes one request's serial critical path and one
proposed change.  The full schema, field by field, is in ``docs/report.md``; in short::

    title: Document QA latency trace            # optional
    workload: {model: nominal 8B dense, parameters: 8.0e+9, layers: 32, query_heads: 32,
               kv_heads: 32, head_dim: 128, dtype: fp16, concurrency: 8,
               prompt_tokens: 4096, output_tokens: 128}
    targets: {ttft_p95_ms: 350.0, tpot_ms: 40.0}
    segments:                                  # in order; TTFT is their sum
      - {name: network, ms: 15.0, source: synchronized socket ingress delta}
      - {name: queue, ms: 65.0, source: server enqueue/dequeue timestamps}
      - {name: prefill, ms: 290.0, source: CUDA profiler span,
         parts: {attention: 116.0, other: 174.0}}
      - {name: first_chunk, ms: 10.0, source: SSE serialization}
    client: {ttft_ms: 380.0, source: client socket timer}   # optional cross-check
    decode: {tpot_ms: 32.0}
    proposal: {change: FlashAttention-2 causal prefill kernel, segment: prefill,
               part: attention, kernel_speedup: 3.0}
    samples: {ttft_ms: [...]}                  # optional: client TTFTs for a p95 verdict
    trace_patterns: {attention: [...], attention_scopes: [...], gemm: [...]}  # optional

Every error is one line that names the field (``segments[2].ms must be ...``) and
is raised as ``ValueError`` (the CLI turns it into exit code 2).  Problems that do
not invalidate the numbers -- segments that do not add up to the client total within
1%, parts that leave part of a segment unattributed, a segment without a source --
are collected as warnings on the parsed :class:`Workload`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.checks import as_scalar, check_bool, check_float, check_int, quote, read_regular_file
from attnlab.dtypes import canonical_dtype
from attnlab.measure.profile import check_pattern
from attnlab.measure.records import portable_path
from attnlab.shapes import PRESETS, ModelPreset

# Segments may disagree with a measured client total by this much before we warn
# (the 1%): clock skew and rounding make exact agreement rare.
CLIENT_TOTAL_TOLERANCE = 0.01
# Parts may exceed their segment by this much (rounding of published figures, e.g.
# 116.0 + 174.1 against 290.0) before it is an error rather than arithmetic noise.
PARTS_OVERFLOW_TOLERANCE = 0.001
# Parts that leave less than this share of a segment unexplained are not worth a warning.
PARTS_GAP_TOLERANCE = 0.001
UNATTRIBUTED_PART = "unattributed"
# A kernel speedup outside these bounds is a typo, not a kernel: 1e-320 would make every
# projected time overflow.  Durations past MAX_MS (11.6 days) are not one request's.
MIN_KERNEL_SPEEDUP = 1e-6
MAX_KERNEL_SPEEDUP = 1e6
MAX_MS = 1e9
MAX_PARAMETERS = 10**15
# Input limits of a workload file (it describes one request in a few dozen lines).
MAX_WORKLOAD_BYTES = 1 << 20
MAX_YAML_ALIASES = 100
MAX_WORKLOAD_DEPTH = 32
MAX_WORKLOAD_NODES = 100_000

TOP_LEVEL_FIELDS = ("title", "workload", "targets", "segments", "client", "decode", "proposal",
                    "samples", "trace_patterns")
WORKLOAD_FIELDS = ("model", "preset", "parameters", "layers", "attention_layers", "query_heads",
                   "kv_heads", "head_dim", "dtype", "concurrency", "prompt_tokens",
                   "output_tokens")
GEOMETRY_FIELDS = ("layers", "query_heads", "kv_heads", "head_dim", "dtype", "parameters")
TARGET_FIELDS = ("ttft_p95_ms", "tpot_ms")
SEGMENT_FIELDS = ("name", "ms", "source", "parts", "load_dependent", "note")
CLIENT_FIELDS = ("ttft_ms", "source")
DECODE_FIELDS = ("tpot_ms", "source")
PROPOSAL_FIELDS = ("change", "segment", "part", "time_share", "kernel_speedup", "speedup_source",
                   "baseline_provider", "candidate_provider", "records_metric")
SAMPLES_FIELDS = ("ttft_ms", "source")
PATTERN_FIELDS = ("attention", "attention_scopes", "gemm")

# Multipliers for parameter counts written as "8B", "70M", "1.5T".
_COUNT_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class Part:
    name: str
    ms: float


@dataclass(frozen=True)
class Segment:
    """One serial step of a request's critical path, measured at its own boundary."""

    name: str
    ms: float
    source: str | None = None
    parts: tuple[Part, ...] = ()
    load_dependent: bool = False  # does its duration change with load (a queue)?
    note: str | None = None

    def part(self, name: str) -> Part | None:
        return next((p for p in self.parts if p.name == name), None)


@dataclass(frozen=True)
class ModelWorkload:
    """The model and the load it serves.  Geometry feeds the FLOP-share comparison."""

    model: str | None = None
    preset: str | None = None
    parameters: int | None = None
    layers: int | None = None
    attention_layers: int | None = None
    query_heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None
    concurrency: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None

    def missing_geometry(self) -> list[str]:
        """Fields the FLOP-share computation needs and this workload lacks."""
        missing = [f"workload.{name}" for name in GEOMETRY_FIELDS if getattr(self, name) is None]
        if self.prompt_tokens is None:
            missing.append("workload.prompt_tokens")
        return missing

    def model_preset(self) -> ModelPreset | None:
        """The workload's geometry as a ModelPreset, or None when a field is missing."""
        if self.missing_geometry():
            return None
        return ModelPreset(
            name=self.preset or "workload", description=self.model or "workload file model",
            layers=self.layers, attention_layers=self.attention_layers or self.layers,
            query_heads=self.query_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
            dtype=self.dtype, score_dtype=self.dtype, parameters=self.parameters,
        )


@dataclass(frozen=True)
class Targets:
    ttft_p95_ms: float | None = None
    tpot_ms: float | None = None


@dataclass(frozen=True)
class Proposal:
    """The change to defend: which segment (and part of it) gets how much faster."""

    change: str
    segment: str
    kernel_speedup: float | None
    part: str | None = None
    time_share: float | None = None
    speedup_source: str | None = None
    baseline_provider: str = "eager"
    candidate_provider: str = "attnlab"
    records_metric: str | None = None


@dataclass(frozen=True)
class Workload:
    title: str
    model: ModelWorkload
    targets: Targets
    segments: tuple[Segment, ...]
    proposal: Proposal
    client_ttft_ms: float | None = None
    client_ttft_source: str | None = None
    decode_tpot_ms: float | None = None
    decode_source: str | None = None
    samples_ttft_ms: tuple[float, ...] = ()
    samples_source: str | None = None
    trace_patterns: dict[str, tuple[str, ...]] | None = None
    origin: str = "built-in"
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def segment(self, name: str) -> Segment | None:
        return next((s for s in self.segments if s.name == name), None)

    @property
    def ttft_ms(self) -> float:
        """Client TTFT of this trace: the serial segments summed (the lesson's assumption)."""
        return math.fsum(s.ms for s in self.segments)


# ----------------------------------------------------------------------------------
# The built-in default: the lesson's Document QA trace (all timings synthetic).
# ----------------------------------------------------------------------------------
LESSON_DOCUMENT_QA: dict[str, Any] = {
    "title": "Document QA endpoint (the lesson's synthetic exit-task trace)",
    "workload": {
        "model": "nominal 8B dense, untied LM head", "parameters": 8_000_000_000,
        "layers": 32, "query_heads": 32, "kv_heads": 32, "head_dim": 128, "dtype": "fp16",
        "concurrency": 8, "prompt_tokens": 4096, "output_tokens": 128,
    },
    "targets": {"ttft_p95_ms": 350.0, "tpot_ms": 40.0},
    "segments": [
        {"name": "network", "ms": 15.0, "source": "synchronized socket ingress delta",
         "note": "synthetic transport estimate"},
        {"name": "queue", "ms": 65.0, "source": "server enqueue -> dequeue timestamps",
         "note": "dwell waiting for a batch slot", "load_dependent": True},
        {"name": "prefill", "ms": 290.0, "source": "hypothetical CUDA profiler span",
         "parts": {"attention": 116.0, "other": 174.0},
         "note": "40% attention, 60% MLP/norms/projections"},
        {"name": "first_chunk", "ms": 10.0, "source": "first SSE chunk serialization",
         "note": "emitting the first streamed chunk"},
    ],
    "client": {"ttft_ms": 380.0, "source": "client socket timer"},
    "decode": {"tpot_ms": 32.0, "source": "hypothetical decode trace"},
    "proposal": {
        "change": "enable a FlashAttention-2 causal kernel in prefill", "segment": "prefill",
        "part": "attention", "kernel_speedup": 3.0,
        "speedup_source": "assumed across the whole timed attention portion, matching shapes",
    },
}


def default_workload() -> Workload:
    return parse_workload(LESSON_DOCUMENT_QA, origin="built-in: the lesson's Document QA trace")


def load_workload(path: str | Path) -> Workload:
    """Read and validate a YAML or JSON workload file (errors name the file and the field).

    Refused before anything is expanded: anything but a regular file (a FIFO would
    wait forever), files over ``MAX_WORKLOAD_BYTES``, YAML with more than
    ``MAX_YAML_ALIASES`` aliases (an alias bomb expands a 1 KB file into gigabytes), and
    nesting deeper than ``MAX_WORKLOAD_DEPTH``.  A key written twice in one mapping is
    refused by name (YAML and JSON would keep the last one silently).

    A file cut short must not read as a shorter valid one: JSON cut anywhere is invalid,
    and a YAML file must end with a line break (a cut inside a line, ``ms: 290.0`` read
    as ``ms: 29``, leaves none); the ``workload.yaml`` that ``attnlab report --out``
    writes also ends with YAML's end-of-document line ``...``, required when its header
    is present, so a cut at a line break is caught too.  ``segments`` and ``proposal``
    are required in any file.
    """
    path = Path(path)
    raw = read_regular_file(path, "workload file", MAX_WORKLOAD_BYTES + 1)
    if len(raw) > MAX_WORKLOAD_BYTES:
        raise ValueError(f"{path.name}: larger than {MAX_WORKLOAD_BYTES:,} bytes; a workload "
                         f"file describes one request in a few lines")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path.name}: not UTF-8 text") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except DuplicateKey as error:
            raise ValueError(f"{path.name}: {error}") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path.name}: not valid JSON: {error.msg} at line {error.lineno}") from error
        except RecursionError:
            raise ValueError(f"{path.name}: nested more deeply than JSON can be read") from None
    else:
        _check_complete_yaml(text, path.name)
        data = _load_yaml(text, path.name)
    _check_depth(data, path.name)
    try:  # the report page names the file as given, never by this machine's path
        return parse_workload(data, origin=portable_path(path, Path.cwd()))
    except ValueError as error:
        raise ValueError(f"{path.name}: {error}") from error


# The first line of the workload.yaml attnlab writes; such a file must end with "...".
WRITTEN_HEADER = "# attnlab report workload"
YAML_DOCUMENT_END = "..."


class DuplicateKey(ValueError):
    """A mapping that names one key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object_pairs_hook: a dict, or DuplicateKey naming the repeated key."""
    mapping: dict = {}
    for key, value in pairs:
        if key in mapping:
            raise DuplicateKey(f"the key {quote(key)} appears twice in one mapping; write it "
                               f"once (JSON would keep the last one silently)")
        mapping[key] = value
    return mapping


def _check_complete_yaml(text: str, name: str) -> None:
    """Refuse a YAML workload that shows it was cut short (see :func:`load_workload`)."""
    if not text.strip():
        return  # empty: refused by the schema ("must be a mapping")
    if not text.endswith(("\n", "\r")):
        raise ValueError(f"{name}: does not end with a line break, so it may have been cut "
                         f"short; if it is complete, end it with a newline")
    if text.startswith(WRITTEN_HEADER):
        last = next(line for line in reversed(text.splitlines()) if line.strip())
        if last.strip() != YAML_DOCUMENT_END:
            raise ValueError(f"{name}: attnlab wrote this file with a final "
                             f"'{YAML_DOCUMENT_END}' line and it has none: it was cut short")


def _load_yaml(text: str, name: str) -> Any:
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """SafeLoader that counts aliases and nesting while it composes, before any
        value is built, so an alias bomb or a 100,000-deep document stops at once."""

        aliases = 0
        depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise ValueError(f"{name}: more than {MAX_YAML_ALIASES} YAML aliases; "
                                     f"write the values out")
            self.depth += 1
            if self.depth > MAX_WORKLOAD_DEPTH:
                raise ValueError(f"{name}: nested more than {MAX_WORKLOAD_DEPTH} levels deep")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in getattr(node, "value", ()):
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue  # '<<: *base' then a key of its own is YAML's override, fine
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ValueError(f"{name}: the key {quote(key)} appears twice in one "
                                     f"mapping (lines {seen[key]} and {line}); write it once "
                                     f"(YAML would keep the last one silently)")
                seen[key] = line
            return super().construct_mapping(node, deep)

    try:
        return yaml.load(text, Loader=BoundedLoader)  # BoundedLoader is a SafeLoader
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or "syntax error"
        raise ValueError(f"{name}: not valid YAML: {problem}{where}") from error
    except RecursionError:
        raise ValueError(f"{name}: nested more than YAML can be read") from None


def _check_depth(data: Any, name: str) -> None:
    """Refuse a parsed document nested deeper than MAX_WORKLOAD_DEPTH (iteratively: no
    recursion on a hostile input), or holding more than MAX_WORKLOAD_NODES values."""
    stack, seen = [(data, 1)], 0
    while stack:
        value, depth = stack.pop()
        seen += 1
        if depth > MAX_WORKLOAD_DEPTH:
            raise ValueError(f"{name}: nested more than {MAX_WORKLOAD_DEPTH} levels deep")
        if seen > MAX_WORKLOAD_NODES:
            raise ValueError(f"{name}: more than {MAX_WORKLOAD_NODES:,} values; a workload "
                             f"file describes one request")
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for item in (*value.keys(), *value.values()))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


# ----------------------------------------------------------------------------------
# Field checks: each raises ValueError naming the field.
# ----------------------------------------------------------------------------------
def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, got {_kind(value)}")
    return value


def _known_fields(mapping: dict, allowed: tuple[str, ...], where: str) -> None:
    for key in mapping:
        if key not in allowed:
            raise ValueError(f"{where}: unknown field {key!r}; allowed: {', '.join(allowed)}")


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {quote(value)}"


def _milliseconds(value: Any, where: str, *, positive: bool = False) -> float:
    if value is None:
        raise ValueError(f"{where} is required (milliseconds)")
    value = as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number of milliseconds, got {_kind(value)}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(f"{where} must be at most {MAX_MS:g} ms, got {quote(value)}") from None
    if not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number of milliseconds, got {value}")
    if abs(value) > MAX_MS:
        raise ValueError(f"{where} must be at most {MAX_MS:g} ms (11.6 days), got {value:g}")
    if positive and value <= 0:
        raise ValueError(f"{where} must be > 0 ms, got {value}")
    if value < 0:
        raise ValueError(f"{where} must be >= 0 ms (a duration cannot be negative), got {value}")
    return value


def _positive_int(value: Any, where: str) -> int:
    return check_int(where, value, minimum=1)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} must be a non-empty string, got {_kind(value)}")
    return value.strip()


def _optional(mapping: dict, key: str, check, where: str):
    value = mapping.get(key)
    return None if value is None else check(value, f"{where}.{key}")


def _parameter_count(value: Any, where: str) -> int:
    """8000000000, 8.0e+9, "8e9" or "8B" -> 8000000000."""
    if isinstance(value, str):
        text = value.strip().replace("_", "").replace(",", "")
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMBGT])", text, flags=re.IGNORECASE)
        try:
            value = (float(match.group(1)) * _COUNT_SUFFIXES[match.group(2).upper()]
                     if match else float(text))
        except ValueError:
            raise ValueError(f"{where} must be a parameter count such as 8000000000, 8.0e+9 "
                             f"or '8B', got {quote(value)}") from None
    value = as_scalar(value)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_PARAMETERS:
        return value
    if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value) \
            or not 1 <= value <= MAX_PARAMETERS:
        raise ValueError(f"{where} must be a positive parameter count (at most "
                         f"{MAX_PARAMETERS:.0e}), got {_kind(value)}")
    return int(round(value))


def _share(value: Any, where: str) -> float:
    return check_float(f"{where} (a time share)", value, minimum=0.0, maximum=1.0)


def check_kernel_speedup(value: Any, where: str) -> float:
    """A kernel speedup: finite, > 0, and within [MIN_KERNEL_SPEEDUP, MAX_KERNEL_SPEEDUP]."""
    value = check_float(where, value, minimum=0.0, min_open=True)
    if not MIN_KERNEL_SPEEDUP <= value <= MAX_KERNEL_SPEEDUP:
        raise ValueError(f"{where} must be a finite number > 0 between {MIN_KERNEL_SPEEDUP:g} "
                         f"and {MAX_KERNEL_SPEEDUP:g} (3.0 = three times faster), got {value:g}")
    return value


_speedup = check_kernel_speedup


def _bool(value: Any, where: str) -> bool:
    return check_bool(where, value)


# ----------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------
def _parse_model(data: Any) -> ModelWorkload:
    if data is None:
        return ModelWorkload()
    data = _mapping(data, "workload")
    _known_fields(data, WORKLOAD_FIELDS, "workload")
    values: dict[str, Any] = {}
    preset_name = _optional(data, "preset", _text, "workload")
    if preset_name is not None:
        if preset_name not in PRESETS:
            raise ValueError(f"workload.preset must be one of {', '.join(sorted(PRESETS))}, "
                             f"got {preset_name!r}")
        chosen = PRESETS[preset_name]
        # The preset fills the geometry; fields written in the file override it.
        values.update(model=chosen.description, preset=preset_name, parameters=chosen.parameters,
                      layers=chosen.layers, attention_layers=chosen.attention_layers,
                      query_heads=chosen.query_heads, kv_heads=chosen.kv_heads,
                      head_dim=chosen.head_dim, dtype=chosen.dtype)
    if data.get("model") is not None:
        values["model"] = _text(data["model"], "workload.model")
    if data.get("parameters") is not None:
        values["parameters"] = _parameter_count(data["parameters"], "workload.parameters")
    for name in ("layers", "attention_layers", "query_heads", "kv_heads", "head_dim",
                 "concurrency", "prompt_tokens", "output_tokens"):
        if data.get(name) is not None:
            values[name] = _positive_int(data[name], f"workload.{name}")
    if data.get("dtype") is not None:
        values["dtype"] = canonical_dtype(data["dtype"], "workload.dtype")
    model = ModelWorkload(**values)
    if model.query_heads and model.kv_heads and model.query_heads % model.kv_heads:
        raise ValueError(f"workload.kv_heads ({model.kv_heads}) must divide workload.query_heads "
                         f"({model.query_heads})")
    if model.layers and model.attention_layers and model.attention_layers > model.layers:
        raise ValueError(f"workload.attention_layers ({model.attention_layers}) must not exceed "
                         f"workload.layers ({model.layers})")
    return model


def _parse_targets(data: Any) -> Targets:
    if data is None:
        return Targets()
    data = _mapping(data, "targets")
    _known_fields(data, TARGET_FIELDS, "targets")
    return Targets(
        ttft_p95_ms=_optional(data, "ttft_p95_ms", lambda v, w: _milliseconds(v, w, positive=True),
                              "targets"),
        tpot_ms=_optional(data, "tpot_ms", lambda v, w: _milliseconds(v, w, positive=True),
                          "targets"),
    )


def _parse_segment(data: Any, index: int, warnings: list[str]) -> Segment:
    where = f"segments[{index}]"
    data = _mapping(data, where)
    _known_fields(data, SEGMENT_FIELDS, where)
    if data.get("name") is None:
        raise ValueError(f"{where}.name is required")
    name = _text(data["name"], f"{where}.name")
    where_named = f"{where}.ms (segment {name!r})"
    if "ms" not in data:
        raise ValueError(f"{where_named} is required (milliseconds)")
    ms = _milliseconds(data["ms"], where_named)
    source = _optional(data, "source", _text, where)
    if source is None:
        warnings.append(f"{where} ({name}) has no source: say where its {ms:g} ms was measured")
    note = _optional(data, "note", _text, where)
    load_dependent = data.get("load_dependent")
    # A queue's dwell moves with load by definition; everything else is held fixed
    # unless the file says otherwise.
    load_dependent = ("queue" in name.lower() if load_dependent is None
                      else _bool(load_dependent, f"{where}.load_dependent"))
    parts: list[Part] = []
    if data.get("parts") is not None:
        raw_parts = _mapping(data["parts"], f"{where}.parts")
        if not raw_parts:
            raise ValueError(f"{where}.parts must name at least one part, got an empty mapping")
        for part_name, part_ms in raw_parts.items():
            part_name = _text(str(part_name), f"{where}.parts key")
            parts.append(Part(part_name, _milliseconds(part_ms, f"{where}.parts.{part_name}")))
        parts_total = math.fsum(p.ms for p in parts)
        if parts_total > ms * (1 + PARTS_OVERFLOW_TOLERANCE) + 1e-9:
            raise ValueError(f"{where}.parts sum to {parts_total:g} ms, more than the segment's "
                             f"{ms:g} ms ({name})")
        if parts_total < ms * (1 - PARTS_GAP_TOLERANCE):
            gap = ms - parts_total
            if any(p.name == UNATTRIBUTED_PART for p in parts):
                raise ValueError(f"{where}.parts.{UNATTRIBUTED_PART} is reserved for the remainder; "
                                 f"the parts sum to {parts_total:g} of {ms:g} ms")
            parts.append(Part(UNATTRIBUTED_PART, gap))
            warnings.append(f"{where}.parts ({name}) explain {parts_total:g} of {ms:g} ms; "
                            f"the remaining {gap:g} ms is reported as '{UNATTRIBUTED_PART}'")
    return Segment(name=name, ms=ms, source=source, parts=tuple(parts),
                   load_dependent=load_dependent, note=note)


def _parse_segments(data: Any, warnings: list[str]) -> tuple[Segment, ...]:
    if data is None:
        raise ValueError("segments is required: a list of {name, ms, source} in critical-path order")
    if not isinstance(data, list) or not data:
        raise ValueError(f"segments must be a non-empty list of {{name, ms, source}}, got {_kind(data)}")
    segments = tuple(_parse_segment(item, i, warnings) for i, item in enumerate(data))
    seen: set[str] = set()
    for i, segment in enumerate(segments):
        if segment.name in seen:
            raise ValueError(f"segments[{i}].name {segment.name!r} repeats an earlier segment's name")
        seen.add(segment.name)
    if math.fsum(s.ms for s in segments) <= 0:
        raise ValueError("segments sum to 0 ms: at least one segment needs a duration > 0")
    return segments


def _parse_proposal(data: Any, segments: tuple[Segment, ...]) -> Proposal:
    if data is None:
        raise ValueError("proposal is required: {change, segment, part, kernel_speedup}")
    data = _mapping(data, "proposal")
    _known_fields(data, PROPOSAL_FIELDS, "proposal")
    change = _text(data.get("change"), "proposal.change")
    if data.get("segment") is None:
        raise ValueError("proposal.segment is required: the name of the segment the change speeds up")
    segment_name = _text(data["segment"], "proposal.segment")
    segment = next((s for s in segments if s.name == segment_name), None)
    if segment is None:
        raise ValueError(f"proposal.segment {segment_name!r} names no segment; segments are: "
                         f"{', '.join(s.name for s in segments)}")
    part = _optional(data, "part", _text, "proposal")
    time_share = _optional(data, "time_share", _share, "proposal")
    if part is not None and time_share is not None:
        raise ValueError("proposal.part and proposal.time_share both say what the change touches; "
                         "give one")
    if part is not None and segment.part(part) is None:
        known = ", ".join(p.name for p in segment.parts) or "none: the segment has no parts"
        raise ValueError(f"proposal.part {part!r} names no part of segment {segment_name!r}; "
                         f"its parts are: {known}")
    if part is not None and part == UNATTRIBUTED_PART:
        raise ValueError(f"proposal.part cannot be {UNATTRIBUTED_PART!r}: nothing is known about it")
    return Proposal(
        change=change, segment=segment_name, part=part, time_share=time_share,
        kernel_speedup=_optional(data, "kernel_speedup", _speedup, "proposal"),
        speedup_source=_optional(data, "speedup_source", _text, "proposal"),
        baseline_provider=_optional(data, "baseline_provider", _text, "proposal") or "eager",
        candidate_provider=_optional(data, "candidate_provider", _text, "proposal") or "attnlab",
        records_metric=_optional(data, "records_metric", _text, "proposal"),
    )


def _parse_samples(data: Any) -> tuple[tuple[float, ...], str | None]:
    if data is None:
        return (), None
    data = _mapping(data, "samples")
    _known_fields(data, SAMPLES_FIELDS, "samples")
    raw = data.get("ttft_ms")
    if raw is None:
        raise ValueError("samples.ttft_ms is required when samples is given: a list of client TTFTs")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"samples.ttft_ms must be a non-empty list of milliseconds, got {_kind(raw)}")
    values = tuple(_milliseconds(v, f"samples.ttft_ms[{i}]") for i, v in enumerate(raw))
    return values, _optional(data, "source", _text, "samples")


def _parse_patterns(data: Any) -> dict[str, tuple[str, ...]] | None:
    if data is None:
        return None
    data = _mapping(data, "trace_patterns")
    _known_fields(data, PATTERN_FIELDS, "trace_patterns")
    patterns: dict[str, tuple[str, ...]] = {}
    for key, value in data.items():
        if not isinstance(value, list) or not value:
            raise ValueError(f"trace_patterns.{key} must be a non-empty list of plain-text "
                             f"patterns, got {_kind(value)}")
        patterns[key] = tuple(check_pattern(p, f"trace_patterns.{key}[{i}]")
                              for i, p in enumerate(value))
    return patterns


def parse_workload(data: Any, *, origin: str = "workload") -> Workload:
    """Validate a workload mapping (as loaded from YAML/JSON) into a :class:`Workload`."""
    data = _mapping(data, "the workload file's top level")
    _known_fields(data, TOP_LEVEL_FIELDS, "top level")
    warnings: list[str] = []
    title = "Latency attribution" if data.get("title") is None else _text(data["title"], "title")
    model = _parse_model(data.get("workload"))
    targets = _parse_targets(data.get("targets"))
    segments = _parse_segments(data.get("segments"), warnings)
    proposal = _parse_proposal(data.get("proposal"), segments)

    client_ttft_ms = client_source = None
    if data.get("client") is not None:
        client = _mapping(data["client"], "client")
        _known_fields(client, CLIENT_FIELDS, "client")
        client_ttft_ms = _milliseconds(client.get("ttft_ms"), "client.ttft_ms", positive=True)
        client_source = _optional(client, "source", _text, "client")
        segments_total = math.fsum(s.ms for s in segments)
        mismatch = abs(segments_total - client_ttft_ms) / client_ttft_ms
        if mismatch > CLIENT_TOTAL_TOLERANCE:
            warnings.append(f"segments sum to {segments_total:g} ms but client.ttft_ms is "
                            f"{client_ttft_ms:g} ms ({mismatch:.1%} apart, more than 1%): the path "
                            f"is not serial, a segment is missing, or the clocks disagree")

    decode_tpot_ms = decode_source = None
    if data.get("decode") is not None:
        decode = _mapping(data["decode"], "decode")
        _known_fields(decode, DECODE_FIELDS, "decode")
        decode_tpot_ms = _milliseconds(decode.get("tpot_ms"), "decode.tpot_ms", positive=True)
        decode_source = _optional(decode, "source", _text, "decode")

    samples, samples_source = _parse_samples(data.get("samples"))
    if proposal.kernel_speedup is not None and proposal.kernel_speedup < 1:
        warnings.append(f"proposal.kernel_speedup is {proposal.kernel_speedup:g}: below 1 the "
                        f"change is a slowdown")
    return Workload(
        title=title, model=model, targets=targets, segments=segments, proposal=proposal,
        client_ttft_ms=client_ttft_ms, client_ttft_source=client_source,
        decode_tpot_ms=decode_tpot_ms, decode_source=decode_source,
        samples_ttft_ms=samples, samples_source=samples_source,
        trace_patterns=_parse_patterns(data.get("trace_patterns")), origin=origin,
        warnings=tuple(warnings),
    )


def workload_to_dict(workload: Workload) -> dict[str, Any]:
    """The inverse of :func:`parse_workload`: a mapping that parses back to an equal Workload."""
    model = {name: getattr(workload.model, name) for name in WORKLOAD_FIELDS
             if getattr(workload.model, name) is not None}
    segments = []
    for segment in workload.segments:
        item: dict[str, Any] = {"name": segment.name, "ms": segment.ms}
        if segment.source is not None:
            item["source"] = segment.source
        parts = [p for p in segment.parts if p.name != UNATTRIBUTED_PART]
        if parts:
            item["parts"] = {p.name: p.ms for p in parts}
        item["load_dependent"] = segment.load_dependent
        if segment.note is not None:
            item["note"] = segment.note
        segments.append(item)
    proposal = {name: getattr(workload.proposal, name) for name in PROPOSAL_FIELDS
                if getattr(workload.proposal, name) is not None}
    data: dict[str, Any] = {"title": workload.title, "workload": model, "segments": segments,
                            "proposal": proposal}
    targets = {name: getattr(workload.targets, name) for name in TARGET_FIELDS
               if getattr(workload.targets, name) is not None}
    if targets:
        data["targets"] = targets
    if workload.client_ttft_ms is not None:
        data["client"] = {"ttft_ms": workload.client_ttft_ms,
                          **({"source": workload.client_ttft_source}
                             if workload.client_ttft_source else {})}
    if workload.decode_tpot_ms is not None:
        data["decode"] = {"tpot_ms": workload.decode_tpot_ms,
                          **({"source": workload.decode_source} if workload.decode_source else {})}
    if workload.samples_ttft_ms:
        data["samples"] = {"ttft_ms": list(workload.samples_ttft_ms),
                           **({"source": workload.samples_source} if workload.samples_source else {})}
    if workload.trace_patterns:
        data["trace_patterns"] = {k: list(v) for k, v in workload.trace_patterns.items()}
    return data
