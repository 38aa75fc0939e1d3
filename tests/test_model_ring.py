"""The ring-attention scaling model: exact bytes, hand-checked timelines, records as inputs."""

from __future__ import annotations

import pytest

from attnlab.measure.records import make_record
from attnlab.model import ring
from attnlab.model.ring import PassTimes, RingLink
from attnlab.shapes import AttentionShape

# The issue's benchmark shard: 32 heads, d = 128, bf16, causal, 32k tokens per GPU.
SHARD_32K = AttentionShape(batch=1, query_heads=32, kv_heads=32, seqlen_q=32768,
                           seqlen_k=32768, head_dim=128, dtype="bf16", causal=True)
# 1 GB/s inside a node, 100 MB/s between nodes: transfers in round milliseconds.
ONE_GB_PER_S = RingLink(intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e8,
                        gpus_per_node=8)


def _shard(seqlen=1024, **changes) -> AttentionShape:
    base = dict(batch=1, query_heads=4, kv_heads=2, seqlen_q=seqlen, seqlen_k=seqlen,
                head_dim=64, dtype="bf16", causal=True)
    return AttentionShape(**{**base, **changes})


def test_hop_bytes_are_exact_integers():
    # K and V: 2 tensors x 32768 tokens x 32 heads x 128 x 2 bytes = 512 MiB per hop.
    assert ring.kv_shard_bytes(SHARD_32K) == 536_870_912
    # dK and dV travel in fp32: twice the bytes of bf16 K/V.
    assert ring.grad_shard_bytes(SHARD_32K) == 1_073_741_824
    assert isinstance(ring.kv_shard_bytes(SHARD_32K), int)
    gqa = SHARD_32K.replace(kv_heads=8)
    assert ring.kv_shard_bytes(gqa) == 536_870_912 // 4


def test_block_shapes_follow_the_zigzag_plan():
    blocks = ring.ring_block_shapes(_shard(1024))
    assert blocks[ring.LOCAL_STEP] == _shard(1024)
    assert (blocks[ring.REMOTE_EARLIER].seqlen_q, blocks[ring.REMOTE_EARLIER].seqlen_k) == (1024, 512)
    assert (blocks[ring.REMOTE_LATER].seqlen_q, blocks[ring.REMOTE_LATER].seqlen_k) == (512, 1024)
    assert not blocks[ring.REMOTE_EARLIER].causal and not blocks[ring.REMOTE_LATER].causal
    assert ring.ring_block_shapes(_shard(1024, causal=False)) == {
        ring.LOCAL_STEP: _shard(1024, causal=False)}


def _link_for_transfer_ms(shard: AttentionShape, transfer_ms: float) -> RingLink:
    """A link on which one K/V hop of ``shard`` takes ``transfer_ms``."""
    return RingLink(intra_node_bytes_per_s=ring.kv_shard_bytes(shard) / (transfer_ms / 1e3))


def test_forward_timeline_hidden_transfer_by_hand():
    shard = _shard()
    times = PassTimes(local_ms=10.0, remote_ms=5.0, combine_ms=1.0)
    rows = ring.weak_scaling(shard, times, link=_link_for_transfer_ms(shard, 3.0), world_sizes=[4])
    (row,) = rows
    # Steps: max(10, 3) + max(6, 3) + max(6, 3) + 6 (the last step sends nothing).
    assert row.ring_ms == pytest.approx(28.0)
    assert row.compute_ms == pytest.approx(28.0)
    assert row.exposed_transfer_ms == pytest.approx(0.0)
    assert row.transfer_hidden
    assert row.efficiency == pytest.approx(4 * 10.0 / 28.0)
    assert row.total_tokens == 4 * 1024 and row.kv_hop_bytes == ring.kv_shard_bytes(shard)
    # The tightest overlapped step is a remote one: 6 ms for one hop.
    assert row.hiding_bytes_per_s == pytest.approx(ring.kv_shard_bytes(shard) / 6e-3)


def test_forward_timeline_exposed_transfer_by_hand():
    shard = _shard()
    times = PassTimes(local_ms=10.0, remote_ms=5.0, combine_ms=1.0)
    (row,) = ring.weak_scaling(shard, times, link=_link_for_transfer_ms(shard, 8.0),
                               world_sizes=[4])
    # max(10, 8) + max(6, 8) + max(6, 8) + 6 = 32: 4 ms of transfer exposed.
    assert row.ring_ms == pytest.approx(32.0)
    assert row.exposed_transfer_ms == pytest.approx(4.0)
    assert not row.transfer_hidden
    # The link that hides it is exactly the one whose hop takes the remote step's 6 ms.
    hiding = RingLink(intra_node_bytes_per_s=row.hiding_bytes_per_s)
    (hidden_row,) = ring.weak_scaling(shard, times, link=hiding, world_sizes=[4])
    assert hidden_row.transfer_hidden and hidden_row.ring_ms == pytest.approx(28.0)


def test_backward_carries_kv_and_fp32_grads_and_one_final_hop():
    shard = _shard()
    kv_ms = 2.0  # one K/V hop; the fp32 dK/dV hop of a bf16 shard moves twice the bytes
    link = _link_for_transfer_ms(shard, kv_ms)
    forward = PassTimes(local_ms=10.0, remote_ms=5.0)
    backward = PassTimes(local_ms=20.0, remote_ms=9.0, combine_ms=1.0)
    (row,) = ring.weak_scaling(shard, forward, backward, phase="fwdbwd", link=link,
                               world_sizes=[3])
    forward_ms = 10 + 5 + 5
    # Backward steps: max(20, kv) + max(10, kv + grad) + max(10, grad) + final grad hop.
    backward_ms = 20 + 10 + 10 + 2 * kv_ms
    assert row.ring_ms == pytest.approx(forward_ms + backward_ms)
    assert row.exposed_transfer_ms == pytest.approx(2 * kv_ms)  # the final hop only
    assert row.transfer_hidden  # the final hop has nothing to overlap, so it does not count
    assert row.grad_hop_bytes == 2 * ring.kv_shard_bytes(shard)
    assert row.single_gpu_ms == pytest.approx(30.0)
    assert row.efficiency == pytest.approx(3 * 30.0 / row.ring_ms)
    # The busiest backward step carries kv + grad bytes in its 10 ms.
    assert row.hiding_bytes_per_s == pytest.approx(3 * ring.kv_shard_bytes(shard) / 10e-3)


def test_one_gpu_is_the_baseline_and_large_rings_cross_nodes():
    shard = _shard()
    times = PassTimes(local_ms=10.0, remote_ms=5.0)
    rows = {r.world_size: r for r in ring.weak_scaling(shard, times, link=ONE_GB_PER_S,
                                                       world_sizes=[1, 8, 16])}
    assert rows[1].ring_ms == pytest.approx(10.0) and rows[1].efficiency == pytest.approx(1.0)
    assert rows[1].kv_hop_bytes == 0
    assert rows[8].hop_bytes_per_s == 1e9 and rows[16].hop_bytes_per_s == 1e8
    assert rows[16].exposed_transfer_ms > rows[8].exposed_transfer_ms


def test_default_world_sizes_and_link_are_the_issues():
    rows = ring.weak_scaling(SHARD_32K, PassTimes(local_ms=40.0, remote_ms=38.0))
    assert [r.world_size for r in rows] == [2, 4, 8, 16, 32, 64]
    assert rows[0].hop_bytes_per_s == ring.NVLINK4_BYTES_PER_S
    assert rows[-1].hop_bytes_per_s == ring.NDR_INFINIBAND_BYTES_PER_S
    # 512 MiB at 450 GB/s is 1.19 ms: hidden behind 38 ms; at 50 GB/s (10.7 ms) still hidden.
    assert all(r.transfer_hidden for r in rows)


def _record(kernel, phase, shape, p50):
    env = dict(gpu="NVIDIA H200", torch="2.11.0", triton="3.6.0", driver=None, git_commit="abc",
               timestamp="2026-01-01T00:00:00+00:00", command="python bench/ring_h200.py")
    return make_record(kernel=kernel, provider="attnlab", phase=phase, shape=shape,
                       metric="latency", unit="ms", p20=p50, p50=p50, p80=p50, repeats=10,
                       env=env)


def test_pass_times_come_from_single_gpu_records():
    shard = _shard()
    blocks = ring.ring_block_shapes(shard)
    records = [
        _record(ring.LOCAL_STEP, "prefill", blocks[ring.LOCAL_STEP], 10.0),
        _record(ring.REMOTE_EARLIER, "prefill", blocks[ring.REMOTE_EARLIER], 5.0),
        _record(ring.REMOTE_LATER, "prefill", blocks[ring.REMOTE_LATER], 6.0),
        _record(ring.MERGE, "prefill", shard, 0.5),
        _record(ring.LOCAL_STEP, "fwdbwd", blocks[ring.LOCAL_STEP], 35.0),
        _record(ring.REMOTE_EARLIER, "fwdbwd", blocks[ring.REMOTE_EARLIER], 20.0),
        _record(ring.REMOTE_LATER, "fwdbwd", blocks[ring.REMOTE_LATER], 19.0),
        _record(ring.GRAD_ACCUMULATE, "fwdbwd", shard, 0.25),
    ]
    forward = ring.pass_times_from_records(records, shard)
    assert forward == PassTimes(local_ms=10.0, remote_ms=6.0, combine_ms=0.5)  # the slower kind
    backward = ring.pass_times_from_records(records, shard, phase="fwdbwd")
    assert backward == PassTimes(local_ms=25.0, remote_ms=15.0, combine_ms=0.25)
    with pytest.raises(ValueError, match="ring-remote-later"):
        ring.pass_times_from_records(records[:2], shard)


@pytest.mark.parametrize(("call", "error", "text"), [
    (lambda: ring.kv_shard_bytes(_shard(1023)), ValueError, "even"),
    (lambda: ring.kv_shard_bytes(_shard(seqlen_k=512)), ValueError, "seqlen_q == seqlen_k"),
    (lambda: ring.kv_shard_bytes(_shard(window=(16, 0))), ValueError, "window"),
    (lambda: ring.weak_scaling(_shard(), PassTimes(1.0, 1.0), phase="bwd"), ValueError, "phase"),
    (lambda: ring.weak_scaling(_shard(), PassTimes(1.0, 1.0), phase="fwdbwd"), TypeError,
     "backward"),
    (lambda: PassTimes(local_ms=-1.0, remote_ms=1.0), ValueError, "local_ms"),
    (lambda: PassTimes(local_ms=0.0, remote_ms=1.0), ValueError, "> 0"),
    (lambda: RingLink(intra_node_bytes_per_s=0.0), ValueError, "intra_node_bytes_per_s"),
    (lambda: ring.weak_scaling(_shard(), PassTimes(1.0, 1.0), world_sizes=[0]), ValueError,
     "world_size"),
])
def test_bad_inputs_are_refused_by_name(call, error, text):
    with pytest.raises(error, match=text):
        call()
