"""The backward's GPU gradient grid over every head dim, one head dim per worker process.

``tests/test_backward.py::test_gpu_gradient_grid_every_head_dim`` hands each head dim to
a process of a spawned pool: a head dim's kernels compile once per (dtype, mask,
specialisation), which is CPU-bound and serial inside one process, so the H200 host's
16 cores build the grid's ~300 kernels side by side.  The shapes are chosen to keep the
compiles down: odd head counts and odd lengths give every stride the same Triton
specialisation class (not 16-divisible where the head dim is not), so within a
(dtype, mask) only a length-1 query (LSE's row stride 1) compiles a second set, and only
one of a head dim's two (dtype, mask) sets has length-1 queries.
"""

from __future__ import annotations

import math

# Every head dim from 8 to 256 in steps of 8, and the odd ones the tests claim.
HEAD_DIMS = (*range(8, 257, 8), 59, 111)
# (query heads, KV heads): MHA, GQA 3:1, MQA -- all odd (see the module doc).
HEADS = ((3, 3), (9, 3), (3, 1))
WITH_ONE = ((1, 1), (1, 199), (77, 199), (199, 77))
WITHOUT_ONE = ((77, 77), (199, 199), (77, 199), (199, 77))


def head_dim_sets(index: int) -> list[tuple[str, bool, tuple]]:
    """The two (dtype, causal, length pairs) sets of the ``index``-th head dim: each head dim
    runs both dtypes and both masks, and over the grid every (dtype, mask) meets the
    length-1 queries."""
    first, second = ("bf16", "fp16") if index % 2 == 0 else ("fp16", "bf16")
    causal_lengths, full_lengths = ((WITH_ONE, WITHOUT_ONE) if (index // 2) % 2 == 0
                                    else (WITHOUT_ONE, WITH_ONE))
    return [(first, True, causal_lengths), (second, False, full_lengths)]


def check_head_dim(index: int) -> list[dict]:
    """Every case of one head dim on the GPU: dQ, dK, dV through the public autograd path
    (``attnlab.flash_attn_func``) against float64 by the gradient rule.  One row per case;
    an exception is a failed row with its reason, and the other cases still run."""
    import torch

    import attnlab
    from attnlab.accuracy import check_gradients

    head_dim = HEAD_DIMS[index]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    rows = []
    for dtype_name, causal, lengths in head_dim_sets(index):
        for case, ((seqlen_q, seqlen_k), (heads, kv_heads)) in enumerate(
                (pair, h) for pair in lengths for h in HEADS):
            row = dict(head_dim=head_dim, dtype=dtype_name, causal=causal, seqlen_q=seqlen_q,
                       seqlen_k=seqlen_k, heads=heads, kv_heads=kv_heads)
            try:
                gen = torch.Generator(device="cuda").manual_seed(1000 * head_dim + case)

                def draw(h, n, gen=gen, dtype=dtypes[dtype_name]):
                    return torch.randn(2, n, h, head_dim, device="cuda", generator=gen).to(
                        dtype).requires_grad_()

                q, k, v = draw(heads, seqlen_q), draw(kv_heads, seqlen_k), draw(kv_heads,
                                                                                seqlen_k)
                dout = torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype)
                out = attnlab.flash_attn_func(q, k, v, causal=causal, impl="triton")
                grads = torch.autograd.grad(out, (q, k, v), dout)
                checks = check_gradients(grads, q.detach(), k.detach(), v.detach(), dout,
                                         causal=causal, scale=1.0 / math.sqrt(head_dim),
                                         layout="bshd")
                row.update(passed=all(c.passed for c in checks),
                           checks=[str(c) for c in checks])
            except Exception as error:  # one case failing must not hide the others
                row.update(passed=False, error=f"{type(error).__name__}: {error}"[:400])
            rows.append(row)
    return rows
