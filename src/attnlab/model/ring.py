"""Ring attention's weak scaling, from one GPU's block times and a link bandwidth.

Weak scaling keeps the tokens per GPU, ``n``, fixed: P GPUs run a sequence of
``P * n`` tokens.  Each rank computes ``P`` blocks (one per ring step) while the K/V
shard of the next step travels one hop; causal attention over ``P * n`` tokens is
``P`` times the work of one GPU running ``n`` tokens, so

    efficiency(P) = P * (one GPU's time at n tokens) / (the ring's time at P * n tokens),

which is the per-GPU throughput of the ring relative to one GPU running ``1/P`` of the
length (the issue's definition).

Per-step accounting (attnlab.distributed.ring's plan, causal zig-zag):

* step 0 computes the rank's own shard: causal ``n x n``, i.e. exactly one GPU's
  baseline call; non-causal: the full ``n x n`` block;
* every later step computes an unmasked block of half the pairs: ``n`` queries x
  ``n/2`` keys when the K/V came from an earlier rank, ``n/2 x n`` from a later rank.
  Both kinds occur at every step 1..P-1 (rank 0 always receives from a later rank,
  rank P-1 from an earlier one) and every rank waits for its neighbour, so a step
  takes the slower of the two;
* forward: the hop for step s+1 (K and V of one shard, storage dtype) overlaps step
  s; steps 0..P-2 carry one, the last step none;
* backward: the same K/V hops, plus the dK/dV accumulators (fp32) of step s-1 passed
  on during step s on the same communicator (so they share the link with the K/V
  hop), and one last accumulator hop after the last step, never hidden.

A step takes ``max(compute, transfer)``: this assumes the copy engine / NCCL kernels
do not slow the attention kernel down (they take a few SMs on Hopper; the measured
ring says how much).  The ring's slowest hop sets every step's pace: within one node
that is NVLink, beyond ``gpus_per_node`` a network hop.  Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from attnlab.checks import check_choice, check_float, check_instance, check_int
from attnlab.shapes import AttentionShape

PHASES = ("prefill", "fwdbwd")  # forward only, or forward + backward (records' names)
WORLD_SIZES: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
# The dK/dV accumulators travel the backward ring in fp32 (attnlab.distributed.ring).
GRAD_ACCUMULATOR_BYTES = 4
# Per direction: NVLink 4 on H100/H200 SXM is 18 links x 25 GB/s = 450 GB/s each way
# (NVIDIA's "900 GB/s" counts both directions); a ring hop uses one direction of the
# sender's links and the opposite one of the receiver's, so each rank's send and
# receive run at once.  Measured NCCL point-to-point reaches less: pass it in.
NVLINK4_BYTES_PER_S = 450e9
# Between nodes: one ConnectX-7 NDR InfiniBand port per GPU (DGX H100/H200),
# 400 Gb/s = 50 GB/s each way.
NDR_INFINIBAND_BYTES_PER_S = 50e9
GPUS_PER_NODE = 8

# Record kernel names of the single-GPU inputs (bench/ring_h200.py --single-gpu).
LOCAL_STEP = "ring-local-step"
REMOTE_EARLIER = "ring-remote-earlier"  # n queries x n/2 keys, unmasked
REMOTE_LATER = "ring-remote-later"      # n/2 queries x n keys, unmasked
MERGE = "ring-merge"                    # one forward step's fp32 merge_states
GRAD_ACCUMULATE = "ring-grad-accumulate"  # one backward step's fp32 dQ, dK, dV adds


# ----- what one shard costs to move and to compute -----------------------------------------
def _check_shard(shard: AttentionShape) -> AttentionShape:
    check_instance("shard", shard, AttentionShape)
    if shard.seqlen_q != shard.seqlen_k:
        raise ValueError(f"shard must hold the same tokens of Q and K/V (seqlen_q == seqlen_k), "
                         f"got {shard.seqlen_q} and {shard.seqlen_k}")
    if shard.has_window:
        raise ValueError(f"ring attention has no sliding window; shard.window must be (-1, -1), "
                         f"got {shard.window}")
    if shard.causal and shard.seqlen_q % 2:
        raise ValueError(f"a causal (zig-zag) shard holds two equal chunks: its seqlen must be "
                         f"even, got {shard.seqlen_q}")
    return shard


def kv_shard_bytes(shard: AttentionShape) -> int:
    """Bytes of one rank's K and V (storage dtype): what one forward hop moves."""
    _check_shard(shard)
    return 2 * shard.batch * shard.seqlen_k * shard.kv_heads * shard.head_dim * shard.element_bytes


def grad_shard_bytes(shard: AttentionShape) -> int:
    """Bytes of one rank's dK and dV accumulators (fp32): what one backward grad hop moves."""
    _check_shard(shard)
    return 2 * shard.batch * shard.seqlen_k * shard.kv_heads * shard.head_dim \
        * GRAD_ACCUMULATOR_BYTES


def ring_block_shapes(shard: AttentionShape) -> dict[str, AttentionShape]:
    """The single-device calls one rank makes, by record kernel name (see module doc).

    ``shard`` is one rank's shard: seqlen = tokens per GPU, ``causal`` as the ring's.
    Non-causal rings have one block kind, the local one.
    """
    _check_shard(shard)
    if not shard.causal:
        return {LOCAL_STEP: shard}
    half = shard.seqlen_q // 2
    return {
        LOCAL_STEP: shard,
        REMOTE_EARLIER: shard.replace(seqlen_k=half, causal=False),
        REMOTE_LATER: shard.replace(seqlen_q=half, causal=False),
    }


# ----- inputs: measured on one GPU ------------------------------------------------------------
@dataclass(frozen=True)
class PassTimes:
    """One ring pass's per-step compute on one GPU, milliseconds (forward, or backward alone).

    ``local_ms``: step 0 (the rank's own shard; forward: one GPU's baseline call).
    ``remote_ms``: each later step, the slower of the two remote block kinds.
    ``combine_ms``: each later step's fp32 bookkeeping (forward: the merge; backward:
    the dQ/dK/dV accumulation), serial with the block.
    """

    local_ms: float
    remote_ms: float
    combine_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("local_ms", "remote_ms", "combine_ms"):
            object.__setattr__(self, name, check_float(name, getattr(self, name), minimum=0.0))
        if self.local_ms == 0.0 or self.remote_ms == 0.0:
            raise ValueError("local_ms and remote_ms must be > 0 (measured times)")


@dataclass(frozen=True)
class RingLink:
    """The ring's hop bandwidth per direction (bytes/s) inside and between nodes."""

    intra_node_bytes_per_s: float = NVLINK4_BYTES_PER_S
    inter_node_bytes_per_s: float = NDR_INFINIBAND_BYTES_PER_S
    gpus_per_node: int = GPUS_PER_NODE
    hop_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            object.__setattr__(self, name, check_float(name, getattr(self, name), minimum=0.0,
                                                       min_open=True))
        object.__setattr__(self, "gpus_per_node",
                           check_int("gpus_per_node", self.gpus_per_node, minimum=1))
        object.__setattr__(self, "hop_latency_s",
                           check_float("hop_latency_s", self.hop_latency_s, minimum=0.0))

    def hop_bytes_per_s(self, world_size: int) -> float:
        """The slowest hop of a ring over ``world_size`` GPUs, filled node by node."""
        check_int("world_size", world_size, minimum=1)
        return self.intra_node_bytes_per_s if world_size <= self.gpus_per_node \
            else self.inter_node_bytes_per_s

    def transfer_ms(self, num_bytes: int, world_size: int) -> float:
        check_int("num_bytes", num_bytes, minimum=0)
        if num_bytes == 0:
            return 0.0
        return 1e3 * (self.hop_latency_s + num_bytes / self.hop_bytes_per_s(world_size))


# ----- the timeline ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RingStep:
    compute_ms: float
    transfer_ms: float  # what the link carries while this step computes

    @property
    def ms(self) -> float:
        return max(self.compute_ms, self.transfer_ms)

    @property
    def hidden(self) -> bool:
        return self.transfer_ms <= self.compute_ms


@dataclass(frozen=True)
class RingPass:
    """One pass round the ring: its steps and the hop left after the last one."""

    steps: tuple[RingStep, ...]
    transfer_bytes: tuple[int, ...]  # per step, the bytes its overlapped transfer moves
    final_hop_ms: float = 0.0        # backward: the last dK/dV hop to their owners

    @property
    def ms(self) -> float:
        return sum(step.ms for step in self.steps) + self.final_hop_ms

    @property
    def compute_ms(self) -> float:
        return sum(step.compute_ms for step in self.steps)

    @property
    def exposed_transfer_ms(self) -> float:
        return self.ms - self.compute_ms

    @property
    def transfer_hidden(self) -> bool:
        """Every overlapped transfer fits in its step (the final hop cannot overlap anything)."""
        return all(step.hidden for step in self.steps)

    def hiding_bytes_per_s(self, hop_latency_s: float = 0.0) -> float:
        """The smallest hop bandwidth that hides every overlapped transfer (0: nothing to hide)."""
        needed = 0.0
        for step, num_bytes in zip(self.steps, self.transfer_bytes, strict=True):
            if num_bytes == 0:
                continue
            budget_s = step.compute_ms / 1e3 - hop_latency_s
            if budget_s <= 0:
                return float("inf")
            needed = max(needed, num_bytes / budget_s)
        return needed


def forward_pass(times: PassTimes, world_size: int, shard: AttentionShape,
                 link: RingLink) -> RingPass:
    """The forward ring: K/V hop for step s+1 during step s (none during the last)."""
    check_int("world_size", world_size, minimum=1)
    kv_bytes = kv_shard_bytes(shard)
    steps, moved = [], []
    for step in range(world_size):
        compute = times.local_ms if step == 0 else times.remote_ms + times.combine_ms
        num_bytes = kv_bytes if step < world_size - 1 else 0
        steps.append(RingStep(compute, link.transfer_ms(num_bytes, world_size)))
        moved.append(num_bytes)
    return RingPass(tuple(steps), tuple(moved))


def backward_pass(times: PassTimes, world_size: int, shard: AttentionShape,
                  link: RingLink) -> RingPass:
    """The backward ring: during step s the K/V hop for s+1 and step s-1's dK/dV hop."""
    check_int("world_size", world_size, minimum=1)
    kv_bytes, grad_bytes = kv_shard_bytes(shard), grad_shard_bytes(shard)
    if world_size == 1:  # no ring: the accumulators never leave
        return RingPass((RingStep(times.local_ms, 0.0),), (0,))
    steps, moved = [], []
    for step in range(world_size):
        compute = times.local_ms if step == 0 else times.remote_ms + times.combine_ms
        num_bytes = (kv_bytes if step < world_size - 1 else 0) + (grad_bytes if step > 0 else 0)
        steps.append(RingStep(compute, link.transfer_ms(num_bytes, world_size)))
        moved.append(num_bytes)
    return RingPass(tuple(steps), tuple(moved), link.transfer_ms(grad_bytes, world_size))


@dataclass(frozen=True)
class RingScalingRow:
    """The ring at one world size (weak scaling: ``tokens_per_gpu`` fixed)."""

    world_size: int
    phase: str
    tokens_per_gpu: int
    total_tokens: int
    hop_bytes_per_s: float
    kv_hop_bytes: int
    grad_hop_bytes: int        # 0 for the forward phase
    single_gpu_ms: float       # one GPU running tokens_per_gpu (forward, or fwd + bwd)
    ring_ms: float
    compute_ms: float
    exposed_transfer_ms: float
    transfer_hidden: bool
    hiding_bytes_per_s: float  # hop bandwidth that hides every overlapped transfer
    efficiency: float          # world_size * single_gpu_ms / ring_ms


def weak_scaling(shard: AttentionShape, forward: PassTimes, backward: PassTimes | None = None, *,
                 phase: str = "prefill", link: RingLink | None = None,
                 world_sizes: Iterable[int] = WORLD_SIZES) -> list[RingScalingRow]:
    """Predicted ring time and efficiency for each world size.

    ``shard`` is one rank's shard (seqlen = tokens per GPU); ``forward`` (and for
    ``phase="fwdbwd"`` ``backward``, the backward alone) are one GPU's step times at
    that shard.  ``link`` defaults to H200 NVLink inside a node, NDR beyond.
    """
    _check_shard(shard)
    check_choice("phase", phase, PHASES)
    check_instance("forward", forward, PassTimes)
    if phase == "fwdbwd":
        check_instance("backward", backward, PassTimes)
    link = RingLink() if link is None else check_instance("link", link, RingLink)
    rows = []
    for world_size in world_sizes:
        check_int("world_size", world_size, minimum=1)
        passes = [forward_pass(forward, world_size, shard, link)]
        single_gpu_ms = forward.local_ms
        if phase == "fwdbwd":
            passes.append(backward_pass(backward, world_size, shard, link))
            single_gpu_ms += backward.local_ms
        ring_ms = sum(p.ms for p in passes)
        rows.append(RingScalingRow(
            world_size=world_size, phase=phase, tokens_per_gpu=shard.seqlen_q,
            total_tokens=world_size * shard.seqlen_q,
            hop_bytes_per_s=link.hop_bytes_per_s(world_size),
            kv_hop_bytes=kv_shard_bytes(shard) if world_size > 1 else 0,
            grad_hop_bytes=grad_shard_bytes(shard) if phase == "fwdbwd" and world_size > 1 else 0,
            single_gpu_ms=single_gpu_ms, ring_ms=ring_ms,
            compute_ms=sum(p.compute_ms for p in passes),
            exposed_transfer_ms=sum(p.exposed_transfer_ms for p in passes),
            transfer_hidden=all(p.transfer_hidden for p in passes),
            hiding_bytes_per_s=max(p.hiding_bytes_per_s(link.hop_latency_s) for p in passes),
            efficiency=world_size * single_gpu_ms / ring_ms,
        ))
    return rows


# ----- inputs from measured records -----------------------------------------------------------
def _latency_ms(records: Sequence[dict], kernel: str, phase: str, shape: AttentionShape) -> float:
    wanted = shape.as_dict()
    for record in records:
        if (record.get("kernel") == kernel and record.get("phase") == phase
                and record.get("metric") == "latency" and record.get("shape") == wanted):
            return float(record["p50"])
    raise ValueError(f"no measured latency record for kernel {kernel!r}, phase {phase!r}, "
                     f"shape {shape.describe()}; run bench/ring_h200.py --single-gpu for it")


def pass_times_from_records(records: Sequence[dict], shard: AttentionShape, *,
                            phase: str = "prefill") -> PassTimes:
    """One pass's :class:`PassTimes` from ``bench/ring_h200.py --single-gpu`` records (median).

    ``phase="prefill"``: the forward pass.  ``phase="fwdbwd"``: the backward alone,
    i.e. each block's fwd + bwd latency minus its forward latency.
    """
    check_choice("phase", phase, PHASES)
    blocks = ring_block_shapes(shard)
    combine_kernel = MERGE if phase == "prefill" else GRAD_ACCUMULATE

    def block_ms(kernel: str) -> float:
        ms = _latency_ms(records, kernel, phase, blocks[kernel])
        if phase == "fwdbwd":
            ms -= _latency_ms(records, kernel, "prefill", blocks[kernel])
        if ms <= 0:
            raise ValueError(f"{kernel}: fwd + bwd is not slower than fwd in the records "
                             f"({shard.describe()}); the records are inconsistent")
        return ms

    remote = [block_ms(kernel) for kernel in blocks if kernel != LOCAL_STEP] \
        or [block_ms(LOCAL_STEP)]
    return PassTimes(local_ms=block_ms(LOCAL_STEP), remote_ms=max(remote),
                     combine_ms=_latency_ms(records, combine_kernel, phase, shard))
