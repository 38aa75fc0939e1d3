"""The direct launch path (kernels/_launch.py): what its cache keys separate, and the
launchers' plans per call signature."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from attention_inputs import make_qkv
from attnlab.kernels._compat import direct_launch_refusal, launcher_convention
from attnlab.kernels._launch import (
    DirectLauncher,
    PlanCache,
    PlannedLaunch,
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

    monkeypatch.setattr("attnlab.kernels._launch.direct_launch_refusal", lambda: None)
    monkeypatch.setattr("attnlab.kernels._launch.kernel_is_interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="constexpr"):
        launcher, args, meta = DirectLauncher(Kernel()), (torch.zeros(1), 3), {"num_warps": 4}
        launcher.launch(launcher.key(args, meta), (1,), args, meta)


def test_a_planned_launch_reuses_the_compiled_launch_with_launch_cacheds_arguments(monkeypatch):
    # After the first call a plan calls the kept compiled launch itself, with exactly the
    # final arguments launch_cached would assemble: tensors, static arguments, constexprs
    # in the kernel's order (not the meta dict's).
    launched = []

    class Compiled:
        def __init__(self, jit_result) -> None:
            self.jit_result = jit_result

        def __call__(self, grid, final_args) -> None:
            launched.append((grid, final_args))

        def planned(self, grid, count):
            assert count == 6  # the plan's launches all pass this many final arguments
            return lambda final_args: self(grid, final_args)

    class Kernel:
        arg_names = ["X", "Y", "n", "scale", "BLOCK", "FLAG"]

        def __getitem__(self, grid):
            return lambda *args, **meta: ("compiled", grid, args)

    monkeypatch.setattr("attnlab.kernels._launch.direct_launch_refusal", lambda: None)
    monkeypatch.setattr("attnlab.kernels._launch.kernel_is_interpreted", lambda: False)
    monkeypatch.setattr("attnlab.kernels._launch.CompiledLaunch", Compiled)
    monkeypatch.setattr("attnlab.kernels._launch.launch_options", lambda: {})
    plan = PlannedLaunch(DirectLauncher(Kernel()), (7,), (5, 0.5),
                         {"FLAG": True, "num_warps": 4, "BLOCK": 64})
    x, y = torch.zeros(2), torch.zeros(3)
    plan(x, y)  # compiles (through kernel[grid]); nothing reaches the kept launch
    assert launched == []

    def no_lookup(*args, **kwargs):
        raise AssertionError("a planned call after the first went through launch_cached")

    monkeypatch.setattr("attnlab.kernels._launch.launch_cached", no_lookup)
    plan(x, y)
    plan(y, x)
    assert launched == [((7,), (x, y, 5, 0.5, 64, True)), ((7,), (y, x, 5, 0.5, 64, True))]


def test_a_plan_cache_builds_once_per_key_and_keeps_the_newest():
    cache, built = PlanCache(size=2), []

    def build(name):
        return lambda: built.append(name) or name

    assert cache.get(("a",), build("a")) == "a"
    assert cache.get(("a",), build("again")) == "a"  # a hit: not rebuilt
    cache.get(("b",), build("b"))
    cache.get(("c",), build("c"))  # over size: the oldest ("a") goes
    assert built == ["a", "b", "c"] and list(cache.plans) == [("b",), ("c",)]


def test_a_plan_cache_finds_by_the_whole_key_the_last_one_first():
    cache = PlanCache(size=2)
    assert cache.find(("a", 1)) is None
    cache.get(("a", 1), lambda: "A")
    cache.get(("b", 2), lambda: "B")
    assert cache.find(("a", 1)) == "A"  # from the dict; now the last one found
    assert cache.find(("a", 2)) is None  # equal in part only: not the last plan
    assert cache.find(("b", 2)) == "B"
    assert cache.find(("a", 1)) == "A"
    cache.get(("c", 3), lambda: "C")  # over size: ("a", 1) leaves the dict ...
    assert ("a", 1) not in cache.plans
    assert cache.find(("a", 1)) == "A"  # ... but its plan still answers its own key


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


direct_here = pytest.mark.skipif(direct_launch_refusal() is not None,
                                 reason=f"no direct launch here: {direct_launch_refusal()}")


def fake_compiled(meta, signature):
    """A CompiledKernel of ``signature`` around this Triton's own CudaLauncher, built
    without a GPU: Triton 3.6's compiles a C module per kernel, so its launcher is
    assembled as its __init__ would; 3.7+'s __init__ runs (it compiles nothing), on the
    fake driver the caller installed."""
    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

    from attnlab.kernels import _launch

    metadata = SimpleNamespace(tensordesc_meta=[meta] if meta else None, num_ctas=1,
                               global_scratch_size=0, global_scratch_align=1,
                               profile_scratch_size=0, profile_scratch_align=1,
                               launch_cooperative_grid=False, launch_pdl=False,
                               instrumentation_mode="")
    if launcher_convention(CudaLauncher) == "variadic":
        names = list(signature)
        src = SimpleNamespace(constants={}, fn=SimpleNamespace(arg_names=names),
                              signature=signature)
        run = CudaLauncher(src, metadata)
    else:
        run = object.__new__(CudaLauncher)
        run.__dict__.update({k: v for k, v in vars(metadata).items() if k != "tensordesc_meta"})
        run.launch = wrap_handle_tensordesc(_launch.driver.active.utils.launch,
                                            dict(enumerate(signature.values())),
                                            metadata.tensordesc_meta)
    return SimpleNamespace(run=run, metadata=metadata, function=7, packed_metadata=(4, 1, 0),
                           launch_metadata=lambda *args: None)


@pytest.fixture
def fake_cuda_driver(monkeypatch):
    """Triton's active driver replaced by one whose C functions record their calls: the
    launcher, the TMA encoder (under both its names) and the signature packer."""
    import triton.backends.nvidia.driver as nvidia_driver
    from triton.runtime import driver

    calls = []

    def fill(pointer, *encoding):  # a stand-in CUtensorMap that shows what was encoded
        return ("map", pointer, repr([list(e) if isinstance(e, tuple) else e
                                      for e in encoding]))

    utils = SimpleNamespace(launch=lambda *args: calls.append(args), fill_tma_descriptor=fill,
                            fill_tma_descriptor_tiled=fill,
                            build_signature_metadata=lambda types: repr(types).encode())
    monkeypatch.setattr(driver, "_active", SimpleNamespace(
        utils=utils, get_current_device=lambda: 0, get_current_stream=lambda device: 77))
    # The annotations 3.7+ builds come from the C utils module: plain tuples stand in.
    monkeypatch.setattr(nvidia_driver, "PyKernelArg",
                        lambda nested_tuple, type: (type, nested_tuple), raising=False)
    for i, name in enumerate(("ARG_CONSTEXPR", "ARG_KERNEL", "ARG_TUPLE")):
        monkeypatch.setattr(nvidia_driver, name, i, raising=False)
    return SimpleNamespace(calls=calls, utils=utils)


@direct_here
def test_compiled_launch_finds_the_c_launcher_under_tritons_descriptor_wrapper(
        fake_cuda_driver):
    # CompiledLaunch reads the C launcher out of wrap_handle_tensordesc's closure and
    # calls it with final arguments: checked here against this Triton's own wrapper
    # (no GPU needed), so an internal rename shows up as a failure, not as a slow path.
    from triton.runtime.jit import mangle_type

    from attnlab.kernels._launch import CompiledLaunch
    from attnlab.kernels._sm90 import descriptor

    example = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 64, 64],
            "fp4_padded": False}
    compiled = fake_compiled(meta, {"desc": mangle_type(descriptor(example, "bshd", 64)),
                                    "X": "*bf16"})
    launch = CompiledLaunch(compiled)
    assert compiled.run.launch is not launch.c_launch  # the wrapper was seen through
    assert launch.c_launch is fake_cuda_driver.utils.launch and launch.direct
    assert launch.tensordesc_meta == (meta,)
    # With scratch memory to allocate, Triton's own path stays in charge.
    compiled.run.global_scratch_size = 128
    assert not CompiledLaunch(compiled).direct


@direct_here
def test_a_direct_gluon_launch_passes_the_c_launcher_what_tritons_own_path_passes(
        fake_cuda_driver):
    # The planned launch (descriptors encoded by TmaSlot, CompiledLaunch.raw) against
    # Triton's own CudaLauncher on the same arguments: the C launcher must receive the
    # same call, in whichever convention this Triton's launcher has.
    from triton.runtime.jit import mangle_type

    from attnlab.kernels._launch import CompiledLaunch
    from attnlab.kernels._sm90 import PlannedDescriptor, PlannedGluonLaunch, descriptor_parts

    q = torch.randn(1, 64, 2, 64).to(torch.bfloat16)
    parts = descriptor_parts(q, "bshd", 64)
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 64, 64],
            "fp4_padded": False}
    planned_descriptor = PlannedDescriptor(q, parts)
    signature = {"q_desc": mangle_type(planned_descriptor(q)), "O": "*bf16", "n": "i32",
                 "BLOCK": "constexpr"}
    compiled = fake_compiled(meta, signature)
    out = torch.empty_like(q)
    # Triton's own path: JITFunction.run's call of CompiledKernel.run, no hooks registered.
    compiled.run(3, 1, 1, 77, compiled.function, compiled.packed_metadata, None, None, None,
                 planned_descriptor(q), out, 5, 64)
    kernel = SimpleNamespace(arg_names=list(signature))
    cache = {"key": CompiledLaunch(compiled)}
    planned = PlannedGluonLaunch(cache, kernel, (3,), (planned_descriptor,), (5,),
                                 {"BLOCK": 64}, "key", 240)
    planned((q,), (out,))
    assert planned.launch is cache["key"]  # it went direct
    # (Triton hands 3.7+'s variadic launcher its arguments as a list, the direct path as a
    # tuple: the C launcher reads either as a sequence.)
    own, direct = ([tuple(a) if isinstance(a, list) else a for a in call]
                   for call in fake_cuda_driver.calls)
    assert direct == own


@direct_here
def test_a_planned_direct_launch_passes_the_c_launcher_what_tritons_own_path_passes(
        fake_cuda_driver):
    # CompiledLaunch.planned fixes the grid and the path once (what a PlannedLaunch keeps);
    # its launches, raw's and __call__'s must all reach the C launcher as Triton's own
    # path does, in whichever convention this Triton's launcher has.
    from attnlab.kernels._launch import CompiledLaunch

    compiled = fake_compiled(None, {"X": "*bf16", "O": "*bf16", "n": "i32",
                                    "BLOCK": "constexpr"})
    x, out = torch.zeros(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    compiled.run(3, 2, 1, 77, compiled.function, compiled.packed_metadata, None, None, None,
                 x, out, 5, 64)
    launch = CompiledLaunch(compiled)
    assert launch.goes_direct(4)
    launch.planned((3, 2), 4)((x, out, 5, 64))
    launch.raw((3, 2), (x, out, 5, 64))
    launch((3, 2), (x, out, 5, 64))
    own, *direct = ([tuple(a) if isinstance(a, list) else a for a in call]
                    for call in fake_cuda_driver.calls)
    assert direct == [own] * 3


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
