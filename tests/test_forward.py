"""The Triton forward kernel against the float64 oracle, by the accuracy rule.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, the
README's test command); the interpreter-run grid keeps shapes small, and the
GPU tests at the bottom repeat it at real sizes.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from attention_inputs import make_qkv as shared_make_qkv
from attnlab.accuracy import check_accuracy
from attnlab.kernels._launch import PlanCache
from attnlab.kernels._primitives import launch_is_traced
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


# The shared maker, in flash-attn's layout on the kernel's device unless a test says otherwise.
make_qkv = functools.partial(shared_make_qkv, layout="bshd", device=DEVICE)


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


def test_only_tensors_without_data_make_a_launch_traced():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    real = torch.ones(2, 3)
    assert not launch_is_traced(real)
    assert not launch_is_traced(torch.nn.Parameter(real))
    with FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(real)
        assert launch_is_traced(fake)
        with FunctionalTensorMode():
            assert launch_is_traced(FunctionalTensor.to_functional(fake))


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


# ---------------------------------------------------------------------------
# Softcap at any cap (issue #11): the tanh has no cancellation.

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [1e6, 1e7])
def test_huge_softcaps_meet_the_accuracy_rule(dtype, softcap):
    # softcap * tanh(s / softcap) is s to 1e-12 here; 1 - 2 / (exp(2x) + 1) lost 0.1 of it.
    q, k, v = make_qkv(1, 2, 2, 77, 77, 64, dtype, seed=12)
    run_and_check(q, k, v, softcap=softcap, causal=True)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_bf16_scores_near_the_edge_of_float32_stay_finite(softcap):
    # |q|, |k| ~ 1e18: scores ~ 1e37, inside float32 (and the float64 reference) but far
    # past any exp: the running max and the softcap must keep every step finite.
    q, k, v = make_qkv(1, 2, 2, 65, 130, 64, torch.bfloat16, seed=13)
    q, k = (t * 1e18 for t in (q, k))
    out, lse = run_and_check(q, k, v, causal=True, softcap=softcap)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ---------------------------------------------------------------------------
# 64-bit offsets (issue #11): the launcher's decision, and the 64-bit path itself.

def test_offsets_need_int64_exactly_when_a_head_row_offset_passes_2_31():
    from attnlab.kernels.forward import offsets_need_int64

    # bshd, 32 heads x 128: a row is 4,096 elements; 600k keys pass 2^31, 300k do not.
    assert offsets_need_int64(600_000, 32 * 128, 128, 128)
    assert not offsets_need_int64(300_000, 32 * 128, 128, 128)
    # bhsd, same tensor size: one head's rows are 600k x 128 elements, far below 2^31.
    assert not offsets_need_int64(600_000, 128, 128, 128)
    # The masked rows of a ragged last tile count too.
    rows = (2**31 - 1 - 128) // 4096
    assert not offsets_need_int64(rows - 128, 4096, 128, 128)
    assert offsets_need_int64(rows, 4096, 128, 128)


class _RecordingLaunch:
    """Stands in for the kernel's launcher: records the launch instead of running it."""

    def __init__(self):
        self.options = None

    def key(self, args, meta):
        return None

    def launch(self, key, grid, args, meta):
        self.options = {"grid": grid, **meta}

    def compiled_launch(self, key, arg_count, meta):
        return None, None  # no compiled kernel: every call records through launch()


@pytest.mark.parametrize(("layout", "seqlen_q", "seqlen_k", "wide"), [
    ("bshd", 64, 600_000, True),     # issue #11: 64 queries x 600k keys x 32 heads x 128
    ("bshd", 600_000, 256, True),    # and 600k queries x 256 keys
    ("bshd", 64, 300_000, False),    # fine in 32 bits (the base offset is int64)
    ("bhsd", 64, 600_000, False),    # 4.9e9 elements, but one head's rows fit 32 bits
])
def test_launcher_picks_64_bit_offsets_for_the_issue_sizes(monkeypatch, layout, seqlen_q,
                                                           seqlen_k, wide):
    import attnlab.kernels.forward as forward_module

    recorder = _RecordingLaunch()
    monkeypatch.setattr(forward_module, "_DIRECT_FORWARD", recorder)
    monkeypatch.setattr(forward_module, "_PLANS", PlanCache())  # no plan from another test

    def meta(seqlen):  # full-size tensors that allocate nothing
        dims = (1, seqlen, 32, 128) if layout == "bshd" else (1, 32, seqlen, 128)
        return torch.empty(dims, dtype=torch.bfloat16, device="meta")

    flash_forward(meta(seqlen_q), meta(seqlen_k), meta(seqlen_k), layout=layout, scale=0.088)
    assert recorder.options["OFFSETS_64"] is wide


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_forced_64_bit_offsets_give_the_same_bits(monkeypatch, layout):
    import attnlab.kernels.forward as forward_module

    q, k, v = make_qkv(2, 4, 2, 97, 130, 64, torch.float16, layout=layout, seed=14)
    fast = flash_forward(q, k, v, layout=layout, scale=0.125, window=(40, 3))
    monkeypatch.setattr(forward_module, "offsets_need_int64", lambda *args: True)
    monkeypatch.setattr(forward_module, "_PLANS", PlanCache())  # re-plan with the patch
    wide = flash_forward(q, k, v, layout=layout, scale=0.125, window=(40, 3))
    assert torch.equal(fast[0], wide[0]) and torch.equal(fast[1], wide[1])


def _free_gpu_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if on_gpu else 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("layout", "seqlen_q", "seqlen_k", "causal"), [
    ("bshd", 64, 600_000, True),    # K, V past 2^31 elements (issue #11's crash)
    ("bshd", 600_000, 256, False),  # Q, O past 2^31 elements
    ("bhsd", 64, 600_000, True),    # the same K, V size on the 32-bit row path
])
def test_gpu_tensors_past_2_31_elements(layout, seqlen_q, seqlen_k, causal):
    heads, head_dim = 32, 128
    big = max(seqlen_q, seqlen_k) * heads * head_dim * 2  # bytes of one big bf16 tensor
    need = 2 * big + (6 << 30)  # two big tensors, the small ones and the reference's head slices
    if _free_gpu_bytes() < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, "
                    f"{_free_gpu_bytes() / 2**30:.0f} free")
    q, k, v = make_qkv(1, heads, heads, seqlen_q, seqlen_k, head_dim, torch.bfloat16,
                       layout=layout, seed=15)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = flash_forward(q, k, v, layout=layout, scale=scale, causal=causal)
    torch.cuda.synchronize()
    # A chunked reference: one head at a time (its whole rows and keys, in float64), the
    # first head and the last (the largest offsets).
    head_axis = 2 if layout == "bshd" else 1
    for head in (0, heads - 1):
        one = [t.narrow(head_axis, head, 1) for t in (q, k, v, out)]
        result = check_accuracy(one[3], lse[:, head:head + 1], *one[:3], scale=scale,
                                causal=causal, layout=layout)
        assert result.passed, (head, result)
