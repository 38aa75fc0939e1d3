"""The few measured files the package ships, and how they are cut from the repository's.

Every GPU run writes under ``bench/results/`` in the repository (records, raw runs,
Nsight Compute CSVs, sweeps, plots: tens of MB).  The wheel carries only what its
readers need from an installed copy in any folder — the demo, the explainer page and
the report — named in one manifest, ``attnlab/data/results/MANIFEST.json``:

* the top-level records (``*.jsonl``) and the kernel lists, copied byte for byte;
* the long-format Nsight Compute CSVs as one row per kernel (ncu's own ``--page raw``
  shape, which :func:`attnlab.measure.ncu.parse_csv` reads), keeping only the metrics
  the page reads (:data:`attnlab.measure.ncu.METRICS`): ncu reports ~300 per kernel,
  and the long format repeats the kernel's name on each of them (4.4 MB -> ~0.1 MB).

``python bench/ship_results.py`` rewrites the shipped folder from ``bench/results``;
a test re-cuts it and asks for the same bytes, so the two never drift apart.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
from pathlib import Path

MANIFEST_NAME = "MANIFEST.json"
# How a source file becomes its shipped copy.
COPY = "copy"
NCU_PAGE_METRICS = "ncu-page-metrics"
# Records with their profiled kernel lists emptied (demangled template names, most of a peer
# run's bytes): the page reads the timings; the proof stays in bench/results.
RECORDS_PAGE = "records-page"
CUTS = (COPY, NCU_PAGE_METRICS, RECORDS_PAGE)
# The wheel's whole budget for measured files (issue #27: a core wheel <= 1.5 MB).
SHIPPED_BYTES_LIMIT = 1_000_000


def read_manifest(folder: Path) -> list[dict]:
    """The manifest's entries (``path`` in the shipped folder, ``source`` in
    ``bench/results``, ``cut``, ``bytes``, ``sha256``), checked for the cuts this module
    knows."""
    entries = json.loads((Path(folder) / MANIFEST_NAME).read_text(encoding="utf-8"))["files"]
    for entry in entries:
        if entry.get("cut") not in CUTS or not isinstance(entry.get("path"), str):
            raise ValueError(f"{MANIFEST_NAME}: bad entry {entry!r}; cut must be one of "
                             f"{', '.join(CUTS)}")
    return entries


def _ncu_page_rows(source: Path) -> bytes:
    """A long-format ncu CSV as ncu's raw page: one row per kernel, a column per metric
    the page reads, a units row under the header."""
    from attnlab.measure.ncu import LONG_HEADER, METRICS

    with source.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != LONG_HEADER:
            raise ValueError(f"{source} is not a long-format ncu CSV (header {LONG_HEADER})")
        kernels: dict[str, dict] = {}
        units: dict[str, str] = {}
        for row in reader:
            kernel = kernels.setdefault(row["id"], {
                "ID": row["id"], "Kernel Name": row["nvtx_range_and_kernel"],
                "Grid Size": row["grid"], "Block Size": row["block"]})
            if row["metric"] in METRICS:
                kernel[row["metric"]] = row["value"]
                units[row["metric"]] = row["unit"]
    header = ["ID", "Kernel Name", "Grid Size", "Block Size",
              *(m for m in METRICS if m in units)]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerow(["", "", "", "", *(units[m] for m in header[4:])])
    writer.writerows([kernel.get(column, "") for column in header] for kernel in kernels.values())
    return text.getvalue().encode("utf-8")


def cut(source: Path, how: str) -> bytes:
    """The shipped bytes of one source file."""
    if how == COPY:
        return Path(source).read_bytes()
    if how == NCU_PAGE_METRICS:
        return _ncu_page_rows(Path(source))
    if how == RECORDS_PAGE:
        lines = Path(source).read_text(encoding="utf-8").splitlines()
        records = [{**json.loads(line), "kernel_names": []} for line in lines if line.strip()]
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode("utf-8")
    raise ValueError(f"unknown cut {how!r}; expected one of {', '.join(CUTS)}")


def shipped_name(relative: str, how: str) -> str:
    """Where a source file's cut lands in the shipped folder: a cut that changes the
    format says so in its name."""
    if how == NCU_PAGE_METRICS:
        return relative.removesuffix(".csv") + ".page.csv"
    if how == RECORDS_PAGE:
        return relative.removesuffix(".jsonl") + ".page.jsonl"
    return relative


def ship(source: Path, dest: Path, paths_and_cuts: list[tuple[str, str]]) -> list[dict]:
    """Write the shipped folder ``dest`` from ``source`` (``bench/results``): the listed
    files, cut, and the manifest naming each with its size and hash.  The folder is
    written whole, so it holds exactly what the manifest names."""
    source, dest = Path(source), Path(dest)
    cuts, entries = {}, []
    for relative, how in paths_and_cuts:
        name, data = shipped_name(relative, how), cut(source / relative, how)
        cuts[name] = data
        entries.append({"path": name, "source": relative, "cut": how, "bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest()})
    total = sum(e["bytes"] for e in entries)
    if total > SHIPPED_BYTES_LIMIT:
        raise ValueError(f"the shipped results would be {total:,} bytes, over the "
                         f"{SHIPPED_BYTES_LIMIT:,}-byte budget: ship fewer files")
    if dest.exists():
        shutil.rmtree(dest)
    for relative, data in cuts.items():
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    manifest = {"source": "bench/results", "files": entries}
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return entries
