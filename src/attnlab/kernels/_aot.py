"""Ahead of time, without a GPU: the Triton kernels compiled for sm_90a as a launch
specialises them, and what ptxas made of them.

ptxas can crash on tiles a dispatch table chooses (Triton 3.6.0's dies with SIGSEGV on
the backward's two-stage dQ tiles at head_dim 16/32: bench/NOTES.md, B15), and a tile
that builds can still spill.  Both show up here on the CPU (the Triton wheels bundle
ptxas and cuobjdump), so the choices are checked on every supported Triton before a GPU
ever runs them: ``bench/ptxas_configs.py`` sweeps them, ``tests/test_ptxas_configs.py``
compiles a sample and checks the tables against the failures recorded.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import triton

# The kernels name their pointers in capitals; these hold fp32 row statistics, the
# cu_seqlens ones int32, the rest the call's dtype.
_FP32_POINTERS = ("LSE", "DLSE", "DELTA", "LSE_LOG2")
_FP32_SCALARS = ("qk_scale", "softcap_log2", "softcap_inv", "scale")
# Strides of the (batch, head, seq) row statistics: 16-divisible where seqlen_q is.
_STAT_STRIDES = ("stride_lse", "stride_delta")


def signature(kernel, dtype: str, constants: dict, *, tensor_strides_aligned: bool) -> tuple:
    """(signature, attrs) of a launch on fresh contiguous tensors: every pointer 16-byte
    aligned (torch's allocations), the statistics' strides 16-divisible (a sequence length
    that is), and the q/k/v/O strides 16-divisible where ``tensor_strides_aligned`` (a
    head dim that is a multiple of 16: bshd's row stride is heads x head_dim)."""
    sig, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            sig[name] = "constexpr"
            continue
        if name.isupper():
            sig[name] = ("*fp32" if name in _FP32_POINTERS else
                         "*i32" if name.startswith("CU_SEQLENS") else f"*{dtype}")
        else:
            sig[name] = "fp32" if name in _FP32_SCALARS else "i32"
        aligned = (name.isupper() or name.startswith(_STAT_STRIDES)
                   or (name.startswith("stride") and tensor_strides_aligned))
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_triton(kernel, dtype: str, constants: dict, *, num_warps: int, num_stages: int):
    """``kernel`` compiled for sm_90a here (``.asm['cubin']``, ``.metadata``); raises
    Triton's PTXASError where ptxas cannot build it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = signature(kernel, dtype, constants,
                           tensor_strides_aligned=constants["HEAD_DIM"] % 16 == 0)
    source = ASTSource(kernel, sig, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _cuobjdump() -> str | None:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


def _cuobjdump_output(cubin: bytes, flag: str) -> str | None:
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=False)
    return done.stdout if done.returncode == 0 else None


def disassemble(cubin: bytes) -> str | None:
    """SASS of a cubin by ``cuobjdump --dump-sass`` (Triton bundles one), or None."""
    return _cuobjdump_output(cubin, "--dump-sass")


def resource_usage(cubin: bytes) -> dict | None:
    """Registers per thread, the stack frame's bytes (where ptxas puts spilled
    registers) and the SASS's local-memory instructions (LDL/STL: the spills' loads
    and stores) of a one-kernel cubin, or None without cuobjdump."""
    usage = _cuobjdump_output(cubin, "--dump-resource-usage")
    sass = disassemble(cubin)
    if usage is None or sass is None:
        return None
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if match is None:
        return None
    return {"registers": int(match.group(1)), "stack_bytes": int(match.group(2)),
            "local_memory_ops": len(re.findall(r"\b(?:LDL|STL)\b", sass))}
