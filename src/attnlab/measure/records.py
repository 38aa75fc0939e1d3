"""Measured records: one JSON object per line in ``*.jsonl`` files, a tidy CSV beside each.

Every record is one measurement of one thing (long, tidy format) and carries what
it takes to reproduce and to trust it: the exact shape, the provider and the
kernels that actually ran, the statistic and its repeats, the machine and software
versions, the git commit, the time, and the command that reproduces it.

Keys (the contract every reader relies on)::

    kernel, provider, phase, shape, metric, unit, p20, p50, p80, repeats,
    tflops, tbps, kernel_names, gpu, torch, triton, driver, git_commit,
    timestamp, command

Optional keys (absent from records written before they existed): ``reason`` (below);
``cuda_runtime`` / ``cudnn``, the CUDA runtime torch was built with and the cuDNN it
loaded (``None`` on a machine without CUDA); ``timing_method``, how the timer took the
samples (``"cuda-graph, flush=l2, warmup=3"``: :meth:`attnlab.measure.timing.Timing.describe_method`).

``kernel`` names what was measured: ``"call"`` for a whole provider call (all the
kernels it launched, listed in ``kernel_names``), or one kernel's short name for
per-kernel rows (``attnlab ncu``).  A provider that could not run is recorded too,
as ``metric="skipped"`` with its ``reason`` and no numbers, so "not measured" is never
confused with "forgotten".

Writing is an upsert: a record replaces the stored one with the same key
``(kernel, provider, phase, shape, metric, gpu)``, so re-running a command updates
its rows instead of duplicating them.  Every write also rewrites ``<stem>.records.csv``
beside the JSONL: one row per record, the shape spread into columns, the reproducing
command last (FlashInfer's benchmark format), for pandas or a spreadsheet.  A
command's absolute paths are written relative to the folder of the records file (an
``--out /root/out/results/bench`` measured into that folder reads ``--out .``), so no
record names a path of the machine that measured it.

Where results live: every GPU run writes under ``bench/results/`` in the repository;
the package ships a curated cut of it (``attnlab/data/results``, named in its
manifest: :mod:`attnlab.measure.shipped`), read through :func:`committed_results`, so
the demo, the explainer and the report find it from an installed wheel in any folder;
:func:`results_dir` is what every reader calls, honouring a user's own folder.
"""

from __future__ import annotations

import csv
import importlib.resources
import io
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from attnlab.checks import open_regular_file
from attnlab.shapes import AttentionShape

PHASES = ("prefill", "decode", "fwdbwd")
RECORD_KEYS = (
    "kernel", "provider", "phase", "shape", "metric", "unit", "p20", "p50", "p80", "repeats",
    "tflops", "tbps", "kernel_names", "gpu", "torch", "triton", "driver", "git_commit",
    "timestamp", "command",
)
OPTIONAL_KEYS = ("reason", "cuda_runtime", "cudnn", "timing_method")
KEY_FIELDS = ("kernel", "provider", "phase", "shape", "metric", "gpu")
ENVIRONMENT_KEYS = ("gpu", "torch", "triton", "driver", "git_commit", "timestamp", "command")
# Captured by environment() and copied into records when present; optional in old records.
ENVIRONMENT_OPTIONAL_KEYS = ("cuda_runtime", "cudnn")
SKIPPED = "skipped"
# The tidy CSV written beside every records file: <stem>.records.csv.
CSV_SUFFIX = ".records.csv"
SHAPE_COLUMNS = ("batch", "query_heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "dtype",
                 "causal", "window_left", "window_right")
CSV_COLUMNS = ("kernel", "provider", "phase", *SHAPE_COLUMNS, "metric", "unit", "p20", "p50",
               "p80", "repeats", "tflops", "tbps", "timing_method", "kernel_names", "reason",
               "gpu", "torch", "triton", "cuda_runtime", "cudnn", "driver", "git_commit",
               "timestamp", "command")


# ----- where results live ------------------------------------------------------------------
def committed_results() -> Path:
    """The committed H200 results shipped inside the package (``attnlab/data/results``):
    the top-level records (``*.jsonl``), the kernel lists and the Nsight Compute CSVs
    cut to the page's metrics, as its ``MANIFEST.json`` names them
    (:mod:`attnlab.measure.shipped`; the full runs stay in the repository's
    ``bench/results``)."""
    folder = importlib.resources.files("attnlab") / "data" / "results"
    if not isinstance(folder, Path) or not folder.is_dir():
        raise FileNotFoundError(f"attnlab's shipped results are missing ({folder}): the "
                                f"package was installed without its data files")
    return folder


def results_dir(records_dir: str | Path | None = None, *, option: str = "--records") -> Path:
    """Where readers take records from: ``records_dir`` (a user's ``--records DIR``; the
    error names ``option``) when given, else the shipped :func:`committed_results`."""
    if records_dir is None:
        return committed_results()
    folder = Path(records_dir)
    if not folder.exists():
        raise ValueError(f"{option} {str(folder)!r} does not exist: pass a folder of *.jsonl "
                         f"records (or a .jsonl file)")
    return folder


# ----- paths in records and pages: never this machine's -------------------------------------
# An absolute path in a command: at its start, after a space, '=' or a quote.
_ABSOLUTE_PATH = re.compile(r"""(?<![^\s='"])/[^\s'"]*""")


def portable_path(path: str | os.PathLike, base: str | os.PathLike) -> str:
    """``path`` as a record or a page may hold it: a relative path unchanged; an absolute
    one relative to ``base`` (``.`` for ``base`` itself) when it lies inside, else by its
    last component alone, so no path of the machine that ran it is written down."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    absolute, root = os.path.normpath(text), os.path.normpath(os.path.abspath(base))
    if absolute == root or absolute.startswith(root.rstrip(os.sep) + os.sep):
        return os.path.relpath(absolute, root)
    return os.path.basename(absolute.rstrip(os.sep)) or "."


def portable_command(command: str, results_dir: str | os.PathLike) -> str:
    """A record's reproducing command with every absolute path made relative to the
    results folder the records are written to (:func:`portable_path`)."""
    return _ABSOLUTE_PATH.sub(lambda m: portable_path(m.group(0), results_dir), command)


def source_label(folder: str | os.PathLike) -> str:
    """A results folder as a page names it: the shipped results by name, a user's folder
    relative to the current folder (:func:`portable_path`)."""
    try:
        if Path(folder).resolve() == committed_results().resolve():
            return "attnlab's committed H200 results (attnlab/data/results)"
    except (FileNotFoundError, OSError):
        pass
    return portable_path(folder, Path.cwd())


# ----- environment -----------------------------------------------------------------------
def _run_quiet(argv: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a short helper command, or None when it is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _checkout_root() -> Path | None:
    """The git checkout this package runs from (an editable install or PYTHONPATH=src), or
    None for an installed copy: the enclosing repository must hold this very package."""
    package = Path(__file__).resolve().parents[1]
    top = _run_quiet(["git", "rev-parse", "--show-toplevel"], cwd=package)
    if top is None or (Path(top) / "src" / "attnlab").resolve() != package:
        return None
    return Path(top)


def git_commit() -> str:
    """HEAD of the checkout, with ``-dirty`` when tracked files differ from it.

    A copy of the tree without ``.git`` (the GPU machine gets one) or an installed
    wheel reports that plainly unless ``ATTNLAB_GIT_COMMIT`` names the commit.
    """
    override = os.environ.get("ATTNLAB_GIT_COMMIT")
    if override:
        return override
    root = _checkout_root()
    head = None if root is None else _run_quiet(["git", "rev-parse", "HEAD"], cwd=root)
    if head is None:
        return "unknown (no git checkout; set ATTNLAB_GIT_COMMIT)"
    dirty = _run_quiet(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return head + ("-dirty" if dirty else "")


def driver_version() -> str | None:
    """The NVIDIA driver version from nvidia-smi; None on a machine without one."""
    out = _run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def gpu_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def cuda_runtime_version() -> str | None:
    """The CUDA runtime torch was built with and ships (``torch.version.cuda``); None for
    a CPU build."""
    import torch

    return torch.version.cuda


def cudnn_version() -> str | None:
    """The cuDNN torch loaded, as major.minor.patch; None without CUDA or cuDNN."""
    import torch

    if not torch.cuda.is_available() or not torch.backends.cudnn.is_available():
        return None
    number = torch.backends.cudnn.version()
    if number is None:
        return None
    # cuDNN 9 encodes major * 10000 + minor * 100 + patch; cuDNN 8, major * 1000 + ...
    major_unit = 10000 if number >= 90000 else 1000
    return f"{number // major_unit}.{number % major_unit // 100}.{number % 100}"


def timestamp_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def environment(command: str) -> dict:
    """The machine/software part of a record, captured once per run."""
    import torch

    if not isinstance(command, str) or not command.strip():
        raise ValueError(f"command must be the non-empty command that reproduces the "
                         f"measurement, got {command!r}")
    return {
        "gpu": gpu_name(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "driver": driver_version() if torch.cuda.is_available() else None,
        "cuda_runtime": cuda_runtime_version(),
        "cudnn": cudnn_version(),
        "git_commit": git_commit(),
        "timestamp": timestamp_now(),
        "command": command,
    }


# ----- building and checking records -------------------------------------------------------
def _check_number(value: object, name: str, *, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or math.isinf(value):
        raise ValueError(f"{name} must be a finite number{' or None' if allow_none else ''}, "
                         f"got {value!r}")
    return float(value)


def _check_shape_field(shape: object) -> dict:
    if isinstance(shape, AttentionShape):
        return shape.as_dict()
    if not isinstance(shape, dict):
        raise TypeError(f"shape must be an AttentionShape or its as_dict(), got "
                        f"{type(shape).__name__}")
    if shape:  # {} is allowed for records that are not attention calls (ceilings)
        AttentionShape.from_dict(shape)
    return dict(shape)


def validate_record(record: dict) -> dict:
    """The record itself if it follows the contract; ValueError/TypeError naming the key."""
    if not isinstance(record, dict):
        raise TypeError(f"a record must be a dict, got {type(record).__name__}")
    missing = [k for k in RECORD_KEYS if k not in record]
    unknown = [k for k in record if k not in RECORD_KEYS and k not in OPTIONAL_KEYS]
    if missing or unknown:
        raise ValueError(f"record keys must be {list(RECORD_KEYS)} (+ optional "
                         f"{list(OPTIONAL_KEYS)}); missing {missing}, unknown {unknown}")
    if record["phase"] not in PHASES:
        raise ValueError(f"phase must be one of {list(PHASES)}, got {record['phase']!r}")
    for key in ("kernel", "provider", "metric", "unit", "gpu", "torch", "triton", "git_commit",
                "timestamp", "command"):
        if not isinstance(record[key], str) or not record[key]:
            raise ValueError(f"{key} must be a non-empty string, got {record[key]!r}")
    record["shape"] = _check_shape_field(record["shape"])
    skipped = record["metric"] == SKIPPED
    for key in ("p20", "p50", "p80"):
        _check_number(record[key], key, allow_none=skipped)
    if skipped:
        if not isinstance(record.get("reason"), str) or not record["reason"]:
            raise ValueError("a skipped record needs a non-empty 'reason'")
    else:
        if "reason" in record:
            raise ValueError("'reason' belongs only to metric='skipped' records")
        if not record["p20"] <= record["p50"] <= record["p80"]:
            raise ValueError(f"percentiles must be ordered p20 <= p50 <= p80, got "
                             f"{record['p20']}, {record['p50']}, {record['p80']}")
    for key in ("tflops", "tbps"):
        _check_number(record[key], key, allow_none=True)
    repeats = record["repeats"]
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"repeats must be an int >= 0, got {repeats!r}")
    names = record["kernel_names"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"kernel_names must be a list of strings, got {names!r}")
    for key in ("driver", "timing_method", *ENVIRONMENT_OPTIONAL_KEYS):
        if record.get(key) is not None and not isinstance(record[key], str):
            raise TypeError(f"{key} must be a string or None, got {record[key]!r}")
    return record


def make_record(*, kernel: str, provider: str, phase: str, shape, metric: str, unit: str,
                p20: float | None, p50: float | None, p80: float | None, repeats: int,
                env: dict, tflops: float | None = None, tbps: float | None = None,
                kernel_names: Iterable[str] = (), reason: str | None = None,
                timing_method: str | None = None) -> dict:
    """One validated record; ``env`` comes from :func:`environment`."""
    if isinstance(kernel_names, str):
        raise TypeError(f"kernel_names must be a list of strings, got the string {kernel_names!r}")
    missing = [k for k in ENVIRONMENT_KEYS if k not in env]
    if missing:
        raise ValueError(f"env must hold {list(ENVIRONMENT_KEYS)} (use environment()); "
                         f"missing {missing}")
    record = {
        "kernel": kernel, "provider": provider, "phase": phase, "shape": shape,
        "metric": metric, "unit": unit, "p20": p20, "p50": p50, "p80": p80,
        "repeats": repeats, "tflops": tflops, "tbps": tbps,
        "kernel_names": list(kernel_names),
        **{k: env[k] for k in ENVIRONMENT_KEYS},
        **{k: env[k] for k in ENVIRONMENT_OPTIONAL_KEYS if k in env},
    }
    if reason is not None:
        record["reason"] = reason
    if timing_method is not None:
        record["timing_method"] = timing_method
    return validate_record(record)


def skipped_record(*, provider: str, phase: str, shape, reason: str, env: dict,
                   kernel: str = "call") -> dict:
    """The record of a provider that could not run, with the reason it gave."""
    return make_record(kernel=kernel, provider=provider, phase=phase, shape=shape,
                       metric=SKIPPED, unit="reason", p20=None, p50=None, p80=None, repeats=0,
                       env=env, reason=reason)


def record_key(record: dict) -> tuple:
    """The upsert key: (kernel, provider, phase, shape as canonical JSON, metric, gpu)."""
    return tuple(json.dumps(record[k], sort_keys=True) if k == "shape" else record[k]
                 for k in KEY_FIELDS)


# ----- files ----------------------------------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with io.TextIOWrapper(open_regular_file(path, "records file"), encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error.msg})") from None
            try:
                records.append(validate_record(record))
            except (ValueError, TypeError) as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    return records


def load_records(path_or_dir: str | Path) -> list[dict]:
    """Every record of one ``.jsonl`` file, or of all ``*.jsonl`` files in a folder (sorted)."""
    path = Path(path_or_dir)
    if path.is_dir():
        records = []
        for file in sorted(path.glob("*.jsonl")):
            records.extend(_read_jsonl(file))
        return records
    if not path.exists():
        raise ValueError(f"no records at {path}: expected a .jsonl file or a folder of them")
    return _read_jsonl(path)


def upsert_records(path: str | Path, records: Iterable[dict]) -> tuple[int, int]:
    """Write records into ``path`` (created if missing), replacing those with the same key.

    Stored order is kept; replaced records stay in place, new ones are appended.
    Returns (added, replaced).  The file is rewritten atomically, and its tidy CSV
    (:func:`write_csv`) with it.  Absolute paths in a record's ``command`` are written
    relative to the records file's folder (:func:`portable_command`).
    """
    path = Path(path)
    stored = _read_jsonl(path) if path.exists() else []
    index = {record_key(r): i for i, r in enumerate(stored)}
    added = replaced = 0
    for record in records:
        validate_record(record)
        record = {**record, "command": portable_command(record["command"], path.parent)}
        key = record_key(record)
        if key in index:
            stored[index[key]] = record
            replaced += 1
        else:
            index[key] = len(stored)
            stored.append(record)
            added += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in stored),
                   encoding="utf-8")
    tmp.replace(path)
    write_csv(stored, csv_path(path))
    return added, replaced


def csv_path(jsonl_path: str | Path) -> Path:
    """``results/measure.jsonl`` -> ``results/measure.records.csv``."""
    path = Path(jsonl_path)
    return path.with_name(path.name.removesuffix(".jsonl") + CSV_SUFFIX)


def csv_row(record: dict) -> dict:
    """One record as one flat CSV row (:data:`CSV_COLUMNS`); absent values are empty."""
    shape = dict(record.get("shape") or {})
    window = shape.pop("window", None)
    row = {key: record.get(key) for key in CSV_COLUMNS if key not in SHAPE_COLUMNS}
    row.update({key: shape.get(key) for key in SHAPE_COLUMNS})
    if window is not None:
        row["window_left"], row["window_right"] = window
    row["kernel_names"] = ";".join(record.get("kernel_names") or [])
    return {key: "" if row[key] is None else row[key] for key in CSV_COLUMNS}


def write_csv(records: Iterable[dict], path: str | Path) -> Path:
    """Write records as a tidy CSV (one row per measurement, header first); atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for record in records:
            writer.writerow(csv_row(record))
    tmp.replace(path)
    return path


def describe_environment(env: dict) -> str:
    """One line for table captions: where and with what the numbers were measured."""
    cuda = (f"CUDA {env['cuda_runtime']} | cuDNN {env.get('cudnn') or 'n/a'} | "
            if env.get("cuda_runtime") else "")
    return (f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | {cuda}"
            f"driver {env['driver'] or 'n/a'} | commit {env['git_commit'][:12]} | "
            f"{env['timestamp']}")
