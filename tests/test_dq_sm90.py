"""The Gluon sm_90 dQ kernel: refusals and sm_90 code on the CPU, gradients on a Hopper GPU.

As for the other Gluon kernels, there is no interpreter path: the CPU tests check what
``supports`` and ``flash_backward`` refuse and, compiling for sm_90a without a GPU, the
roles, registers and shared memory the source claims.  The GPU tests compare dQ, dK, dV
with float64 by the gradient rule, with this kernel forced for dQ.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from attention_inputs import make_qkv as shared_make_qkv
from attnlab.accuracy import check_gradients
from attnlab.kernels._sm90 import SHARED_MEMORY_LIMIT
from attnlab.kernels.configs import backward_config
from attnlab.kernels.dq_sm90 import DEFAULT_CONFIGS, Sm90DqConfig, refusal
from attnlab.shapes import AttentionShape
from sm90_marks import built_here, sm90
from test_backward_sm90 import assert_spills_within

ALLOWED = dict(capability=(9, 0), dtype=torch.bfloat16, head_dim=128, window=(-1, -1),
               softcap=0.0, layout="bshd", aligned=True)


# ----- refusals (CPU; the reasons both Gluon backward kernels share: test_backward_sm90) ---

def test_the_covered_call_is_accepted():
    for head_dim in (64, 128, 256):
        assert refusal(**{**ALLOWED, "head_dim": head_dim}) is None


def test_a_key_ring_past_shared_memory_is_refused():
    # Q and dO of a 128-row block take 128 KiB at d = 256: 64-key tiles do not fit twice.
    reason = refusal(**{**ALLOWED, "head_dim": 256}, config=Sm90DqConfig(64, 2))
    assert reason is not None and "shared memory" in reason


def test_asking_for_it_where_it_cannot_run_is_a_value_error():
    # Forcing the kernel never falls back to the Triton dQ kernel silently.
    from attnlab.kernels.backward import flash_backward

    q = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="dq_sm90"):
        flash_backward(q, q, q, q, q, lse, layout="bshd", scale=0.125,
                       dq_sm90=DEFAULT_CONFIGS[64])


@pytest.mark.parametrize("fields", [dict(block_n=48, stages=2), dict(block_n=64, stages=5),
                                    dict(block_n=64, stages=2, producer_regs=20)])
def test_configs_outside_the_compiled_space_are_rejected(fields):
    with pytest.raises(ValueError):
        Sm90DqConfig(**fields)


@pytest.mark.parametrize("config", [Sm90DqConfig(32, 3), Sm90DqConfig(128, 2, 32)])
def test_config_names_round_trip(config):
    assert Sm90DqConfig.from_name(config.name()) == config
    with pytest.raises(ValueError, match="config name"):
        Sm90DqConfig.from_name("sm90bwd[m64,s2,r24]")


def test_the_dispatch_table_names_only_valid_configs():
    from attnlab.kernels import dq_sm90
    from attnlab.kernels.dispatch import DQ_SM90

    for (head_dim, causal, bucket), config in DQ_SM90.table().items():
        assert head_dim in dq_sm90.SUPPORTED_HEAD_DIMS and isinstance(causal, bool)
        assert bucket in (1024, 2048, 4096, 8192, 16384)
        assert dq_sm90.shared_memory_bytes(head_dim, config) <= SHARED_MEMORY_LIMIT


# ----- sm_90 code without a GPU (CPU, ~20 s) ----------------------------------------------

@built_here
def test_compiles_for_sm90_with_roles_and_no_spills(json_from_fresh_python):
    # Every default and the sweep's other candidates (dq_sm90.CANDIDATES).
    compiled = json_from_fresh_python(
        "import json; from attnlab.kernels.dq_sm90 import *; out = []\n"
        "for d, c, causal in ((64, DEFAULT_CONFIGS[64], True), (128, DEFAULT_CONFIGS[128], True),\n"
        "                     (256, DEFAULT_CONFIGS[256], True), (256, DEFAULT_CONFIGS[256], False),\n"
        "                     (128, Sm90DqConfig(128, 2), True), (64, Sm90DqConfig(128, 3), False)):\n"
        "    k = compile_for_sm90(d, c, causal=causal, has_dlse=d == 64)\n"
        "    out.append({**sass_evidence(k.asm), 'shared': k.metadata.shared,\n"
        "                'estimate': shared_memory_bytes(d, c)})\n"
        "print(json.dumps(out))")
    for evidence in compiled:
        # The refusal's shared-memory estimate is an upper bound, and a tight one.
        assert 0 <= evidence["estimate"] - evidence["shared"] <= 1024
        assert evidence["estimate"] <= SHARED_MEMORY_LIMIT
        assert ["dec", "24"] in evidence["setmaxnreg"]
        assert ["inc", "240"] in evidence["setmaxnreg"]
        # S is waited for while dP is in flight.
        assert evidence["wait_group_1"] >= 2
        # No barrier spans both consumer warpgroups.
        assert evidence["barrier_threads"] == [128]
    # Spill-free on Triton 3.6.0 and 3.9.0 (compiled here).
    assert_spills_within(compiled, [0] * 6, [0] * 6)


# ----- gradients on the GPU ---------------------------------------------------------------

make_qkv = functools.partial(shared_make_qkv, device="cuda")
SEQLEN_PAIRS = [(1, 1), (1, 239), (239, 1), (113, 203), (203, 113), (128, 256), (1023, 1024)]
HEADS = [(2, 2), (6, 2), (3, 1)]


def gluon_dq_gradients(q, k, v, dout, *, layout, causal, dq, **options):
    """The gradients with dQ from this kernel's config ``dq`` (None: as ``options`` say)."""
    from attnlab.kernels.backward import flash_backward
    from attnlab.kernels.forward import flash_forward

    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = flash_forward(q, k, v, layout=layout, scale=scale, causal=causal)
    return flash_backward(dout, q, k, v, out, lse, layout=layout, scale=scale, causal=causal,
                          dq_sm90=dq, **options)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gradient_grid(dtype, head_dim, causal):
    # With the Triton dK/dV kernel (D from this kernel, unpadded rows) and with the Gluon
    # one (D and LSE in log2 units from this kernel, padded rows), alternately.
    from attnlab.kernels.backward_sm90 import DEFAULT_CONFIGS as DKDV_CONFIGS

    for i, ((seqlen_q, seqlen_k), heads) in enumerate(itertools.product(SEQLEN_PAIRS, HEADS)):
        layout = ("bshd", "bhsd")[i % 2]
        q, k, v = make_qkv(2, *heads, seqlen_q, seqlen_k, head_dim, dtype, layout=layout, seed=i)
        dout = torch.randn_like(q)
        # An explicit Triton config keeps the dK/dV table out: the Triton dK/dV kernel.
        dkdv = {"dkdv_sm90": DKDV_CONFIGS[head_dim]} if i % 3 else {"config": backward_config(
            AttentionShape(batch=2, query_heads=heads[0], kv_heads=heads[1], seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, head_dim=head_dim, causal=causal))}
        grads = gluon_dq_gradients(q, k, v, dout, layout=layout, causal=causal,
                                   dq=DEFAULT_CONFIGS[head_dim], **dkdv)
        checks = check_gradients(grads, q, k, v, dout, layout=layout,
                                 scale=1.0 / math.sqrt(head_dim), causal=causal)
        assert all(c.passed for c in checks), (seqlen_q, seqlen_k, heads, layout, dkdv, checks)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_every_candidate_and_an_expanded_dout(head_dim):
    # The sweep's other candidates, and a stride-0 dO (copied once for TMA), bit-identical
    # run to run (no atomics).
    from attnlab.kernels.dq_sm90 import CANDIDATES

    q, k, v = make_qkv(2, 6, 2, 300, 333, head_dim, torch.bfloat16, layout="bshd", seed=3)
    dout = torch.randn_like(q[:1]).expand_as(q)
    for config in CANDIDATES[head_dim]:
        first = gluon_dq_gradients(q, k, v, dout, layout="bshd", causal=True, dq=config)
        again = gluon_dq_gradients(q, k, v, dout, layout="bshd", causal=True, dq=config)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        checks = check_gradients(first, q, k, v, dout, layout="bshd",
                                 scale=head_dim ** -0.5, causal=True)
        assert all(c.passed for c in checks), (config, checks)


def float64_gradients_with_lse(q, k, v, dout, dlse, *, causal):
    """dQ, dK, dV of sum(O dO) + sum(LSE dLSE) in float64, through the reference (bshd in
    and out), as tests/test_backward.py's LSE test does."""
    from attnlab.reference import naive

    leaves = [t.detach().transpose(1, 2).double().requires_grad_() for t in (q, k, v)]
    out, scores, _ = naive(*leaves, causal=causal, return_scores=True)
    loss = (out * dout.transpose(1, 2).double()).sum() \
        + (torch.logsumexp(scores, -1) * dlse.double()).sum()
    return tuple(g.transpose(1, 2) for g in torch.autograd.grad(loss, leaves))


@pytest.mark.gpu
@sm90
def test_gpu_a_differentiated_lse_folds_into_d_as_in_the_triton_kernel():
    # d LSE / d S = P: dLSE is subtracted from D.  This kernel's error against float64 is
    # within twice the Triton dQ kernel's (itself held to the gradient rule elsewhere).
    q, k, v = make_qkv(2, 6, 2, 257, 257, 128, torch.bfloat16, layout="bshd", seed=8)
    dout = torch.randn_like(q)
    dlse = torch.randn(2, 6, 257, device="cuda")
    want = float64_gradients_with_lse(q, k, v, dout, dlse, causal=True)
    gluon = gluon_dq_gradients(q, k, v, dout, layout="bshd", causal=True,
                               dq=DEFAULT_CONFIGS[128], dlse=dlse)
    # An explicit Triton config keeps every Gluon kernel out (no table is read).
    tiles = backward_config(AttentionShape(batch=2, query_heads=6, kv_heads=2, seqlen_q=257,
                                           seqlen_k=257, head_dim=128, causal=True))
    triton = gluon_dq_gradients(q, k, v, dout, layout="bshd", causal=True, dq=None,
                                dlse=dlse, config=tiles)
    for got, yardstick, exact in zip(gluon, triton, want, strict=True):
        error = (got.double() - exact).abs().max().item()
        allowed = 2 * (yardstick.double() - exact).abs().max().item() + 1e-3
        assert error <= allowed, (error, allowed)
