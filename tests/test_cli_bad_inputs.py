"""The catalogue of bad inputs (issue 11): each one answers in one line, never a traceback.

Every row names the input and what must come back: exit code 2 and a one-line
message naming the problem, or the right answer (exit 0) with a bounded output.
A bad input found later gets one more row here, so it stays fixed.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from attnlab.cli import main
from attnlab.commands.cli_support import MAX_TOKENS

# ----- input files, written once per test into tmp_path ----------------------------------
WORKLOAD = """\
title: {title}
segments:
  - {{name: network, ms: {network_ms}, source: socket timestamps}}
  - {{name: prefill, ms: 290.0, source: CUDA profiler span,
     parts: {{attention: 116.0, other: 174.0}}}}
proposal: {{change: a faster kernel, segment: prefill, part: attention, kernel_speedup: 3.0}}
"""


def alias_bomb() -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    previous = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
        previous = name
    return "\n".join([*lines, f"title: *{previous}", "segments: []", ""])


def device_trace(events: list[tuple[str, float, float]]) -> dict:
    return {"traceEvents": [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                             "pid": 0, "tid": 0} for name, ts, dur in events]}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Every bad (and one good) input file the catalogue refers to, by name."""
    import attnlab.measure.profile as profile

    monkeypatch.setattr(profile, "MAX_TRACE_BYTES", 1 << 20)  # a small bomb is enough
    paths = {}

    def write(name: str, content: str | bytes) -> None:
        path = tmp_path / name
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        paths[name] = path

    write("bomb.yaml", alias_bomb())
    write("deep.yaml", "title: " + "[" * 100_000 + "]" * 100_000 + "\n")
    write("deep.json", '{"title": ' + "[" * 100_000 + "]" * 100_000 + "}")
    write("huge_ms.yaml", WORKLOAD.format(title="t", network_ms="1.0e+308"))
    write("html.yaml", WORKLOAD.format(title='"<script>alert(1)</script> & <b>x</b>"',
                                       network_ms="15.0"))
    write("big.yaml", "title: x\n" + "# padding\n" * 200_000)
    write("corrupt.json.gz", b"\x1f\x8b\x08\x00" + b"not a gzip stream at all")
    write("bomb.json.gz", gzip.compress(b" " * (2 << 20)))
    write("deep_trace.json", '{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    write("negative.json", json.dumps(device_trace(
        [("flash_fwd_kernel", 0, 100), ("gemm_a", 100, -50), ("gemm_b", 150, 100)])))
    write("stray.json", json.dumps(device_trace(
        [("flash_fwd_kernel", 0, 100), ("gemm_a", 100, 100), ("elementwise", 1e12, 1)])))
    write("a_file", "I am a file")
    paths["file/sub"] = tmp_path / "a_file" / "sub"
    paths["out"] = tmp_path / "out"
    # issue 28: pipes, repeated keys, a cut file, a backtracking pattern, a user's folder
    for name in ("fifo.yaml", "fifo.json", "fifo.jsonl"):
        os.mkfifo(tmp_path / name)
        paths[name] = tmp_path / name
    good = WORKLOAD.format(title="t", network_ms="15.0")
    write("dup_top.yaml", good + "title: again\n")
    write("dup_segment.yaml", good.replace("{name: network, ms: 15.0,",
                                           "{name: network, ms: 15.0, ms: 16.0,"))
    write("dup.json", '{"title": "a", "title": "b", "segments": []}')
    write("no_newline.yaml", good.rstrip("\n"))  # cut inside its last line
    written = ("# attnlab report workload (schema: docs/report.md)\n" + good + "...\n")
    write("cut_at_line.yaml", written.rsplit("...", 1)[0])  # attnlab's file, cut at a line
    write("redos.yaml", good + "trace_patterns: {attention: ['(a+)+$']}\n")
    folder = tmp_path / "users_folder"
    folder.mkdir()
    (folder / "thesis.tex").write_text("mine")
    paths["users_folder"] = folder
    paths["missing"] = tmp_path / "missing"
    return paths


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# (argv with {file} placeholders, exit code, a phrase the one-line error must hold)
REFUSED = [
    (["report", "{bomb.yaml}"], "more than 100,000 values"),
    (["report", "{deep.yaml}"], "nested more than 32 levels"),
    (["report", "{deep.json}"], "nested more deeply than JSON"),
    (["report", "{big.yaml}"], "larger than 1,048,576 bytes"),
    (["report", "{huge_ms.yaml}"], "must be at most 1e+09 ms"),
    (["report", "--kernel-speedup", "1e-320"], "between 1e-06 and 1e+06"),
    (["report", "--kernel-speedup", "1e308"], "between 1e-06 and 1e+06"),
    (["report", "--trace", "{corrupt.json.gz}"], "corrupt gzip stream"),
    (["report", "--trace", "{bomb.json.gz}"], "refusing to read it"),
    (["report", "--trace", "{deep_trace.json}"], "nested too deeply"),
    (["report", "--out", "/proc/attnlab-x"], "--out: cannot create"),
    (["report", "--out", "{a_file}"], "is a file"),
    (["report", "--out", "{file/sub}"], "which is not a folder"),
    (["report", "--out", "/dev/null"], "is not a folder"),
    (["report", "--out", ""], "--out must name a folder, got an empty path"),
    (["bench", "--replot", "--plots", "/proc/attnlab-x"], "--plots: cannot create"),
    (["bench", "--replot", "--plots", "{a_file}"], "is a file"),
    (["bench", "--replot", "--plots", "{file/sub}"], "which is not a folder"),
    (["bench", "--replot", "--plots", "/dev/null"], "is not a folder"),
    (["bench", "--replot", "--plots", ""], "empty path"),
    (["verify", "--seqlen-q", "100000"], "more than its bound of 16,777,216"),
    (["verify", "--seed", "1e30"], "--seed must be an int <= "),
    (["amdahl", "--time-share", "0.1,,0.2"], "no empty item"),
    (["amdahl", "--time-share", "0.1,"], "no empty item"),
    (["trace", "--scores", "1,,2", "--values", "1,2,3"], "no empty item"),
    (["traffic", "--seqlen", str(MAX_TOKENS + 1)], f"--seqlen must be an int <= {MAX_TOKENS:,}"),
    (["tiles", "--seqlen", "1e400"], "--seqlen must be an int"),
    (["tiles", "--window", "1,2,3"], "--window must be LEFT,RIGHT"),
    (["tiles", "--window", "1," + "9" * 500], "--window RIGHT must be an int"),
    (["tiles", "--query-tile", "99999999999999999999"], "--query-tile must be"),
    (["traffic", "--decode-splits", "5000", "--seqlen-q", "1"], "num_splits must be an int in"),
    (["roofline", "--measured-tflops", "1e400"], "--measured-tflops must be a finite number"),
    (["kernels", "--provider", "x" * 10_000], "unknown provider"),
    # issue 28: names the file system refuses, empty paths, a user's own folder
    (["report", "--out", "n" * 300], "longer than the 255 bytes a file name may have"),
    (["explain", "--out", "n" * 300], "longer than the 255 bytes a file name may have"),
    (["demo", "--out", "n" * 300], "longer than the 255 bytes a file name may have"),
    (["report", "--trace", "t" * 300], "File name too long"),
    (["report", "r" * 300 + ".yaml"], "File name too long"),
    (["demo", "--out", ""], "--out must name a folder, got an empty path"),
    (["explain", "--out", ""], "--out must name a folder, got an empty path"),
    (["explain", "--out", "."], "must not be the current folder or one above it"),
    (["demo", "--out", "{users_folder}"], "holds files attnlab did not write ('thesis.tex')"),
    (["explain", "--out", "{users_folder}"], "or pass --force"),
    (["report", "--out", "{users_folder}"], "holds files attnlab did not write"),
    # non-regular files: a FIFO would block the read forever
    (["report", "{fifo.yaml}"], "is a named pipe (FIFO), not a regular file"),
    (["report", "{fifo.json}"], "is a named pipe (FIFO), not a regular file"),
    (["report", "--trace", "{fifo.json}"], "trace file"),
    (["report", "--records", "{fifo.jsonl}"], "records file"),
    # duplicate keys, cut files, patterns that could backtrack
    (["report", "{dup_top.yaml}"], "the key 'title' appears twice in one mapping"),
    (["report", "{dup_segment.yaml}"], "the key 'ms' appears twice in one mapping"),
    (["report", "{dup.json}"], "the key 'title' appears twice in one mapping"),
    (["report", "{no_newline.yaml}"], "does not end with a line break"),
    (["report", "{cut_at_line.yaml}"], "it was cut short"),
    (["report", "{redos.yaml}", "--trace", "{negative.json}"], "not regular expressions"),
    # --records for the page and the demo; dtype names
    (["explain", "--records", "{missing}"], "--records"),
    (["demo", "--records", "{a_file}"], "is not a folder"),
    (["explain", "--records", ""], "--records must name a results folder, got an empty path"),
    (["bench", "--replot", "--out", "{missing}", "--plots", "{out}"], "no records at"),
    (["bench", "--replot", "--out", ""], "--out must name a folder of records or a .jsonl file, got an empty"),
    (["traffic", "--dtype", "int8"], "--dtype must be one of fp16 (float16, half), bf16"),
    (["bench", "--dtype", "float8"], "--dtype must be one of"),
]


def expand(argv: list[str], files: dict) -> list[str]:
    return [str(files[a[1:-1]]) if a.startswith("{") and a.endswith("}") else a for a in argv]


@pytest.mark.parametrize("argv, phrase", REFUSED, ids=[" ".join(a)[:60] for a, _ in REFUSED])
def test_refused_in_one_line_with_exit_2(capsys, files, argv, phrase):
    code, out, err = run(capsys, expand(argv, files))
    lines = err.strip().splitlines()
    assert code == 2 and out == "", (code, out[:200], err[:500])
    assert len(lines) == 1 and phrase in lines[0], err[:500]
    assert len(lines[0]) < 600  # a short prefix of a bad value, never the value
    # A refused command creates nothing and touches no one's files (issue 28, 30).
    assert not files["out"].exists() and not files["missing"].exists()
    assert [p.name for p in files["users_folder"].iterdir()] == ["thesis.tex"]
    assert not list(files["out"].parent.glob(".attnlab-partial-*"))


# (argv, a phrase the output must hold): big inputs answered at once, exactly.
ANSWERED = [
    (["tiles", "--seqlen", "1e12"], "loads KV tiles 1-10"),
    (["tiles", "--seqlen", str(MAX_TOKENS), "--query-tile", str(MAX_TOKENS // 128)],
     "loaded tiles not shown"),
    (["traffic", "--seqlen", "1e12"], "fa2-forward: "),
    (["traffic", "--seqlen", str(MAX_TOKENS), "--backward", "two-pass", "--decode-splits", "7",
      "--json"], '"variant": "flash-decoding"'),
    (["roofline", "--seqlen", "1e12"], "fa2-forward"),
    (["memory", "--seqlen", "1e12", "--json"], '"name": "S + P, training retention"'),
]


@pytest.mark.parametrize("argv, phrase", ANSWERED, ids=[" ".join(a)[:60] for a, _ in ANSWERED])
def test_huge_lengths_answer_at_once_with_a_bounded_output(capsys, argv, phrase):
    started = time.perf_counter()
    code, out, err = run(capsys, argv)
    assert code == 0 and err == "", err[:500]
    assert phrase in out and len(out) < 40_000
    assert time.perf_counter() - started < 10.0


def test_huge_traffic_bytes_are_exact_integers(capsys):
    code, out, _ = run(capsys, ["traffic", "--seqlen", str(MAX_TOKENS), "--json", "--causal"])
    report = json.loads(out)
    fused = next(row for row in report["rows"] if row["variant"] == "fa2-forward")
    assert code == 0 and isinstance(fused["total_bytes"], int)
    assert fused["write_bytes"] == MAX_TOKENS * 128 * 2  # O written once: N x d x 2 bytes
    assert fused["total_bytes"] == sum(k["total_bytes"] for k in fused["kernels"])


def test_trace_problems_are_warnings_not_silence(capsys, files):
    for name, phrase in (("negative.json", "negative durations"),
                         ("stray.json", "a stray event far from the others")):
        code, _, err = run(capsys, ["report", "--trace", str(files[name])])
        assert code == 0 and phrase in err, err


def test_report_md_escapes_the_workloads_html(capsys, files):
    code, _, _ = run(capsys, ["report", str(files["html.yaml"]), "--out", str(files["out"])])
    markdown = (files["out"] / "report.md").read_text()
    assert code == 0
    assert "<script>" not in markdown and "<b>" not in markdown
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;x&lt;/b&gt;" in markdown


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("attnlab ")


def test_a_closed_pipe_ends_quietly():
    """`attnlab traffic --json | head -1`: exit 0, nothing on stderr."""
    command = [sys.executable, "-m", "attnlab.cli", "traffic", "--json", "--seqlen", "1e9"]
    producer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    producer.stdout.readline()
    producer.stdout.close()  # the reader goes away after one line
    _, err = producer.communicate(timeout=60)
    assert producer.returncode == 0, err.decode()[-2000:]
    assert b"Traceback" not in err and b"BrokenPipe" not in err


# ----- the reference: dtypes it computes in, and NaN never hidden ------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64,
                                   torch.uint8])
def test_the_reference_refuses_dtypes_it_does_not_compute_in(dtype):
    from attnlab.reference import naive, tiled

    q = torch.ones(1, 1, 4, 8).to(dtype)
    for function in (naive, tiled):
        with pytest.raises(TypeError, match=r"q.dtype must be one of torch.float16, "
                                            r"torch.bfloat16, torch.float32, torch.float64"):
            function(q, q, q)


def test_the_reference_refuses_a_score_matrix_past_its_bound():
    from attnlab.reference import naive
    from attnlab.reference.naive import MAX_SCORE_ELEMENTS

    seqlen = math.isqrt(MAX_SCORE_ELEMENTS) + 1
    q = torch.empty(1, 1, seqlen, 1).expand(1, 1, seqlen, 1)  # no allocation to speak of
    with pytest.raises(ValueError, match="more than its bound"):
        naive(q, q, q)


@pytest.mark.parametrize("where", ["k", "q", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_and_inf_in_an_input_reach_the_rows_that_see_it(where, bad):
    """As PyTorch's attention: the rows whose computation touches the value are not
    finite; the rows that never see it are unchanged; the oracle never returns 0."""
    from attnlab.reference import naive, tiled

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 4, generator=generator, dtype=torch.float64)
               for _ in range(3))
    clean_out, clean_lse = tiled(q, k, v, causal=True, block_m=4, block_n=4)
    poisoned = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    row = 5  # query 5 (q), or key 5 (k, v): causal rows >= 5 see key 5
    poisoned[where][0, 0, row] = bad
    out, lse = tiled(poisoned["q"], poisoned["k"], poisoned["v"], causal=True,
                     block_m=4, block_n=4)
    direct = naive(poisoned["q"], poisoned["k"], poisoned["v"], causal=True)
    touched = [row] if where == "q" else list(range(row, 20))
    untouched = [r for r in range(20) if r not in touched]
    assert (~torch.isfinite(out[0, 0, touched])).any(dim=-1).all()
    assert (~torch.isfinite(direct[0, 0, touched])).any(dim=-1).all()
    if where != "v":  # a NaN or inf score: the row's LSE is not a number either
        assert not torch.isfinite(lse[0, 0, touched]).all()
    if where != "v" or bad == math.nan:
        # rows of the same masked tile that hide the key stay exact
        torch.testing.assert_close(out[0, 0, untouched], clean_out[0, 0, untouched])
        torch.testing.assert_close(lse[0, 0, untouched], clean_lse[0, 0, untouched])
    torch.testing.assert_close(out[0, 1], clean_out[0, 1])  # the other head is untouched
    assert not (out[0, 0, touched] == 0).all(dim=-1).any()  # never the empty-row answer


def test_the_api_reference_path_refuses_int_tensors():
    """impl='reference' must not cast an int tensor to float64 and compute something else."""
    from attnlab import attention

    q = torch.ones(1, 1, 4, 8, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype"):
        attention(q, q, q, impl="reference")
