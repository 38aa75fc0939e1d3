"""bench/seed_h200.py on a CPU: its plans, FlashInfer's points deferred while the modules
build, unmeasured points recorded with their reason, the closing table's peer."""

from __future__ import annotations

import json
import math

import pytest

from attnlab.measure import records as rec
from attnlab.measure.engine import BUDGET_SPENT, Context
from attnlab.measure.timing import Timing

ENV = {"gpu": "test GPU", "torch": "t", "triton": "t", "driver": None, "git_commit": "abc",
       "timestamp": "2026-01-01T00:00:00+00:00", "command": "seed"}


@pytest.fixture
def seed(bench_script):
    return bench_script("seed_h200")


class Prebuild:
    def __init__(self, finishes: bool) -> None:
        self.finishes, self.finished, self.waits, self.builds = finishes, False, 0, {}

    def done(self, name=None) -> bool:
        return self.finished

    def wait(self, timeout_s: float) -> float:
        self.waits += 1
        self.finished = self.finishes
        return 0.0

    def rows(self) -> list[dict]:
        return []


def context(seed, tmp_path, phases, argv=("--quick",)):
    args = seed.bench.parse([*argv, "--out", str(tmp_path)])
    ctx = Context(args=args, out_dir=tmp_path, command="seed", device="cpu", phases=phases)
    ctx._env = dict(ENV)
    return ctx


def fake_measure(ctx, point):
    return [rec.make_record(kernel="call", provider=point.provider, phase=point.phase,
                            shape=point.shape, metric="latency", unit="ms", p20=1.0, p50=1.0,
                            p80=1.0, repeats=5, env=ctx.env, timing_method="cuda-graph")]


def stored(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]


def test_the_plans_are_the_seeds_layer(seed):
    args = seed.bench.parse([])
    plans = seed.bench.plans(args)
    prefill = plans["prefill"]
    assert len(prefill) == 6 * 7 and {p.shape.seqlen_q for p in prefill} == {
        1024, 2048, 4096, 8192, 16384, 32768}
    shape = prefill[0].shape
    assert (shape.batch, shape.query_heads, shape.kv_heads, shape.head_dim, shape.dtype,
            shape.causal) == (1, 24, 4, 256, "bf16", True)
    assert [p.provider for p in prefill[:7]] == list(seed.PROVIDERS_OF["prefill"])
    for table, batch in (("decode_b1", 1), ("decode_b16", 16)):
        points = plans[table]
        assert {(p.shape.batch, p.shape.seqlen_q) for p in points} == {(batch, 1)}
        assert sorted({p.shape.seqlen_k for p in points}) == list(seed.DECODE_CACHES)
        assert {"fa4_paged16", "flashinfer_paged16", "attnlab_decode_paged16"} <= {
            p.provider for p in points}
    assert plans["deferred"] is None
    flex = seed.bench.plans(seed.bench.parse(["--flex"]))
    assert "flex" in {p.provider for p in flex["prefill"]}
    assert "flex" not in {p.provider for p in flex["fwdbwd"]}


def test_flashinfer_points_wait_for_their_builds_and_the_rest_run_first(seed, tmp_path,
                                                                        monkeypatch, capsys):
    monkeypatch.setattr(seed, "measure", fake_measure)
    ctx = context(seed, tmp_path, ["prefill", "deferred"])
    ctx.results["state"] = seed.RunState(prebuild=Prebuild(finishes=True))
    ctx.phase, ctx.plan = "prefill", seed.bench.plans(ctx.args)["prefill"]
    seed.run_table(ctx)
    first = stored(tmp_path, "seed_prefill.jsonl")
    assert "flashinfer" not in {r["provider"] for r in first} and len(first) == 2 * 6
    assert [p.provider for p in ctx.results["deferred"]] == ["flashinfer"] * 2
    ctx.phase, ctx.plan = "deferred", None
    seed.deferred(ctx)
    records = stored(tmp_path, "seed_prefill.jsonl")
    assert len(records) == 2 * 7 and {r["metric"] for r in records} == {"latency"}
    seed.print_tables(ctx)
    table = capsys.readouterr().out
    assert "N | eager_typical | eager | sdpa_cudnn" in table
    assert "1k | 1000.0 | 1000.0 | 1000.0" in table and "| sdpa_cudnn | 1.00x" in table


def test_a_build_that_outlasts_the_run_and_a_spent_budget_are_recorded(seed, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(seed, "measure", fake_measure)
    ctx = context(seed, tmp_path, ["decode_b1"])  # no deferred phase: the table waits itself
    ctx.results["state"] = seed.RunState(prebuild=Prebuild(finishes=False))
    ctx.phase, ctx.plan = "decode_b1", seed.bench.plans(ctx.args)["decode_b1"]
    seed.run_table(ctx)
    records = stored(tmp_path, "seed_decode_b1.jsonl")
    reasons = {r["provider"]: r.get("reason") for r in records}
    assert reasons["flashinfer"] == reasons["flashinfer_paged16"] == seed.BUILDING
    assert reasons["fa4"] is None and len(records) == 2 * len(seed.PROVIDERS_OF["decode"])
    spent = context(seed, tmp_path / "spent", ["decode_b1"])
    spent.results["state"] = seed.RunState()
    spent.phase, spent.plan, spent.deadline = "decode_b1", ctx.plan, -math.inf
    seed.run_table(spent)
    assert {r["reason"] for r in stored(tmp_path / "spent", "seed_decode_b1.jsonl")} == {
        BUDGET_SPENT}


def test_the_fastest_peer_is_neither_attnlab_nor_eager(seed):
    def row(**p50):
        return {name: {"provider": name, "metric": "latency", "p50": value}
                for name, value in p50.items()}

    point = row(attnlab=1.0, eager=0.1, sdpa_cudnn=2.0, fa4=1.5, flashinfer=3.0)
    assert seed.fastest_peer(point)["provider"] == "fa4"
    point["fa4"]["metric"] = "skipped"
    assert seed.fastest_peer(point)["provider"] == "sdpa_cudnn"
    assert seed.fastest_peer(row(attnlab=1.0)) is None


def test_the_uncaptured_time_is_a_record_beside_the_graph_timed_one(seed):
    from attnlab.measure.sweep import PointResult

    shape = seed.LAYER.shape(1024)
    main = rec.make_record(kernel="call", provider="fa4", phase="prefill", shape=shape,
                           metric="latency", unit="ms", p20=0.04, p50=0.05, p80=0.06, repeats=9,
                           env=ENV, tflops=100.0, tbps=1.0, kernel_names=["k"],
                           timing_method="cuda-graph, flush=l2, warmup=3")
    result = PointResult("fa4", "prefill", shape, main,
                         uncaptured=Timing((0.09, 0.1, 0.11), "cuda-event", "l2", 3))
    record = seed.uncaptured_record(result, seed.PHASE_TIMING["prefill"], ENV)
    assert record["metric"] == "latency_uncaptured" and record["p50"] == 0.1
    assert record["tflops"] == pytest.approx(50.0) and record["kernel_names"] == ["k"]
    assert record["timing_method"].startswith("cuda-event") and "--no-cuda-graph" in record["command"]
    assert rec.record_key(record) != rec.record_key(main)


def test_a_failed_build_stands_for_its_points_without_a_second_compile(seed, tmp_path,
                                                                      monkeypatch):
    from attnlab.measure.peer_jit import BATCH, Build

    first_calls = []
    monkeypatch.setattr(seed, "first_call", lambda ctx, point: first_calls.append(point))
    ctx = context(seed, tmp_path, ["decode_b16"], ["--quick", "--providers", "flashinfer_paged16"])
    prebuild = Prebuild(finishes=True)
    prebuild.finished, prebuild.builds = True, {BATCH: Build(BATCH, 10.0, "CalledProcessError: nvcc")}
    ctx.results["state"] = seed.RunState(prebuild=prebuild)
    point = seed.bench.plans(ctx.args)["decode_b16"][0]
    [record] = seed.measure(ctx, point)
    assert record["reason"] == ("failed: FlashInfer's JIT build of its batch prefill module "
                                "failed: CalledProcessError: nvcc")
    assert first_calls == []


def test_the_readme_seed_tables_name_the_fastest_peer_and_attnlabs_ratio(bench_script, tmp_path):
    tables = bench_script("readme_tables")

    def timed(provider, batch, seqlen_k, us, seqlen_q=1, metric="latency"):
        shape = {"batch": batch, "query_heads": 24, "kv_heads": 4, "seqlen_q": seqlen_q,
                 "seqlen_k": seqlen_k, "head_dim": 256, "dtype": "bf16", "causal": True}
        return rec.make_record(kernel="call", provider=provider, phase="decode", shape=shape,
                               metric=metric, unit="ms", p20=us / 1e3, p50=us / 1e3,
                               p80=us / 1e3, repeats=5, env=ENV)

    rec.upsert_records(tmp_path / "seed_decode_b1.jsonl", [
        timed("eager_typical", 1, 1024, 5.0), timed("sdpa_cudnn", 1, 1024, 30.0),
        timed("fa4", 1, 1024, 60.0), timed("flashinfer", 1, 1024, 20.0),
        timed("attnlab_decode", 1, 1024, 25.0), timed("flashinfer_paged16", 1, 1024, 22.0),
        timed("attnlab_decode_paged16", 1, 1024, 11.0),
        timed("flashinfer", 1, 1024, 1.0, metric="latency_uncaptured")])
    rec.upsert_records(tmp_path / "seed_decode_b16.jsonl", [timed("fa4", 16, 1024, 90.0)])
    lines = tables.seed_table("seed_decode", tmp_path)
    assert lines[0].startswith("| batch × cache | eager | cuDNN | FA2 | FA4 | FlashInfer | attnlab")
    assert lines[2] == ("| 1 × 1024 | 5.0 | 30.0 | – | 60.0 | 20.0 | 25.0 | – | 22.0 | 11.0 | "
                        "FlashInfer | 0.80× | FlashInfer paged | 2.00× |")
    assert lines[3] == "| 16 × 1024 | – | – | – | 90.0 | – | – | – | – | – | FA4 | – | – | – |"
    assert tables.main(["--results", str(tmp_path / "none"), "seed_prefill"]) == 2
