"""The experimental Gluon sm_90 forward against the accuracy rule, the Triton kernel and cuDNN.

    ATTNLAB_GIT_COMMIT=<sha> PYTHONPATH=src:bench/experiments python3 bench/experiments/sm90_check.py --out OUT

Result on the H200 (bench/results/runs/2026-11-29-run6/sm90_check.json): 108/108 accurate,
but slower than the Triton kernel (bench/NOTES.md, attempt 7), so attnlab does not use it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from forward_sm90 import flash_forward_sm90, supports
from triton.testing import do_bench

from attnlab.accuracy import check_accuracy
from attnlab.kernels.configs import forward_config
from attnlab.kernels.forward import _bhs_strides, flash_forward
from attnlab.shapes import AttentionShape


def sm90(q, k, v, *, layout, scale, causal):
    """The experiment's launcher: same outputs as attnlab.kernels.forward.flash_forward."""
    if layout == "bshd":
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
    else:
        batch, heads, seqlen_q, head_dim = q.shape
        kv_heads, seqlen_k = k.shape[1], k.shape[2]
    assert supports(q, head_dim, seqlen_q, seqlen_k, causal, (-1, -1), 0.0, True)
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    strides = [s for t in (q, k, v, out) for s in _bhs_strides(t, layout)]
    flash_forward_sm90(q, k, v, out, lse, strides, num_heads=heads, num_kv_heads=kv_heads,
                       seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, scale=scale,
                       causal=causal)
    return out, lse


def rand(shape, dtype, gen):
    return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, failures = [], 0
    cases = []
    for d in (64, 128):
        for causal in (False, True):
            for (nq, nk) in ((1, 1), (1, 239), (113, 203), (128, 217), (1023, 1024), (1024, 1024),
                             (2000, 2000), (97, 97), (203, 113)):
                for heads in ((4, 4), (6, 2), (3, 1)):
                    cases.append((d, causal, nq, nk, heads))
    for i, (d, causal, nq, nk, (hq, hk)) in enumerate(cases):
        dtype = torch.bfloat16 if i % 2 else torch.float16
        layout = "bshd" if i % 3 else "bhsd"
        dims = (lambda n, h: (2, n, h, d)) if layout == "bshd" else (lambda n, h: (2, h, n, d))
        q, k, v = rand(dims(nq, hq), dtype, gen), rand(dims(nk, hk), dtype, gen), rand(dims(nk, hk), dtype, gen)
        out, lse = sm90(q, k, v, layout=layout, scale=1 / math.sqrt(d), causal=causal)
        again, _ = sm90(q, k, v, layout=layout, scale=1 / math.sqrt(d), causal=causal)
        res = check_accuracy(out, lse, q, k, v, causal=causal, layout=layout)
        ok = res.passed and torch.equal(out, again)
        failures += not ok
        rows.append({"d": d, "causal": causal, "nq": nq, "nk": nk, "hq": hq, "hk": hk, "layout": layout,
                     "dtype": str(dtype), "error": res.error, "allowed": res.allowed,
                     "lse": res.lse_error, "passed": ok})
        if not ok:
            print("FAIL", rows[-1], flush=True)
    print(f"accuracy: {len(rows) - failures}/{len(rows)} passed", flush=True)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    timing = []
    for d, heads in ((128, 16), (64, 32)):
        for causal in (False, True):
            for n in (1024, 2048, 4096, 8192, 16384):
                b = 16384 // n
                q, k, v = (rand((b, n, heads, d), torch.bfloat16, gen) for _ in range(3))
                flops = 4 * b * heads * n * n * d / (2 if causal else 1)
                config = forward_config(AttentionShape(batch=b, query_heads=heads, kv_heads=heads,
                                                       seqlen_q=n, seqlen_k=n, head_dim=d,
                                                       dtype="bf16", causal=causal))
                t_gluon = do_bench(lambda: sm90(q, k, v, layout="bshd", scale=d ** -0.5, causal=causal), warmup=25, rep=100)
                t_triton = do_bench(lambda: flash_forward(q, k, v, layout="bshd", scale=d ** -0.5, causal=causal, config=config), warmup=25, rep=100)
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return sdpa(qt, kt, vt, is_causal=causal)
                t_cudnn = do_bench(cudnn, warmup=25, rep=100)
                row = {"d": d, "heads": heads, "causal": causal, "n": n, "batch": b,
                       "sm90_tflops": flops / t_gluon / 1e9, "triton_tflops": flops / t_triton / 1e9,
                       "cudnn_tflops": flops / t_cudnn / 1e9}
                timing.append(row)
                print(f"d={d} causal={causal!s:5} N={n:5}: sm90 {row['sm90_tflops']:4.0f}  triton "
                      f"{row['triton_tflops']:4.0f}  cudnn {row['cudnn_tflops']:4.0f}  "
                      f"sm90/cudnn {row['sm90_tflops'] / row['cudnn_tflops']:.2f}", flush=True)
    with open(os.path.join(args.out, "sm90_check.json"), "w") as f:
        json.dump({"commit": os.environ.get("ATTNLAB_GIT_COMMIT"), "gpu": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%d"), "accuracy": rows, "timing": timing}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
