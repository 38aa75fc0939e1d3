"""Which kernels a call actually launched: the proof behind every provider name.

An eligibility check says a fused kernel *could* run; only the profiler says it
*did* (the lesson, §6.2).  :func:`profile_call` runs a prepared call once under
``torch.profiler`` (after a warm-up outside it, so compilation, autotuning and lazy
initialisation are not counted), exports the trace and reads the GPU activity
back with :func:`parse_chrome_trace` — the same parser the tests run on a
captured trace.

A :class:`KernelList` gives each kernel's launches and time, and the share of GPU
time spent outside the matrix multiplies (the post's eager baseline: 12 kernels,
91.5% of the time outside its two GEMMs).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Chrome-trace categories of GPU work recorded by torch.profiler (Kineto).
GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")

# Base-name patterns of matrix-multiply kernels: cuBLAS (incl. Hopper's nvjet JIT
# kernels), CUTLASS GEMMs, and Triton's matmul templates from torch.compile.
_GEMM_BASE = re.compile(r"gemm|nvjet|cublas|xmma|_mm_|bmm|matmul|triton_tem_fused_mm",
                        re.IGNORECASE)
_ATTENTION_HINT = re.compile(r"flash|fmha|attention|attn|sdpa|flex", re.IGNORECASE)


def base_name(name: str) -> str:
    """A kernel's name without return type, template arguments or parameters."""
    text = name.strip()
    if text.startswith("void "):
        text = text[5:]
    # Anonymous namespaces are part of the name, not template arguments or parameters.
    protected = {"<unnamed>": "\x00u", "(anonymous namespace)": "\x00a"}
    for original, stand_in in protected.items():
        text = text.replace(original, stand_in)
    for stop in ("<", "("):
        cut = text.find(stop)
        if cut > 0:
            text = text[:cut]
    for original, stand_in in protected.items():
        text = text.replace(stand_in, original)
    return text.strip()


def is_gemm(name: str) -> bool:
    """True for matrix-multiply kernels, False for attention and elementwise kernels.

    Decided on the base name first, because attention kernels mention CUTLASS or
    wgmma in their template arguments; a generic ``cutlass::Kernel`` counts as a
    GEMM only when its arguments say gemm and nothing says attention.
    """
    base = base_name(name)
    if _ATTENTION_HINT.search(base):
        return False
    if _GEMM_BASE.search(base):
        return True
    return base.startswith("cutlass") and "gemm" in name.lower() \
        and not _ATTENTION_HINT.search(name)


_ELEMENTWISE = ("vectorized_elementwise_kernel", "elementwise_kernel",
                "unrolled_elementwise_kernel", "distribution_elementwise_grid_stride_kernel")
_FUNCTOR = re.compile(r"(\w*Functor\w*|masked_fill\w*|bitwise_not\w*|copy_kernel\w*|"
                      r"\w+_kernel_cuda|normal_kernel)")
_WRAPPER = re.compile(r"(A|B)?Unary\w*Functor|Binary\w*Functor")


def short_name(name: str, width: int = 72) -> str:
    """The kernel's own name without namespaces; a generic elementwise kernel also says
    which operation it applies (``vectorized_elementwise_kernel[MulFunctor]``)."""
    base = base_name(name)
    tail = base.split("::")[-1] or base
    if tail in _ELEMENTWISE:
        found = _FUNCTOR.findall(name)
        # AUnaryFunctor/BinaryFunctor wrap the operation (MulFunctor): name the operation
        specific = [f for f in found if not _WRAPPER.match(f)]
        if found:
            tail = f"{tail}[{(specific or found)[0]}]"
    return tail if len(tail) <= width else tail[: width - 1] + "…"


@dataclass(frozen=True)
class KernelStat:
    name: str
    calls: int
    total_us: float

    @property
    def mean_us(self) -> float:
        return self.total_us / self.calls

    @property
    def is_gemm(self) -> bool:
        return is_gemm(self.name)


@dataclass(frozen=True)
class KernelList:
    """GPU work of one call, aggregated by kernel name in first-launch order."""

    kernels: tuple[KernelStat, ...]

    @property
    def launches(self) -> int:
        return sum(k.calls for k in self.kernels)

    @property
    def total_us(self) -> float:
        return sum(k.total_us for k in self.kernels)

    @property
    def gemm_us(self) -> float:
        return sum(k.total_us for k in self.kernels if k.is_gemm)

    @property
    def outside_gemm_share(self) -> float:
        """Fraction of GPU time in kernels that are not matrix multiplies."""
        total = self.total_us
        return (total - self.gemm_us) / total if total > 0 else 0.0

    def names(self) -> list[str]:
        return [k.name for k in self.kernels]

    def as_dict(self) -> dict:
        return {
            "launches": self.launches, "total_us": self.total_us, "gemm_us": self.gemm_us,
            "outside_gemm_share": self.outside_gemm_share,
            "kernels": [{"name": k.name, "short_name": short_name(k.name), "calls": k.calls,
                         "total_us": k.total_us, "mean_us": k.mean_us, "is_gemm": k.is_gemm}
                        for k in self.kernels],
        }


def summarize(activities: Iterable[tuple[str, float]]) -> KernelList:
    """Aggregate (name, duration in µs) pairs, in launch order, by name."""
    order: list[str] = []
    calls: dict[str, int] = {}
    total: dict[str, float] = {}
    for name, duration in activities:
        if name not in calls:
            order.append(name)
            calls[name], total[name] = 0, 0.0
        calls[name] += 1
        total[name] += float(duration)
    return KernelList(tuple(KernelStat(n, calls[n], total[n]) for n in order))


def gpu_activities(trace: dict) -> list[tuple[str, float]]:
    """(name, duration µs) of the GPU work in a Chrome trace, sorted by start time."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list")
    events = [e for e in trace["traceEvents"]
              if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    events.sort(key=lambda e: float(e.get("ts", 0.0)))
    return [(str(e["name"]), float(e.get("dur", 0.0))) for e in events]


def parse_chrome_trace(path: str | Path) -> KernelList:
    """The kernel list of a trace written by ``torch.profiler``'s ``export_chrome_trace``."""
    path = Path(path)
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no trace at {path}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON ({error.msg})") from None
    return summarize(gpu_activities(trace))


def profile_call(call, args: tuple, *, warmup: int = 1,
                 trace_path: str | Path | None = None) -> KernelList:
    """Run ``call(*args)`` once under the profiler and list the GPU work it launched.

    Raises RuntimeError when the profiler saw no GPU work at all (a CPU run, or a
    call that never reached the device): an empty list is never a result.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        raise RuntimeError("listing kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    for _ in range(warmup):
        call(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(*args)
        torch.cuda.synchronize()
    if trace_path is None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            kernels = parse_chrome_trace(path)
    else:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        kernels = parse_chrome_trace(trace_path)
    if not kernels.kernels:
        raise RuntimeError("the profiler recorded no GPU kernels for this call")
    return kernels
