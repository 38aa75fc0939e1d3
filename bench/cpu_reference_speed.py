"""How much slower impl="auto" is than torch SDPA on CPU tensors (it runs the float64
reference): one table for docs/ecosystem.md.

    PYTHONPATH=src python bench/cpu_reference_speed.py [--seqlen 1024] [--heads 8]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import attnlab
from attnlab.measure.timing import time_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seqlen, args.head_dim, generator=generator)
               for _ in range(3))
    print(f"batch 1, heads {args.heads}, seqlen {args.seqlen}, head_dim {args.head_dim}, "
          f"float32 CPU tensors, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| causal | torch SDPA (ms) | attnlab impl='auto' (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for causal in (False, True):
        sdpa = time_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                         [()], device="cpu", min_repeats=5, max_repeats=50)
        ours = time_call(lambda: attnlab.attention(q, k, v, causal=causal), [()],
                         device="cpu", warmup=1, min_repeats=3, max_repeats=5)
        assert attnlab.last_impl() == "reference"
        print(f"| {causal} | {sdpa.p50:.2f} | {ours.p50:.1f} | {ours.p50 / sdpa.p50:.0f}x |")


if __name__ == "__main__":
    main()
