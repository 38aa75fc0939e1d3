"""Ahead of time, without a GPU: the Triton kernels compiled for sm_90a as a launch
specialises them, and what Triton and ptxas made of them.

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

# The kernels name their pointers in capitals; these hold fp32 row statistics (and the
# decode kernel's partials and descale factors), the index tensors int32, the index-error
# record int64, the rest the call's dtype.
_FP32_POINTERS = ("LSE", "DLSE", "DELTA", "LSE_LOG2", "O_PART", "LSE_OUT",
                  "K_DESCALE", "V_DESCALE")
_I32_POINTERS = ("CU_SEQLENS", "CACHE_SEQLENS", "CACHE_BATCH_IDX", "CACHE_LEFTPAD",
                 "BLOCK_TABLE", "SEQUSED")
_I64_POINTERS = ("ERRORS",)
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
                         "*i32" if name.startswith(_I32_POINTERS) else
                         "*i64" if name in _I64_POINTERS else f"*{dtype}")
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


# The layout of a dot's result: Triton's MMA encodings name the instruction family
# (versionMajor 3 is wgmma, 2 mma.sync) and how the warps tile the result.
_MMA_ENCODING = re.compile(
    r"^#(\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+).*?warpsPerCTA = \[(\d+), (\d+)\]"
    r".*?instrShape = \[(\d+), (\d+)", re.M)
# "%dk_198 = ttng.warp_group_dot %a, %b, %c {...} : A * B -> tensor<64x256xf32, #mma>";
# the SSA name carries the kernel's variable (the compiler's _N suffix dropped).
_DOT = re.compile(r"%([A-Za-z_]\w*?)(?:_\d+)?(?::\d+)? = (tt\.dot|ttng\.warp_group_dot) (.*) -> "
                  r"tensor<(\d+)x(\d+)x\w+, #(\w+)>")
_OPERAND_SHAPE = re.compile(r"(?:tensor|memdesc)<((?:\d+x)+)")


def mma_dots(ttgir: str) -> list[dict]:
    """Each distinct dot of a compiled kernel (``.asm['ttgir']``), in order: the kernel's
    variable, the instruction (``wgmma``, ``mma.sync`` or ``fma``), its M x N x K, how
    the warps tile M and N, and ``replication``: how many times a warp layout that
    covers more than the tile computes each output element (warps laid along M cover
    16 rows each, so 8 warps over a 64-row wgmma compute every row twice)."""
    encodings = {name: (int(major), (int(wm), int(wn)), (int(im), int(inn)))
                 for name, major, wm, wn, im, inn in _MMA_ENCODING.findall(ttgir)}
    dots: dict[tuple, dict] = {}
    for name, op, operands, m, n, encoding in _DOT.findall(ttgir):
        # A's shape is the first operand type: its last extent is K.
        m, n, k = int(m), int(n), int(_OPERAND_SHAPE.findall(operands)[0].split("x")[-2])
        if encoding not in encodings:
            dot = {"dot": name, "mma": "fma", "m": m, "n": n, "k": k, "warps": None,
                   "replication": 1}
        else:
            major, warps, instr = encodings[encoding]
            covered = (warps[0] * instr[0], warps[1] * instr[1])
            dot = {"dot": name, "mma": "wgmma" if op == "ttng.warp_group_dot" else "mma.sync",
                   "m": m, "n": n, "k": k, "warps": list(warps),
                   "replication": max(1, covered[0] // m) * max(1, covered[1] // n)}
        dots.setdefault(tuple(sorted((key, str(value)) for key, value in dot.items())), dot)
    return list(dots.values())


def mma_instructions(ptx: str) -> dict[str, int]:
    """How many wgmma and mma.sync instructions a kernel's PTX issues (per thread's
    program text, unrolled loops counted once per copy)."""
    return {"wgmma": len(re.findall(r"\bwgmma\.mma_async\b", ptx)),
            "mma_sync": len(re.findall(r"\bmma\.sync\b", ptx))}


def async_copy_depths(ttgir: str) -> list[int]:
    """How many async-copy groups each ``ttg.async_wait`` leaves in flight, in order: a
    loop whose K/V copies run two tiles ahead waits with 2 (num_stages 3), one that awaits
    every copy before its MMAs with 0."""
    return [int(n) for n in re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", ttgir)]
