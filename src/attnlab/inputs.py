"""One value for a call: what a layout name means, and an attention call's checked inputs.

A layout names a tensor's dimension order where tensors cross a boundary:

* ``bshd`` -- (batch, seqlen, heads, head_dim), flash-attn's ``flash_attn_func``;
* ``bhsd`` -- (batch, heads, seqlen, head_dim), PyTorch SDPA's;
* ``thd``  -- (total_tokens, heads, head_dim), flash-attn's varlen, sequences placed by
  ``cu_seqlens``.

This module is the only place that reads one: every other module asks a
:class:`Layout` for sizes, strides, shapes and views, and takes a call's sizes from
the :class:`AttentionInputs` the public call built (checked once, there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnlab.checks import check_instance, check_strided
from attnlab.dtypes import TORCH_NAMES

# torch dtype -> the dtype name every module uses (attnlab.dtypes: fp16, bf16, fp32, fp64).
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, torch_name): name
                                             for name, torch_name in TORCH_NAMES.items()}


@dataclass(frozen=True)
class Layout:
    """Where batch, sequence and head sit in a tensor of this layout (``batch_dim`` is
    None for ``thd``, whose batch is ``cu_seqlens``'s)."""

    name: str
    batch_dim: int | None
    seq_dim: int
    head_dim: int

    @property
    def is_varlen(self) -> bool:
        return self.batch_dim is None

    @property
    def rank(self) -> int:
        return 3 if self.is_varlen else 4

    @property
    def dims(self) -> str:
        """The dimension names in order, for messages."""
        return {"bshd": "(batch, seqlen, heads, head_dim)",
                "bhsd": "(batch, heads, seqlen, head_dim)",
                "thd": "(total_tokens, heads, head_dim)"}[self.name]

    def bhs_strides(self, t) -> tuple[int, int, int]:
        """(batch, head, seq) strides; a varlen tensor's batch stride is 0."""
        batch = 0 if self.is_varlen else t.stride(self.batch_dim)
        return batch, t.stride(self.head_dim), t.stride(self.seq_dim)

    def bsh_strides(self, t) -> tuple[int, int, int]:
        """(batch, seq, head) strides, the decode kernel's order."""
        batch, head, seq = self.bhs_strides(t)
        return batch, seq, head

    def seqlen(self, t) -> int:
        return t.shape[self.seq_dim]

    def heads(self, t) -> int:
        return t.shape[self.head_dim]

    def shape(self, batch: int, seqlen: int, heads: int, head_dim: int) -> tuple[int, ...]:
        """A tensor shape in this layout (``thd``: ``seqlen`` is the total token count)."""
        if self.is_varlen:
            return (seqlen, heads, head_dim)
        sizes = [0, 0, 0, head_dim]
        sizes[self.batch_dim], sizes[self.seq_dim], sizes[self.head_dim] = batch, seqlen, heads
        return tuple(sizes)

    def lse_shape(self, batch: int, heads: int, seqlen_q: int) -> tuple[int, ...]:
        """The LSE flash-attn returns: (batch, heads, seqlen_q), or (heads, total_q) for
        varlen."""
        return (heads, seqlen_q) if self.is_varlen else (batch, heads, seqlen_q)

    def to_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        """A (batch, heads, seqlen, head_dim) view (a ``thd`` tensor as one sequence)."""
        if self.is_varlen:
            return t.unsqueeze(0).transpose(1, 2)
        return t.transpose(1, 2) if self.name == "bshd" else t

    def from_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        """A (batch, heads, seqlen, head_dim) tensor as a view in this layout."""
        if self.is_varlen:
            return t.transpose(1, 2).squeeze(0)
        return t.transpose(1, 2) if self.name == "bshd" else t


LAYOUTS: dict[str, Layout] = {
    "bshd": Layout("bshd", batch_dim=0, seq_dim=1, head_dim=2),
    "bhsd": Layout("bhsd", batch_dim=0, seq_dim=2, head_dim=1),
    "thd": Layout("thd", batch_dim=None, seq_dim=0, head_dim=1),
}
DENSE_LAYOUTS = ("bshd", "bhsd")


def layout_named(name: str) -> Layout:
    """The layout of that name, else the ValueError listing them."""
    layout = LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {name!r}")
    return layout


@dataclass(frozen=True)
class AttentionInputs:
    """The q, k, v of one attention call and the sizes read off them once.

    ``seqlen_q``/``seqlen_k`` are the dense lengths, or for varlen the longest
    (``max_seqlen_q/k``) with ``batch`` = the number of sequences.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: Layout
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    def out_shape(self) -> tuple[int, ...]:
        rows = self.q.shape[0] if self.layout.is_varlen else self.seqlen_q
        return self.layout.shape(self.batch, rows, self.heads, self.head_dim)

    def lse_shape(self) -> tuple[int, ...]:
        rows = self.q.shape[0] if self.layout.is_varlen else self.seqlen_q
        return self.layout.lse_shape(self.batch, self.heads, rows)

    def with_tensors(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> AttentionInputs:
        """The same call on other tensors of the same sizes (a copy with unit last stride,
        a cast)."""
        return replace(self, q=q, k=k, v=v)

    @classmethod
    def read(cls, q, k, v, layout: str, cu_seqlens_q: torch.Tensor | None = None,
             cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
             max_seqlen_k: int | None = None) -> AttentionInputs:
        """The sizes of inputs a public call already checked (the launchers' way in)."""
        lay = layout_named(layout)
        if lay.is_varlen:
            return cls(q, k, v, lay, cu_seqlens_q.shape[0] - 1, lay.heads(q), lay.heads(k),
                       int(max_seqlen_q), int(max_seqlen_k), q.shape[-1],
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return cls(q, k, v, lay, q.shape[0], lay.heads(q), lay.heads(k), lay.seqlen(q),
                   lay.seqlen(k), q.shape[-1])

    @classmethod
    def dense(cls, q, k, v, layout: str) -> AttentionInputs:
        """Check q, k, v of a dense (``bshd``/``bhsd``) call: tensors of one dtype and
        device, K and V alike, GQA heads that divide, nothing empty."""
        lay = layout_named(layout)
        if lay.is_varlen:
            raise ValueError(f"a dense call takes layout {' or '.join(DENSE_LAYOUTS)}, "
                             f"got {layout!r}")
        _check_tensor_triple(q, k, v, lay)
        inputs = cls.read(q, k, v, layout)
        if k.shape[0] != inputs.batch:
            raise ValueError(f"k batch ({k.shape[0]}) must equal q batch ({inputs.batch})")
        _check_heads(inputs.heads, inputs.kv_heads, inputs.head_dim, k.shape[-1])
        if min(inputs.batch, inputs.seqlen_q, inputs.seqlen_k, inputs.heads,
               inputs.head_dim) == 0:
            raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
        return inputs



def check_packed(q, k, v) -> None:
    """Check the packed (``thd``) q, k, v of a varlen call by the dense calls' rules
    (their lengths come from ``cu_seqlens``, checked where their values are read)."""
    lay = LAYOUTS["thd"]
    _check_tensor_triple(q, k, v, lay)
    _check_heads(lay.heads(q), lay.heads(k), q.shape[-1], k.shape[-1])
    if q.shape[-1] == 0:
        raise ValueError(f"empty input: head_dim is 0 (q {tuple(q.shape)})")


def check_paged_keys(q, k, v) -> None:
    """Check a paged varlen call's q (total_q, heads, head_dim) against its paged keys
    and values (num_pages, page_size, kv_heads, head_dim), by the dense calls' rules."""
    lay = LAYOUTS["thd"]
    check_strided("q", check_instance("q", q, torch.Tensor))
    if q.dim() != lay.rank:
        raise ValueError(f"q must be {lay.rank}-D {lay.dims}, got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        check_strided(name, check_instance(name, t, torch.Tensor))
        if t.dim() != 4 or min(t.shape) == 0:
            raise ValueError(f"{name} must be a paged cache (num_pages, page_size, kv_heads, "
                             f"head_dim) with a block_table, non-empty; got {tuple(t.shape)}")
    _check_alike(q, k, v)
    _check_heads(lay.heads(q), k.shape[2], q.shape[-1], k.shape[-1])
    if q.shape[-1] == 0:
        raise ValueError(f"empty input: head_dim is 0 (q {tuple(q.shape)})")


def _check_tensor_triple(q, k, v, layout: Layout) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_strided(name, check_instance(name, t, torch.Tensor))
        if t.dim() != layout.rank:
            raise ValueError(f"{name} must be {layout.rank}-D {layout.dims}, got shape "
                             f"{tuple(t.shape)}")
    _check_alike(q, k, v)


def _check_alike(q, k, v) -> None:
    """One dtype and device for q, k, v; one shape for k and v."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")


def _check_heads(heads: int, kv_heads: int, head_dim: int, kv_head_dim: int) -> None:
    if kv_head_dim != head_dim:
        raise ValueError(f"k/v head_dim ({kv_head_dim}) must equal q head_dim ({head_dim})")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"kv heads ({kv_heads}) must divide query heads ({heads})")
