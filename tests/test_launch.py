"""The direct launch path (kernels/_launch.py): what its cache keys separate, and the
launchers' plans per call signature."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import triton

from attention_inputs import make_qkv
from attnlab.kernels._launch import (
    DIRECT_LAUNCH_TRITON,
    DirectLauncher,
    PlanCache,
    _arg_class,
    int_class,
    tensor_key,
)
from attnlab.kernels._primitives import kernel_is_interpreted
from attnlab.kernels.backward import flash_backward
from attnlab.kernels.forward import flash_forward


def test_int_classes_follow_tritons_specialisation():
    assert int_class(1) == (True, False, True)
    assert int_class(32) == (False, True, True)
    assert int_class(33) == (False, False, True)
    assert int_class(2**31) == (False, True, False)
    assert int_class(-2**31) == (False, True, True)


def test_arg_classes_separate_alignment_dtype_and_scalars():
    base = torch.zeros(64, dtype=torch.float16)
    assert _arg_class(base) == _arg_class(torch.zeros(8, dtype=torch.float16))
    assert _arg_class(base) != _arg_class(base[1:])  # 2-byte offset: not 16-byte aligned
    assert _arg_class(base) != _arg_class(base.float())
    assert _arg_class(True) != _arg_class(1)
    assert _arg_class(None) is None and _arg_class(0.5) is float
    with pytest.raises(TypeError, match="str"):
        _arg_class("x")


def test_a_launch_missing_a_constexpr_is_an_attnlab_bug(monkeypatch):
    class Kernel:
        arg_names = ["X", "n", "BLOCK"]

        class fn:  # noqa: N801 - mirrors JITFunction.fn
            __name__ = "k"

    monkeypatch.setattr("attnlab.kernels._launch.triton.__version__", "3.6.0")
    monkeypatch.setattr("attnlab.kernels._launch.kernel_is_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="constexpr"):
        launcher, args, meta = DirectLauncher(Kernel()), (torch.zeros(1), 3), {"num_warps": 4}
        launcher.launch(launcher.key(args, meta), (1,), args, meta)


def test_a_plan_cache_builds_once_per_key_and_keeps_the_newest():
    cache, built = PlanCache(size=2), []

    def build(name):
        return lambda: built.append(name) or name

    assert cache.get(("a",), build("a")) == "a"
    assert cache.get(("a",), build("again")) == "a"  # a hit: not rebuilt
    cache.get(("b",), build("b"))
    cache.get(("c",), build("c"))  # over size: the oldest ("a") goes
    assert built == ["a", "b", "c"] and list(cache.plans) == [("b",), ("c",)]


def test_the_plan_key_separates_strides_alignment_and_dtype():
    base = torch.zeros(2, 8, 4, 16, dtype=torch.float16)
    assert tensor_key(base) == tensor_key(torch.ones_like(base))
    assert tensor_key(base) != tensor_key(base.transpose(1, 2))
    unaligned = torch.zeros(base.numel() + 1, dtype=torch.float16)[1:].view(base.shape)
    assert tensor_key(base) != tensor_key(unaligned)
    assert tensor_key(base) != tensor_key(base.bfloat16())
    assert tensor_key(None) == (None,)


@pytest.mark.skipif(not (torch.cuda.is_available() or kernel_is_interpreted()),
                    reason="needs a CUDA GPU or TRITON_INTERPRET=1")
def test_the_launchers_plan_once_per_signature_and_replan_for_a_new_one():
    from attnlab.kernels import backward as backward_module
    from attnlab.kernels import forward as forward_module

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = make_qkv(1, 2, 2, 24, 24, 32, torch.float16, layout="bhsd", seed=3,
                       device=device)
    dout = make_qkv(1, 2, 2, 24, 24, 32, torch.float16, layout="bhsd", seed=4,
                    device=device)[0]
    forward_plans, backward_plans = (module._PLANS.plans for module in
                                     (forward_module, backward_module))

    def step(*tensors):
        out, lse = flash_forward(*tensors[:3], layout="bhsd", scale=0.2, causal=True)
        return out, lse, flash_backward(tensors[3], *tensors[:3], out, lse, layout="bhsd",
                                        scale=0.2, causal=True)

    first = step(q, k, v, dout)
    sizes = len(forward_plans), len(backward_plans)
    again = step(*(t.clone() for t in (q, k, v, dout)))  # new tensors, same signature
    assert (len(forward_plans), len(backward_plans)) == sizes
    for a, b in zip((*first[:2], *first[2]), (*again[:2], *again[2]), strict=True):
        assert torch.equal(a, b)
    # A transposed dO (same values, other strides) is a new signature with the same result.
    strided = dout.transpose(1, 2).contiguous().transpose(1, 2)
    other = step(q, k, v, strided)
    assert len(backward_plans) == sizes[1] + 1
    for a, b in zip(first[2], other[2], strict=True):
        assert torch.equal(a, b)
    # The cached plans keep no reference to a call's tensors.
    alive = [weakref.ref(t) for t in (q, k, v, dout, strided)]
    del q, k, v, dout, strided, first, again, other
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_launch_hooks_are_passed_only_while_one_is_registered():
    from triton import knobs

    from attnlab.kernels._launch import _hooks

    if not hasattr(knobs.runtime.launch_enter_hook, "calls"):
        pytest.skip("this Triton's launch hooks are not hook chains")
    assert _hooks() == (None, None)  # the chains exist but are empty

    def hook(metadata):
        return None

    knobs.runtime.launch_exit_hook.add(hook)
    try:
        assert _hooks() == (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    assert _hooks() == (None, None)


@pytest.mark.skipif(triton.__version__ not in DIRECT_LAUNCH_TRITON,
                    reason=f"the direct launch path is for Triton {DIRECT_LAUNCH_TRITON}")
def test_compiled_launch_finds_the_c_launcher_under_tritons_descriptor_wrapper():
    # CompiledLaunch reads the C launcher out of wrap_handle_tensordesc's closure and
    # calls it with final arguments: checked here against this Triton's own wrapper
    # (no GPU needed), so an internal rename shows up as a failure, not as a slow path.
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import wrap_handle_tensordesc

    from attnlab.kernels._launch import CompiledLaunch

    calls = []

    def c_launcher(*args):
        calls.append(args)

    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 64],
            "fp4_padded": False}
    wrapped = wrap_handle_tensordesc(c_launcher, {0: "tensordesc<bf16[64,64]>", 1: "*bf16"},
                                     [meta])
    assert wrapped is not c_launcher
    run = SimpleNamespace(launch=wrapped, global_scratch_size=0, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=False)
    compiled = SimpleNamespace(run=run, metadata=SimpleNamespace(tensordesc_meta=[meta]),
                               function=7, packed_metadata=(4, 1, 0))
    launch = CompiledLaunch(compiled)
    assert launch.c_launch is c_launcher and launch.direct
    assert launch.tensordesc_meta == (meta,)
    # With scratch memory to allocate, Triton's own path stays in charge.
    run.global_scratch_size = 128
    assert not CompiledLaunch(compiled).direct


def test_a_tma_slot_encodes_again_only_for_a_new_pointer():
    from attnlab.kernels._launch import TmaSlot

    encoded = []

    def fill(pointer, *encoding):
        encoded.append(pointer)
        return ("map", pointer, encoding)

    slot = object.__new__(TmaSlot)  # __init__ asks the CUDA driver for its encoder
    slot.fill, slot.encoding, slot.tail, slot.last = fill, ("swizzle",), (4, 1), (None, None)
    a, b = torch.zeros(8), torch.zeros(8)
    assert slot(a) == ("map", a.data_ptr(), ("swizzle",))
    assert slot(a) == ("map", a.data_ptr(), ("swizzle",))
    assert slot(b)[1] == b.data_ptr() and slot(a)[1] == a.data_ptr()
    assert encoded == [a.data_ptr(), b.data_ptr(), a.data_ptr()]
