"""Host (Python) time of one ``flash_attn_with_kvcache`` decode call with its launches
stubbed, on the CPU: the part of the GPU host time (bench/host_cost_h200.py) that is
attnlab's Python, measurable where no GPU is (bench/NOTES.md S20).

    PYTHONPATH=src python bench/decode_host_python.py [--calls N] [--repeats R]
        [--entry fa3|plain|both] [--shapes contiguous,paged16,paged256,d256] [--profile]

CPU tensors; what the GPU path needs of the device is patched, nothing else:
  * attnlab.api.kvcache._resolve_impl -> "triton" after check_impl (q.is_cuda is read
    only when a plan is made),
  * the decode kernels' DirectLaunchers: ``launch`` a no-op, ``compiled_launch`` a
    CompiledLaunch as Triton 3.9's variadic launcher builds one with a no-op C launcher,
    so a PlannedLaunch takes its steady-state path exactly as after its first launch on
    a GPU,
  * attnlab.kernels._launch._current_stream -> 0 (on a GPU: two C calls into the driver).
No TRITON_INTERPRET: the GPU tiling is planned.  On a GPU host each call adds its two or
three allocations and the launches' C calls.  To compare two trees, alternate them
(``PYTHONPATH=<other tree>/src``) in several processes: a shared machine drifts by ~30%.
"""
import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

import attnlab
import attnlab.api.kvcache as kvcache
import attnlab.kernels._launch as _launch
import attnlab.kernels.decode as decode
from attnlab.api.common import check_impl
from attnlab.flash_attn_interface import flash_attn_with_kvcache as fa3_call


def _triton(impl, q):
    check_impl(impl)
    return "triton"


class _FakeKernel:
    """What CompiledLaunch reads of a CompiledKernel (its C launcher a no-op)."""
    function, packed_metadata = 0, ()

    def launch_metadata(self, grid, stream, *args):
        return None


def _c_launch_noop(*args):
    return None


def _fake_compiled_launch(kernel):
    """A CompiledLaunch as Triton 3.9's variadic launcher gives one (direct, no TMA
    descriptors), its C launcher a no-op: the steady-state launch's Python runs as on a GPU."""
    fake = object.__new__(_launch.CompiledLaunch)
    fake.compiled, fake.c_launch, fake.tensordesc_meta = _FakeKernel(), _c_launch_noop, ()
    fake.direct, fake.variadic = True, True
    fake.fixed = (0, False, False, ())
    fake.after_hooks = (None, None, (), "")
    fake.arity = len(kernel.arg_names)
    return fake


def _stub(launcher):
    fake = _fake_compiled_launch(launcher.kernel)
    launcher.launch = lambda key, grid, args, meta: None
    launcher.compiled_launch = lambda key, n, meta: (
        fake, tuple(meta[name] for name in launcher.kernel.arg_names[n:]))


kvcache._resolve_impl = _triton
# driver.active.get_current_stream(get_current_device()): two C calls on a GPU host.
_launch._current_stream = lambda: 0
_stub(decode._SPLIT)
_stub(decode._COMBINE)


def inputs(page_size, *, batch=1, keys=4096, heads=32, kv_heads=8, d=128):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, heads, d, generator=gen).to(torch.bfloat16)
    k = torch.zeros(batch, keys, kv_heads, d, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    lengths = torch.full((batch,), keys, dtype=torch.int32)
    if page_size is None:
        return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lengths), None
    per_seq = keys // page_size
    k, v = (t.view(batch * per_seq, page_size, kv_heads, d) for t in (k, v))
    table = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(torch.int32)
    return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lengths), table


SHAPES = {
    "contiguous": dict(page_size=None),
    "paged16": dict(page_size=16),
    "paged256": dict(page_size=256),
    "d256": dict(page_size=None, keys=32768, heads=24, kv_heads=4, d=256),
}


def call_for(entry, name):
    spec = dict(SHAPES[name])
    args, table = inputs(spec.pop("page_size"), **spec)
    scale = args["q"].shape[-1] ** -0.5
    q, k, v, n = args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"]
    # As bench/host_cost_h200.py's decode_call calls it (FA3's names for the fa3 entry).
    if entry == "fa3":
        if table is None:
            return lambda: fa3_call(q, k, v, cache_seqlens=n, causal=True, softmax_scale=scale)
        return lambda: fa3_call(q, k, v, cache_seqlens=n, page_table=table, causal=True,
                                softmax_scale=scale)
    if table is None:
        return lambda: attnlab.flash_attn_with_kvcache(q, k, v, cache_seqlens=n, causal=True,
                                                       softmax_scale=scale)
    return lambda: attnlab.flash_attn_with_kvcache(q, k, v, cache_seqlens=n, block_table=table,
                                                   causal=True, softmax_scale=scale)


def per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--entry", default="both")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    entries = ("fa3", "plain") if a.entry == "both" else (a.entry,)
    for entry in entries:
        for name in a.shapes.split(","):
            fn = call_for(entry, name)
            for _ in range(2000):
                fn()
            assert attnlab.last_impl() == "triton-decode", attnlab.last_impl()
            if a.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(2000):
                    fn()
                prof.disable()
                print(f"== {entry} {name}")
                pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
                continue
            times = [per_call_us(fn, a.calls) for _ in range(a.repeats)]
            print(f"{entry:5s} {name:10s} median {statistics.median(times):6.2f} us  "
                  f"min {min(times):6.2f}  max {max(times):6.2f}", flush=True)


if __name__ == "__main__":
    main()
