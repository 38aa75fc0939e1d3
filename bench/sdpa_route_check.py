"""Which kernels plain SDPA runs before and after `attnlab.integrations.sdpa.activate()`.

Prints, per case, SDPA's own backend choice (``torch._fused_sdp_choice``) and the CUDA
kernels a forward and a backward launched, so a call that SDPA still sends to cuDNN
shows up by name:

    PYTHONPATH=src python3 bench/sdpa_route_check.py [--phases activate-first]

Phase ``activate-first`` (``--phases activate-first``; it was ``--activate-first``)
activates attnlab before this process makes any CUDA call (the order a test that starts
with activation has) and prints SDPA's priority order at each step, to show whether
initialising CUDA afterwards changes it.  A configuration of attnlab.measure.engine
(it writes nothing).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import attnlab.integrations.sdpa as attnlab_sdpa
from attnlab.measure.engine import Bench

bench = Bench("sdpa_route_check", __doc__)

CASES = [(1024, 1024, True, 8, 2), (1024, 1024, True, 8, 8), (1024, 1024, False, 8, 2),
         (300, 1000, False, 8, 2)]


def kernels_of(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as trace:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in trace.events() if e.device_type.name == "CUDA"})


def run(label: str) -> None:
    for seqlen_q, seqlen_k, causal, heads, kv_heads in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(2, heads, seqlen_q, 128, device="cuda", dtype=torch.bfloat16,
                        generator=gen, requires_grad=True)
        k = torch.randn(2, kv_heads, seqlen_k, 128, device="cuda", dtype=torch.bfloat16,
                        generator=gen, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        gqa = heads != kv_heads
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=None, enable_gqa=gqa)
        out = None

        def forward():
            nonlocal out
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        fwd = kernels_of(forward)
        bwd = kernels_of(lambda: out.backward(torch.randn_like(out)))
        print(f"{label} Sq={seqlen_q} Sk={seqlen_k} causal={causal} heads={heads}/{kv_heads}: "
              f"choice={choice} fwd={fwd} bwd={bwd}")


def priority() -> list[str]:
    return [str(b) for b in torch._C._get_sdp_priority_order()]


@bench.phase("before-after")
def before_after(ctx) -> None:
    """Each case's SDPA choice and kernels, then the same after activate()."""
    run("before")
    attnlab_sdpa.activate()
    run("after ")


@bench.phase("activate-first", default=False)
def activate_first(ctx) -> None:
    """activate() before the first CUDA call; SDPA's priority order at each step."""
    print("priority at start:", priority())
    attnlab_sdpa.activate()
    print("priority after activate:", priority())
    torch.zeros(1, device="cuda")
    print("priority after the first CUDA tensor:", priority())
    run("activated first")


if __name__ == "__main__":
    sys.exit(bench.main())
