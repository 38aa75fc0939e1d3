"""Which kernels a call actually launched: the proof behind every provider name.

An eligibility check says a fused kernel *could* run; only the profiler says it
*did* (the lesson, §6.2).  :func:`profile_call` runs a prepared call once under
``torch.profiler`` (after a warm-up outside it, so compilation, autotuning and lazy
initialisation are not counted), exports the trace and reads the GPU activity
back with :func:`attnlab.measure.profile.parse_chrome_trace` -- the one trace
reader, the same the tests run on a captured trace and the report uses.

A :class:`~attnlab.measure.profile.KernelList` gives each kernel's launches and time,
and the share of GPU time spent outside the matrix multiplies (the post's eager
baseline: 12 kernels, 91.5% of the time outside its two GEMMs).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from attnlab.measure.profile import KernelList, parse_chrome_trace


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



def kernel_proof_failure(owner: str, expected, names) -> str | None:
    """Why the profiled kernel ``names`` do not prove that ``owner``'s kernel ran (none
    contains a piece of ``expected``), or None (also when nothing is expected)."""
    if not expected or any(piece in name for piece in expected for name in names):
        return None
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "") or "no kernels"
    return (f"the profiler saw none of {owner}'s kernels (a name containing "
            f"{' or '.join(map(repr, expected))}); it saw {shown}")


def kernels_that_ran(call, args: tuple, expected: tuple[str, ...] = (), *,
                     owner: str = "the call", context=None) -> list[str]:
    """The names of the GPU kernels ``call(*args)`` launched (:func:`profile_call`, inside
    ``context()`` where given, as the timer takes it), for a record's ``kernel_names``:
    what ran, not what was meant to.  RuntimeError (:func:`kernel_proof_failure`) when
    none contains a piece of ``expected``."""
    with context() if context is not None else contextlib.nullcontext():
        names = profile_call(call, args).names()
    failure = kernel_proof_failure(owner, expected, names)
    if failure:
        raise RuntimeError(failure)
    return names
