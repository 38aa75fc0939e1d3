"""V for the FP8 forwards: an fp8 wgmma reads both operands k-major, and for P V the
reduction runs over the keys, so both FP8 forward kernels read V copied with each
head-dim row's keys contiguous (``keys_contiguous``), the Gluon kernel's keys in the
order its P columns take (``permuted``).  Kernel, launcher, glue."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.kernels._launch import DirectLauncher, PlanCache, PlannedLaunch, tensor_key
from attnlab.kernels.configs import head_dim_padded

V_COPY_KEYS = 64  # positions per program of the copy (a multiple of 32)


@triton.jit
def _v_keys_contiguous(V, OUT, seqlen, padded, kv_heads, stride_vb, stride_vs, stride_vh,
                       stride_vd, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                       BLOCK_S: tl.constexpr, PERMUTED: tl.constexpr):
    """``keys_contiguous``'s copy, one-byte elements: one program per (BLOCK_S positions,
    batch x KV head) reads its keys as a [HEAD_DIM, BLOCK_S] tile (each key's bytes
    contiguous) and writes it keys-contiguous, zeros past ``seqlen``.  PERMUTED: position
    16h + 4q + 2g + e of each 32 holds key 16h + 8g + 2q + e (the Gluon FP8 kernel's P
    column order, forward_sm90._p_operand)."""
    bh = tl.program_id(1).to(tl.int64)
    pos = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    key = pos
    if PERMUTED:
        local = pos % 32
        key = (pos - local + local // 16 * 16 + (local // 2) % 2 * 8 + (local // 4) % 4 * 2
               + local % 2)
    d = tl.arange(0, HEAD_DIM_PAD)
    src = (V + bh // kv_heads * stride_vb + bh % kv_heads * stride_vh
           + key[None, :].to(tl.int64) * stride_vs + d[:, None] * stride_vd)
    tile = tl.load(src, mask=(key[None, :] < seqlen) & (d[:, None] < HEAD_DIM), other=0)
    dst = OUT + (bh * HEAD_DIM + d[:, None]) * padded + pos[None, :]
    tl.store(dst, tile, mask=(pos[None, :] < padded) & (d[:, None] < HEAD_DIM))


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------

def keys_contiguous_shape(v_shape) -> tuple[int, int, int, int]:
    """The shape of ``keys_contiguous``'s copy of a (batch, seqlen, kv_heads, d) V:
    (batch, kv_heads, d, seqlen rounded up to 32)."""
    batch, seqlen, heads, head_dim = v_shape
    return batch, heads, head_dim, triton.cdiv(seqlen, 32) * 32


class _KeysContiguousPlan:
    """``keys_contiguous`` for one V signature: the copy's planned launch."""

    def __init__(self, v: torch.Tensor, permuted: bool) -> None:
        self.shape = keys_contiguous_shape(v.shape)
        batch, heads, head_dim, padded = self.shape
        sb, ss, sh, sd = v.stride()
        self.launch = PlannedLaunch(
            _V_COPY, (triton.cdiv(padded, V_COPY_KEYS), batch * heads),
            (v.shape[1], padded, heads, sb, ss, sh, sd),
            dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_padded(head_dim),
                 BLOCK_S=V_COPY_KEYS, PERMUTED=permuted, num_warps=4))

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        copy = torch.empty(self.shape, dtype=torch.uint8, device=v.device)
        self.launch(v.view(torch.uint8), copy)
        return copy.view(v.dtype)


_V_COPY = DirectLauncher(_v_keys_contiguous)
# Copy plans by V's signature (kernels/_launch.PlanCache).
_V_COPIES = PlanCache()


def keys_contiguous(v: torch.Tensor, *, permuted: bool = False) -> torch.Tensor:
    """A (batch, seqlen, kv_heads, d) one-byte V (e4m3) copied as (batch, kv_heads, d,
    seqlen rounded up to 32), zeros past seqlen: each head-dim row's keys contiguous.  An
    fp8 wgmma reads both operands k-major, and for P V the reduction runs over the keys;
    with d contiguous instead, Triton 3.7.1 stages V through registers into a transposed
    shared layout and leaves it out of the cp.async pipeline (sm_90a PTX: 12 against 24
    async copies, 76 shared stores per tile); Triton's own fp8 tutorial transposes V the
    same way.  ``permuted``: the Gluon FP8 kernel's key order within each 32
    (``_v_keys_contiguous``).  One read and write of V by one Triton kernel (torch's
    strided copy of one-byte elements is uncoalesced on one side), small beside an
    O(N^2) prefill."""
    key = (tensor_key(v), v.device, permuted)  # the alignment too: Triton specialises on it
    return _V_COPIES.get(key, lambda: _KeysContiguousPlan(v, permuted))(v)
