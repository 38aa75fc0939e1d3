"""attnlab behind PyTorch SDPA (`attnlab.integrations.sdpa`).

The oracle is PyTorch's own SDPA math backend in float64 (its ``is_causal`` is the
top-left definition being honoured); the yardstick is the same math backend in the
inputs' dtype: forward error <= 2x the yardstick's plus the rounding floor, gradients
<= 3x (attnlab's accuracy rule).  CPU tests run attnlab's Triton kernels in Triton's
interpreter (TRITON_INTERPRET=1, the suite's mode); the GPU test needs CUDA.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab.accuracy import GRADIENT_FACTOR
from attnlab.integrations import sdpa as attnlab_sdpa
from attnlab.kernels._primitives import kernel_is_interpreted

attention_api = pytest.importorskip("torch.nn.attention")
HAS_REGISTRY = hasattr(attention_api, "activate_flash_attention_impl")
needs_registry = pytest.mark.skipif(
    not HAS_REGISTRY, reason=f"torch {torch.__version__} has no flash attention registry")
needs_interpreter = pytest.mark.skipif(
    not kernel_is_interpreted(), reason="CPU tensors reach attnlab's kernels only under "
                                        "TRITON_INTERPRET=1 (Triton's interpreter)")

# (seqlen_q, seqlen_k, is_causal): square, more queries than keys, more keys than queries.
CAUSAL_CASES = [(24, 24, True), (29, 13, True), (7, 30, True), (19, 33, False)]


def _inputs(seqlen_q, seqlen_k, *, heads=4, kv_heads=2, head_dim=32, dtype=torch.float16,
            device="cpu", seed=0, requires_grad=False):
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(h, n):
        t = torch.randn(1, h, n, head_dim, generator=generator, device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return draw(heads, seqlen_q), draw(kv_heads, seqlen_k), draw(kv_heads, seqlen_k)


def _math(q, k, v, is_causal, dtype=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t if dtype is None else t.to(dtype) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


def _assert_forward_close(out, q, k, v, is_causal):
    exact = _math(*(t.detach() for t in (q, k, v)), is_causal, torch.float64)
    yardstick = (_math(*(t.detach() for t in (q, k, v)), is_causal).double() - exact).abs().max()
    rounded = exact.to(q.dtype)
    floor = ((rounded + 0.3 - 0.3) - rounded).abs().max().item()
    error = (out.double() - exact).abs().max().item()
    assert not torch.isnan(out).any()
    assert error <= 2 * yardstick.item() + 2 * floor + 1e-6, (error, yardstick.item(), floor)


@pytest.fixture
def activated():
    attnlab_sdpa.activate()
    try:
        yield
    finally:
        attention_api.restore_flash_attention_impl()


# ----- the top-left mapping, exactly (float64 reference; no kernels) ---------------------------
@pytest.mark.parametrize("seqlen_q, seqlen_k, is_causal", CAUSAL_CASES + [(1, 9, True),
                                                                        (9, 1, True)])
def test_top_left_causal_is_expressed_exactly(seqlen_q, seqlen_k, is_causal):
    q, k, v = _inputs(seqlen_q, seqlen_k, dtype=torch.float64)
    got = attnlab.attention(q, k, v, is_causal=is_causal, enable_gqa=True, impl="reference")
    expected = _math(q, k, v, is_causal)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)


def test_top_left_differs_from_bottom_right_where_it_should():
    q, k, v = _inputs(7, 30, dtype=torch.float64)
    bottom_right = attnlab.attention(q, k, v, causal=True, enable_gqa=True, impl="reference")
    assert not torch.allclose(bottom_right, _math(q, k, v, True))  # the test can fail


# ----- plain SDPA calls run attnlab -----------------------------------------------------------
@needs_registry
def test_register_adds_attnlab_to_the_registry():
    attnlab_sdpa.register()
    assert "attnlab" in attention_api.list_flash_attention_impls()


@needs_registry
@needs_interpreter
@pytest.mark.parametrize("seqlen_q, seqlen_k, is_causal", CAUSAL_CASES)
def test_activated_sdpa_runs_attnlab_with_top_left_causal(activated, seqlen_q, seqlen_k,
                                                          is_causal):
    q, k, v = _inputs(seqlen_q, seqlen_k, seed=seqlen_q)
    attnlab.attention(q, k, v, enable_gqa=True, impl="reference")  # last_impl: "reference"
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    assert attnlab.last_impl() == "triton"
    assert attention_api.current_flash_attention_impl() == "attnlab"
    _assert_forward_close(out, q, k, v, is_causal)


@needs_registry
@needs_interpreter
def test_inference_mode_calls_run_attnlab_too(activated):
    q, k, v = _inputs(16, 16, kv_heads=4, dtype=torch.bfloat16, seed=3)
    attnlab.attention(q, k, v, impl="reference")
    with torch.inference_mode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert attnlab.last_impl() == "triton"
    _assert_forward_close(out, q, k, v, True)


def _assert_gradients_close(grads, q, k, v, dout, is_causal):
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = torch.autograd.grad(_math(*leaves64, is_causal), leaves64, dout.double())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    same = torch.autograd.grad(_math(*leaves, is_causal), leaves, dout)
    eps = torch.finfo(q.dtype).eps
    for name, grad, ref, yard in zip(("dq", "dk", "dv"), grads, exact, same, strict=True):
        error = (grad.double() - ref).abs().max().item()
        allowed = GRADIENT_FACTOR * (yard.double() - ref).abs().max().item() \
            + eps * max(ref.abs().max().item(), 1.0) + 1e-6
        assert not torch.isnan(grad).any() and error <= allowed, (name, error, allowed)


@needs_registry
@needs_interpreter
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(20, 20), (23, 11), (6, 21)])
def test_backward_through_sdpa_runs_attnlab_and_matches(activated, seqlen_q, seqlen_k):
    q, k, v = _inputs(seqlen_q, seqlen_k, seed=7, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert attnlab.last_impl() == "triton"
    _assert_gradients_close(torch.autograd.grad(out, (q, k, v), dout), q, k, v, dout, True)


@needs_registry
@needs_interpreter
def test_restore_gives_sdpa_back_to_pytorch():
    attnlab_sdpa.activate()
    attention_api.restore_flash_attention_impl()
    q, k, v = _inputs(12, 12, kv_heads=4)
    attnlab.attention(q, k, v, impl="reference")
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert attnlab.last_impl() == "reference"
    assert attention_api.current_flash_attention_impl() is None


# ----- refusals -----------------------------------------------------------------------------
@needs_registry
@needs_interpreter
def test_dropout_and_masks_are_refused_not_rerouted(activated):
    q, k, v = _inputs(8, 8, kv_heads=4)
    # SDPA's CPU selection never sends dropout to its flash backend (CUDA's does): the op.
    with pytest.raises(NotImplementedError, match="dropout"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.1)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with pytest.raises(NotImplementedError, match="attn_mask"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_torch_without_the_registry_is_named(monkeypatch):
    for name in ("register_flash_attention_impl", "activate_flash_attention_impl"):
        monkeypatch.delattr(attention_api, name, raising=False)
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)} .*registry"):
        attnlab_sdpa.register()


# ----- the GPU ---------------------------------------------------------------------------------
# SDPA's CUDA selection gives its flash backend no causal call with seqlen_q != seqlen_k
# (PyTorch's check_flash_causal_non_square_seqlens): those reach attnlab through the op.
GPU_CASES = [(1024, 1024, True, "sdpa"), (300, 1000, False, "sdpa"), (777, 129, False, "sdpa"),
             (300, 1000, True, "op"), (777, 129, True, "op")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@needs_registry
@pytest.mark.parametrize("seqlen_q, seqlen_k, is_causal, via", GPU_CASES)
def test_gpu_sdpa_forward_and_backward_run_attnlab(activated, seqlen_q, seqlen_k, is_causal, via):
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _inputs(seqlen_q, seqlen_k, heads=8, kv_heads=2, head_dim=128,
                      dtype=torch.bfloat16, device="cuda", seed=11, requires_grad=True)
    dout = torch.randn_like(q)
    # acc_events: keep every cycle's events (the first call's forward was dropped without it).
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as trace:
        if via == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        else:
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal, scale=q.shape[-1] ** -0.5)[0]
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in trace.events() if e.device_type.name == "CUDA"})
    assert attnlab.last_impl() == "triton"
    # attnlab's Triton kernels ran, forward and backward; no PyTorch or cuDNN attention did.
    assert any(n.startswith("_attn_fwd") for n in kernels), kernels
    assert any(n.startswith("_attn_bwd") for n in kernels), kernels
    assert not any(word in n.lower() for n in kernels
                   for word in ("pytorch_flash", "cudnn", "fmha", "efficient_attention")), kernels
    _assert_forward_close(out, q, k, v, is_causal)
    _assert_gradients_close(grads, q, k, v, dout, is_causal)
