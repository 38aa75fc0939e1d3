"""The benchmark engine (attnlab.measure.engine) and the bench scripts built on it, on a CPU.

(a) The engine with fake phases: the shared budget and what it leaves unmeasured, phase
selection and order, an unknown phase refused by name, the output folder (checked first,
created only when something is written, never inside the package), the environment
captured once, records written through measure.records.

(b) Every bench script imports without CUDA, lists its phases, and builds every phase's
plan (shapes, providers, configs) from its default options, so a broken script fails
here and not on the next GPU lease; the scripts that take ``--device cpu`` run a phase
end to end under TRITON_INTERPRET=1 on a tiny shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.measure import engine
from attnlab.measure import records as rec
from attnlab.measure.engine import BUDGET_SPENT, Bench, Unavailable, check_out_dir
from attnlab.shapes import AttentionShape

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# Every bench script that is a configuration of the engine.  The two table writers
# (forward_table.py, sm90_dispatch_table.py) read committed records and run no phases.
# Every script built on the engine (found, not listed: a new one is covered at once).
BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = tuple(sorted(p.stem for p in BENCH_DIR.glob("*.py") if "Bench(" in p.read_text()))


class Clock:
    """A monotonic clock the test moves by hand (the engine reads time.monotonic)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(engine.time, "monotonic", fake)
    return fake


def cpu_bench(**options) -> Bench:
    return Bench("fake", "A fake benchmark.", devices=("cpu",), **options)


# ----- (a) the engine --------------------------------------------------------------------------
def test_each_phase_gets_the_budget_left_and_says_what_it_left_unmeasured(clock, tmp_path,
                                                                          capsys):
    bench = cpu_bench(budget_s=10.0)
    done = []

    @bench.phase(plan=lambda args: [f"p{i}" for i in range(6)])
    def first(ctx):
        """Six points, 3 s each."""
        for point in ctx.within_budget(ctx.plan):
            clock.now += 3.0
            done.append(point)

    @bench.phase()
    def second(ctx):
        """Never reached: the budget is gone."""
        done.append("second")

    assert bench.main(["--out", str(tmp_path / "o")]) == 0
    # 0, 3, 6, 9 s are inside the 10 s budget; at 12 s the rest is left.
    assert done == ["p0", "p1", "p2", "p3"]
    err = capsys.readouterr().err
    assert "first: 2 point(s), the time budget spent: p4, p5" in err
    assert "second: the whole phase, the run's time budget spent before it" in err
    assert err.count("left unmeasured: ") == 2


def test_a_phase_cap_ends_that_phase_only(clock, tmp_path):
    bench = cpu_bench()
    reached = {}

    @bench.phase(cap_s=5.0, plan=lambda args: list(range(10)))
    def capped(ctx):
        """Stops at its own cap."""
        reached["capped"] = [clock.now for _ in ctx.within_budget(ctx.plan)
                             if not setattr(clock, "now", clock.now + 2.0)]

    @bench.phase(plan=lambda args: list(range(4)))
    def free(ctx):
        """No cap, no run budget: everything."""
        reached["free"] = list(ctx.within_budget(ctx.plan))

    assert bench.main(["--out", str(tmp_path / "o"), "--capped-budget", "4"]) == 0
    assert len(reached["capped"]) == 3  # 0, 2, 4 s <= 4 s
    assert reached["free"] == [0, 1, 2, 3]


def test_phases_run_in_registration_order_and_only_those_named(tmp_path):
    bench = cpu_bench()
    ran = []
    for name in ("a", "b", "c"):
        bench.phase(name, default=name != "c")(lambda ctx: ran.append(ctx.phase))
    assert bench.main(["--out", str(tmp_path / "1")]) == 0
    assert ran == ["a", "b"]  # c is not a default
    ran.clear()
    assert bench.main(["--out", str(tmp_path / "2"), "--phases", "c,a"]) == 0
    assert ran == ["a", "c"]


def test_an_unknown_phase_is_refused_by_name_before_anything_is_written(tmp_path, capsys):
    bench = cpu_bench()
    bench.phase("tune")(lambda ctx: ctx.write_rows("x.jsonl", [{}]))
    bench.phase("bench")(lambda ctx: None)
    out = tmp_path / "never"
    assert bench.main(["--out", str(out), "--phases", "tune,tuen"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "unknown phase 'tuen'" in err and "the phases of fake are tune, bench" in err
    assert not out.exists()


def test_the_output_folder_is_created_only_when_a_phase_writes(tmp_path, capsys):
    bench = cpu_bench()
    bench.phase("quiet")(lambda ctx: None)
    bench.phase("writes", default=False)(lambda ctx: ctx.append_row("rows.jsonl", {"a": 1}))
    out = tmp_path / "results" / "run1"
    assert bench.main(["--out", str(out), "--list"]) == 0
    assert "quiet" in capsys.readouterr().out and not out.exists()
    assert bench.main(["--out", str(out)]) == 0
    assert not out.exists()  # nothing written, no empty folder left behind
    assert bench.main(["--out", str(out), "--phases", "writes"]) == 0
    assert (out / "rows.jsonl").read_text() == '{"a": 1}\n'


def test_a_run_that_cannot_start_leaves_no_folder(tmp_path, capsys, monkeypatch):
    bench = Bench("gpu_only", "Needs CUDA.")
    bench.phase("p")(lambda ctx: ctx.write_rows("x.jsonl", [{}]))
    monkeypatch.setattr(engine, "_cuda_available", lambda: False)
    out = tmp_path / "o"
    assert bench.main(["--out", str(out)]) == 2
    assert capsys.readouterr().err == "gpu_only: needs a CUDA GPU\n"
    assert not out.exists()

    refusing = cpu_bench()
    refusing.phase("p")(lambda ctx: ctx.write_rows("x.jsonl", [{}]))

    @refusing.setup
    def no_kernel(ctx):
        raise Unavailable("the sm90 kernel does not run here")

    assert refusing.main(["--out", str(out)]) == 2
    assert "the sm90 kernel does not run here" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("inside", ["src/attnlab/data/results/x", "src/attnlab"])
def test_the_output_folder_is_never_inside_the_package(inside, capsys):
    target = ROOT / inside
    bench = cpu_bench()
    bench.phase("p")(lambda ctx: ctx.write_rows("x.jsonl", [{}]))
    existed = target.exists()
    assert bench.main(["--out", str(target)]) == 2
    assert "inside the attnlab package" in capsys.readouterr().err
    assert target.exists() == existed


@pytest.mark.parametrize("make, message", [
    (lambda tmp: tmp / "file.txt", "is a file"),
    (lambda tmp: tmp / "file.txt" / "sub", "which is not a folder"),
    (lambda tmp: "", "empty path"),
])
def test_a_bad_output_folder_is_one_line(tmp_path, make, message):
    (tmp_path / "file.txt").write_text("mine")
    with pytest.raises(ValueError, match=message):
        check_out_dir(make(tmp_path))
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_records_are_written_with_the_environment_captured_once(tmp_path, monkeypatch, capsys):
    calls = []
    real = rec.environment
    monkeypatch.setattr(rec, "environment", lambda command: calls.append(command) or real(command))
    bench = cpu_bench()
    shape = AttentionShape(query_heads=2, kv_heads=2, seqlen_q=16, seqlen_k=16, head_dim=16)

    def record(ctx, p50):
        return rec.make_record(kernel="call", provider=ctx.phase, phase="prefill", shape=shape,
                               metric="latency", unit="ms", p20=p50, p50=p50, p80=p50,
                               repeats=3, env=ctx.env)

    bench.phase("one")(lambda ctx: ctx.upsert("r.jsonl", [record(ctx, 1.0)]))
    bench.phase("two")(lambda ctx: ctx.upsert("r.jsonl", [
        record(ctx, 2.0), rec.skipped_record(provider="late", phase="prefill", shape=shape,
                                             reason=BUDGET_SPENT, env=ctx.env)]))
    # A phase's own rows carry the environment too (tuning logs, comparison rows).
    bench.phase("rows")(lambda ctx: ctx.write_rows("rows.jsonl", [{"what": "x", **ctx.env}]))
    out = tmp_path / "o"
    assert bench.main(["--out", str(out), "--budget", "600"]) == 0
    stored = rec.load_records(out / "r.jsonl")
    assert [r["provider"] for r in stored] == ["one", "two", "late"]
    assert len(calls) == 1
    # Captured relative to the output folder: no path of the measuring machine, in the
    # records and in every row written with the environment.
    assert calls[0] == "PYTHONPATH=src python3 bench/fake.py --out . --budget 600"
    assert {r["command"] for r in stored} == {calls[0]}
    row = json.loads((out / "rows.jsonl").read_text())
    assert row["command"] == calls[0] and str(tmp_path) not in json.dumps(row)
    assert stored[0]["gpu"] == "cpu"
    assert rec.csv_path(out / "r.jsonl").exists()  # the CSV twin
    assert rec.describe_environment(stored[0]) in capsys.readouterr().err


def test_a_crashed_phase_fails_the_run_and_the_next_phase_still_runs(tmp_path, capsys):
    bench = cpu_bench()
    ran = []

    @bench.phase()
    def broken(ctx):
        """Raises."""
        raise RuntimeError("kernel exploded")

    @bench.phase()
    def counted(ctx):
        """Counts two failures of its own."""
        ran.append("counted")
        ctx.fail(2)

    bench.finish(lambda ctx: ran.append(("finish", ctx.failures)))
    assert bench.main(["--out", str(tmp_path / "o")]) == 1
    assert ran == ["counted", ("finish", 3)]
    err = capsys.readouterr().err
    assert "RuntimeError: kernel exploded" in err and "broken: crashed" in err


def test_a_bad_plan_option_is_refused_before_any_work(tmp_path, capsys):
    bench = cpu_bench()
    bench.option("--lengths", default="1024")
    ran = []

    @bench.setup
    def setup(ctx):
        ran.append("setup")

    def plan(args):
        return [int(n) for n in args.lengths.split(",")]

    bench.phase("sweep", plan=plan)(lambda ctx: ran.append(ctx.plan))
    assert bench.main(["--out", str(tmp_path / "o"), "--lengths", "1024,x"]) == 2
    assert "invalid literal" in capsys.readouterr().err and ran == []
    assert bench.main(["--out", str(tmp_path / "o"), "--lengths", "16,32"]) == 0
    assert ran == ["setup", [16, 32]]


def test_a_phase_registered_twice_is_refused():
    bench = cpu_bench()
    bench.phase("p")(lambda ctx: None)
    with pytest.raises(ValueError, match="'p' is registered twice"):
        bench.phase("p")(lambda ctx: None)


# ----- (b) the bench scripts -------------------------------------------------------------------


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_lists_its_phases_and_builds_every_plan_without_cuda(bench_script, name, capsys):
    bench = bench_script(name).bench
    assert bench.phases, f"{name} registers no phase"
    assert bench.main(["--list"]) == 0
    listing = capsys.readouterr().out
    for phase in bench.phases.values():
        assert phase.name in listing and phase.help, (name, phase.name)
    plans = bench.plans(bench.parse([]))
    for phase, plan in plans.items():
        assert plan is None or plan, f"{name}: phase {phase}'s default plan is empty"


# Options that change a plan: each variant must build too (the commands in bench/NOTES.md).
PLAN_VARIANTS = [
    ("forward_h200", ["--flex", "all", "--groups", "d128,gqa_d256"]),
    ("backward_h200", ["--quick"]),
    ("backward_h200", ["--providers", "flex", "--flex", "all", "--shapes", "Nq=1024,d=64"]),
    ("backward_h200", ["--tune-seqlens", "4096,1024", "--tune-heads", "128,64"]),
    ("decode_h200", ["--quick"]),
    ("serving_h200", ["--quick"]),
    ("decode_h200", ["--phases", "paged_sweep"]),
    ("host_cost_h200", ["--phases", "decode"]),
    ("fp8_h200", ["--phases", "correct,decode,prefill,tune"]),
    ("fp8_h200", ["--phases", "ncu"]),
    ("sm90_h200", ["--quick"]),
    ("sm90_h200", ["--head-dims", "128,256,64", "--schedules", "split", "--rescales",
                   "late,early", "--stores", "direct,vector"]),
    ("sanitize_h200", ["--racecheck"]),
    ("sanitize_h200", ["--only", "backward_sm90"]),
    ("varlen_h200", ["--quick", "--no-flex", "--mixes", "b"]),
    ("seed_h200", ["--quick", "--flex"]),
    ("seed_h200", ["--providers", "fa4,flashinfer_paged16", "--phases", "decode_b16"]),
]


@pytest.mark.parametrize("name, argv", PLAN_VARIANTS)
def test_plan_variants_build(bench_script, name, argv):
    bench = bench_script(name).bench
    plans = bench.plans(bench.parse(argv))
    assert any(plans.values()), (name, argv)


@pytest.mark.parametrize("name, argv, message", [
    ("backward_h200", ["--providers", "sdpa_cudnn,fa9"], "unknown provider 'fa9'"),
    ("backward_h200", ["--tune-heads", "96"], "--tune-heads: 96 is not one of"),
    ("forward_h200", ["--groups", "d512"], "--groups: unknown group 'd512'"),
    ("sm90_h200", ["--stores", "scatter"], "--stores must be comma-separated from"),
    ("varlen_h200", ["--providers", "attnlab_varlen,xformers"], "unknown provider 'xformers'"),
    ("varlen_h200", ["--mixes", "a,d"], "--mixes must be comma-separated from a, b, c"),
    ("ring_h200", ["--phases", "prefill,train"], "unknown phase 'train'"),
    ("seed_h200", ["--providers", "fa4,fa9"], "unknown provider 'fa9'"),
])
def test_a_script_refuses_a_bad_option_in_one_line(bench_script, name, argv, message, capsys, tmp_path):
    bench = bench_script(name).bench
    assert bench.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_the_table_writers_still_run_on_committed_records():
    done = subprocess.run([sys.executable, str(BENCH / "forward_table.py"), "--fwdbwd"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("| shape (bf16, fwd + bwd) |")


def test_the_l2_schedule_script_replays_both_orders_through_the_models_lru(monkeypatch):
    # The replay itself is the cache model's (tests/test_model_l2.py); the script keeps
    # session 16's order beside it.
    monkeypatch.syspath_prepend(str(BENCH))
    import l2_schedule_sim as sim

    from attnlab.model.l2 import KeyBlockOrder, key_block_programs, lru_misses

    shape = AttentionShape(batch=1, query_heads=8, kv_heads=2, seqlen_q=1024, seqlen_k=1024,
                           head_dim=256, dtype="bf16", causal=True)
    old = sim.session16_programs(shape, 64)
    split = key_block_programs(shape, KeyBlockOrder(128, 64, block_major=True, head_split=2))
    assert len(old) == 1024 // 128 * 2 and len(split) == 2 * len(old)
    # The same (head, tile) reads, in other orders.
    assert sorted(t for p in old for t in p) == sorted(t for p in split for t in p)
    tiles = 8 * 1024 // 64  # every (query head, tile) the launch reads
    for programs in (old, split):  # an L2 that holds every tile: each read once
        assert sum(lru_misses(programs, capacity=tiles, slots=4).values()) == tiles
    # A small L2: the programs that read each tile together read fewer again.
    together = key_block_programs(shape, KeyBlockOrder(128, 64))
    small = dict(capacity=8, slots=16)
    assert sum(lru_misses(together, **small).values()) < sum(lru_misses(old, **small).values())


def run_on_cpu(script: str, argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--device", "cpu",
                           "--out", str(tmp_path / "out"), *argv],
                          capture_output=True, text=True, timeout=600, check=False, env=env,
                          cwd=ROOT)


@pytest.mark.slow
def test_sanitize_runs_a_case_end_to_end_on_the_cpu(tmp_path):
    done = run_on_cpu("sanitize_h200", ["--only", "forward seqlen_q=1 "], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "summary: 1 cases, 1 passed, 0 failed" in done.stdout
    (row,) = [__import__("json").loads(line)
              for line in (tmp_path / "out" / "sanitize_cases.jsonl").read_text().splitlines()]
    assert row["status"] == "passed" and row["gpu"] == "cpu" and "--device cpu" in row["command"]


@pytest.mark.slow
def test_varlen_runs_correctness_and_timing_end_to_end_on_the_cpu(tmp_path):
    done = run_on_cpu("varlen_h200", ["--tokens", "64", "--mixes", "c", "--providers",
                                      "attnlab_varlen", "--phases", "correct,prefill"],
                      tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (record,) = rec.load_records(tmp_path / "out" / "varlen_h200.jsonl")
    assert record["provider"] == "attnlab_varlen" and record["metric"] == "latency"
    checks = (tmp_path / "out" / "varlen_correctness.jsonl").read_text()
    assert '"passed": true' in checks and '"passed": false' not in checks


@pytest.mark.slow
def test_ring_single_gpu_mode_runs_end_to_end_on_the_cpu(tmp_path):
    done = run_on_cpu("ring_h200", ["--single-gpu", "--phases", "correct,prefill"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "correctness causal-gqa on 1 GPU(s): PASS" in done.stdout
    kernels = {r["kernel"] for r in rec.load_records(tmp_path / "out" / "ring_h200.jsonl")}
    assert {"ring-local-step", "ring-remote-later", "ring-remote-earlier",
            "ring-merge"} <= kernels
    assert "model prefill P= 2" in done.stdout


def test_check_case_records_each_case_at_once_and_counts_failures(tmp_path, capsys):
    import argparse
    import json

    from attnlab.measure.engine import Context

    ctx = Context(args=argparse.Namespace(), out_dir=tmp_path, command="test", device="cpu")

    def crash():
        raise RuntimeError("boom")

    rows = [ctx.check_case("fine", lambda: (True, "err 0")),
            ctx.check_case("wrong", lambda: (False, "err 9")),
            ctx.check_case("crash", crash)]
    assert [r["passed"] for r in rows] == [True, False, False] and ctx.failures == 2
    assert rows[2]["detail"] == "RuntimeError: boom"
    written = [json.loads(line) for line in (tmp_path / "correctness.jsonl").read_text().splitlines()]
    assert [r["what"] for r in written] == ["fine", "wrong", "crash"]
    assert "FAIL crash: RuntimeError: boom" in capsys.readouterr().err  # engine.say: stderr


@pytest.mark.slow
def test_the_serving_bench_runs_its_whole_path_on_a_toy_model(tmp_path, bench_script):
    """generate timing, the step profile and the greedy check, on a CPU toy model."""
    pytest.importorskip("transformers")
    bench = bench_script("serving_h200").bench
    out = tmp_path / "serving"
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "serving.jsonl").read_text().splitlines()]
    measured = {(r["batch"], r["provider"]) for r in rows if "time_per_token_ms" in r}
    assert measured == {(b, p) for b in (1, 2) for p in ("sdpa", "attnlab", "eager")}
    judged = [r for r in rows if r["provider"] in ("attnlab", "eager")]
    assert all(r["greedy"]["mismatches"] == 0 and r["greedy"]["steps"] for r in judged)
    # The check can fail: the sabotaged attnlab (its newest key dropped) strays from SDPA.
    assert all(r["greedy"]["verdict"] == "match" and r["greedy"]["logit_outliers"] == 0
               and r["greedy"]["sabotaged_logit_outliers"] > 0 for r in judged)
    assert all(r["attention_ms"] > 0 for r in rows if "time_per_token_ms" in r)



# ----- fp8_h200's ncu phase: everything but ncu and the GPU ------------------------------------
def test_the_fp8_ncu_plan_puts_both_caches_side_by_side_at_every_shape(bench_script):
    from attnlab.measure.compare import PREDICTED_PROVIDERS
    from attnlab.measure.ncu import case_label

    fp8 = bench_script("fp8_h200")
    (cases,) = fp8.bench.plans(fp8.bench.parse(["--phases", "ncu"]), [fp8.bench.phases["ncu"]]
                               ).values()
    shapes = {(s.batch, s.query_heads, s.kv_heads, s.head_dim, s.seqlen_q, s.seqlen_k, s.dtype)
              for _, _, s in cases}
    assert shapes == {(b, hq, hk, d, 1, 32768, "bf16") for b in (1, 16)
                      for hq, hk, d in ((32, 8, 128), (24, 4, 256))}
    assert [name for name, _, _ in cases] == \
        ["attnlab_decode", "attnlab_decode_fp8", "attnlab_decode_paged16"] * 4
    assert {phase for _, phase, _ in cases} == {"decode"} and all(s.causal for _, _, s in cases)
    assert all(name in PREDICTED_PROVIDERS for name, _, _ in cases)
    assert len({case_label(*case) for case in cases}) == 12


def test_the_fp8_ncu_phase_without_ncu_is_one_line_before_any_work(bench_script, monkeypatch,
                                                                  tmp_path, capsys):
    from attnlab.measure import ncu

    fp8 = bench_script("fp8_h200")
    monkeypatch.setattr(engine, "_cuda_available", lambda: True)
    monkeypatch.setattr(ncu, "find_ncu", lambda: None)
    out = tmp_path / "o"
    assert fp8.bench.main(["--phases", "ncu", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "fp8_h200: the ncu phase needs Nsight Compute's ncu (on PATH, in $NCU or in "
        "/usr/local/cuda/bin); not found\n")
    assert not out.exists()


def test_the_fp8_ncu_phase_compares_every_kernel_it_profiled(bench_script, monkeypatch,
                                                           tmp_path, capsys):
    """The phase on a stand-in for run_ncu (what it would parse from ncu: each case's
    kernels at the byte model's prediction + 5%, one case failed): the counters as
    records, a comparison row per kernel, both tables written and printed, the failed
    case counted."""
    import argparse

    from attnlab.measure import ncu
    from attnlab.measure.compare import predict
    from attnlab.measure.engine import Context

    fp8 = bench_script("fp8_h200")
    ctx = Context(args=argparse.Namespace(), out_dir=tmp_path, command="test", device="cpu",
                  phase="ncu", plan=fp8.ncu_cases(None), deadline=float("inf"))
    ctx.results["ncu"] = "/opt/ncu"
    names = {"split_kv": "_split_kv_decode", "combine": "_combine_partials"}
    lost = ctx.plan[-1]
    seen = []

    def run_ncu(cases, out_dir, **options):
        seen.append((list(cases), out_dir, options["ncu"], options["timeout_s"]))
        kernels = []
        for case in cases[:-1]:
            for k in predict(case[0], case[2]):
                kernels.append(ncu.NcuKernel(
                    len(kernels), names[k.role], ncu.case_label(*case), None, None,
                    {"dram__bytes_read.sum": (1.05 * k.read_bytes, "byte"),
                     "dram__bytes_write.sum": (1.05 * k.write_bytes, "byte")}))
        return ncu.NcuRun(kernels, out_dir / "ncu_kernels.csv", out_dir / "ncu_raw.csv", [],
                          ncu.CORE_METRICS, {ncu.case_label(*lost): "RuntimeError: boom"}, [])

    monkeypatch.setattr(ncu, "run_ncu", run_ncu)
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    rows = fp8.ncu_phase(ctx)
    ((cases, out_dir, binary, timeout),) = seen
    assert cases == ctx.plan and out_dir == tmp_path / "ncu" and binary == "/opt/ncu"
    assert timeout == fp8.NCU_TIMEOUT_S
    assert fp8.os.environ["PYTHONPATH"].split(fp8.os.pathsep) == [str(ROOT / "src"), "elsewhere"]
    expected = sum(len(predict(name, shape)) for name, _, shape in ctx.plan)
    assert len(rows) == expected  # the lost case's kernels are rows too: not measured
    measured = [r for r in rows if r["measured"] is not None]
    assert len(measured) == expected - len(predict(lost[0], lost[2]))
    assert all(r["relative_error"] == pytest.approx(1 / 1.05 - 1, rel=1e-4) and r["within_goal"]
               for r in measured)
    written = [json.loads(line) for line in
               (tmp_path / "decode_ncu_vs_model.jsonl").read_text().splitlines()]
    assert [r["role"] for r in written] == [r["role"] for r in rows]
    assert written[0]["what"] == "decode_ncu_vs_model" and written[0]["gpu"] == "cpu"
    records = rec.load_records(tmp_path / "decode_ncu.jsonl")
    assert {r["metric"] for r in records} == {"dram_bytes_read", "dram_bytes_write"}
    assert len(records) == 2 * len(measured)
    tables = (tmp_path / "cache_model_vs_ncu.md").read_text()
    assert tables.count("| attnlab_decode_fp8 |") == 4 + 8  # 4 cases, 8 kernels (2 lost)
    assert "Per kernel:" in tables and "(not measured)" in tables
    assert tables in capsys.readouterr().out
    assert ctx.failures == 1
