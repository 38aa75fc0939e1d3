"""`attnlab demo` leaves engineer-grade artefacts: plots, the records' CSV, an index page.

The demo runs once for the module (it is the README's first command, so it must stay
fast on a 2-core CPU with no GPU); the checks read what it wrote.
"""

from __future__ import annotations

import contextlib
import csv
import html
import io
import json
import re
import struct
import time

import pytest

from attnlab.cli import main as cli_main
from attnlab.commands import demo
from attnlab.measure import plots
from attnlab.measure.outputs import MANIFEST_NAME
from attnlab.measure.records import committed_results, load_records, source_label

# Left in --out by an earlier attnlab run (its manifest lists them): a records file that
# must not be shown as this run's measurements, and a plot this run does not draw.
LEFTOVER_RECORDS = demo.FRESH_RECORDS
LEFTOVER_PLOT = "plots/leftover_latency.png"


def leftover_record() -> dict:
    from attnlab.measure.records import make_record
    from attnlab.shapes import AttentionShape

    env = {"gpu": "LEFTOVER GPU", "torch": "0", "triton": "0", "driver": None,
           "git_commit": "0", "timestamp": "2020-01-01T00:00:00+00:00", "command": "old"}
    return make_record(kernel="call", provider="attnlab", phase="prefill",
                       shape=AttentionShape(seqlen_q=1024, seqlen_k=1024), metric="latency",
                       unit="ms", p20=1.0, p50=1.0, p80=1.0, repeats=1, env=env)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "attnlab-demo"
    (out / "plots").mkdir(parents=True)
    (out / LEFTOVER_RECORDS).write_text(json.dumps(leftover_record()) + "\n")
    (out / LEFTOVER_PLOT).write_bytes(b"\x89PNG not a real one")
    (out / MANIFEST_NAME).write_text(json.dumps(
        {"written_by": "attnlab", "files": [LEFTOVER_RECORDS, LEFTOVER_PLOT]}))
    buffer = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(buffer):
        code = cli_main(["demo", "--out", str(out), "--json"])
    elapsed = time.perf_counter() - start
    return {"out": out, "code": code, "stdout": buffer.getvalue(), "seconds": elapsed}


def test_demo_prints_one_json_document(demo_run):
    assert demo_run["code"] == 0
    summary = json.loads(demo_run["stdout"])  # nothing but the document on stdout
    assert summary["out"] == str(demo_run["out"].resolve())
    # no GPU here: the committed results, named without this machine's path
    assert summary["records"]["source"] == source_label(committed_results())
    assert "/" not in summary["records"]["source"].split("(")[0]
    assert set(summary["headlines"]) >= {"prefill", "decode"}
    assert summary["headlines"]["prefill"]["sentence"].startswith("At 4k tokens, attnlab takes")
    listed = {entry["path"] for entry in summary["files"]}
    on_disk = {p.relative_to(demo_run["out"]).as_posix()
               for p in demo_run["out"].rglob("*") if p.is_file()}
    assert listed | {MANIFEST_NAME} == on_disk  # the manifest lists exactly the others
    manifest = json.loads((demo_run["out"] / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == listed


def test_the_earlier_runs_files_are_gone_and_never_read(demo_run):
    """--out held attnlab's earlier output: replaced whole, its records not this run's."""
    assert not (demo_run["out"] / LEFTOVER_RECORDS).exists()
    assert not (demo_run["out"] / LEFTOVER_PLOT).exists()
    summary = json.loads(demo_run["stdout"])
    assert summary["records"]["count"] == len(load_records(committed_results()))
    index = (demo_run["out"] / demo.INDEX_NAME).read_text()
    assert "leftover" not in index and "LEFTOVER GPU" not in index
    assert not list(demo_run["out"].parent.glob(".attnlab-partial-*"))  # no staging left


def test_demo_stays_fast(demo_run):
    # The README's first command: well under a minute on CI's 2 cores (here: the whole demo).
    assert demo_run["seconds"] < 60


def test_demo_plots_every_committed_workload_at_readme_width(demo_run):
    records = load_records(committed_results())
    expected = {f"{plots.family_slug(f)}_{kind}.png" for f in plots.workload_families(records)
                for kind in ("latency", "throughput")} | {"forward_tflops.png"}
    written = {p.name for p in (demo_run["out"] / demo.PLOTS_FOLDER).glob("*.png")}
    assert written == expected
    for name in written:
        data = (demo_run["out"] / demo.PLOTS_FOLDER / name).read_bytes()
        width, _ = struct.unpack(">II", data[16:24])
        assert 800 <= width <= 1200


def test_demo_csv_holds_every_record(demo_run):
    records = load_records(committed_results())
    with (demo_run["out"] / demo.CSV_NAME).open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(records)
    assert {(r["provider"], r["phase"]) for r in rows} == \
        {(r["provider"], r["phase"]) for r in records}


def test_demo_index_links_everything_it_wrote(demo_run):
    index = (demo_run["out"] / demo.INDEX_NAME).read_text()
    links = set(re.findall(r'<a href="([^"]+)"', index))
    files = {p.relative_to(demo_run["out"]).as_posix() for p in demo_run["out"].rglob("*")
             if p.is_file() and p.name not in (demo.INDEX_NAME, MANIFEST_NAME)}
    assert files <= links
    assert "explain.html" in files and "report/report.html" in files
    assert index.count("<img ") == len(list((demo_run["out"] / demo.PLOTS_FOLDER).glob("*.png")))


def test_demo_index_shows_plots_as_captioned_thumbnails(demo_run):
    """A gallery: each plot an <img> inside a link to it, with the workload in words."""
    index = (demo_run["out"] / demo.INDEX_NAME).read_text()
    figures = re.findall(r'<figure><a href="([^"]+)"><img src="([^"]+)" alt="([^"]+)"[^>]*>'
                         r'</a><figcaption>(.+?)</figcaption></figure>', index)
    pngs = {p.relative_to(demo_run["out"]).as_posix()
            for p in (demo_run["out"] / demo.PLOTS_FOLDER).glob("*.png")}
    assert {href for href, *_ in figures} == pngs
    for href, src, alt, caption in figures:
        assert href == src and alt and caption.split("<br>")[0].strip()
    records = load_records(committed_results())
    titles = {f"{demo.PHASE_NAMES[f['phase']]}, {plots.family_title(f)}"
              for f in plots.workload_families(records)}
    captions = [caption for *_, caption in figures]
    for title in titles:  # every workload is named in words, not only by its file name
        assert sum(c.startswith(html.escape(title)) for c in captions) == 2, title
    assert "grid-template-columns" in index  # thumbnails, not 960-pixel figures in a column


def test_demo_tables_fit_the_terminal(demo_run, monkeypatch, capsys):
    summary = json.loads(demo_run["stdout"])
    monkeypatch.setenv("COLUMNS", "80")
    demo.print_summary(summary)
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    monkeypatch.setenv("COLUMNS", "300")
    assert demo.table_width() == demo.MAX_TABLE_WIDTH


def test_demo_refuses_an_unusable_out(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli_main(["demo", "--out", str(blocker / "below")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and len(err.strip().splitlines()) == 1
