"""The one way tests make attention inputs: ``make_qkv`` (import it, don't copy it), and
``paged_copy``, a contiguous KV cache scattered over shuffled pages.

Seeded normal q, k, v in a named layout: ``bhsd`` (SDPA, the reference's) or ``bshd``
(flash-attn's).  Values are drawn in float64 for a float64 target and in float32
otherwise, then cast, so a test's numbers do not depend on the target dtype's RNG path.
"""

from __future__ import annotations

import torch

LAYOUTS = ("bhsd", "bshd")


def make_qkv(batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int,
             head_dim: int, dtype: torch.dtype = torch.float64, *, layout: str = "bhsd",
             seed: int = 0, value_dim: int | None = None, magnitude: float = 1.0,
             device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v): q has ``heads`` heads, k and v ``kv_heads``; v's last dim is
    ``value_dim`` (default ``head_dim``); every value is N(0, magnitude^2)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    generator = torch.Generator().manual_seed(seed)
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def draw(h: int, n: int, dim: int) -> torch.Tensor:
        size = (batch, h, n, dim) if layout == "bhsd" else (batch, n, h, dim)
        values = torch.randn(size, generator=generator, dtype=draw_dtype) * magnitude
        return values.to(dtype).to(device)

    return (draw(heads, seqlen_q, head_dim), draw(kv_heads, seqlen_k, head_dim),
            draw(kv_heads, seqlen_k, head_dim if value_dim is None else value_dim))


def paged_copy(cache, page_size, *, extra_pages=3, seed=0):
    """(pages, block_table): the contiguous cache's rows scattered over shuffled pages."""
    batch, capacity = cache.shape[:2]
    per_seq = -(-capacity // page_size)
    total = batch * per_seq + extra_pages
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:batch * per_seq]
    block_table = order.view(batch, per_seq).to(torch.int32).to(cache.device)
    pages = torch.randn((total, page_size, *cache.shape[2:]), dtype=torch.float32).to(cache.dtype)
    pages = pages.to(cache.device)
    padded = torch.zeros((batch, per_seq * page_size, *cache.shape[2:]), dtype=cache.dtype,
                         device=cache.device)
    padded[:, :capacity] = cache
    pages[block_table.flatten().long()] = padded.view(batch * per_seq, page_size, *cache.shape[2:])
    return pages, block_table
