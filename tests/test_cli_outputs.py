"""What the CLI writes and where (issues 28 and 30): the output-folder rule, nothing
created by a failed command, no path of this machine in a record or a page, and every
documented flag known to its verb's parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from attnlab.cli import build_parser, main
from attnlab.measure import records as rec
from attnlab.measure.outputs import MANIFEST_NAME, STAGING_PREFIX
from attnlab.shapes import AttentionShape

REPO = Path(__file__).resolve().parents[1]
# Where a path of the machine that measured (or ran the tests) would show.
MACHINE_PATH = re.compile(r"(?<![\w.-])/(tmp|root|home|work|Users)/")
REPORT_FILES = {"report.html", "report.md", "report.json", "waterfall.svg", "workload.yaml"}


def files_in(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_bare_attnlab_prints_help_and_exits_0(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnlab")
    for verb in ("demo", "report", "explain", "bench", "traffic"):
        assert verb in out


# ----- the output-folder rule ------------------------------------------------------------------
def test_a_new_folder_holds_this_runs_files_and_the_manifest(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "report"
    assert main(["report", "--out", str(out)]) == 0
    assert files_in(out) == REPORT_FILES | {MANIFEST_NAME}
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["written_by"] == "attnlab" and set(manifest["files"]) == REPORT_FILES
    assert f"written: {out / 'report.html'}" in capsys.readouterr().out  # the final paths
    assert not list(tmp_path.rglob(f"{STAGING_PREFIX}*"))


def test_attnlab_s_earlier_output_is_replaced_whole(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["explain", "--out", str(out)]) == 0
    assert "index.html" in files_in(out)
    assert main(["report", "--out", str(out)]) == 0  # no mix of the two runs
    assert files_in(out) == REPORT_FILES | {MANIFEST_NAME}


def test_an_empty_existing_folder_is_used(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["report", "--out", str(out)]) == 0
    assert files_in(out) == REPORT_FILES | {MANIFEST_NAME}


def test_a_users_folder_is_refused_then_written_beside_with_force(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "report.md").write_text("my own report")  # a name attnlab also writes
    assert main(["report", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds files attnlab did not write" in err and "--force" in err
    assert (out / "report.md").read_text() == "my own report"  # untouched
    assert main(["explain", "--out", str(out), "--force"]) == 0
    assert files_in(out) == {"notes.txt", "report.md", "index.html", MANIFEST_NAME}
    assert json.loads((out / MANIFEST_NAME).read_text())["files"] == ["index.html"]
    # A second forced run removes the first one's files and keeps the user's.
    assert main(["report", "--out", str(out), "--force"]) == 0
    assert files_in(out) == {"notes.txt", *REPORT_FILES, MANIFEST_NAME}
    assert (out / "notes.txt").read_text() == "mine"
    # Still the user's folder: a run without --force is refused again.
    assert main(["report", "--out", str(out)]) == 2


def test_a_manifest_that_is_not_attnlabs_does_not_make_a_folder_attnlabs(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_NAME).write_text('{"files": ["data.csv"]}')
    (out / "data.csv").write_text("1,2")
    assert main(["report", "--out", str(out)]) == 2
    assert "holds files attnlab did not write" in capsys.readouterr().err
    assert (out / "data.csv").exists()


def test_a_failed_run_leaves_the_earlier_output_and_creates_nothing(tmp_path, capsys,
                                                                    monkeypatch):
    out = tmp_path / "out"
    assert main(["report", "--out", str(out)]) == 0
    before = {name: (out / name).read_bytes() for name in files_in(out)}
    import attnlab.report.render as render

    def broken(report, folder):
        (Path(folder) / "report.html").write_text("half written")
        raise ValueError("the disk filled up")

    monkeypatch.setattr(render, "write_report", broken)
    assert main(["report", "--out", str(out)]) == 2
    assert {name: (out / name).read_bytes() for name in files_in(out)} == before
    assert main(["report", "--out", str(tmp_path / "new" / "deeper")]) == 2
    assert not (tmp_path / "new").exists()
    assert not list(tmp_path.rglob(f"{STAGING_PREFIX}*"))


def test_a_failed_replot_creates_no_folder(tmp_path, monkeypatch, capsys):
    """`bench --replot` without records used to create ./bench/results/plots."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--replot"]) == 2
    assert "no records at" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_report_help_says_what_it_writes():
    report = subparser("report")
    out_help = next(a.help for a in report._actions if "--out" in a.option_strings)
    assert "without it nothing is written" in out_help
    assert "with --out DIR also write" in report.description


# ----- no path of this machine in a record or a page ------------------------------------------
def committed_jsonl() -> list[Path]:
    return sorted(rec.committed_results().rglob("*.jsonl"))


def test_no_committed_record_names_a_machine_path():
    offenders = []
    for path in committed_jsonl():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            command = json.loads(line).get("command") if line.strip() else None
            if isinstance(command, str) and MACHINE_PATH.search(command):
                offenders.append(f"{path.relative_to(rec.committed_results())}:{number}")
    assert committed_jsonl() and not offenders, offenders[:10]
    for csv in rec.committed_results().rglob("*.records.csv"):
        assert not MACHINE_PATH.search(csv.read_text(encoding="utf-8")), csv


def test_records_are_written_with_paths_relative_to_their_folder(tmp_path):
    folder = tmp_path / "results"
    command = (f"attnlab bench --out {folder}/bench.jsonl --plots={folder}/plots "
               f"--trace '/root/elsewhere/t.json' --phase prefill")
    env = {**rec.environment(command), "gpu": "NVIDIA H200"}
    record = rec.make_record(kernel="call", provider="sdpa", phase="prefill",
                             shape=AttentionShape(), metric="latency", unit="ms", p20=1.0,
                             p50=1.0, p80=1.0, repeats=3, env=env)
    rec.upsert_records(folder / "bench.jsonl", [record])
    stored = rec.load_records(folder / "bench.jsonl")[0]["command"]
    assert stored == "attnlab bench --out bench.jsonl --plots=plots --trace 't.json' --phase prefill"
    assert not MACHINE_PATH.search((folder / "bench.records.csv").read_text())


@pytest.mark.parametrize("path, base, expected", [
    ("/r/out/results/bench", "/r/out/results/bench", "."),
    ("/r/out/results/ncu/ncu.jsonl", "/r/out/results/ncu", "ncu.jsonl"),
    ("/elsewhere/x/trace.json", "/r/out", "trace.json"),
    ("relative/stays", "/r/out", "relative/stays"),
])
def test_portable_path(path, base, expected):
    assert rec.portable_path(path, base) == expected


def test_the_explainer_page_names_no_machine_path(tmp_path, capsys):
    results = tmp_path / "my-results"
    results.mkdir()
    for source in rec.committed_results().glob("*.jsonl"):
        (results / source.name).write_text(source.read_text())
    for argv in (["explain", "--out", str(tmp_path / "page")],
                 ["explain", "--out", str(tmp_path / "page2"), "--records", str(results)]):
        assert main(argv) == 0
        text = (Path(argv[2]) / "index.html").read_text(encoding="utf-8")
        found = MACHINE_PATH.findall(text)
        assert not found, [m for m in re.findall(r".{40}/(?:tmp|root|home|work)/.{40}", text)][:5]
    assert "my-results" in text  # a user's folder named by its name


def test_the_report_page_names_its_input_without_the_machine_path(tmp_path, capsys):
    workload = tmp_path / "qa.yaml"
    assert main(["report", "--out", str(tmp_path / "r")]) == 0
    workload.write_text((tmp_path / "r" / "workload.yaml").read_text())
    assert main(["report", str(workload), "--out", str(tmp_path / "r2")]) == 0
    for name in ("report.html", "report.md", "report.json"):
        assert not MACHINE_PATH.search((tmp_path / "r2" / name).read_text()), name


# ----- every documented flag exists -----------------------------------------------------------
def subparser(verb: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices[verb]


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) for every `attnlab VERB ...` in README.md and docs/*.md:
    inline code spans and lines of fenced blocks (indented lines continue a command)."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        blocks = re.findall(r"```([^\n]*)\n(.*?)```", text, flags=re.S)
        for language, block in blocks:
            if language.strip() in ("python", "py", "yaml", "json"):
                continue  # code, not command lines
            current = None
            for line in block.splitlines():
                if current is not None and line[:1].isspace() and line.strip():
                    current += " " + line.strip()
                    continue
                if current is not None:
                    found.append((doc.name, current))
                current = line.strip() if re.search(r"(^|\s)attnlab [a-z]", line) else None
            if current is not None:
                found.append((doc.name, current))
        inline = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(doc.name, " ".join(span.split())) for span in re.findall(r"`([^`]+)`", inline)
                  if re.search(r"(^|\s)attnlab [a-z]", span)]
    return found


def test_every_documented_flag_is_known_to_its_verb():
    parser = build_parser()
    verbs = next(a for a in parser._actions
                 if a.__class__.__name__ == "_SubParsersAction").choices
    unknown, seen = [], 0
    for where, line in documented_commands():
        for verb, rest in re.findall(r"(?:^|\s)attnlab ([a-z]+)(:?)", line):
            if rest == ":":  # "attnlab report: error: ..." quotes a message, not a command
                continue
            if verb not in verbs:
                unknown.append(f"{where}: `{line}`: no verb {verb!r}")
                continue
            # the flags up to the next command of the line (a pipe, &&, another attnlab)
            tail = re.split(r"\s(?:\||&&|;)\s|\sattnlab\s", line.split(f"attnlab {verb}", 1)[1])[0]
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", tail):
                seen += 1
                if flag not in verbs[verb]._option_string_actions:
                    unknown.append(f"{where}: `{line}`: {verb} has no {flag}")
    assert seen > 20, "the docs' command lines were not found"
    assert not unknown, "\n".join(unknown)


def test_the_records_flag_the_readme_names_for_the_page_and_the_demo_exists():
    for verb in ("explain", "demo", "report"):
        assert "--records" in subparser(verb)._option_string_actions, verb


# ----- tables and the demo's records ---------------------------------------------------------
def test_the_records_table_tells_every_row_apart(capsys):
    """The demo's table of committed latency rows: decode rows that differ only in
    seqlen_q (speculative queries) used to print identically."""
    from rich.console import Console

    from attnlab.commands.measure import records_table

    latency = [r for r in rec.load_records(rec.committed_results())
               if r["metric"] == "latency" and r["kernel"] == "call"]
    table = records_table(latency, "committed")
    Console(width=400, record=True).print(table)
    columns = [[str(cell) for cell in column._cells] for column in table.columns]
    rows = list(zip(*columns, strict=True))
    shown = [row[:5 + sum(c.header in ("GPU", "metric", "kernel", "measured")
                          for c in table.columns)]
             for row in rows]
    assert len(set(shown)) == len(shown)  # phase, shape, provider, Nq, Nk (+ GPU ...)
    assert {c.header for c in table.columns} >= {"Nq", "Nk"}


def test_the_demo_plots_the_records_folder_it_is_given(tmp_path):
    from attnlab.commands.demo import demo_records

    folder = tmp_path / "results"
    env = {**rec.environment("attnlab bench"), "gpu": "MY GPU"}
    mine = [rec.make_record(kernel="call", provider="attnlab", phase="prefill",
                            shape=AttentionShape(seqlen_q=n, seqlen_k=n), metric="latency",
                            unit="ms", p20=1.0, p50=1.0, p80=1.0, repeats=3, env=env)
            for n in (1024, 2048)]
    rec.upsert_records(folder / "bench.jsonl", mine)
    records, source = demo_records([], folder)
    assert {r["gpu"] for r in records} == {"MY GPU"} and source == str(folder.name)
    fresh = [{**mine[0], "gpu": "FRESH GPU"}]
    records, source = demo_records(fresh, folder)  # this run's, never the folder's
    assert records == fresh and "this run's measurements" in source
