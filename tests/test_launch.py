"""The direct launch path (kernels/_launch.py): what its cache key separates."""

from __future__ import annotations

import pytest
import torch

from attnlab.kernels._launch import DirectLauncher, _arg_class, int_class


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
        DirectLauncher(Kernel())((1,), (torch.zeros(1), 3), {"num_warps": 4})
