"""`attnlab trace`, `tiles`, `verify` and the reference demo section, run in-process."""

from __future__ import annotations

import json

import pytest

from attnlab.cli import main
from attnlab.commands import reference as reference_commands


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


# ----- trace -------------------------------------------------------------------------
def test_trace_default_is_the_lessons_two_tile_trace(capsys):
    code, out, err = run_cli(capsys, "trace")
    assert code == 0 and err == ""
    for number in ("1.1353", "1.4060", "2.5413", "0.1353", "1.2034", "5.5388", "6.7422",
                   "[4.6025, 5.6025]", "[0.1125, 0.0152, 0.8310, 0.0414]"):
        assert number in out
    assert "match" in out and "MISMATCH" not in out


def test_trace_json(capsys):
    code, out, _ = run_cli(capsys, "trace", "--json")
    assert code == 0
    report = json.loads(out)
    assert [round(x, 4) for x in report["output"]] == [4.6025, 5.6025]
    assert [step["tile"] for step in report["steps"]] == [1, 2]
    assert report["steps"][0]["m_old"] == "-inf"  # JSON has no infinities
    assert [round(report["steps"][1][key], 4) for key in ("m_old", "m_new", "alpha", "l")] == [
        8.0, 10.0, 0.1353, 1.2034]
    assert report["matches"] is True
    assert report["full_row_softmax"]["output"] == pytest.approx(report["output"], abs=1e-12)


def test_trace_the_posts_walk(capsys):
    code, out, _ = run_cli(capsys, "trace", "--scores", "1,3,0,2", "--values", "10,20,30,40",
                           "--tile", "1", "--json")
    assert code == 0
    report = json.loads(out)
    assert len(report["steps"]) == 4
    assert round(report["output"][0], 1) == 24.2
    code, out, _ = run_cli(capsys, "trace", "--scores", "1,3,0,2", "--values", "10,20,30,40",
                           "--tile", "1")
    assert code == 0 and "24.1868" in out


def test_trace_accepts_minus_inf_scores_and_a_ragged_last_tile(capsys):
    code, out, _ = run_cli(capsys, "trace", "--scores=-inf,2,-inf", "--values", "1;2;3",
                           "--tile", "2", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["output"] == [2.0] and len(report["steps"]) == 2


# ----- tiles -------------------------------------------------------------------------
def test_tiles_default_is_exercise_4(capsys):
    code, out, err = run_cli(capsys, "tiles")
    assert code == 0 and err == ""
    assert "rows 513-640" in out
    assert "loads KV tiles 1-10" in out
    assert "element mask on 9-10" in out
    assert "skipped 11-64" in out
    assert "513-576 none visible" in out  # tile 10 is empty for the upper half


def test_tiles_json(capsys):
    code, out, _ = run_cli(capsys, "tiles", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["query_tile"] == 5 and report["rows"] == [513, 640]
    assert report["loaded"] == list(range(1, 11))
    assert report["masked"] == [9, 10]
    assert report["full"] == list(range(1, 9))
    assert report["skipped"] == list(range(11, 65))
    assert report["loaded_kv_rows"] == 640
    tile_10 = report["loaded_tiles"][-1]
    assert tile_10["kv_tile"] == 10 and tile_10["columns"] == [577, 640]
    assert tile_10["row_segments"][0] == {"rows": [513, 576], "visibility": "none visible"}
    assert report["whole_plan"]["loaded_masked"] == 64


def test_tiles_other_shapes(capsys):
    code, out, _ = run_cli(capsys, "tiles", "--seqlen-q", "97", "--seqlen-k", "113",
                           "--block-m", "32", "--block-n", "64", "--query-tile", "4",
                           "--no-causal", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["rows"] == [97, 97] and report["loaded_kv_rows"] == 113
    assert report["masked"] == []
    code, out, _ = run_cli(capsys, "tiles", "--seqlen", "64", "--block-m", "16", "--block-n",
                           "32", "--query-tile", "3", "--window", "8,-1", "--json")
    assert code == 0
    report = json.loads(out)
    # Rows 33-48 with causal + left window 8 see keys 25..48: KV tile 1 (1-32) and 2 (33-64).
    assert report["loaded"] == [1, 2] and report["masked"] == [1, 2]


# ----- verify ------------------------------------------------------------------------
def test_verify_passes_on_the_default_case(capsys):
    code, out, err = run_cli(capsys, "verify")
    assert code == 0 and err == ""
    assert "equal" in out and "different" in out and "passed" in out


def test_verify_json(capsys):
    code, out, _ = run_cli(capsys, "verify", "--seqlen-q", "13", "--seqlen-k", "29",
                           "--block-m", "4", "--block-n", "8", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["passed"] and report["tiled_equals_direct"] and report["no_mask_differs"]
    assert report["tiled_vs_direct_max_abs_difference"] < 1e-12
    assert report["no_mask_rows_wrong"] > 0


def test_verify_fails_when_no_tile_needs_the_mask(capsys):
    # One query, one key: the only tile is full, so dropping the mask changes nothing.
    code, out, _ = run_cli(capsys, "verify", "--seqlen-q", "1", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["tiled_equals_direct"] and not report["no_mask_differs"]
    assert not report["passed"]


# ----- bad arguments: one line on stderr, exit 2 -------------------------------------------
BAD_ARGUMENTS = [
    (["trace", "--tile", "0"], "--tile"),
    (["trace", "--tile", "abc"], "--tile"),
    (["trace", "--tile", "1.5"], "--tile"),
    (["trace", "--scores", "1,2"], "--values"),
    (["trace", "--values", "1,2"], "--scores"),
    (["trace", "--scores", "a,b", "--values", "1,2"], "--scores"),
    (["trace", "--scores", "", "--values", ""], "--scores"),
    (["trace", "--scores", "1,nan", "--values", "1,2"], "--scores"),
    (["trace", "--scores", "1,inf", "--values", "1,2"], "scores"),
    (["trace", "--scores", "1,2", "--values", "1"], "values"),
    (["trace", "--scores", "1,2", "--values", "1,2;3"], "values"),
    (["trace", "--scores", "1", "--values", "inf"], "values"),
    (["tiles", "--query-tile", "0"], "--query-tile"),
    (["tiles", "--query-tile", "33"], "--query-tile"),
    (["tiles", "--query-tile", "x"], "--query-tile"),
    (["tiles", "--seqlen", "0"], "--seqlen"),
    (["tiles", "--seqlen", "abc"], "--seqlen"),
    (["tiles", "--seqlen-q", "0"], "--seqlen-q"),
    (["tiles", "--seqlen-k", "-3"], "--seqlen-k"),
    (["tiles", "--block-m", "0"], "--block-m"),
    (["tiles", "--block-n", "1.5"], "--block-n"),
    (["tiles", "--window", "1"], "--window"),
    (["tiles", "--window=-2,0"], "--window"),
    (["tiles", "--window", "a,b"], "--window"),
    (["tiles", "--window", "1,2,3"], "--window"),
    (["verify", "--seqlen-q", "0"], "--seqlen-q"),
    (["verify", "--seqlen-k", "0"], "--seqlen-k"),
    (["verify", "--head-dim", "0"], "--head-dim"),
    (["verify", "--block-m", "0"], "--block-m"),
    (["verify", "--block-n", "x"], "--block-n"),
    (["verify", "--seed", "-1"], "--seed"),
]


@pytest.mark.parametrize(("argv", "named"), BAD_ARGUMENTS, ids=lambda x: " ".join(x)
                         if isinstance(x, list) else x)
def test_bad_argument_is_one_line_and_exit_2(capsys, argv, named):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"attnlab {argv[0]}: error:")
    assert named in lines[0]


@pytest.mark.parametrize("argv", [["trace", "--bogus"], ["tiles", "--causal", "yes"],
                                  ["verify", "--json", "extra"]])
def test_argparse_usage_errors_exit_2(capsys, argv):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "error" in err


# ----- demo section --------------------------------------------------------------------
def test_demo_prints_and_writes_the_trace_and_the_plan(tmp_path, capsys):
    reference_commands.demo(tmp_path)
    out = capsys.readouterr().out
    assert "[4.6025, 5.6025]" in out and "loads KV tiles 1-10" in out
    trace = json.loads((tmp_path / "reference_trace.json").read_text())
    plan = json.loads((tmp_path / "tile_plan.json").read_text())
    assert [round(x, 4) for x in trace["output"]] == [4.6025, 5.6025]
    assert plan["loaded"] == list(range(1, 11)) and plan["masked"] == [9, 10]
