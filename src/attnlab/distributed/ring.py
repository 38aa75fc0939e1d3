"""Ring attention over ``torch.distributed``: exact attention when the sequence is sharded.

Every rank of a process group holds one shard of the sequence (layout ``bshd``:
batch, local seqlen, heads, head_dim) of Q, K and V.  The K/V shards travel round
the ring: at step ``s`` rank ``r`` holds the K/V of rank ``(r - s) mod P``, attends
its own queries to it with the single-device kernel, and folds the partial output
into its running (O, LSE) with :func:`merge_state` in fp32 (float64 for float64
inputs).  The transfer of the next step's K/V is posted (``isend``/``irecv``)
**before** the current step's compute, so it overlaps the compute.

Sharding (:func:`shard_sequence` does it for the user):

* non-causal: rank ``r`` holds contiguous chunk ``r`` of ``P`` chunks; every step
  is one full (local queries x received keys) block;
* causal: zig-zag (head-tail) sharding: the sequence is cut into ``2P`` chunks
  and rank ``r`` holds chunks ``r`` and ``2P - 1 - r``, so every rank does the
  same work.  Step 0 is the local block with the ordinary causal mask (the two
  diagonal chunks, plus local tail queries over local head keys); at a later step
  the received shard came from an earlier rank (all local queries see its head
  chunk, none see its tail) or from a later one (only the local tail queries see
  it, all of it).  Each block is a slice of contiguous tensors along the sequence
  dimension, a view the kernels read through strides: nothing is copied.

Backward (``torch.autograd``): the ring runs again.  dQ stays local (fp32); the
dK/dV accumulators (fp32) travel with the K/V they belong to, each rank adding its
block's contribution before passing them on, and one last hop hands every rank its
own finished dK/dV.  Both kinds of hop use the one process group, so on NCCL they
share its stream and the link: a backward step moves the K/V plus the fp32 dK/dV
(``attnlab.model.ring`` counts exactly this).  A block's gradients come from the single-device backward given
the block's rows of the *global* O and LSE: delta = rowsum(dO * O) uses the global O,
so the per-block backward is the unchanged single-device one.

Per-block compute is an explicit choice, as in :mod:`attnlab.api`: ``impl="triton"``
(attnlab's kernels: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``),
``"reference"`` (the float64 CPU reference), ``"auto"`` (triton on CUDA, reference
on CPU).  Nothing falls back silently.  Backends: ``nccl`` for CUDA tensors, ``gloo``
for CPU tensors; launch with ``torchrun``.

Usage (``torchrun --nproc-per-node 4 script.py``)::

    dist.init_process_group("nccl")  # "gloo" for CPU tensors
    q_local, k_local, v_local = (shard_sequence(t, causal=True) for t in (q, k, v))
    out_local = ring_attention(q_local, k_local, v_local, causal=True)
    out = unshard_sequence(out_local, causal=True)  # only if the full sequence is needed

Lengths: every rank's shard must have the same shape (checked across the ranks with
one small ``all_gather`` per forward call, so a mismatch is a ``ValueError`` on every
rank, not a hang), and a causal shard must hold two equal chunks, i.e. the total
length must be a multiple of ``2 * world_size`` (non-causal: of ``world_size``).
Ragged totals are rejected, never padded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from attnlab.api.common import _refuse_unsupported, _resolve_impl
from attnlab.api.merge import merge_state
from attnlab.checks import check_bool, check_instance
from attnlab.inputs import AttentionInputs
from attnlab.reference.inputs import accumulation_dtype, resolve_scale

LAYOUT = "bshd"
SEQ_DIM = 1  # the sequence dimension of bshd


# ---------------------------------------------------------------------------
# The plan: which tokens a rank holds, which sub-block a ring step computes.
# Pure integer arithmetic (no communication), so it can be checked on its own.
# ---------------------------------------------------------------------------

def required_multiple(world_size: int, causal: bool) -> int:
    """The total sequence length must be a multiple of this: 2P (causal zig-zag) or P."""
    return 2 * world_size if causal else world_size


def shard_ranges(seqlen: int, *, world_size: int, rank: int, causal: bool) -> tuple[range, ...]:
    """The token positions of a full sequence that ``rank`` holds, in its local order.

    Non-causal: one contiguous chunk ``rank`` of ``world_size``.  Causal: the zig-zag
    pair (chunk ``rank``, chunk ``2 * world_size - 1 - rank``) of ``2 * world_size``.
    """
    for name, value in (("seqlen", seqlen), ("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    multiple = required_multiple(world_size, causal)
    if seqlen <= 0 or seqlen % multiple:
        mode = "causal (zig-zag, 2 chunks per rank)" if causal else "non-causal"
        raise ValueError(
            f"ring attention needs the total sequence length to be a positive multiple of "
            f"{multiple} ({mode}, world_size={world_size}); got seqlen={seqlen}. "
            f"Pad or trim the sequence to a multiple of {multiple}")
    chunk = seqlen // multiple
    if not causal:
        return (range(rank * chunk, (rank + 1) * chunk),)
    tail = 2 * world_size - 1 - rank
    return (range(rank * chunk, (rank + 1) * chunk), range(tail * chunk, (tail + 1) * chunk))


@dataclass(frozen=True)
class RingBlock:
    """The sub-block one ring step computes, as slices of the local sequence dimension.

    ``q_rows`` slices the local queries, ``kv_rows`` the received K/V shard;
    ``causal`` says whether the block takes the causal mask (only the local diagonal
    block does) or is fully visible.
    """

    q_rows: slice
    kv_rows: slice
    causal: bool


def ring_step_block(step: int, *, rank: int, world_size: int, local_seqlen: int,
                    causal: bool) -> RingBlock:
    """The block rank ``rank`` computes at ``step`` (it then holds rank ``(rank - step) % P``'s K/V)."""
    everything = slice(0, local_seqlen)
    if not causal:
        return RingBlock(everything, everything, causal=False)
    if step == 0:
        # Own shard: chunks (r, 2P-1-r) against themselves.  The ordinary causal mask
        # on the concatenation is exactly right: head queries see the head chunk's
        # diagonal only, tail queries see all of the head chunk and the tail's diagonal.
        return RingBlock(everything, everything, causal=True)
    half = local_seqlen // 2
    source = (rank - step) % world_size
    if source < rank:
        # Earlier rank: its head chunk precedes both local chunks; its tail chunk
        # (2P-1-source > 2P-1-rank) follows both.
        return RingBlock(everything, slice(0, half), causal=False)
    # Later rank: its two chunks both lie between the local head and tail chunks.
    return RingBlock(slice(half, local_seqlen), everything, causal=False)


# ---------------------------------------------------------------------------
# Communication: one hop round the ring, posted before the compute it overlaps.
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Ring:
    """A process group seen as a ring: this rank, its size, and its neighbours' global ranks."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    next_peer: int
    previous_peer: int

    @classmethod
    def of(cls, group) -> _Ring:
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("this process is not a member of the process group passed as group")
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        return cls(group, rank, world_size, to_global((rank + 1) % world_size),
                   to_global((rank - 1) % world_size))

    def start_hop(self, tensors: tuple[torch.Tensor, ...]) -> _Hop:
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous."""
        if self.world_size == 1:  # a ring of one: the next rank is this one
            return _Hop(tensors, [])
        received = tuple(torch.empty_like(t) for t in tensors)
        # One batch of paired sends and receives: NCCL needs them grouped, or every
        # rank would block in its send waiting for a receive that is not posted yet.
        ops = [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.previous_peer, self.group) for t in received]
        return _Hop(received, dist.batch_isend_irecv(ops))


@dataclass
class _Hop:
    received: tuple[torch.Tensor, ...]
    works: list

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        return self.received


# ---------------------------------------------------------------------------
# One block on one device: the kernels or the float64 reference.
# ---------------------------------------------------------------------------

def _block_forward(q, k, v, *, scale: float, causal: bool, impl: str):
    """(O in bhsd, LSE) of one block; O and LSE in any float dtype the caller converts."""
    if impl == "triton":
        from attnlab.kernels.forward import flash_forward

        out, lse = flash_forward(q, k, v, layout=LAYOUT, scale=scale, causal=causal)
        return out.transpose(1, 2), lse
    from attnlab.reference import tiled

    out, lse = tiled(*(t.transpose(1, 2).to(torch.float64) for t in (q, k, v)),
                     causal=causal, scale=scale)
    return out, lse


def _block_backward(dout, q, k, v, out, lse, *, scale: float, causal: bool, impl: str,
                    deterministic: bool):
    """(dQ, dK, dV) of one block in bshd, given the block's rows of the global O and LSE."""
    if impl == "triton":
        from attnlab.kernels.backward import flash_backward

        return flash_backward(dout, q, k, v, out, lse, layout=LAYOUT, scale=scale,
                              causal=causal, deterministic=deterministic)
    from attnlab.reference.backward import tiled_backward

    q, k, v, dout, out = (t.transpose(1, 2).to(torch.float64) for t in (q, k, v, dout, out))
    grads = tiled_backward(q, k, v, dout, out=out, lse=lse.to(torch.float64), causal=causal,
                           scale=scale)
    return tuple(g.transpose(1, 2) for g in grads)


# ---------------------------------------------------------------------------
# The ring loops.
# ---------------------------------------------------------------------------

def _merge_block(out, lse, rows: slice, part_out, part_lse) -> None:
    """Fold one block's (O in bhsd, LSE) into the running (O in bshd, LSE) of ``rows``, in place."""
    # merge_state works in fp32 (float64 when a side is float64) and returns out's dtype.
    merged_out, merged_lse = merge_state(out[:, rows], lse[:, :, rows],
                                         part_out.transpose(1, 2), part_lse)
    out[:, rows] = merged_out
    lse[:, :, rows] = merged_lse


def _add_block_grads(dq, dk, dv, block: RingBlock, dq_block, dk_block, dv_block) -> None:
    """Add one block's gradients into the fp32 accumulators of its rows."""
    dq[:, block.q_rows] += dq_block
    dk[:, block.kv_rows] += dk_block
    dv[:, block.kv_rows] += dv_block


def _ring_forward(q, k, v, *, scale: float, causal: bool, impl: str, ring: _Ring):
    """Local (O in bshd, accumulation dtype; LSE (batch, heads, local seqlen))."""
    local_seqlen = q.shape[SEQ_DIM]
    acc_dtype = accumulation_dtype(q.dtype)
    out = lse = None
    kv = (k, v)
    for step in range(ring.world_size):
        pending = ring.start_hop(kv) if step < ring.world_size - 1 else None
        block = ring_step_block(step, rank=ring.rank, world_size=ring.world_size,
                                local_seqlen=local_seqlen, causal=causal)
        rows = block.q_rows
        part_out, part_lse = _block_forward(q[:, rows], kv[0][:, block.kv_rows],
                                            kv[1][:, block.kv_rows], scale=scale,
                                            causal=block.causal, impl=impl)
        if out is None:  # step 0 covers every local row
            out = part_out.to(acc_dtype).transpose(1, 2).contiguous()
            lse = part_lse.to(acc_dtype).contiguous()
        else:
            _merge_block(out, lse, rows, part_out, part_lse)
        if pending is not None:
            kv = pending.wait()
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, *, scale: float, causal: bool, impl: str,
                   deterministic: bool, ring: _Ring):
    """Local (dQ, dK, dV) in the accumulation dtype, bshd."""
    local_seqlen = q.shape[SEQ_DIM]
    acc_dtype = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv = (k, v)
    grads_hop = None
    for step in range(ring.world_size):
        kv_hop = ring.start_hop(kv) if step < ring.world_size - 1 else None
        block = ring_step_block(step, rank=ring.rank, world_size=ring.world_size,
                                local_seqlen=local_seqlen, causal=causal)
        rows, kv_rows = block.q_rows, block.kv_rows
        dq_block, dk_block, dv_block = _block_backward(
            dout[:, rows], q[:, rows], kv[0][:, kv_rows], kv[1][:, kv_rows], out[:, rows],
            lse[:, :, rows], scale=scale, causal=block.causal, impl=impl,
            deterministic=deterministic)
        if grads_hop is None:  # step 0: this rank starts the accumulators of its own K/V
            dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        else:  # the accumulators of the K/V held now, from the previous rank
            dk, dv = grads_hop.wait()
        _add_block_grads(dq, dk, dv, block, dq_block, dk_block, dv_block)
        # Passed on at every step: after the last one the hop reaches the K/V's owner.
        grads_hop = ring.start_hop((dk, dv))
        if kv_hop is not None:
            kv = kv_hop.wait()
    dk, dv = grads_hop.wait()
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """Keeps q, k, v, O and LSE for the backward ring; nothing else."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, impl, deterministic, ring):
        out_acc, lse = _ring_forward(q, k, v, scale=scale, causal=causal, impl=impl, ring=ring)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(scale=scale, causal=causal, impl=impl, deterministic=deterministic,
                           ring=ring)
        lse_public = lse.to(torch.float32)
        ctx.mark_non_differentiable(lse_public)
        return out, lse_public

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, **ctx.options)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


# ---------------------------------------------------------------------------
# Checks: local ones, then one all_gather so every rank agrees (or every rank raises).
# ---------------------------------------------------------------------------

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_IMPL_CODES = {"triton": 0, "reference": 1}


def _check_backend(q: torch.Tensor, group) -> None:
    backend = dist.get_backend(group)
    if backend == "nccl" and not q.is_cuda:
        raise ValueError(f"the process group's backend is nccl, which needs CUDA tensors; "
                         f"q is on {q.device} (use a gloo group for CPU tensors)")
    if backend == "gloo" and q.is_cuda:
        raise ValueError("the process group's backend is gloo; CUDA tensors need an nccl group")


def _check_same_call_on_every_rank(q, k, v, *, scale: float, causal: bool, impl: str,
                                   ring: _Ring) -> None:
    """Every rank must pass the same shapes, dtype and options, or every rank raises."""
    (scale_bits,) = struct.unpack("<q", struct.pack("<d", scale))
    signature = [*q.shape, *k.shape, int(causal), _DTYPE_CODES[q.dtype], _IMPL_CODES[impl],
                 scale_bits]
    mine = torch.tensor(signature, dtype=torch.int64, device=q.device)
    everyone = [torch.empty_like(mine) for _ in range(ring.world_size)]
    dist.all_gather(everyone, mine, group=ring.group)
    signatures = [tuple(t.tolist()) for t in everyone]
    if len(set(signatures)) > 1:
        described = "; ".join(
            f"rank {r}: q {list(s[0:4])} k/v {list(s[4:8])} causal={bool(s[8])} dtype "
            f"{[d for d, c in _DTYPE_CODES.items() if c == s[9]][0]} impl "
            f"{[i for i, c in _IMPL_CODES.items() if c == s[10]][0]} scale "
            f"{struct.unpack('<d', struct.pack('<q', s[11]))[0]:.6g}"
            for r, s in enumerate(signatures))
        raise ValueError(f"ring attention needs the same shard shape, dtype and options on "
                         f"every rank of the group; got {described}")


def _prepare(q, k, v, *, causal, softmax_scale, group, impl):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring attention needs an initialised torch.distributed process group "
                           "(launch with torchrun and call torch.distributed.init_process_group)")
    causal = check_bool("causal", causal)
    inputs = AttentionInputs.dense(q, k, v, LAYOUT)
    seqlen_q, seqlen_k, head_dim = inputs.seqlen_q, inputs.seqlen_k, inputs.head_dim
    if seqlen_q != seqlen_k:
        raise ValueError(f"q and k/v shards must have the same local seqlen (each rank holds "
                         f"the same tokens of Q, K and V), got {seqlen_q} and {seqlen_k}")
    if q.dtype not in _DTYPE_CODES:
        raise TypeError(f"q, k, v dtype must be one of {list(_DTYPE_CODES)}, got {q.dtype}")
    impl = _resolve_impl(impl, q)
    if impl == "triton":
        from attnlab.kernels.forward import MAX_HEAD_DIM, SUPPORTED_DTYPES

        if q.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"the Triton kernels take dtype torch.float16 or torch.bfloat16, "
                            f"got {q.dtype}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM} for the Triton kernels, "
                             f"got {head_dim}")
    scale = resolve_scale(softmax_scale, head_dim)
    ring = _Ring.of(group)
    _check_backend(q, group)
    _check_same_call_on_every_rank(q, k, v, scale=scale, causal=causal, impl=impl, ring=ring)
    # From here on every rank has the same shapes, so every rank raises alike.
    if causal and seqlen_q % 2:
        raise ValueError(
            f"causal ring attention needs each rank's shard to hold two equal zig-zag chunks, "
            f"so the local seqlen must be even (the total a multiple of "
            f"{required_multiple(ring.world_size, True)}); got local seqlen {seqlen_q}")
    # Sent tensors must be contiguous; a contiguous input costs nothing here.
    return q, k.contiguous(), v.contiguous(), scale, impl, ring


# ---------------------------------------------------------------------------
# Public functions.
# ---------------------------------------------------------------------------

def ring_attention(q, k, v, *, causal=False, softmax_scale=None, group=None, impl="auto",
                   deterministic=False, return_lse=False):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Layout ``bshd``: q is this rank's shard (batch, local seqlen, heads, head_dim);
    k, v (batch, local seqlen, kv_heads, head_dim) with kv_heads dividing heads (GQA).
    The shards must be laid out as :func:`shard_sequence` does: contiguous chunks
    (non-causal) or the zig-zag pair of chunks (causal).  ``causal`` masks by global
    position.  The total length must be a multiple of ``world_size`` (non-causal) or
    ``2 * world_size`` (causal); otherwise ``ValueError`` (nothing is padded).
    ``group`` is a process group (None: the default one); backend nccl for CUDA
    tensors, gloo for CPU tensors.  ``impl``: "auto" | "triton" | "reference" (see
    the module doc).  Differentiable in q, k, v.

    Returns this rank's output shard (q's shape and dtype), or ``(out, lse)`` with
    ``return_lse=True`` (LSE (batch, heads, local seqlen), float32, natural log; not
    differentiable).  ``deterministic`` is passed to the backward kernel; the ring's
    own order of accumulation is fixed, so results repeat run to run.
    """
    q, k, v, scale, impl, ring = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                          group=group, impl=impl)
    out, lse = _RingAttention.apply(q, k, v, scale, causal, impl, bool(deterministic), ring)
    return (out, lse) if return_lse else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         deterministic=False, return_attn_probs=False, group=None, *,
                         impl="auto"):
    """flash-attn's ``flash_attn_func`` signature over a sharded sequence (layout ``bshd``).

    The same computation as :func:`ring_attention`; returns ``out``, or
    ``(out, softmax_lse, None)`` with ``return_attn_probs=True``.  Dropout, ALiBi,
    sliding windows and softcap are refused (``NotImplementedError``): the ring's
    block plan covers full and causal attention only.
    """
    _refuse_unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"window_size must be (-1, -1): ring attention has no sliding "
                                  f"window (got {window_size!r})")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap must be 0.0: ring attention has no softcap "
                                  f"(got {softcap!r})")
    out, lse = ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                              impl=impl, deterministic=deterministic, return_lse=True)
    return (out, lse, None) if return_attn_probs else out


def _group_position(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sharding needs an initialised torch.distributed process group")
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: torch.Tensor, *, causal: bool, group=None, seq_dim: int = SEQ_DIM):
    """This rank's shard of a full sequence ``x`` (the same tensor on every rank).

    ``seq_dim`` is the sequence dimension (1 for bshd Q/K/V, 2 for a (batch, heads,
    seqlen) LSE).  Causal: the zig-zag pair of chunks; otherwise one contiguous chunk.
    Returns a contiguous tensor (a copy).
    """
    check_instance("x", x, torch.Tensor)
    causal = check_bool("causal", causal)
    rank, world_size = _group_position(group)
    ranges = shard_ranges(x.shape[seq_dim], world_size=world_size, rank=rank, causal=causal)
    return torch.cat([x.narrow(seq_dim, r.start, len(r)) for r in ranges], dim=seq_dim)


def unshard_sequence(x_local: torch.Tensor, *, causal: bool, group=None,
                     seq_dim: int = SEQ_DIM) -> torch.Tensor:
    """The full sequence from every rank's shard (an ``all_gather``; not differentiable)."""
    check_instance("x_local", x_local, torch.Tensor)
    causal = check_bool("causal", causal)
    _, world_size = _group_position(group)
    shards = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(shards, x_local.contiguous(), group=group)
    seqlen = x_local.shape[seq_dim] * world_size
    full = x_local.new_empty(x_local.shape[:seq_dim] + (seqlen,) + x_local.shape[seq_dim + 1:])
    for rank, shard in enumerate(shards):
        offset = 0
        for r in shard_ranges(seqlen, world_size=world_size, rank=rank, causal=causal):
            full.narrow(seq_dim, r.start, len(r)).copy_(shard.narrow(seq_dim, offset, len(r)))
            offset += len(r)
    return full
