"""The package's shipped results are exactly the manifest's cut of bench/results."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from attnlab.measure import shipped
from attnlab.measure.records import committed_results

REPO = Path(__file__).resolve().parents[1]
REPO_RESULTS = REPO / "bench" / "results"


def _ship_list() -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("ship_results", REPO / "bench" / "ship_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SHIPPED


def test_the_shipped_folder_holds_exactly_the_manifest():
    folder = committed_results()
    entries = shipped.read_manifest(folder)
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert on_disk == {e["path"] for e in entries} | {shipped.MANIFEST_NAME}
    for entry in entries:
        data = (folder / entry["path"]).read_bytes()
        assert len(data) == entry["bytes"], entry["path"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["path"]
    assert sum(e["bytes"] for e in entries) <= shipped.SHIPPED_BYTES_LIMIT


def test_recutting_bench_results_gives_the_shipped_bytes(tmp_path):
    # A record added under bench/results without `python bench/ship_results.py` fails here.
    entries = shipped.ship(REPO_RESULTS, tmp_path / "cut", _ship_list())
    assert entries == shipped.read_manifest(committed_results())
    assert json.loads((tmp_path / "cut" / shipped.MANIFEST_NAME).read_text()) == \
        json.loads((committed_results() / shipped.MANIFEST_NAME).read_text())


def test_bench_results_is_a_folder_of_the_repository_not_a_link_into_the_package():
    assert REPO_RESULTS.is_dir() and not REPO_RESULTS.is_symlink()
    assert not (REPO_RESULTS.resolve()).is_relative_to(REPO / "src")


def test_the_page_reads_the_same_from_the_cut_as_from_the_full_runs():
    from attnlab.explain import build_page_data

    def without_paths(section: dict) -> dict:
        # Both name the folder they read; everything else must agree.
        return {k: v for k, v in section.items() if k not in ("source", "empty_message")}

    full, cut = build_page_data(REPO_RESULTS), build_page_data(committed_results())
    for section in ("profiler", "traffic", "memory", "amdahl"):
        assert without_paths(cut[section]) == without_paths(full[section]), section
    for key in ("points", "headline", "table", "headers"):
        assert cut["measured"]["bytes"][key] == full["measured"]["bytes"][key], key


def test_the_ncu_cut_parses_to_the_same_kernels_with_the_page_metrics(tmp_path):
    from attnlab.measure import ncu

    source = REPO_RESULTS / "ncu" / "decode" / "ncu_kernels.csv"
    target = tmp_path / "cut.csv"
    target.write_bytes(shipped.cut(source, shipped.NCU_PAGE_METRICS))
    full, cut = ncu.parse_csv(source), ncu.parse_csv(target)
    assert [(k.id, k.name, k.case, k.grid, k.block) for k in cut] == \
        [(k.id, k.name, k.case, k.grid, k.block) for k in full]
    for a, b in zip(full, cut, strict=True):
        assert b.metrics == {m: v for m, v in a.metrics.items() if m in ncu.METRICS}
        assert b.summary() == a.summary()


def test_a_cut_over_the_budget_is_refused(tmp_path, monkeypatch):
    (tmp_path / "big.jsonl").write_bytes(b"x" * 100)
    monkeypatch.setattr(shipped, "SHIPPED_BYTES_LIMIT", 99)
    with pytest.raises(ValueError, match="over the 99-byte budget"):
        shipped.ship(tmp_path, tmp_path / "out", [("big.jsonl", shipped.COPY)])
    assert not (tmp_path / "out").exists()
