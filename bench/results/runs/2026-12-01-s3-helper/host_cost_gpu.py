"""Host cost of the eager launchers and entry points: N calls on a tiny tensor."""
import gc
import os
import statistics
import sys
import time

import torch

from attnlab.kernels import autograd as ag
from attnlab.kernels.autograd import attention_forward
from attnlab.kernels.backward import flash_backward
from attnlab.kernels.forward import flash_forward

if os.environ.get("HC_ALWAYS_WRAP"):
    import attnlab.kernels.backward as bw
    import attnlab.kernels.forward as fw
    fw.launch_is_traced = bw.launch_is_traced = lambda t: True

dev = "cuda" if torch.cuda.is_available() else "cpu"
calls, reps = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 16, 1, 16, generator=g).half().to(dev) for _ in range(3))
opts = dict(layout="bshd", scale=0.25, causal=True)
out, lse = flash_forward(q, k, v, **opts)
dout = torch.randn_like(out)
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
entry = dict(layout="bshd", scale=0.25, causal=True, window=(-1, -1), softcap=0.0)
op_args = ("bshd", 0.25, True, -1, -1, 0.0, False, None, None, None, None)
items = [
    ("flash_forward (launcher)", lambda: flash_forward(q, k, v, **opts)),
    ("flash_backward (launcher)", lambda: flash_backward(dout, q, k, v, out, lse, **opts)),
    ("attention_forward, no grad", lambda: attention_forward(q, k, v, **entry)),
    ("flash_fwd_op (op dispatcher)", lambda: ag.flash_fwd_op(q, k, v, *op_args)),
    ("eager train step fwd+bwd", lambda: attention_forward(qg, kg, vg, **entry)[0].backward(dout)),
]
print("tree:", ag.__file__.split("/kernels")[0], "| torch", torch.__version__, "| wrap always:",
      bool(os.environ.get("HC_ALWAYS_WRAP")))
for name, fn in items:
    for _ in range(20):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    times = []
    gc.disable()
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    gc.enable()
    print(f"  {name:30s} median {statistics.median(times):9.1f}  min {min(times):9.1f} us/call")
