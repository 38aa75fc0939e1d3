"""kernels/_compat.py: each probe of the installed Triton, both answers where a fake module
can give the other one, and that nothing else in the package compares version strings."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from attnlab.kernels import _compat
from attnlab.kernels._compat import (
    GluonApi,
    expect_takes_bytes_second,
    launcher_convention,
    probe_gluon,
    reinterpret_name,
    tma_fill_name,
    tma_load_name,
)


def fn(*_args, **_kwargs):
    return None


def installed_gluon() -> dict:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    return {"gl": gl, "hopper": hopper, "tma": tma, "mbarrier": mbarrier}


def test_the_tma_load_is_async_load_where_it_exists():
    # 3.8 added async_load (3.9 keeps async_copy_global_to_shared only to raise).
    assert tma_load_name(SimpleNamespace(async_load=fn, async_copy_global_to_shared=fn)) \
        == "async_load"
    assert tma_load_name(SimpleNamespace(async_copy_global_to_shared=fn)) \
        == "async_copy_global_to_shared"
    assert tma_load_name(SimpleNamespace(async_copy_global_to_shared=None)) is None
    assert tma_load_name(installed_gluon()["tma"]) is not None


def test_reinterpret_is_the_public_name_where_it_exists():
    class Public:
        def reinterpret(self): ...

        def _reinterpret(self): ...

    class Private:
        def _reinterpret(self): ...

    assert reinterpret_name(Public) == "reinterpret"
    assert reinterpret_name(Private) == "_reinterpret"
    assert reinterpret_name(object) is None
    assert reinterpret_name(installed_gluon()["gl"].shared_memory_descriptor) is not None


def test_expect_must_take_the_byte_count_second_whatever_its_name():
    def expect_36(mbarrier, bytes, pred=True, _semantic=None): ...  # noqa: A002

    def expect_37(mbarrier, bytes_per_cta=None, pred=True, _semantic=None): ...

    def expect_keyword_only(mbarrier, *, bytes_per_cta, pred=True): ...

    def expect_reordered(mbarrier, pred, bytes_per_cta): ...

    assert expect_takes_bytes_second(expect_36) and expect_takes_bytes_second(expect_37)
    assert not expect_takes_bytes_second(expect_keyword_only)
    assert not expect_takes_bytes_second(expect_reordered)
    assert not expect_takes_bytes_second(None)
    assert expect_takes_bytes_second(installed_gluon()["mbarrier"].expect)


def test_the_installed_gluon_is_recognised():
    api = probe_gluon(installed_gluon())
    assert isinstance(api, GluonApi), api
    assert _compat.gluon_refusal() is None


def test_a_gluon_missing_what_the_kernels_call_is_refused_by_name():
    modules = installed_gluon()

    def warp_specialize(functions_and_args, worker_num_warps, _semantic=None): ...

    changed = {**modules, "gl": SimpleNamespace(**{
        name: getattr(modules["gl"], name) for name in dir(modules["gl"])
        if not name.startswith("__")})}
    changed["gl"].warp_specialize = warp_specialize
    del changed["gl"].SwizzledSharedLayout
    for name in ("barrier", "thread_barrier"):
        if hasattr(changed["gl"], name):
            delattr(changed["gl"], name)
    changed["tma"] = SimpleNamespace()
    reason = probe_gluon(changed)
    assert isinstance(reason, str)
    for words in ("gl.warp_specialize(functions_and_args, worker_num_warps, worker_num_regs)",
                  "gl.SwizzledSharedLayout", "tma.async_load", "gl.barrier / thread_barrier"):
        assert words in reason


def test_the_launcher_convention_is_read_from_its_call_signature():
    class PerKernel:  # Triton 3.6
        def __call__(self, gridX, gridY, gridZ, stream, function, *args): ...

    class Variadic:  # Triton 3.7-3.9
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                     launch_metadata, launch_enter_hook, launch_exit_hook, *args): ...

    class Unknown:
        def __call__(self, grid, stream, function, *args): ...

    assert launcher_convention(PerKernel) == "per-kernel"
    assert launcher_convention(Variadic) == "variadic"
    assert launcher_convention(Unknown) is None
    from triton.backends.nvidia.driver import CudaLauncher

    assert launcher_convention(CudaLauncher) is not None  # every supported Triton's
    assert _compat.direct_launch_refusal() is None


def test_an_unknown_launcher_is_named_in_the_refusal(monkeypatch):
    import triton.backends.nvidia.driver as nvidia_driver

    class Unknown:
        def __call__(self, grid, stream, function, *args): ...

    monkeypatch.setattr(nvidia_driver, "CudaLauncher", Unknown)
    reason = _compat.direct_launch_refusal.__wrapped__()
    assert "grid, stream, function, args" in reason


def test_the_tma_encoder_is_the_tiled_one_where_it_exists():
    assert tma_fill_name(SimpleNamespace(fill_tma_descriptor_tiled=fn,
                                         fill_tma_descriptor_im2col=fn)) \
        == "fill_tma_descriptor_tiled"
    assert tma_fill_name(SimpleNamespace(fill_tma_descriptor=fn)) == "fill_tma_descriptor"
    assert tma_fill_name(SimpleNamespace()) is None


def test_fp_fusion_is_passed_where_the_options_have_it(monkeypatch):
    from dataclasses import dataclass

    import triton.backends.nvidia.compiler as nvidia_compiler

    assert _compat.launch_options() == {"enable_fp_fusion": True}

    @dataclass
    class Options:
        num_warps: int = 4

    monkeypatch.setattr(nvidia_compiler, "CUDAOptions", Options)
    assert _compat.launch_options.__wrapped__() == {}


def test_an_unrecognised_triton_keeps_the_plain_launch_and_says_why(monkeypatch):
    import torch

    from attnlab.kernels import _launch, backward, dispatch
    from attnlab.kernels.backward_sm90 import DEFAULT_CONFIGS

    monkeypatch.setattr(_launch, "direct_launch_refusal", lambda: "a launcher we never saw")
    monkeypatch.setattr(_launch, "kernel_is_interpreted", lambda: False)
    launcher = _launch.DirectLauncher(SimpleNamespace(arg_names=["X"]))
    assert launcher.key((torch.zeros(1),), {}) is None  # kernel[grid] on every call
    monkeypatch.setattr(dispatch, "gluon_refusal", lambda: "no Gluon we know")
    q = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="no Gluon we know"):
        backward.flash_backward(q, q, q, q, q, torch.zeros(1, 2, 16), layout="bshd",
                                scale=0.125, dkdv_sm90=DEFAULT_CONFIGS[64])


# Comparing a version string is allowed only for a bug of one release, named here.
ALLOWED = {("src/attnlab/kernels/_primitives.py", "_interpreter_numpy_conflict")}


def reads_tritons_version(node) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "__version__"
               and isinstance(n.value, ast.Name) and n.value.id == "triton"
               for n in ast.walk(node))


def test_no_module_compares_tritons_version_string():
    repo = Path(__file__).parents[1]
    found = set()
    for path in sorted([*(repo / "src").rglob("*.py"), *(repo / "tests").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        enclosing = {}  # node -> the innermost function around it (ast.walk goes outer first)
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                enclosing.update((n, function.name) for n in ast.walk(function))
        for node in ast.walk(tree):
            splits = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "split")
            if (isinstance(node, ast.Compare) or splits) and reads_tritons_version(node):
                found.add((str(path.relative_to(repo)), enclosing.get(node, "<module>")))
    assert found <= ALLOWED, sorted(found - ALLOWED)
