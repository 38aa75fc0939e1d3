"""FlashInfer's nvcc builds: where they go, for which GPU, and started early.

FlashInfer compiles each kernel module with nvcc the first time a call needs it (for
head_dim 256 that is minutes of compiler time, not seconds), FlashAttention-4 each
configuration with the CuTe DSL on its first call (seconds, in process).  A benchmark
that measures FlashInfer inside a time budget therefore

1. points FlashInfer's cache at a folder of its own and its targets at this GPU's
   architecture alone, before ``flashinfer`` is imported (it reads both at import):
   :func:`configure_flashinfer`;
2. starts the builds at once, beside the other providers' GPU work
   (:class:`FlashInferPrebuild`): a build is ninja running nvcc in subprocesses, so the
   measuring thread goes on while it runs, and the first call of a built module only
   loads it (one causal FA3 head_dim-256 kernel file took nvcc 13.0 165 s of CPU and
   3.6 GB here).  A build takes FlashInfer's own lock, so a call that needs a module still
   building waits for that build instead of starting a second one.

The modules are the ones the providers' calls select (``measure.providers``):
``single_prefill_with_kv_cache`` (FA3 on sm_90 for head_dim 64/128/256, else FA2), the
tensor-core ``single_decode_with_kv_cache`` (FA2 single prefill) and the FA2 batch
prefill behind the ragged and paged wrappers.  A build that fails is reported with its
error; the call that needs it then compiles (and fails) in the foreground, with the
reason recorded like any provider failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Where attnlab's runs keep FlashInfer's builds (the benchmark's and the GPU tests' alike,
# so one reuses the other's modules).
DEFAULT_CACHE = "/tmp/attnlab-flashinfer"
CACHE_ENV = "FLASHINFER_WORKSPACE_BASE"
ARCH_ENV = "FLASHINFER_CUDA_ARCH_LIST"
# FlashInfer's FA3 (Hopper) prefill kernels exist for these head dims.
FA3_HEAD_DIMS = (64, 128, 256)


def flashinfer_arch(capability: tuple[int, int]) -> str:
    """FlashInfer's spelling of one architecture ("9.0"; it adds the "a" itself)."""
    major, minor = capability
    return f"{major}.{minor}"


def configure_flashinfer(cache_root: str | os.PathLike, capability: tuple[int, int]) -> dict:
    """Set FlashInfer's cache folder and target architecture (values already in the
    environment win); returns what is in force.  Refused once flashinfer is imported:
    it would not read them any more."""
    if "flashinfer" in sys.modules:
        raise RuntimeError("configure_flashinfer must run before flashinfer is imported "
                           "(it reads its cache folder and targets at import)")
    os.environ.setdefault(CACHE_ENV, os.fspath(cache_root))
    os.environ.setdefault(ARCH_ENV, flashinfer_arch(capability))
    return {name: os.environ[name] for name in (CACHE_ENV, ARCH_ENV)}


def prefill_backend(capability: tuple[int, int], head_dim: int) -> str:
    """The backend ``single_prefill_with_kv_cache(backend="auto")`` picks for bf16/fp16
    without custom masks: FA3 on Hopper where its kernels exist, else FA2."""
    return "fa3" if capability[0] == 9 and head_dim in FA3_HEAD_DIMS else "fa2"


SINGLE_PREFILL, SINGLE_DECODE, BATCH = "single prefill", "single decode", "batch prefill"


def module_for(provider: str, phase: str, batch: int) -> str:
    """Which module a flashinfer provider's call builds (``measure.providers``): the single
    prefill, the tensor-core single decode (batch 1), or the FA2 batch prefill behind the
    ragged (batch > 1) and paged wrappers."""
    if provider == "flashinfer_paged16" or batch > 1:
        return BATCH
    return SINGLE_PREFILL if phase == "prefill" else SINGLE_DECODE


def module_specs(dtype, head_dim: int, capability: tuple[int, int]) -> dict[str, Callable]:
    """() -> JitSpec of each module the flashinfer providers use at this dtype and head
    dim, by :func:`module_for`'s names."""
    import torch
    from flashinfer.jit.attention import modules

    args = (dtype, dtype, dtype, head_dim, head_dim, 0, False, False, False)
    batch_args = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)
    backend = prefill_backend(capability, head_dim)
    return {
        SINGLE_PREFILL: lambda: modules.gen_single_prefill_module(backend, *args),
        SINGLE_DECODE: lambda: modules.gen_single_prefill_module("fa2", *args),
        # The wrappers' FA2 module (ragged and equal-stride paged kernels); its name is
        # FlashInfer's own, so a version without it is a failed prebuild, not a crash.
        BATCH: lambda: modules._gen_batch_prefill_primary_module("fa2", *batch_args),
    }


@dataclass
class Build:
    module: str
    seconds: float | None = None
    error: str | None = None

    def as_dict(self) -> dict:
        return {"module": self.module, "seconds": self.seconds, "error": self.error}


@dataclass
class FlashInferPrebuild:
    """The builds, each in a background thread of its own at a lower CPU priority.

    All at once: a head_dim-256 module is 6 to 10 nvcc processes of minutes each (about
    3.6 GB of memory apiece), so the modules together fill a 16-core host about once;
    one after another they would take three times as long.  ``nice``: the compilers
    yield the CPU to the measuring thread, whose kernel launches must not wait."""

    specs: dict[str, Callable]
    nice: int = 10
    builds: dict[str, Build] = field(default_factory=dict)
    _threads: dict[str, threading.Thread] = field(default_factory=dict)

    def start(self) -> FlashInferPrebuild:
        for name, make in self.specs.items():
            self.builds[name] = Build(name)
            self._threads[name] = threading.Thread(
                target=self._run, args=(self.builds[name], make), daemon=True,
                name=f"flashinfer-prebuild: {name}")
            self._threads[name].start()
        return self

    def _run(self, build: Build, make: Callable) -> None:
        begin = time.monotonic()
        # Linux keeps a nice value per thread; ninja and nvcc, forked here, inherit it.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        try:
            make().build(need_lock=True)
        except Exception as error:  # noqa: BLE001 - reported; the call compiles again
            build.error = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        build.seconds = round(time.monotonic() - begin, 1)

    def done(self, name: str | None = None) -> bool:
        """Whether the build of ``name`` (a module not built here counts as done), or every
        build, has finished."""
        threads = self._threads.values() if name is None else [self._threads.get(name)]
        return not any(thread is not None and thread.is_alive() for thread in threads)

    def wait(self, timeout_s: float) -> float:
        """Wait up to ``timeout_s`` for every build; the seconds waited."""
        begin = time.monotonic()
        for thread in self._threads.values():
            thread.join(max(0.0, timeout_s - (time.monotonic() - begin)))
        return time.monotonic() - begin

    def rows(self) -> list[dict]:
        return [build.as_dict() for build in self.builds.values()]
