"""Ring attention: the zig-zag plan, and real process groups (gloo on CPU, nccl on GPUs).

The plan tests are pure integer checks in this process.  The ring tests spawn one
group per backend and world size (2 and 4 processes, file-store rendezvous in a tmp
dir; the nccl groups are marked ``gpu`` and need that many GPUs),
run every case inside it, and judge the gathered output and gradients against
single-process float64 attention with the project's rules (``attnlab.accuracy``:
forward 2x, gradients 3x of PyTorch's same-dtype error).  Every collective has a
timeout and the whole group a deadline, so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnlab.accuracy import check_accuracy, check_gradients
from attnlab.distributed import (
    required_multiple,
    ring_attention,
    ring_flash_attn_func,
    ring_step_block,
    shard_ranges,
    shard_sequence,
    unshard_sequence,
)
from attnlab.reference import mask

WORLD_SIZES = (2, 4)
GROUP_DEADLINE_S = 240     # the whole spawned group, spawn and imports included
COLLECTIVE_TIMEOUT_S = 60  # one gloo operation


# ---------------------------------------------------------------------------
# The plan, without processes
# ---------------------------------------------------------------------------

def _pairs_of_step(step: int, rank: int, world_size: int, seqlen: int, causal: bool) -> set:
    """(query position, key position) pairs that rank computes at step, in global positions."""
    q_positions = [p for r in shard_ranges(seqlen, world_size=world_size, rank=rank,
                                           causal=causal) for p in r]
    source = (rank - step) % world_size
    kv_positions = [p for r in shard_ranges(seqlen, world_size=world_size, rank=source,
                                            causal=causal) for p in r]
    block = ring_step_block(step, rank=rank, world_size=world_size, local_seqlen=len(q_positions),
                            causal=causal)
    rows = range(len(q_positions))[block.q_rows]
    cols = range(len(kv_positions))[block.kv_rows]
    visible = mask(len(rows), len(cols), causal=block.causal)
    return {(q_positions[rows[i]], kv_positions[cols[j]])
            for i, j in visible.nonzero().tolist()}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3])
def test_plan_computes_every_visible_pair_once_with_equal_work(world_size, causal, chunk):
    seqlen = required_multiple(world_size, causal) * chunk
    visible = mask(seqlen, seqlen, causal=causal)
    work = set()
    for rank in range(world_size):
        mine = set()
        for step in range(world_size):
            pairs = _pairs_of_step(step, rank, world_size, seqlen, causal)
            assert not pairs & mine, f"rank {rank} step {step} recomputes pairs"
            mine |= pairs
        q_positions = [p for r in shard_ranges(seqlen, world_size=world_size, rank=rank,
                                               causal=causal) for p in r]
        expected = {(i, j) for i in q_positions for j in range(seqlen) if visible[i, j]}
        assert mine == expected, f"rank {rank}: missing {sorted(expected - mine)[:4]}, " \
                                 f"extra {sorted(mine - expected)[:4]}"
        work.add(len(mine))
    assert len(work) == 1, f"zig-zag must balance the work, got pairs per rank {sorted(work)}"


def test_shard_ranges_partition_the_sequence_in_zigzag_order():
    assert shard_ranges(16, world_size=4, rank=1, causal=True) == (range(2, 4), range(12, 14))
    assert shard_ranges(16, world_size=4, rank=1, causal=False) == (range(4, 8),)
    for causal in (True, False):
        covered = sorted(p for rank in range(4)
                         for r in shard_ranges(24, world_size=4, rank=rank, causal=causal)
                         for p in r)
        assert covered == list(range(24))


@pytest.mark.parametrize(("seqlen", "causal", "multiple"), [(12, True, 8), (10, False, 4),
                                                            (0, False, 4)])
def test_ragged_total_lengths_are_rejected_naming_the_multiple(seqlen, causal, multiple):
    with pytest.raises(ValueError, match=f"multiple of {multiple}"):
        shard_ranges(seqlen, world_size=4, rank=0, causal=causal)


@pytest.mark.parametrize("causal", [True, False])
def test_scaling_model_counts_the_blocks_the_ring_computes(causal):
    from attnlab.model.ring import ring_block_shapes
    from attnlab.shapes import AttentionShape

    world_size, local = 4, 12
    shard = AttentionShape(seqlen_q=local, seqlen_k=local, causal=causal)
    modelled = {(s.seqlen_q, s.seqlen_k, s.causal) for s in ring_block_shapes(shard).values()}
    planned = set()
    for rank in range(world_size):
        for step in range(world_size):
            block = ring_step_block(step, rank=rank, world_size=world_size, local_seqlen=local,
                                    causal=causal)
            planned.add((len(range(local)[block.q_rows]), len(range(local)[block.kv_rows]),
                         block.causal))
    assert planned == modelled


def test_ring_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("this process already belongs to a process group")
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)


# ---------------------------------------------------------------------------
# Cases run inside the spawned gloo groups
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    causal: bool
    dtype: torch.dtype
    batch: int = 1
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    tokens_per_rank: int = 8
    impl: str = "reference"
    flash_api: bool = False  # through ring_flash_attn_func instead of ring_attention


ACCURACY_CASES = {
    "full-bf16-mha": Case(causal=False, dtype=torch.bfloat16),
    "full-fp16-gqa": Case(causal=False, dtype=torch.float16, heads=4, kv_heads=2),
    "causal-bf16-gqa": Case(causal=True, dtype=torch.bfloat16, heads=4, kv_heads=2),
    "causal-fp32-mqa-batch2": Case(causal=True, dtype=torch.float32, batch=2, heads=4,
                                   kv_heads=1, head_dim=8),
    "causal-bf16-flash-api": Case(causal=True, dtype=torch.bfloat16, flash_api=True),
    # The Triton kernels per block, in Triton's CPU interpreter (slow: one small case).
    "causal-fp16-gqa-triton": Case(causal=True, dtype=torch.float16, heads=4, kv_heads=2,
                                   tokens_per_rank=4, impl="triton"),
}
REJECTION_CASES = ("odd-causal-shard", "shards-differ-across-ranks", "ragged-total",
                   "unknown-impl", "window-refused")


def _run_accuracy_case(case: Case, rank: int, world_size: int, device: str) -> dict:
    impl = case.impl
    if device.startswith("cuda") and case.dtype in (torch.float16, torch.bfloat16):
        impl = "triton"  # on GPUs the point is the kernels
    elif impl == "triton":
        from attnlab.kernels.forward import kernel_is_interpreted

        if not kernel_is_interpreted():
            return {"skipped": "the Triton kernels on CPU tensors need TRITON_INTERPRET=1"}
    generator = torch.Generator().manual_seed(1234)
    seqlen = case.tokens_per_rank * world_size
    q = torch.randn(case.batch, seqlen, case.heads, case.head_dim, generator=generator)
    k, v = (torch.randn(case.batch, seqlen, case.kv_heads, case.head_dim, generator=generator)
            for _ in range(2))
    dout = torch.randn(q.shape, generator=generator)
    q, k, v, dout = (t.to(device=device, dtype=case.dtype) for t in (q, k, v, dout))
    shards = [shard_sequence(t, causal=case.causal).requires_grad_() for t in (q, k, v)]
    if case.flash_api:
        out, lse, _ = ring_flash_attn_func(*shards, causal=case.causal, return_attn_probs=True,
                                           impl=impl)
    else:
        out, lse = ring_attention(*shards, causal=case.causal, impl=impl, return_lse=True)
    out.backward(shard_sequence(dout, causal=case.causal))
    gathered = [unshard_sequence(t, causal=case.causal)
                for t in (out.detach(), *(s.grad for s in shards))]
    full_lse = unshard_sequence(lse, causal=case.causal, seq_dim=2)
    if rank != 0:
        return {"passed": True, "detail": "checked on rank 0"}
    forward = check_accuracy(gathered[0], full_lse, q, k, v, causal=case.causal, layout="bshd")
    gradients = check_gradients(gathered[1:], q, k, v, dout, causal=case.causal, layout="bshd")
    detail = f"forward {forward}; " + "; ".join(str(g) for g in gradients)
    return {"passed": forward.passed and all(g.passed for g in gradients), "detail": detail}


def _expect_error(error_type, text: str, call) -> dict:
    try:
        call()
    except error_type as error:
        if text in str(error):
            return {"passed": True, "detail": str(error)}
        return {"passed": False, "detail": f"message lacks {text!r}: {error}"}
    return {"passed": False, "detail": f"no {error_type.__name__} raised"}


def _run_rejection_case(name: str, rank: int, world_size: int, device: str) -> dict:
    x = torch.randn(1, 8, 2, 16, device=device)
    if name == "odd-causal-shard":
        odd = torch.randn(1, 7, 2, 16, device=device)
        return _expect_error(ValueError, f"multiple of {2 * world_size}",
                             lambda: ring_attention(odd, odd, odd, causal=True))
    if name == "shards-differ-across-ranks":
        mine = x if rank == 0 else torch.randn(1, 10, 2, 16, device=device)
        return _expect_error(ValueError, "same shard shape",
                             lambda: ring_attention(mine, mine, mine, causal=False))
    if name == "ragged-total":
        full = torch.randn(1, 2 * world_size * 4 + 2, 2, 16, device=device)
        return _expect_error(ValueError, f"multiple of {2 * world_size}",
                             lambda: shard_sequence(full, causal=True))
    if name == "unknown-impl":
        return _expect_error(ValueError, "unknown impl 'cuda'",
                             lambda: ring_attention(x, x, x, impl="cuda"))
    if name == "window-refused":
        return _expect_error(NotImplementedError, "window_size",
                             lambda: ring_flash_attn_func(x, x, x, window_size=(4, 0)))
    raise AssertionError(f"unknown rejection case {name}")


def _worker(rank: int, world_size: int, backend: str, folder: str) -> None:
    torch.set_num_threads(1)  # the CI machine has two cores for everything
    device = "cpu"
    if backend == "nccl":
        # NVLink multicast stays off on the lent GPU machines.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    elif sys.platform.startswith("linux") and Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results = {}
    try:
        for name, case in ACCURACY_CASES.items():
            started = time.perf_counter()
            try:
                results[name] = _run_accuracy_case(case, rank, world_size, device)
            except Exception:
                results[name] = {"passed": False, "detail": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - started
        for name in REJECTION_CASES:
            try:
                results[name] = _run_rejection_case(name, rank, world_size, device)
            except Exception:
                results[name] = {"passed": False, "detail": traceback.format_exc()}
    finally:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _run_group(backend: str, world_size: int, folder: Path) -> dict[int, dict]:
    context = mp.start_processes(_worker, args=(world_size, backend, str(folder)),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + GROUP_DEADLINE_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world_size}-process {backend} group did not finish within "
                            f"{GROUP_DEADLINE_S} s (a hang?)")
    finally:
        for process in context.processes:  # only the processes this test started
            if process.is_alive():
                process.terminate()
                process.join(5)
    return {rank: json.loads((folder / f"rank{rank}.json").read_text())
            for rank in range(world_size)}


def _nccl(world_size: int):
    return pytest.param(("nccl", world_size), id=f"nccl-{world_size}gpus", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < world_size,
                           reason=f"needs {world_size} CUDA GPUs for an nccl group")])


@pytest.fixture(scope="module", params=[
    *(pytest.param(("gloo", n), id=f"gloo-{n}ranks") for n in WORLD_SIZES),
    *(_nccl(n) for n in WORLD_SIZES)])
def ring_group(request, tmp_path_factory):
    backend, world_size = request.param
    folder = tmp_path_factory.mktemp(f"ring-{backend}-{world_size}")
    return world_size, _run_group(backend, world_size, folder)


def _assert_on_every_rank(results: dict[int, dict], name: str) -> None:
    outcomes = {rank: r[name] for rank, r in results.items()}
    skipped = [o["skipped"] for o in outcomes.values() if "skipped" in o]
    if skipped:
        pytest.skip(skipped[0])
    failed = {rank: o["detail"] for rank, o in outcomes.items() if not o["passed"]}
    assert not failed, "\n".join(f"rank {rank}: {detail}" for rank, detail in failed.items())


@pytest.mark.parametrize("name", list(ACCURACY_CASES))
def test_ring_matches_single_process_attention(ring_group, name):
    _, results = ring_group
    _assert_on_every_rank(results, name)


@pytest.mark.parametrize("name", REJECTION_CASES)
def test_ring_rejects_bad_input_on_every_rank(ring_group, name):
    _, results = ring_group
    _assert_on_every_rank(results, name)
