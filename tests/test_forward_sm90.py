"""The Gluon sm_90 forward kernel: refusals and sm_90 code on the CPU, accuracy on a Hopper GPU.

The kernel cannot run in Triton's interpreter (Gluon's TMA, mbarriers and wgmma have no
interpreter path), so the CPU tests check what ``supports`` refuses and, by compiling for
sm_90a without a GPU, that the code has the roles and the overlap the source claims.
The GPU tests repeat tests/test_forward.py's grid on the covered head dims and masks.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_inputs import make_qkv as shared_make_qkv
from attnlab.accuracy import check_accuracy
from attnlab.kernels.forward_sm90 import (
    DEFAULT_CONFIGS,
    SCHEDULES,
    Sm90Config,
    flash_forward_sm90,
    refusal,
    supports,
)
from sm90_marks import built_here, sm90

SEQLEN_PAIRS = [(1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (108, 256), (1023, 1024)]
SEQLEN_PAIRS += [(b, a) for a, b in SEQLEN_PAIRS if a != b]
HEAD_DIMS = [64, 128, 256]
HEADS = [(2, 2), (6, 2), (3, 1)]  # MHA, GQA 3:1, MQA

ALLOWED = dict(capability=(9, 0), dtype=torch.bfloat16, head_dim=128, window=(-1, -1),
               softcap=0.0, aligned=True)


# ----- refusals (CPU) ---------------------------------------------------------------------

def test_the_covered_call_is_accepted():
    assert refusal(**ALLOWED) is None


@pytest.mark.parametrize(("change", "words"), [
    ({"capability": None}, "sm_90"),
    ({"capability": (8, 0)}, "sm_80"),
    ({"capability": (10, 0)}, "sm_100"),
    ({"dtype": torch.float32}, "dtype"),
    ({"head_dim": 96}, "head_dim"),
    ({"head_dim": 32}, "head_dim"),
    ({"window": (19, 7)}, "window"),
    ({"softcap": 30.0}, "softcap"),
    ({"aligned": False}, "16-byte"),
    ({"head_dim": 256, "config": Sm90Config(block_n=128, stages=2)}, "shared memory"),
])
def test_refusals_name_their_reason(change, words):
    reason = refusal(**{**ALLOWED, **change})
    assert reason is not None and words in reason


def test_supports_refuses_cpu_tensors_without_raising():
    q = torch.randn(1, 16, 2, 128, dtype=torch.bfloat16)
    ok, reason = supports(q, q, q, causal=True, window=(-1, -1), softcap=0.0)
    assert not ok and "sm_90" in reason
    ok, reason = supports(q, q, q, causal=False, window=(4, 4), softcap=0.0)
    assert not ok and reason


def test_launcher_refuses_with_a_value_error():
    q = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot run this call"):
        flash_forward_sm90(q, q, q, layout="bshd", scale=0.125, causal=False)
    with pytest.raises(ValueError, match="layout"):
        flash_forward_sm90(q, q, q, layout="sbhd", scale=0.125, causal=False)


@pytest.mark.parametrize("fields", [dict(block_n=176, stages=2), dict(block_n=128, stages=4),
                                    dict(block_n=128, stages=2, producer_regs=20),
                                    dict(block_n=128, stages=2, schedule="lockstep")])
def test_configs_outside_the_compiled_space_are_rejected(fields):
    with pytest.raises(ValueError):
        Sm90Config(**fields)


@pytest.mark.parametrize("config", [Sm90Config(128, 2), Sm90Config(64, 3, 32, "pingpong", True),
                                    Sm90Config(128, 2, rescale="early", store="vector"),
                                    Sm90Config(64, 2, persistent=True, store="vector")])
def test_config_names_round_trip(config):
    # The sweep's records and the winners file name configs; the table script reads them.
    assert Sm90Config.from_name(config.name()) == config


def test_launch_key_separates_what_triton_specialises_on():
    # The launcher reuses a compiled kernel only under the key Triton itself would
    # specialise on: a stride past 2^31 (64-bit), a unit stride, an odd one, another
    # config, dtype or mask each get their own compile.
    from attnlab.kernels.forward_sm90 import launch_key

    q = torch.empty(2, 256, 4, 128, dtype=torch.bfloat16, device="meta")
    config = Sm90Config(128, 2)
    base = launch_key(config, True, q, (131072, 128, 512), 4096)
    assert base == launch_key(config, True, q, (262144, 32768, 128), 8192)  # bshd vs bhsd
    for other in (launch_key(config, True, q, (2**31, 128, 512), 4096),
                  launch_key(config, True, q, (131072, 1, 512), 4096),
                  launch_key(config, True, q, (131072, 136, 520), 4096),
                  launch_key(config, True, q, (131072, 128, 512), 2**31),
                  launch_key(config, False, q, (131072, 128, 512), 4096),
                  launch_key(Sm90Config(128, 2, store="vector"), True, q, (131072, 128, 512),
                             4096),
                  launch_key(config, True, q.half(), (131072, 128, 512), 4096)):
        assert other != base


@pytest.mark.parametrize("name", ["sm90[n128,s2,r24,split,fast]", "sm90[n128,s2]", "n128"])
def test_unknown_config_names_are_refused(name):
    with pytest.raises(ValueError, match="sm90 config name"):
        Sm90Config.from_name(name)


# ----- sm_90 code without a GPU (CPU, ~5 s) -----------------------------------------------

@built_here
def test_compiles_for_sm90_with_roles_and_overlap(json_from_fresh_python):
    evidence = json_from_fresh_python(
        "import json; from attnlab.kernels.forward_sm90 import *; "
        "c = DEFAULT_CONFIGS[128]; k = compile_for_sm90(128, c, causal=True); "
        "print(json.dumps({**overlap_evidence(k.asm), 'shared': k.metadata.shared, "
        "'estimate': shared_memory_bytes(128, c)}))")
    # The refusal's shared-memory estimate is an upper bound, and a tight one.
    assert 0 <= evidence["estimate"] - evidence["shared"] <= 1024
    # The producer gives registers back, the consumers take them (setmaxnreg per role).
    assert ["dec", "24"] in evidence["setmaxnreg"] and ["inc", "240"] in evidence["setmaxnreg"]
    # S_j is waited for while P_{j-1} V_{j-1} stays in flight, in both loop stages of
    # both consumer warpgroups (one partition each) ...
    assert evidence["wait_group_1"] == 4
    # No barrier spans both consumer warpgroups (they would run in lockstep).
    assert evidence["barrier_threads"] == [128]
    if "ex2_between_waits" not in evidence:
        pytest.skip("no cuobjdump to read the SASS")
    # ... and ptxas left the exponentials between the two waits (the overlap itself).
    assert len(evidence["ex2_between_waits"]) == 4
    assert min(evidence["ex2_between_waits"]) >= DEFAULT_CONFIGS[128].block_n // 2
    assert evidence["local_memory_ops"] == 0, "register spills"


# ----- accuracy on the GPU ----------------------------------------------------------------

# The shared maker on the GPU (these tests run only there).
make_qkv = functools.partial(shared_make_qkv, device="cuda")


def run_and_check(q, k, v, *, layout, causal, config=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = flash_forward_sm90(q, k, v, layout=layout, scale=scale, causal=causal,
                                  config=config)
    result = check_accuracy(out, lse, q, k, v, causal=causal, scale=scale, layout=layout)
    assert result.passed, result
    return out, lse


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_accuracy_grid(dtype, head_dim, causal, schedule):
    base = DEFAULT_CONFIGS[head_dim]
    config = Sm90Config(base.block_n, base.stages, base.producer_regs, schedule)
    for i, ((seqlen_q, seqlen_k), heads) in enumerate(itertools.product(SEQLEN_PAIRS, HEADS)):
        layout = ("bshd", "bhsd")[i % 2]
        q, k, v = make_qkv(2, *heads, seqlen_q, seqlen_k, head_dim, dtype, layout=layout, seed=i)
        run_and_check(q, k, v, layout=layout, causal=causal, config=config)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize(("block_n", "stages"), [(64, 2), (64, 3), (128, 2), (128, 3)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_every_config_that_fits(head_dim, block_n, stages, schedule):
    config = Sm90Config(block_n=block_n, stages=stages, schedule=schedule)
    q, k, v = make_qkv(2, 6, 2, 1000, 1337, head_dim, torch.bfloat16, layout="bshd", seed=head_dim)
    if not supports(q, k, v, causal=True, config=config)[0]:
        pytest.skip(supports(q, k, v, causal=True, config=config)[1])
    for causal in (False, True):
        run_and_check(q, k, v, layout="bshd", causal=causal, config=config)


def _dispatched_configs():
    from attnlab.kernels.dispatch import FORWARD_SM90

    return sorted({(d, causal, config) for (d, causal, _), config in FORWARD_SM90.table().items()},
                  key=str)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize(("head_dim", "causal", "config"), _dispatched_configs(), ids=str)
def test_gpu_every_dispatched_config(head_dim, causal, config):
    # What the committed table sends to this kernel, on ragged GQA with 768 query blocks
    # (a persistent config walks ~6 per program, odd snake rounds included).
    q, k, v = make_qkv(16, 6, 2, 1000, 1337, head_dim, torch.bfloat16, layout="bshd",
                       seed=head_dim + causal)
    run_and_check(q, k, v, layout="bshd", causal=causal, config=config)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_persistent_programs_walk_many_blocks(schedule, causal):
    # 16 x 6 heads x 8 query blocks = 768 blocks for 132 SMs: ~6 blocks per program, so
    # the K/V ring, the Q hand-over and the turns continue across blocks; ragged ends.
    config = Sm90Config(128, 2, schedule=schedule, persistent=True)
    q, k, v = make_qkv(16, 6, 2, 1000, 1337, 128, torch.bfloat16, layout="bshd", seed=11)
    out, lse = run_and_check(q, k, v, layout="bshd", causal=causal, config=config)
    # Each block's arithmetic is the same whichever program runs it.
    one_per_block, lse_one = flash_forward_sm90(
        q, k, v, layout="bshd", scale=1.0 / math.sqrt(128), causal=causal,
        config=dataclasses.replace(config, persistent=False))
    assert torch.equal(out, one_per_block) and torch.equal(lse, lse_one)


@pytest.mark.gpu
@sm90
def test_gpu_causal_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = make_qkv(1, 2, 2, 300, 40, 128, torch.bfloat16, layout="bhsd", seed=3)
    out, lse = run_and_check(q, k, v, layout="bhsd", causal=True)
    hidden = 300 - 40  # bottom-right: query i sees key j iff j <= i - 260
    assert torch.all(out[:, :, :hidden] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :hidden]))


@pytest.mark.gpu
@sm90
def test_gpu_is_bit_identical_across_runs_and_ignores_other_sequences():
    q, k, v = make_qkv(3, 4, 4, 777, 777, 64, torch.float16, layout="bshd", seed=5)
    first, _ = run_and_check(q, k, v, layout="bshd", causal=True)
    again, _ = flash_forward_sm90(q, k, v, layout="bshd", scale=0.125, causal=True)
    assert torch.equal(first, again)
    # TMA bounds are per sequence: batch 0 alone gives the same bits as inside the batch.
    alone, _ = flash_forward_sm90(q[:1].contiguous(), k[:1].contiguous(), v[:1].contiguous(),
                                  layout="bshd", scale=0.125, causal=True)
    assert torch.equal(first[:1], alone)


def test_dispatch_table_holds_only_measured_winners():
    """The committed table (bench/sm90_dispatch_table.py's output) parses into valid
    configs, each entry with a config a bucket where the Gluon kernel measured faster
    than Triton, and the dispatcher reads the entries this Triton selects."""
    import json
    from importlib.resources import files

    import triton

    from attnlab.kernels._sm90 import entry_bucket, select_entries
    from attnlab.kernels.dispatch import FORWARD_SM90

    table = json.loads(files("attnlab.kernels").joinpath("sm90_dispatch.json").read_text())
    winners = [e for e in table["entries"] if e["config"] is not None]
    assert winners and all(e["sm90_vs_triton"] > 1.0 for e in winners)
    selected, _ = select_entries(table, triton.__version__)
    assert set(FORWARD_SM90.table()) == {entry_bucket(e) for e in selected}


def test_dispatch_takes_each_buckets_entry_from_this_triton_or_says_whose_stand_in():
    import json
    from importlib.resources import files

    from attnlab.kernels._sm90 import select_entries

    def entry(bucket, release=None, config="sm90"):
        return {"head_dim": 256, "causal": True, "bucket": bucket, "config": config,
                **({"triton": release} if release else {})}

    own_first = entry(4096, "3.9.0", config=None)  # measured on 3.9: the Triton kernel won
    table = {"source": {"triton": "3.6.0"}, "entries": [
        own_first, entry(1024), entry(4096, "3.6.0"), entry(16384, "3.6.0"),
        entry(16384, "3.9.0", config="other")]}
    assert select_entries(table, "3.6.0") == (table["entries"][1:4], None)
    entries, note = select_entries(table, "3.9.0")
    assert entries == [table["entries"][1], table["entries"][4]]
    assert "1 bucket(s)" in note and "3.9.0" in note and "3.6.0" in note
    entries, note = select_entries(table, "3.8.0")  # nothing measured on 3.8.0
    assert entries == table["entries"][1:4] and "3 bucket(s)" in note
    for name in ("sm90_dispatch.json", "sm90_backward_dispatch.json"):  # each names its Triton
        committed = json.loads(files("attnlab.kernels").joinpath(name).read_text())
        assert all(e["triton"] for e in committed["entries"])


def test_a_run_on_one_triton_updates_only_its_own_entries_of_the_buckets_it_measured():
    from attnlab.kernels._sm90 import merged_table, select_entries

    def entry(bucket, release, config):
        return {"head_dim": 256, "causal": True, "bucket": bucket, "config": config,
                "triton": release}

    current = {"source": {"triton": "3.6.0", "git_commit": "old"}, "min_gain": 1.02,
               "entries": [entry(1024, "3.6.0", {"n": 1}), entry(4096, "3.6.0", {"n": 2}),
                           entry(4096, "3.9.0", {"n": 3}), entry(16384, "3.9.0", {"n": 4})]}
    env = {"triton": "3.9.0", "git_commit": "new", "timestamp": "now", "gpu": "H100"}
    # The 3.9 run timed 4k (the Gluon kernel won with config 5) and 1k (it lost).
    table = merged_table(current, [{**entry(4096, None, {"n": 5}), "sm90_vs_triton": 1.1}],
                         {(256, True, 4096), (256, True, 1024)}, env)
    assert table["source"] == current["source"] and table["min_gain"] == 1.02
    by_key = {(e["bucket"], e["triton"]): e for e in table["entries"]}
    assert set(by_key) == {(1024, "3.6.0"), (1024, "3.9.0"), (4096, "3.6.0"), (4096, "3.9.0"),
                           (16384, "3.9.0")}
    assert by_key[1024, "3.9.0"]["config"] is None
    assert by_key[4096, "3.9.0"]["config"] == {"n": 5}
    assert by_key[4096, "3.9.0"]["measured"] == {"gpu": "H100", "git_commit": "new",
                                                 "timestamp": "now"}
    assert by_key[4096, "3.6.0"] == current["entries"][1]  # another release's: untouched
    assert by_key[16384, "3.9.0"] == current["entries"][3]  # a bucket not measured: kept
    assert [e["config"] for e in select_entries(table, "3.9.0")[0]] == [{"n": 5}, {"n": 4}]
    assert [e["config"] for e in select_entries(table, "3.6.0")[0]] == [{"n": 1}, {"n": 2}]
    fresh = merged_table(None, [], {(256, True, 1024)}, env)  # no table yet: this run's source
    assert fresh["source"]["triton"] == "3.9.0" and fresh["entries"][0]["config"] is None


def test_cpu_tensors_never_dispatch_to_gluon():
    from attnlab.kernels.dispatch import dkdv_config, forward_config

    q = torch.zeros(1, 4096, 24, 256, dtype=torch.bfloat16)
    k = torch.zeros(1, 4096, 4, 256, dtype=torch.bfloat16)
    assert forward_config(q, k, k, layout="bshd", causal=True, window=(-1, -1),
                          softcap=0.0) is None
    assert dkdv_config(q, k, k, q, layout="bshd", causal=True, window=(-1, -1),
                       softcap=0.0) is None


def test_dispatch_table_script_leaves_publicly_slower_buckets_to_triton(tmp_path):
    """bench/sm90_dispatch_table.py keeps the kernel-time winners, except a bucket whose
    public-path record (Gluon kernel in force) is slower than the baseline's at that shape."""
    script = Path(__file__).parents[1] / "bench" / "sm90_dispatch_table.py"
    winner = {"winner": "sm90", "sm90_config": "sm90[n128,s2,r24,split,persistent]",
              "head_dim": 128, "heads": [16, 16], "sm90_vs_triton": 1.2}
    winners = {"env": {"gpu": "test", "triton": "3.6.0"}, "winners": [
        {**winner, "causal": True, "bucket": 1024}, {**winner, "causal": True, "bucket": 4096},
        {**winner, "causal": False, "bucket": 4096, "winner": "triton"}]}
    (tmp_path / "winners.json").write_text(json.dumps(winners))

    def record(seqlen, tflops, kernel):
        shape = {"batch": 16384 // seqlen, "query_heads": 16, "kv_heads": 16, "head_dim": 128,
                 "seqlen_q": seqlen, "seqlen_k": seqlen, "causal": True, "dtype": "bf16"}
        return json.dumps({"provider": "attnlab", "phase": "prefill", "shape": shape,
                           "tflops": tflops, "kernel_names": [kernel]})

    (tmp_path / "public.jsonl").write_text(
        record(1024, 170.0, "_attn_fwd_sm90") + "\n" + record(4096, 485.0, "_attn_fwd_sm90"))
    (tmp_path / "baseline.jsonl").write_text(
        record(1024, 297.0, "_attn_fwd") + "\n" + record(4096, 425.0, "_attn_fwd"))
    out = tmp_path / "table.json"
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "winners.json"),
                           "--public", str(tmp_path / "public.jsonl"),
                           "--baseline", str(tmp_path / "baseline.jsonl"), "--out", str(out)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    table = json.loads(out.read_text())
    # Every measured bucket has an entry; those the Gluon kernel did not win hold no config.
    assert [(e["causal"], e["bucket"], e["config"] is None) for e in table["entries"]] == [
        (False, 4096, True), (True, 1024, True), (True, 4096, False)]
    assert table["entries"][2]["config"] == {"block_n": 128, "stages": 2, "producer_regs": 24,
                                             "schedule": "split", "persistent": True,
                                             "rescale": "late", "store": "direct"}
    assert [(e["bucket"], e["public_tflops"], e["baseline_public_tflops"])
            for e in table["dropped"]] == [(1024, 170.0, 297.0)]


def test_dispatch_table_script_updates_its_own_tritons_entries_and_keeps_the_rest(tmp_path):
    """A sweep on Triton 3.9 of some buckets adds 3.9's entries for those (a measured
    Triton win as a null config) and keeps 3.6's entries and the table's source."""
    script = Path(__file__).parents[1] / "bench" / "sm90_dispatch_table.py"
    config = {"block_n": 64, "stages": 2, "producer_regs": 24, "schedule": "split",
              "persistent": True, "rescale": "late", "store": "direct"}
    current = {"source": {"git_commit": "old1234", "timestamp": "2026-12-01", "triton": "3.6.0"},
               "entries": [{"head_dim": 256, "causal": True, "bucket": b, "config": config,
                            "sm90_vs_triton": 1.3, "measured_heads": [24, 4], "triton": "3.6.0"}
                           for b in (1024, 4096, 16384)]}
    out = tmp_path / "table.json"
    out.write_text(json.dumps(current))
    winner = {"winner": "sm90", "sm90_config": "sm90[n64,s2,r24,split,persistent]",
              "head_dim": 256, "causal": True, "heads": [24, 4], "sm90_vs_triton": 1.25}
    winners = {"env": {"gpu": "test", "git_commit": "new5678", "triton": "3.9.0"}, "winners": [
        {**winner, "bucket": 2048}, {**winner, "bucket": 4096, "winner": "triton"}]}
    (tmp_path / "winners.json").write_text(json.dumps(winners))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "winners.json"),
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    table = json.loads(out.read_text())
    assert table["source"] == current["source"]
    assert [(e["bucket"], e["triton"], e["config"] is None) for e in table["entries"]] == [
        (1024, "3.6.0", False), (2048, "3.9.0", False), (4096, "3.6.0", False),
        (4096, "3.9.0", True), (16384, "3.6.0", False)]
    by_key = {(e["bucket"], e["triton"]): e for e in table["entries"]}
    assert by_key[2048, "3.9.0"]["sm90_vs_triton"] == 1.25
    assert by_key[2048, "3.9.0"]["measured"]["git_commit"] == "new5678"
    assert by_key[1024, "3.6.0"] == current["entries"][0]
