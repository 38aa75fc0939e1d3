"""The Triton forward kernel against the float64 oracle, by the accuracy rule.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, the
README's test command); the interpreter-run grid keeps shapes small, and the
GPU tests at the bottom repeat it at real sizes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnlab.accuracy import check_accuracy
from attnlab.kernels.configs import ForwardConfig
from attnlab.kernels.forward import flash_forward, kernel_is_interpreted

on_gpu = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not on_gpu and not kernel_is_interpreted(),
    reason="the Triton kernel needs a CUDA GPU or TRITON_INTERPRET=1 (the README's test command)")
DEVICE = "cuda" if on_gpu else "cpu"

SEQLEN_PAIRS = [(1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (108, 256), (1023, 1024)]
SEQLEN_PAIRS += [(b, a) for a, b in SEQLEN_PAIRS if a != b]
HEAD_DIMS = [32, 59, 64, 111, 128, 256]
HEADS = [(2, 2), (6, 2), (3, 1)]  # MHA, GQA 3:1, MQA


def make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, layout="bshd", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h, n):
        dims = (batch, n, h, head_dim) if layout == "bshd" else (batch, h, n, head_dim)
        return torch.randn(dims, generator=gen, dtype=torch.float32).to(dtype).to(DEVICE)

    return rand(heads, seqlen_q), rand(kv_heads, seqlen_k), rand(kv_heads, seqlen_k)


def run_and_check(q, k, v, *, layout="bshd", config=None, **options):
    scale = options.pop("scale", 1.0 / math.sqrt(q.shape[-1]))
    out, lse = flash_forward(q, k, v, layout=layout, scale=scale, config=config, **options)
    result = check_accuracy(out, lse, q, k, v, scale=scale, layout=layout, **options)
    assert result.passed, result
    return out, lse


def interpreter_grid():
    """Every seqlen pair, head dim, head layout and mask appears; not every product."""
    masks = ["none", "causal", "window", "softcap"]
    cases = []
    for i, (seqlens, head_dim) in enumerate(itertools.product(SEQLEN_PAIRS, HEAD_DIMS)):
        if i % 4:
            continue
        heads = HEADS[(i // 4) % 3]
        cases.append((seqlens, head_dim, heads, masks[(i // 4) % 4]))
    return cases


MASK_OPTIONS = {
    "none": {},
    "causal": {"causal": True},
    "window": {"window": (19, 7)},
    "softcap": {"softcap": 5.0, "causal": True},
}


@pytest.mark.parametrize(("seqlens", "head_dim", "heads", "mask"), interpreter_grid(),
                         ids=lambda x: str(x).replace(" ", ""))
def test_accuracy_grid(seqlens, head_dim, heads, mask):
    seqlen_q, seqlen_k = seqlens
    dtype = torch.bfloat16 if head_dim % 2 else torch.float16
    q, k, v = make_qkv(1, *heads, seqlen_q, seqlen_k, head_dim, dtype, seed=seqlen_q + head_dim)
    run_and_check(q, k, v, **MASK_OPTIONS[mask])


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_both_layouts_and_tile_shapes(layout):
    q, k, v = make_qkv(2, 4, 2, 97, 113, 64, torch.float16, layout=layout, seed=1)
    for block_m, block_n in ((16, 64), (64, 16), (32, 32)):  # B_c > B_r too
        config = ForwardConfig(block_m, block_n, num_warps=4, num_stages=1)
        run_and_check(q, k, v, layout=layout, config=config, causal=True)


def test_causal_rows_without_keys_give_zero_and_minus_inf():
    # Bottom-right causal with seqlen_q > seqlen_k: the first rows see no key.
    q, k, v = make_qkv(1, 2, 2, 70, 20, 32, torch.float16, seed=2)
    out, lse = run_and_check(q, k, v, causal=True)
    assert torch.all(out[:, :50] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :50]))
    assert torch.isfinite(lse[:, :, 50:]).all()


def test_window_that_hides_everything_from_some_rows():
    # A window ending before the sequence starts: rows see nothing, not NaN.
    q, k, v = make_qkv(1, 1, 1, 40, 8, 32, torch.float16, seed=3)
    out, lse = run_and_check(q, k, v, window=(2, 0))
    assert not torch.isnan(out).any()
    assert torch.isneginf(lse).any()


def test_large_logits_stay_finite():
    q, k, v = make_qkv(1, 2, 2, 65, 130, 64, torch.bfloat16, seed=4)
    q = (q.float() * 1e4).clamp(-1e4, 1e4).to(torch.bfloat16)
    out, lse = run_and_check(q, k, v, scale=1.0, causal=True)
    assert torch.isfinite(out).all()


def test_batch_composition_does_not_change_results():
    q, k, v = make_qkv(3, 4, 2, 77, 91, 64, torch.float16, seed=5)
    together, _ = flash_forward(q, k, v, layout="bshd", scale=0.125, causal=True)
    alone, _ = flash_forward(q[1:2], k[1:2], v[1:2], layout="bshd", scale=0.125, causal=True)
    assert torch.equal(together[1:2], alone)


def test_forward_is_bit_identical_across_runs():
    q, k, v = make_qkv(2, 4, 4, 100, 100, 64, torch.bfloat16, seed=6)
    first = flash_forward(q, k, v, layout="bshd", scale=0.125, causal=True)
    second = flash_forward(q, k, v, layout="bshd", scale=0.125, causal=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_non_contiguous_inputs_with_unit_last_stride():
    # q, k, v as views into one packed (batch, seqlen, 3, heads, dim) tensor.
    gen = torch.Generator().manual_seed(7)
    packed = torch.randn(2, 50, 3, 4, 64, generator=gen).to(torch.float16).to(DEVICE)
    q, k, v = packed.unbind(2)
    assert not q.is_contiguous() and q.stride(-1) == 1
    run_and_check(q, k, v, causal=True)


# ---------------------------------------------------------------------------
# GPU: the whole grid at real sizes, and no O(N^2) memory.

gpu = pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mask", list(MASK_OPTIONS))
def test_gpu_accuracy_grid(dtype, head_dim, mask):
    for (seqlen_q, seqlen_k), heads in itertools.product(SEQLEN_PAIRS, HEADS):
        q, k, v = make_qkv(2, *heads, seqlen_q, seqlen_k, head_dim, dtype, seed=seqlen_k)
        run_and_check(q, k, v, **MASK_OPTIONS[mask])


@pytest.mark.gpu
@gpu
def test_gpu_peak_memory_is_linear_in_seqlen():
    q, k, v = make_qkv(1, 8, 8, 16384, 16384, 128, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    flash_forward(q, k, v, layout="bshd", scale=0.088, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    out_and_lse = q.numel() * q.element_size() + 8 * 16384 * 4
    assert extra <= out_and_lse + (1 << 20), extra  # O, LSE, and a descriptor scratch at most
