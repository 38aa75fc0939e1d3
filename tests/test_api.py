"""The public calls: layouts, dispatch, drop-in behaviour, and every bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attnlab
from attention_inputs import make_qkv
from attnlab import attention, flash_attn_func, last_impl
from attnlab.accuracy import check_accuracy
from attnlab.kernels.forward import kernel_is_interpreted

triton_runs_here = torch.cuda.is_available() or kernel_is_interpreted()
needs_triton = pytest.mark.skipif(not triton_runs_here,
                                  reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bshd(batch=2, seqlen_q=37, seqlen_k=53, heads=4, kv_heads=2, head_dim=32,
         dtype=torch.float16, seed=0):
    """The shared maker with this file's defaults, in flash-attn's layout."""
    return make_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, layout="bshd",
                    seed=seed, device=DEVICE)


@needs_triton
def test_flash_attn_func_is_a_drop_in():
    q, k, v = bshd()
    out = flash_attn_func(q, k, v, causal=True, impl="triton")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert last_impl() == "triton"
    out2, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, impl="triton")
    assert probs is None and torch.equal(out, out2)
    assert lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    assert check_accuracy(out2.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), causal=True,
                          layout="bshd").passed


@needs_triton
def test_sdpa_layout_matches_flash_layout():
    q, k, v = bshd(seed=1)
    ours_bshd = flash_attn_func(q, k, v, causal=True, softmax_scale=0.3, impl="triton")
    ours_bhsd = attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, scale=0.3,
                          enable_gqa=True, impl="triton")
    assert torch.equal(ours_bshd, ours_bhsd.transpose(1, 2))


@needs_triton
def test_triton_agrees_with_the_reference_impl():
    q, k, v = bshd(seed=2)
    fast = flash_attn_func(q, k, v, window_size=(8, 3), impl="triton")
    slow = flash_attn_func(q.cpu(), k.cpu(), v.cpu(), window_size=(8, 3), impl="reference")
    assert last_impl() == "reference"
    assert (fast.cpu().float() - slow.float()).abs().max() < 1e-2


def test_auto_on_cpu_runs_the_reference():
    q, k, v = (t.cpu() for t in bshd(seed=3))
    out = flash_attn_func(q, k, v, causal=True)
    assert last_impl() == ("reference")
    assert check_accuracy(out, flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[1],
                          q, k, v, causal=True, layout="bshd").passed


def test_reference_impl_accepts_float32_and_float64():
    for dtype in (torch.float32, torch.float64):
        q, k, v = (t.cpu() for t in bshd(dtype=dtype, seed=4))
        out, lse = attention(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True,
                             impl="reference", return_lse=True)
        assert out.dtype == dtype and torch.isfinite(lse).all()


@needs_triton
def test_custom_op_compiles_without_graph_breaks():
    q, k, v = bshd(seed=5)

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, impl="triton") * 2.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), step(q, k, v))


@needs_triton
def test_custom_op_path_and_direct_path_agree():
    # Inputs that need grad go through the custom op; plain eager calls skip its dispatcher.
    q, k, v = bshd(seed=9)
    direct = flash_attn_func(q, k, v, causal=True, impl="triton")
    through_op = flash_attn_func(*(t.clone().requires_grad_() for t in (q, k, v)), causal=True,
                                 impl="triton")
    assert through_op.grad_fn is not None
    assert torch.equal(direct, through_op.detach())


@needs_triton
def test_backward_runs_through_the_custom_op():
    # The gradients themselves are judged in tests/test_backward.py.
    q, k, v = (t.requires_grad_() for t in bshd(seed=6))
    out = flash_attn_func(q, k, v, impl="triton")
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and torch.isfinite(t.grad).all()
               for t in (q, k, v))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"dropout_p": 0.1}, NotImplementedError, "dropout_p"),
    ({"alibi_slopes": torch.ones(4)}, NotImplementedError, "alibi_slopes"),
    ({"window_size": (-2, 0)}, ValueError, "window_size"),
    ({"window_size": 5}, TypeError, "window_size"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"causal": "yes"}, TypeError, "causal"),
    ({"softmax_scale": 0.0}, ValueError, "scale"),
    ({"impl": "cuda"}, ValueError, "unknown impl 'cuda'; expected one of auto, triton, reference"),
])
def test_bad_options_are_named(kwargs, error, match):
    q, k, v = (t.cpu() for t in bshd())
    with pytest.raises(error, match=match):
        flash_attn_func(q, k, v, **kwargs)


def test_bad_tensors_are_named():
    q, k, v = (t.cpu() for t in bshd())
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attn_func(q.numpy(), k, v)
    with pytest.raises(ValueError, match="4-D"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attn_func(q, k.float(), v)
    with pytest.raises(ValueError, match="kv heads .3. must divide query heads .4."):
        flash_attn_func(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1))
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_func(q, k[..., :16], v[..., :16])
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attention(*(t.transpose(1, 2) for t in (q, k, v)))


@needs_triton
def test_triton_rejects_float32_and_huge_head_dims():
    q, k, v = bshd()
    with pytest.raises(TypeError, match="torch.float16 or torch.bfloat16"):
        flash_attn_func(q.float(), k.float(), v.float(), impl="triton")
    big = [torch.zeros(1, 4, 1, 288, dtype=torch.float16, device=DEVICE) for _ in range(3)]
    with pytest.raises(ValueError, match="head_dim must be <= 256"):
        flash_attn_func(*big, impl="triton")


@needs_triton
def test_inner_stride_other_than_one_costs_one_copy_and_stays_right():
    q, k, v = bshd(seed=7)
    q_strided = torch.empty(*q.shape, 2, dtype=q.dtype, device=q.device)[..., 0]
    q_strided.copy_(q)
    assert q_strided.stride(-1) == 2
    assert torch.equal(flash_attn_func(q_strided, k, v, impl="triton"),
                       flash_attn_func(q, k, v, impl="triton"))


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch, attnlab\n"
            "q = torch.zeros(1, 4, 1, 32, dtype=torch.float16)\n"
            "try:\n"
            "    attnlab.flash_attn_func(q, q, q, impl='triton')\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            timeout=120)
    if torch.cuda.is_available():
        pytest.skip("CUDA is present, so CPU tensors are the only way to hit this path")
    assert "TRITON_INTERPRET=1" in result.stdout, result.stderr


def test_public_api_is_exported():
    assert {"flash_attn_func", "attention", "last_impl", "AttentionShape"} <= set(attnlab.__all__)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_and_replay():
    q, k, v = bshd(seqlen_q=512, seqlen_k=512, head_dim=128, seed=8)
    expected = flash_attn_func(q, k, v, causal=True)
    static_out = flash_attn_func(q, k, v, causal=True)  # warm: compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_attn_func(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, flash_attn_func(q, k, v, causal=True))
    assert not torch.equal(static_out, expected)



PUBLIC_CALLS = ("flash_attn_func", "attention", "flash_attn_varlen_func", "flash_attn_with_kvcache")


def public_call(name, q, k, v, *, window_size, softmax_scale, softcap):
    """One public entry point on bshd (q, k, v) with the reference impl; its bshd output."""
    from attnlab import flash_attn_varlen_func, flash_attn_with_kvcache

    options = dict(window_size=window_size, softmax_scale=softmax_scale, softcap=softcap,
                   impl="reference")
    if name == "flash_attn_func":
        return flash_attn_func(q, k, v, **options)
    if name == "attention":
        options["scale"] = options.pop("softmax_scale")
        return attention(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True,
                         **options).transpose(1, 2)
    if name == "flash_attn_varlen_func":
        (batch, seqlen_q), seqlen_k = q.shape[:2], k.shape[1]
        cu_q, cu_k = (torch.arange(0, (batch + 1) * n, n, dtype=torch.int32)
                      for n in (seqlen_q, seqlen_k))
        return flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q,
                                      cu_k, seqlen_q, seqlen_k,
                                      **options).unflatten(0, (batch, seqlen_q))
    return flash_attn_with_kvcache(q, k, v, **options)


@pytest.mark.parametrize("name", PUBLIC_CALLS)
def test_numpy_and_0d_tensor_options_act_as_python_numbers(name):
    np = pytest.importorskip("numpy")
    q, k, v = (t.cpu() for t in bshd(seqlen_q=5, seqlen_k=9, seed=10))
    plain = public_call(name, q, k, v, window_size=(3, 1), softmax_scale=0.25, softcap=30.0)
    assert torch.isfinite(plain).all()
    for window, scale, softcap in (
            ((np.int64(3), np.int32(1)), np.float32(0.25), torch.tensor(30.0)),
            ((torch.tensor(3), 1), torch.tensor(0.25), np.float64(30.0)),
            (np.array([3, 1]), np.float64(0.25), np.int64(30))):
        assert torch.equal(public_call(name, q, k, v, window_size=window, softmax_scale=scale,
                                       softcap=softcap), plain)


@pytest.mark.parametrize("name", PUBLIC_CALLS)
def test_a_bool_is_not_a_window_side(name):
    np = pytest.importorskip("numpy")
    q, k, v = (t.cpu() for t in bshd(seqlen_q=5, seqlen_k=9))
    for window in ((True, -1), (-1, np.bool_(False)), (torch.tensor(True), 2)):
        with pytest.raises(TypeError, match="window_size"):
            public_call(name, q, k, v, window_size=window, softmax_scale=None, softcap=0.0)


def test_last_impl_is_per_thread():
    import threading

    q, k, v = (t.cpu() for t in bshd(seqlen_q=5, seqlen_k=9))
    first_call_done, second_call_done = threading.Event(), threading.Event()
    seen = {}

    def reference_caller():
        flash_attn_func(q, k, v, impl="reference")
        first_call_done.set()
        second_call_done.wait(timeout=60)
        seen["reference_caller"] = last_impl()

    def other_thread():
        first_call_done.wait(timeout=60)
        seen["before its own call"] = last_impl()
        if triton_runs_here:
            flash_attn_func(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), impl="triton")
            seen["after its own call"] = last_impl()
        second_call_done.set()

    threads = [threading.Thread(target=reference_caller), threading.Thread(target=other_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert seen["before its own call"] is None  # the other thread's call is not this one's
    assert seen["reference_caller"] == "reference"
    if triton_runs_here:
        assert seen["after its own call"] == "triton"


# ----- attention() speaks SDPA: its positional order, names and top-left is_causal ---------------
@pytest.mark.parametrize(("seqlen_q", "seqlen_k"), [(9, 9), (7, 30), (30, 7)])
def test_attention_takes_sdpa_arguments_in_sdpa_order(seqlen_q, seqlen_k):
    import torch.nn.functional as F

    q, k, v = (t.cpu().transpose(1, 2) for t in bshd(seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                                      dtype=torch.float64, seed=11))
    # SDPA's own call: attn_mask, dropout_p, is_causal positional; scale, enable_gqa by name.
    ours = attention(q, k, v, None, 0.0, True, scale=0.3, enable_gqa=True, impl="reference")
    theirs = F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.3, enable_gqa=True)
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    bottom_right = attention(q, k, v, causal=True, scale=0.3, enable_gqa=True, impl="reference")
    assert torch.equal(bottom_right, ours) == (seqlen_q == seqlen_k)  # the test can fail


@needs_triton
def test_attention_is_causal_runs_the_kernel_top_left():
    q, k, v = (t.transpose(1, 2) for t in bshd(seqlen_q=20, seqlen_k=45, seed=12))
    fast = attention(q, k, v, is_causal=True, enable_gqa=True, impl="triton")
    assert last_impl() == "triton"
    # Top-left causal sees keys j <= i: bottom-right causal over the first 20 keys.
    assert check_accuracy(fast.cpu(), None, q.cpu(), k[:, :, :20].cpu(), v[:, :, :20].cpu(),
                          causal=True).passed


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"attn_mask": torch.ones(5, 9, dtype=torch.bool)}, NotImplementedError, "attn_mask"),
    ({"dropout_p": 0.1}, NotImplementedError, "dropout_p"),
    ({"is_causal": "yes"}, TypeError, "is_causal"),
    ({"is_causal": True, "causal": True}, ValueError, "not both"),
    ({"is_causal": True, "window_size": (4, 0)}, NotImplementedError, "is_causal"),
])
def test_attention_refuses_what_sdpa_names_but_attnlab_cannot_do(kwargs, error, match):
    q, k, v = (t.cpu().transpose(1, 2) for t in bshd(seqlen_q=5, seqlen_k=9))
    with pytest.raises(error, match=match):
        attention(q, k, v, enable_gqa=True, **kwargs)


def test_last_impl_detail_says_the_reference_ran():
    q, k, v = (t.cpu() for t in bshd(seqlen_q=5, seqlen_k=9))
    flash_attn_func(q, k, v)
    assert last_impl() == "reference"
    detail = last_impl(detail=True)
    assert detail.startswith("reference: ") and "float64" in detail and "slower" in detail
    with pytest.raises(TypeError, match="detail"):
        last_impl(detail="yes")
    # Every public call that takes impl says what impl="auto" does on CPU tensors.
    import inspect

    import attnlab.flash_attn_interface as fa3

    calls = [getattr(module, name) for module in (attnlab, fa3) for name in module.__all__]
    with_impl = [call for call in calls if callable(call) and not isinstance(call, type)
                 and "impl" in inspect.signature(call).parameters]
    assert len(with_impl) == 11
    assert all("runs the float64 reference" in call.__doc__ for call in with_impl)
