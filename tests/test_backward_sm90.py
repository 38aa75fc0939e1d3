"""The Gluon sm_90 dK/dV kernel: refusals and sm_90 code on the CPU, gradients on a Hopper GPU.

As for the Gluon forward (tests/test_forward_sm90.py), the kernel has no interpreter
path: the CPU tests check what ``supports`` and ``flash_backward`` refuse and, by
compiling for sm_90a without a GPU, the roles, the registers and the shared memory the
source claims.  The GPU tests compare dQ, dK, dV with float64 by the gradient rule.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
import weakref

import pytest
import torch

from attention_inputs import make_qkv as shared_make_qkv
from attnlab.accuracy import check_gradients
from attnlab.kernels import backward_sm90, dq_sm90
from attnlab.kernels._primitives import kernel_is_interpreted
from attnlab.kernels._sm90 import SHARED_MEMORY_LIMIT
from attnlab.kernels.backward_sm90 import (
    DEFAULT_CONFIGS,
    Sm90BackwardConfig,
    refusal,
)
from sm90_marks import built_here, sm90

# Both Gluon backward kernels refuse through _sm90.backward_refusal / backward_supports.
GLUON_BACKWARD_KERNELS = [backward_sm90, dq_sm90]
ALLOWED = dict(capability=(9, 0), dtype=torch.bfloat16, head_dim=128, window=(-1, -1),
               softcap=0.0, layout="bshd", aligned=True)


# ----- refusals (CPU) ---------------------------------------------------------------------

def test_the_covered_call_is_accepted():
    assert refusal(**ALLOWED) is None


@pytest.mark.parametrize(("change", "words"), [
    ({"capability": None}, "sm_90"),
    ({"capability": (8, 0)}, "sm_80"),
    ({"dtype": torch.float32}, "dtype"),
    ({"head_dim": 32}, "head_dim"),
    ({"head_dim": 96}, "head_dim"),
    ({"window": (19, 7)}, "window"),
    ({"softcap": 30.0}, "softcap"),
    ({"layout": "thd"}, "varlen"),
    ({"aligned": False}, "16-byte"),
])
@pytest.mark.parametrize("kernel", GLUON_BACKWARD_KERNELS)
def test_refusals_name_their_reason(kernel, change, words):
    reason = kernel.refusal(**{**ALLOWED, **change})
    assert reason is not None and words in reason


@pytest.mark.parametrize("kernel", GLUON_BACKWARD_KERNELS)
def test_supports_refuses_cpu_tensors_without_raising(kernel):
    q = torch.randn(1, 16, 2, 128, dtype=torch.bfloat16)
    ok, reason = kernel.supports(q, q, q, q, layout="bshd")
    assert not ok and "sm_90" in reason


def test_asking_for_it_where_it_cannot_run_is_a_value_error():
    # Forcing the kernel never falls back to another one silently.
    from attnlab.kernels.backward import flash_backward

    q = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="dkdv_sm90"):
        flash_backward(q, q, q, q, q, lse, layout="bshd", scale=0.125,
                       dkdv_sm90=DEFAULT_CONFIGS[64])


@pytest.mark.parametrize("fields", [dict(block_m=48, stages=2), dict(block_m=64, stages=5),
                                    dict(block_m=64, stages=2, producer_regs=20)])
def test_configs_outside_the_compiled_space_are_rejected(fields):
    with pytest.raises(ValueError):
        Sm90BackwardConfig(**fields)


@pytest.mark.parametrize("config", [Sm90BackwardConfig(32, 3), Sm90BackwardConfig(128, 2, 32),
                                    Sm90BackwardConfig(32, 2, 24, 64, 2)])
def test_config_names_round_trip(config):
    assert Sm90BackwardConfig.from_name(config.name()) == config
    with pytest.raises(ValueError, match="config name"):
        Sm90BackwardConfig.from_name("sm90[n128,s2,r24,split]")


def test_the_dispatch_table_names_only_valid_configs():
    from attnlab.kernels import backward_sm90
    from attnlab.kernels.dispatch import DKDV_SM90

    for (head_dim, causal, bucket), config in DKDV_SM90.table().items():
        assert head_dim in backward_sm90.SUPPORTED_HEAD_DIMS and isinstance(causal, bool)
        assert bucket in (1024, 2048, 4096, 8192, 16384)
        assert backward_sm90.shared_memory_bytes(head_dim, config) <= SHARED_MEMORY_LIMIT


# ----- what the Triton backward hands the Gluon kernel (CPU under TRITON_INTERPRET=1) -----

@built_here
@pytest.mark.skipif(not torch.cuda.is_available() and not kernel_is_interpreted(),
                    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_the_dq_kernel_writes_lse_and_d_for_the_gluon_kernel(monkeypatch, layout):
    # The Gluon kernel has no interpreter path: its launch is replaced by one that keeps
    # the descriptors it was given, so what the dQ kernel (launched first) wrote into them
    # is checked on the CPU, and dQ is the all-Triton backward's.
    from attnlab.kernels import _sm90 as sm90_host
    from attnlab.kernels import backward, backward_sm90
    from attnlab.kernels.forward import flash_forward

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = Sm90BackwardConfig(block_m=128, stages=2)
    # Bottom-right causal with seqlen_q > seqlen_k: the first 50 rows see no key.
    seqlen_q, seqlen_k, scale = 70, 20, 0.125
    q, k, v = shared_make_qkv(2, 6, 2, seqlen_q, seqlen_k, 64, torch.float16, layout=layout,
                              seed=5, device=device)
    dout = torch.randn_like(q)
    out, lse = flash_forward(q, k, v, layout=layout, scale=scale, causal=True)
    options = dict(layout=layout, scale=scale, causal=True)
    dq_triton, _, _ = backward.flash_backward(dout, q, k, v, out, lse, **options)

    launched = []

    def keep_descriptors(cache, key, kernel, grid, args, meta, **launch_options):
        launched.append(args)
        for grad in args[6:8]:  # dK, dV
            grad.zero_()

    monkeypatch.setattr(backward, "_PLANS", backward.PlanCache())
    # A kernel compiled before (this call's first backward, or another test's) would be
    # launched directly, past the replaced launch_cached.
    monkeypatch.setattr(backward_sm90, "_COMPILED", {})
    monkeypatch.setattr(backward.dispatch, "dkdv_config", lambda *a, **kw: (config, False, a[3]))
    monkeypatch.setattr(sm90_host, "launch_cached", keep_descriptors)
    dq, _, _ = backward.flash_backward(dout, q, k, v, out, lse, **options)
    assert torch.equal(dq, dq_triton)

    lse_desc, delta_desc = launched[0][4:6]
    padded = backward_sm90.padded_seqlen(seqlen_q)
    assert padded == 72
    for desc in (lse_desc, delta_desc):
        # TMA reads the first seqlen_q entries of each padded row and zero-fills the rest.
        assert desc.base.shape == (2, 6, padded) and desc.shape == [2, 6, seqlen_q]
        assert desc.strides == [6 * padded, padded, 1] and desc.block_shape == [1, 1, 128]
    lse_log2, delta = lse_desc.base, delta_desc.base
    seq_dim = 1 if layout == "bshd" else 2
    rowsum = (out.float() * dout.float()).sum(-1).movedim(seq_dim, -1)
    torch.testing.assert_close(delta[..., :seqlen_q], rowsum)
    expected = torch.where(lse == float("-inf"), float("inf"), lse * math.log2(math.e))
    torch.testing.assert_close(lse_log2[..., :seqlen_q], expected)
    assert torch.all(lse_log2[..., :50] == float("inf"))  # no key: P = exp2(s - inf) = 0


def planned_launches(monkeypatch, batch: int, heads: tuple[int, int], **plan_options):
    """What a d = 256 causal plan launches (grid, arguments, meta-parameters per launch),
    recorded instead of run, and the dK, dV it was handed."""
    from attnlab.kernels import _sm90 as sm90_host
    from attnlab.kernels import backward_sm90

    q, k, v = shared_make_qkv(batch, *heads, 100, 300, 256, torch.bfloat16, layout="bshd",
                              seed=2)
    dout = torch.randn_like(q)
    launched = []
    monkeypatch.setattr(sm90_host, "launch_cached",
                        lambda cache, key, kernel, grid, args, meta, **kw:
                        launched.append((grid, args, meta)))
    planned = backward_sm90.plan_launch(q, k, v, dout, layout="bshd", scale=0.0625,
                                        causal=True, config=DEFAULT_CONFIGS[256], **plan_options)
    rows = torch.zeros(batch, heads[0], backward_sm90.padded_seqlen(100))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    planned((k, v, q, dout, rows, rows.clone()), (dk, dv))
    return launched, dk, dv


@built_here
def test_d256_launches_dv_then_dk_with_each_launch_s_own_tiles(monkeypatch):
    # Host side of the one-gradient head dim: two launches over the same arguments, the
    # dV launch first with its 64-row Q/dO/LSE boxes, then the dK launch with 32-row ones.
    launched, dk, dv = planned_launches(monkeypatch, 1, (6, 2))
    assert [(m["FORM_DK"], m["FORM_DV"], m["BLOCK_M"]) for _, _, m in launched] \
        == [(False, True, 64), (True, False, 32)]
    for (grid, args, _), block_m in zip(launched, (64, 32), strict=True):
        assert grid == (3 * 1 * 2,)  # 128-key blocks x batch x KV heads
        k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc = args[:6]
        assert k_desc.block_shape == v_desc.block_shape == [1, 1, 64, 256]
        assert q_desc.block_shape == do_desc.block_shape == [1, 1, block_m, 256]
        assert lse_desc.block_shape == delta_desc.block_shape == [1, 1, block_m]
        assert args[6] is dk and args[7] is dv


@built_here
def test_a_split_schedule_doubles_the_programs_and_gives_them_a_workspace(monkeypatch):
    from attnlab.kernels import backward_sm90
    from attnlab.kernels.dispatch import BackwardSchedule

    launched, dk, _ = planned_launches(monkeypatch, 2, (8, 2),
                                       schedule=BackwardSchedule(True, 2))
    units = 3 * 2 * 2  # 128-key blocks x batch x KV heads
    (grid_dv, args_dv, meta_dv), (grid_dk, args_dk, meta_dk) = launched
    assert grid_dv == grid_dk == (2 * units,)
    assert meta_dv["HEAD_SPLIT"] == meta_dk["HEAD_SPLIT"] == 2
    partials, arrivals = args_dv[8:10]
    # Both launches share them: a 64 x 256 fp32 partial per (unit, warpgroup, program).
    assert args_dk[8] is partials and args_dk[9] is arrivals
    assert partials.dtype == torch.float32 and partials.numel() == units * 2 * 2 * 64 * 256
    # A counter per 8 of a warpgroup's 64 rows (per warp and half of its 16).
    assert arrivals.dtype == torch.int32 and arrivals.shape == (units * 2 * 8,)
    assert not arrivals.any()
    block_major = backward_sm90._attn_bwd_dkdv_sm90.arg_names.index("block_major")
    assert args_dv[block_major] == 1
    # Unsplit, the kernel reads neither: any pointer stands in.
    launched, dk, _ = planned_launches(monkeypatch, 2, (8, 2))
    assert all(args[8] is dk and args[9] is dk and args[block_major] == 0
               for _, args, _ in launched)
    with pytest.raises(ValueError, match="head_split must be 1 or 2 and divide the GQA group"):
        planned_launches(monkeypatch, 2, (6, 2), schedule=BackwardSchedule(False, 2))


def test_the_schedule_splits_and_reorders_only_where_the_launch_is_shorter():
    from attnlab.kernels.dispatch import (
        BackwardSchedule,
        dkdv_schedule,
        dq_block_major,
        greedy_makespan,
    )

    # The block scheduler, greedily: 3 slots, works in launch order.
    assert greedy_makespan([4, 1, 1, 1, 1], 3) == 4
    assert greedy_makespan([1, 1, 1, 1, 4], 3) == 5
    assert greedy_makespan([], 3) == 0
    seed = dict(batch=1, kv_heads=4, group_size=6, causal=True, block_m=32, block_n=128,
                sm_count=132)
    # The seed's layer at 4k: 128 programs of 1-32 tiles x 6 heads on 132 SMs.
    assert dkdv_schedule(seqlen_q=4096, seqlen_k=4096, **seed) == BackwardSchedule(True, 2)
    # At 8k block-major order suffices; from 16k the head-major default is within 5%.
    assert dkdv_schedule(seqlen_q=8192, seqlen_k=8192, **seed) == BackwardSchedule(True, 1)
    assert dkdv_schedule(seqlen_q=16384, seqlen_k=16384, **seed) == BackwardSchedule()
    # Not causal: every program equal.  An odd group cannot be halved.
    assert dkdv_schedule(seqlen_q=4096, seqlen_k=4096, **{**seed, "causal": False}) \
        == BackwardSchedule()
    assert dkdv_schedule(seqlen_q=4096, seqlen_k=4096, **{**seed, "group_size": 3}) \
        .head_split == 1
    # Many programs (d = 128, 16 heads, B = 4): the default.
    assert dkdv_schedule(batch=4, kv_heads=16, group_size=1, seqlen_q=4096, seqlen_k=4096,
                         causal=True, block_m=64, block_n=128, sm_count=132) \
        == BackwardSchedule()
    dq = dict(batch=1, heads=24, causal=True, block_m=128, block_n=32, sm_count=132)
    assert dq_block_major(seqlen_q=4096, seqlen_k=4096, **dq)
    assert not dq_block_major(seqlen_q=4096, seqlen_k=4096, **{**dq, "causal": False})
    assert not dq_block_major(seqlen_q=16384, seqlen_k=16384, **dq)


@built_here
def test_a_planned_descriptor_is_the_checked_one_over_the_new_tensor():
    from attnlab.kernels._sm90 import PlannedDescriptor, descriptor, descriptor_parts

    first, second = (torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    planned = PlannedDescriptor(first, descriptor_parts(first, "bshd", 32))
    rebased = planned(second)
    assert rebased == descriptor(second, "bshd", 32) and rebased.base is second
    assert planned(first).base is first  # re-basing leaves the plan's fields alone
    # The plan keeps no reference to the tensor it was checked on (plans are cached).
    alive = weakref.ref(first)
    del first, rebased
    gc.collect()
    assert alive() is None


# ----- sm_90 code without a GPU (CPU, ~10 s) ----------------------------------------------

def assert_spills_within(compiled: list, bounds_36: list[int], bounds_39: list[int]) -> None:
    """Each compiled kernel's LDL/STL count at most its bound: ``bounds_39`` where Gluon
    names ``reinterpret`` publicly (Triton 3.9, whose ptxas is CUDA 13.4's), else
    ``bounds_36``.  Nothing to check without cuobjdump (counts of None)."""
    from attnlab.kernels._compat import gluon_api

    spills = [e.get("local_memory_ops") for e in compiled]
    if None in spills:
        return
    newer_gluon = getattr(gluon_api(), "reinterpret", None) == "reinterpret"
    bounds = bounds_39 if newer_gluon else bounds_36
    assert all(n <= b for n, b in zip(spills, bounds, strict=True)), spills


@built_here
def test_compiles_for_sm90_with_roles_and_no_spills(json_from_fresh_python):
    # The defaults, and the tiles that spilled while LSE and D sat in registers (41-711
    # local-memory instructions) before they came through shared memory.
    compiled = json_from_fresh_python(
        "import json; from attnlab.kernels.backward_sm90 import *; out = []\n"
        "for d, c, causal in ((128, DEFAULT_CONFIGS[128], True), (64, DEFAULT_CONFIGS[64], False),\n"
        "                     (128, Sm90BackwardConfig(64, 3), True),\n"
        "                     (64, Sm90BackwardConfig(128, 2), True)):\n"
        "    k = compile_for_sm90(d, c, causal=causal)\n"
        "    out.append({**sass_evidence(k.asm), 'shared': k.metadata.shared,\n"
        "                'estimate': shared_memory_bytes(d, c)})\n"
        "print(json.dumps(out))")
    for evidence in compiled:
        # The refusal's shared-memory estimate is an upper bound, and a tight one.
        assert 0 <= evidence["estimate"] - evidence["shared"] <= 1024
        assert ["dec", "24"] in evidence["setmaxnreg"]
        assert ["inc", "240"] in evidence["setmaxnreg"]
        # S^T is waited for while dP^T is in flight, and dP^T while dV is.
        assert evidence["wait_group_1"] >= 4
        # No barrier spans both consumer warpgroups.
        assert evidence["barrier_threads"] == [128]
    # None where Gluon still names it `_reinterpret` (Triton 3.6-3.8).  The Gluon that made
    # it public (3.9) compiles the d = 128 causal tiles to 24 and 22 LDL/STL
    # (docs/versions.md, a finding awaiting the H200's measurement): no more than that.
    assert_spills_within(compiled, [0, 0, 0, 0], [24, 0, 22, 0])


@built_here
def test_d256_forms_one_gradient_per_launch_in_the_registers(json_from_fresh_python):
    # dK and dV of 64 keys x 256 would be 256 fp32 registers a thread: the dV launch and
    # the dK launch each hold one accumulator.  The dK launch (K, V and the dO ring) is
    # the larger; the refusal's estimate bounds it, the dV launch has V's 64 KiB less.
    compiled = json_from_fresh_python(
        "import json; from attnlab.kernels.backward_sm90 import *; out = []\n"
        "for c in (Sm90BackwardConfig(32, 2), Sm90BackwardConfig(32, 3)):\n"
        "    for form in ('dv', 'dk'):\n"
        "        k = compile_for_sm90(256, c, causal=True, form=form)\n"
        "        out.append({**sass_evidence(k.asm), 'shared': k.metadata.shared,\n"
        "                    'estimate': shared_memory_bytes(256, c), 'form': form})\n"
        "print(json.dumps(out))")
    for evidence in compiled:
        assert ["inc", "240"] in evidence["setmaxnreg"]
        assert evidence["barrier_threads"] == [128]
        assert evidence["shared"] <= evidence["estimate"] <= SHARED_MEMORY_LIMIT
        # The dK launch waits for S^T while dP^T is in flight; the dV launch has no dP.
        assert (evidence["wait_group_1"] > 0) == (evidence["form"] == "dk")
    dv, dk = compiled[:2]
    assert dk["estimate"] - dk["shared"] <= 1024
    assert dk["shared"] - dv["shared"] >= 2 * 64 * 256 * 2
    # Triton 3.6-3.8: none at 2 stages (the shipped tiles).  The 3-stage dK launch keeps
    # a few scalars in local memory: 3.6.0 two in its producer warp (24 registers)
    # between its loops (4), 3.8.0 12, some inside the loops.  3.9's ptxas (CUDA 13.4):
    # the dK launch 10 / 15 (2 / 3 stages; 22 before its tiles came in one (tile, head)
    # loop), the 3-stage dV launch one 4-byte slot stored once and reloaded outside the
    # loops (11).
    assert_spills_within(compiled, [0, 0, 0, 12], [0, 10, 11, 15])


@built_here
def test_the_split_schedule_merges_its_two_partials_in_the_kernel(json_from_fresh_python):
    # head_split = 2: each consumer warpgroup stores its fp32 partial; then per warp and
    # 8-row half, lane 0's acquire-release add on the half's counter, between two warp
    # barriers and shuffled to the lanes, says which program is second; that one merges.
    # No scalar atomic (its result would go through a shared-memory scratch word) and no
    # barrier across both consumers; the split adds no shared memory but captures.
    compiled = json_from_fresh_python(
        "import json, re; from attnlab.kernels.backward_sm90 import *; out = []\n"
        "for d, form in ((256, 'dk'), (256, 'dv'), (128, '')):\n"
        "    for split in (1, 2):\n"
        "        k = compile_for_sm90(d, causal=True, form=form, head_split=split)\n"
        "        ptx = k.asm['ptx']\n"
        "        out.append({**sass_evidence(k.asm), 'shared': k.metadata.shared,\n"
        "                    'split': split, 'ptx': {name: len(re.findall(pattern, ptx))\n"
        "                    for name, pattern in (('add', r'atom\\.acq_rel\\.gpu\\.global\\.add'),\n"
        "                    ('reset', r'st\\.relaxed\\.gpu\\.global'),\n"
        "                    ('warp_barrier', r'bar\\.warp\\.sync\\s+-1'),\n"
        "                    ('scalar_atom', r'atom\\.global'))}})\n"
        "print(json.dumps(out))")
    for unsplit, split in zip(compiled[::2], compiled[1::2], strict=True):
        # Two rows-halves per warp's accumulator rows, in each consumer warpgroup.
        assert split["ptx"]["add"] == split["ptx"]["reset"] == 4
        assert split["ptx"]["warp_barrier"] >= 8
        assert split["ptx"]["scalar_atom"] == 0 and unsplit["ptx"]["add"] == 0
        assert split["barrier_threads"] == [128]
        assert 0 <= split["shared"] - unsplit["shared"] <= 16
    # 3.9's ptxas (CUDA 13.4), compiled here: a few outside the loops.
    assert_spills_within(compiled[1::2], [0, 0, 0], [20, 0, 2])


def test_d256_plans_the_dv_launch_then_the_dk_launch():
    from attnlab.kernels import backward_sm90

    # The dV launch (no V block, no D) has room for 64-row tiles where the dK launch has not.
    assert DEFAULT_CONFIGS[256].launches(256) == ((False, True, 64, 2), (True, False, 32, 2))
    assert Sm90BackwardConfig(32, 3).launches(256) == ((False, True, 32, 3), (True, False, 32, 3))
    assert DEFAULT_CONFIGS[128].launches(128) == ((True, True, 64, 2),)
    assert backward_sm90.shared_memory_bytes(256, DEFAULT_CONFIGS[256]) \
        == backward_sm90.shared_memory_bytes(256, Sm90BackwardConfig(32, 2))
    assert refusal(**{**ALLOWED, "head_dim": 256}) is None
    # 64-row tiles leave the dK launch no room for two stages.
    reason = refusal(**{**ALLOWED, "head_dim": 256}, config=Sm90BackwardConfig(64, 2))
    assert reason is not None and "shared memory" in reason


# ----- gradients on the GPU ---------------------------------------------------------------

make_qkv = functools.partial(shared_make_qkv, device="cuda")
SEQLEN_PAIRS = [(1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (128, 256), (1023, 1024)]
HEADS = [(2, 2), (6, 2), (3, 1)]


def sm90_gradients(q, k, v, dout, *, layout, causal, config):
    from attnlab.kernels.backward import flash_backward
    from attnlab.kernels.forward import flash_forward

    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = flash_forward(q, k, v, layout=layout, scale=scale, causal=causal)
    return flash_backward(dout, q, k, v, out, lse, layout=layout, scale=scale, causal=causal,
                          dkdv_sm90=config)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gradient_grid(dtype, head_dim, causal):
    for i, ((seqlen_q, seqlen_k), heads) in enumerate(itertools.product(SEQLEN_PAIRS, HEADS)):
        layout = ("bshd", "bhsd")[i % 2]
        q, k, v = make_qkv(2, *heads, seqlen_q, seqlen_k, head_dim, dtype, layout=layout, seed=i)
        dout = torch.randn_like(q)
        grads = sm90_gradients(q, k, v, dout, layout=layout, causal=causal,
                               config=DEFAULT_CONFIGS[head_dim])
        checks = check_gradients(grads, q, k, v, dout, layout=layout,
                                 scale=1.0 / math.sqrt(head_dim), causal=causal)
        assert all(c.passed for c in checks), (seqlen_q, seqlen_k, heads, layout, checks)


@pytest.mark.gpu
@sm90
def test_gpu_bit_identical_and_expanded_dout():
    q, k, v = make_qkv(2, 6, 2, 300, 300, 128, torch.bfloat16, layout="bshd", seed=3)
    dout = torch.randn_like(q[:1]).expand_as(q)  # stride 0 over the batch
    first = sm90_gradients(q, k, v, dout, layout="bshd", causal=True,
                           config=DEFAULT_CONFIGS[128])
    for _ in range(20):
        again = sm90_gradients(q, k, v, dout, layout="bshd", causal=True,
                               config=DEFAULT_CONFIGS[128])
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    checks = check_gradients(first, q, k, v, dout, layout="bshd", scale=128 ** -0.5,
                             causal=True)
    assert all(c.passed for c in checks), checks


def force_schedule(monkeypatch, schedule):
    """Every backward planned from here on takes ``schedule`` (plans made before are
    dropped: they hold the schedule they were made with)."""
    from attnlab.kernels import backward, dispatch

    monkeypatch.setattr(backward._PLANS, "plans", {})
    monkeypatch.setattr(dispatch, "dkdv_schedule", lambda **_: schedule)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_major", [False, True])
def test_gpu_split_schedule_gradient_grid(monkeypatch, head_dim, block_major):
    # Two programs per (key block, KV head), each over half the group's query heads,
    # merged by whichever finishes second: every gradient as accurate as unsplit.
    from attnlab.kernels.dispatch import BackwardSchedule

    force_schedule(monkeypatch, BackwardSchedule(block_major, 2))
    for i, ((seqlen_q, seqlen_k), heads) in enumerate(itertools.product(
            SEQLEN_PAIRS, [(4, 2), (8, 2), (2, 1)])):
        layout = ("bshd", "bhsd")[i % 2]
        q, k, v = make_qkv(2, *heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16,
                           layout=layout, seed=i)
        dout = torch.randn_like(q)
        grads = sm90_gradients(q, k, v, dout, layout=layout, causal=True,
                               config=DEFAULT_CONFIGS[head_dim])
        checks = check_gradients(grads, q, k, v, dout, layout=layout,
                                 scale=1.0 / math.sqrt(head_dim), causal=True)
        assert all(c.passed for c in checks), (seqlen_q, seqlen_k, heads, layout, checks)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("head_dim", [128, 256])
def test_gpu_split_schedule_is_bit_identical_run_to_run(monkeypatch, head_dim):
    # The merge is one addition of two partials, so which program comes second does not
    # change a bit; the arrival counters are left at zero for the next launch.
    from attnlab.kernels.dispatch import BackwardSchedule

    force_schedule(monkeypatch, BackwardSchedule(True, 2))
    q, k, v = make_qkv(2, 8, 2, 1000, 1000, head_dim, torch.bfloat16, layout="bshd", seed=5)
    dout = torch.randn_like(q)
    first = sm90_gradients(q, k, v, dout, layout="bshd", causal=True,
                           config=DEFAULT_CONFIGS[head_dim])
    for _ in range(20):
        again = sm90_gradients(q, k, v, dout, layout="bshd", causal=True,
                               config=DEFAULT_CONFIGS[head_dim])
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    checks = check_gradients(first, q, k, v, dout, layout="bshd",
                             scale=1.0 / math.sqrt(head_dim), causal=True)
    assert all(c.passed for c in checks), checks


def test_dispatch_looks_up_the_bucket_of_the_longer_sequence():
    from attnlab.kernels.dispatch import DKDV_SM90

    table = DKDV_SM90.table()
    q = torch.empty(1, 1000, 4, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 3000, 4, 128, dtype=torch.bfloat16, device="meta")
    assert DKDV_SM90.bucket_config(q, k, layout="bshd", causal=True) \
        == table.get((128, True, 4096))
    bhsd = q.transpose(1, 2), k.transpose(1, 2)
    assert DKDV_SM90.bucket_config(*bhsd, layout="bhsd", causal=False) \
        == table.get((128, False, 4096))
    assert DKDV_SM90.bucket_config(q[..., :96], k[..., :96], layout="bshd",
                                   causal=True) is None  # no d = 96 bucket


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_direct_gluon_launches_equal_tritons_own_path(monkeypatch, head_dim):
    # After its first compile a planned Gluon launch encodes the TMA descriptors itself and
    # calls the C launcher (_sm90.PlannedGluonLaunch, _launch.CompiledLaunch.raw): the same
    # kernels on the same inputs as Triton's own launch path, so bit-identical results.
    from triton import knobs

    from attnlab.kernels import _sm90, backward, forward, forward_sm90
    from attnlab.kernels._launch import PlanCache

    config = DEFAULT_CONFIGS[head_dim]
    q, k, v = make_qkv(2, 6, 2, 300, 300, head_dim, torch.bfloat16, layout="bshd", seed=11)
    dout = torch.randn_like(q)

    def step():
        # A new forward plan per call: its first launch goes direct once compiled.
        out, lse = forward_sm90.plan_launch(q, k, v, layout="bshd", scale=0.1, causal=True,
                                            config=forward_sm90.DEFAULT_CONFIGS[head_dim])(
                                                q, k, v)
        return (out, lse, *sm90_gradients(q, k, v, dout, layout="bshd", causal=True,
                                          config=config))

    monkeypatch.setattr(backward, "_PLANS", PlanCache())
    step()  # compiles (or finds compiled) every kernel
    direct = step()
    planned = [p for p in backward._PLANS.plans.values() if p.sm90_dkdv is not None]
    assert planned and all(launch.launch is not None for p in planned
                           for launch in p.sm90_dkdv.launches)  # went direct
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)  # a registered hook sees the launches
    try:
        hooked = step()
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert any("dkdv_sm90" in m.get()["name"] for m in seen)  # LazyDict: .get() holds it
    monkeypatch.setattr(_sm90.PlannedGluonLaunch, "_go_direct", lambda self, n: False)
    monkeypatch.setattr(backward, "_PLANS", PlanCache())
    monkeypatch.setattr(forward, "_PLANS", PlanCache())
    own = step()
    for a, b, c in zip(direct, hooked, own, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    checks = check_gradients(direct[2:], q, k, v, dout, layout="bshd", scale=head_dim ** -0.5,
                             causal=True)
    assert all(c.passed for c in checks), checks
