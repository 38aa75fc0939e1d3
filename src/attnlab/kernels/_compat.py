"""What the installed Triton offers the Gluon sm_90 kernels and the direct launches, found
by probing features (does a name exist, which parameters does a call take), never by
comparing version strings: the one module that knows Triton releases differ.

Read from the released wheels' sources (docs/versions.md has the table):

* 3.7 made ``mbarrier.expect``'s byte count ``bytes_per_cta`` (the kernels pass it by
  position, so both spellings serve), renamed ``gl.thread_barrier`` ``gl.barrier``, and replaced the C launcher generated per kernel
  with one variadic ``utils.launch`` taking the kernel's arguments as one sequence after
  their annotations and signature; ``fill_tma_descriptor`` became
  ``fill_tma_descriptor_tiled``.
* 3.8 added ``tma.async_load``; ``async_copy_global_to_shared`` became its alias.
* 3.9 made ``async_copy_global_to_shared`` raise and renamed the private
  ``_reinterpret`` to the public ``reinterpret``; ``enable_fp_fusion`` will default to
  off in 3.10, so launches pass the value the kernels were tuned with.

A Triton whose probes fail keeps the portable Triton kernels and the plain
``kernel[grid]`` launch, and the reason is kept: ``gluon_refusal()`` (what the Gluon
kernels' ``supports`` report) and ``direct_launch_refusal()``, each logged once to the
``attnlab.kernels`` logger.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

log = logging.getLogger("attnlab.kernels")

# The value of enable_fp_fusion every kernel was tuned and checked with (Triton 3.6-3.9's
# default; 3.9 warns that 3.10 turns it off).
FP_FUSION = True


@dataclass(frozen=True)
class GluonApi:
    """The spellings this Triton's Gluon uses for what the kernels call."""

    tma_load: str     # hopper.tma's global -> shared copy: async_load or its older name
    reinterpret: str  # shared_memory_descriptor's method: reinterpret or _reinterpret
    barrier: str      # gl's barrier of the calling partition's threads: barrier or older


def first_name(owner, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` that ``owner`` has as a callable attribute."""
    return next((n for n in names if callable(getattr(owner, n, None))), None)


def parameters(fn) -> list[str]:
    """``fn``'s parameter names (through functools.wraps, as Gluon's builtins are)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def tma_load_name(tma) -> str | None:
    """3.8+: ``async_load`` (3.9's ``async_copy_global_to_shared`` exists only to raise);
    3.6-3.7: ``async_copy_global_to_shared``."""
    return first_name(tma, ("async_load", "async_copy_global_to_shared"))


def reinterpret_name(descriptor_class) -> str | None:
    """3.9+: ``reinterpret``; 3.6-3.8: ``_reinterpret``."""
    return first_name(descriptor_class, ("reinterpret", "_reinterpret"))


def barrier_name(gl) -> str | None:
    """3.7+: ``barrier``; 3.6: ``thread_barrier``."""
    return first_name(gl, ("barrier", "thread_barrier"))


def expect_takes_bytes_second(expect) -> bool:
    """The kernels call ``mbarrier.expect(barrier, nbytes)``: the byte count must be the
    second parameter, whatever its name (``bytes`` in 3.6, ``bytes_per_cta`` from 3.7)."""
    try:
        second = list(inspect.signature(expect).parameters.values())[1]
    except (TypeError, ValueError, IndexError):
        return False
    return second.name in ("bytes", "bytes_per_cta") and second.kind in (
        second.POSITIONAL_ONLY, second.POSITIONAL_OR_KEYWORD)


# What else the kernels call, with the parameters they pass by name or position.
_GLUON_CALLS = {
    "gl.warp_specialize": ("functions_and_args", "worker_num_warps", "worker_num_regs"),
    "gl.allocate_shared_memory": ("element_ty", "shape", "layout"),
    "hopper.warpgroup_mma": ("a", "b", "acc", "use_acc", "is_async"),
    "hopper.warpgroup_mma_wait": ("num_outstanding", "deps"),
    "mbarrier.init": ("mbarrier", "count"),
    "mbarrier.wait": ("mbarrier", "phase", "pred"),
    "mbarrier.arrive": ("mbarrier", "count"),
    "mbarrier.invalidate": ("mbarrier",),
}
_GLUON_NAMES = ("gl.NVMMADistributedLayout", "gl.DotOperandLayout", "gl.NVMMASharedLayout",
                "gl.SwizzledSharedLayout", "mbarrier.MBarrierLayout", "hopper.fence_async_shared")


def probe_gluon(modules: dict) -> GluonApi | str:
    """The spellings to use, or why the kernels cannot be built on these modules
    (``gl``, ``hopper``, ``tma``, ``mbarrier``, and ``gl.shared_memory_descriptor``)."""
    def lookup(path):
        owner, _, name = path.partition(".")
        return getattr(modules[owner], name, None)

    missing = [p for p in _GLUON_NAMES if lookup(p) is None]
    for path, wanted in _GLUON_CALLS.items():
        names = parameters(lookup(path)) if callable(lookup(path)) else []
        if not set(wanted) <= set(names):
            missing.append(f"{path}({', '.join(wanted)})")
    if not expect_takes_bytes_second(getattr(modules["mbarrier"], "expect", None)):
        missing.append("mbarrier.expect(mbarrier, bytes)")
    tma_load = tma_load_name(modules["tma"])
    if tma_load is None:
        missing.append("tma.async_load / async_copy_global_to_shared")
    reinterpret = reinterpret_name(getattr(modules["gl"], "shared_memory_descriptor", None))
    if reinterpret is None:
        missing.append("shared_memory_descriptor.reinterpret / _reinterpret")
    barrier = barrier_name(modules["gl"])
    if barrier is None:
        missing.append("gl.barrier / thread_barrier")
    if missing:
        return f"this Triton's Gluon lacks what the kernels call: {', '.join(missing)}"
    return GluonApi(tma_load=tma_load, reinterpret=reinterpret, barrier=barrier)


@functools.cache
def gluon_api() -> GluonApi | str:
    """``probe_gluon`` on the installed Triton (a reason string if it has no Gluon)."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as error:
        found = f"this Triton has no Gluon for Hopper ({error})"
    else:
        found = probe_gluon({"gl": gl, "hopper": hopper, "tma": tma, "mbarrier": mbarrier})
    if isinstance(found, str):
        log.info("attnlab: the Gluon sm_90 kernels are off: %s", found)
    return found


def gluon_refusal() -> str | None:
    """Why the Gluon sm_90 kernels cannot be built on this Triton, or None."""
    found = gluon_api()
    return found if isinstance(found, str) else None


# ----- the direct launch ------------------------------------------------------------------

# CudaLauncher.__call__'s parameters (JITFunction.run calls every version the same way;
# what the launcher then hands its C function differs).
_PER_KERNEL = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
_VARIADIC = ["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
             "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args"]


def launcher_convention(launcher_class) -> str | None:
    """How Triton's CUDA launcher calls its C function: ``"per-kernel"`` (3.6: a module
    compiled per kernel, ``launch(grid, stream, function, cooperative, pdl, scratch x 2,
    metadata, hooks, *args)``), ``"variadic"`` (3.7+: ``utils.launch(grid, stream,
    function, cooperative, pdl, metadata, hooks, scratch x 2, annotations, signature,
    args)``), or None for a launcher this module does not know."""
    names = parameters(launcher_class.__call__)
    if names == _PER_KERNEL:
        return "per-kernel"
    if names == _VARIADIC:
        return "variadic"
    return None


def tma_fill_name(utils) -> str | None:
    """The CUDA utils' tiled TMA descriptor encoder: ``fill_tma_descriptor_tiled`` (3.7+)
    or ``fill_tma_descriptor`` (3.6); the same arguments either way."""
    return first_name(utils, ("fill_tma_descriptor_tiled", "fill_tma_descriptor"))


@functools.cache
def direct_launch_refusal() -> str | None:
    """Why compiled kernels must be launched through ``kernel[grid]`` here, or None."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError as error:
        reason = f"this Triton has no CUDA launcher to call ({error})"
    else:
        reason = None if launcher_convention(CudaLauncher) else (
            "this Triton's CudaLauncher takes "
            f"({', '.join(parameters(CudaLauncher.__call__)[1:])}), a convention attnlab "
            "does not know")
    if reason is not None:
        log.info("attnlab: launches go through kernel[grid]: %s", reason)
    return reason


@functools.cache
def launch_options() -> dict:
    """Compile options every attnlab kernel launch passes: the fp fusion the kernels were
    tuned with, where this Triton's CUDA options have the field."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return {}
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return {"enable_fp_fusion": FP_FUSION} if "enable_fp_fusion" in fields else {}
