"""bench/backward_d256_tiles.py without compiling: what a TTGIR's dots are read as, the
grid's order and skips, and the table and ranking over a small fake JSON lines file; and
the d = 256 candidates of bench/backward_h200.py against the committed builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnlab.kernels._aot import mma_dots, mma_instructions

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "ptxas" / "backward_d256_tiles.jsonl"

# Lines as Triton 3.6.0 writes them for the d = 256 dK/dV kernel (64 keys, 8 warps) and
# an mma.sync one (32 keys, 8 warps), shortened.
TTGIR_WGMMA = """\
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 128, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
    %qk_t_170 = ttng.warp_group_dot %k_44, %qk_t, %cst_2 {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x256xbf16, #shared, #smem> * !ttg.memdesc<256x64xbf16, #shared1, #smem> -> tensor<64x64xf32, #mma1> loc(#loc511)
    %qk_t_171:3 = ttng.warp_group_dot_wait %qk_t_170, %k_44, %qk_t {pendings = 0 : i32} : tensor<64x64xf32, #mma1>, !ttg.memdesc<64x256xbf16, #shared, #smem> loc(#loc511)
    %dv_188 = ttng.warp_group_dot %dv_187, %do_163, %arg48 {inputPrecision = 0 : i32, isAsync = true} : tensor<64x16xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * !ttg.memdesc<16x256xbf16, #shared, #smem> -> tensor<64x256xf32, #mma> loc(#loc512)
    %qk_t_166 = ttng.warp_group_dot %k_44, %qk_t, %cst_2 {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x256xbf16, #shared, #smem> * !ttg.memdesc<256x64xbf16, #shared1, #smem> -> tensor<64x64xf32, #mma1> loc(#loc525)
"""
TTGIR_MMA_SYNC = """\
#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], instrShape = [16, 8]}>
    %qk_t_178 = tt.dot %k_177, %qk_t_159, %cst_3, inputPrecision = tf32 : tensor<32x256xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<256x16xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<32x16xf32, #mma> loc(#loc513)
"""


def test_mma_dots_names_each_dot_once_with_its_instruction_and_replication():
    assert mma_dots(TTGIR_WGMMA) == [
        {"dot": "qk_t", "mma": "wgmma", "m": 64, "n": 64, "k": 256, "warps": [8, 1],
         "replication": 2},
        {"dot": "dv", "mma": "wgmma", "m": 64, "n": 256, "k": 16, "warps": [4, 2],
         "replication": 1},
    ]
    # Eight warps side by side along 16 columns: each column four times.
    assert mma_dots(TTGIR_MMA_SYNC) == [
        {"dot": "qk_t", "mma": "mma.sync", "m": 32, "n": 16, "k": 256, "warps": [1, 8],
         "replication": 4}]


def test_mma_instructions_counts_wgmma_and_mma_sync():
    ptx = ("wgmma.fence.sync.aligned;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16\n"
           "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16\n"
           "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32\n")
    assert mma_instructions(ptx) == {"wgmma": 2, "mma_sync": 1}


def test_the_grid_skips_what_the_accumulators_cannot_hold_and_starts_with_wgmma(bench_script):
    tiles = bench_script("backward_d256_tiles")
    tasks = tiles.tasks()
    built = {(kernel, config.num_warps, config.dq_block_m if kernel == "triton-dq"
              else config.dkdv_block_n) for kernel, _, config, _ in tasks}
    # dK + dV of 64 keys at 4 warps, of 128 keys at 8; dQ of 128 rows at 4 warps: 256
    # registers a thread before anything else.  Split, one of dK, dV: 128 keys at 8 warps.
    assert ("triton-dkdv", 4, 64) not in built and ("triton-dkdv", 8, 128) not in built
    assert ("triton-dq", 4, 128) not in built and ("triton-dq", 8, 128) in built
    assert ("triton-dkdv-split", 8, 128) in built and ("triton-dkdv-split", 4, 128) not in built
    assert all(config.dkdv_split == (kernel == "triton-dkdv-split")
               for kernel, _, config, _ in tasks)
    assert len(tasks) == len({(k, c, o["causal"]) for k, _, c, o in tasks})
    first_dq = next(config for kernel, _, config, _ in tasks if kernel == "triton-dq")
    assert tiles.predicted_mma("triton-dq", first_dq.dq_block_m, first_dq.dq_block_n,
                               first_dq.num_warps) == 0
    # Both masks of a tile side by side, both kernels early.
    assert [o["causal"] for _, _, _, o in tasks[:2]] == [True, False]
    assert {kernel for kernel, _, _, _ in tasks[:6]} == {"triton-dkdv", "triton-dkdv-split",
                                                         "triton-dq"}


def _row(kernel, tile, causal, *, spills=0, shared=64 * 1024, mma="wgmma", replication=1,
         built=True):
    block_m, block_n, warps, stages = tile
    row = {"triton": "3.6.0", "kernel": kernel, "head_dim": 256,
           "config": {"type": "BackwardConfig", "dkdv_block_m": block_m, "dkdv_block_n": block_n,
                      "dq_block_m": block_m, "dq_block_n": block_n, "num_warps": warps,
                      "num_stages": stages},
           "dtype": "bf16", "causal": causal, "window": False, "softcap": False, "varlen": False,
           "built": built, "seconds": 1.0}
    if not built:
        return {**row, "error": "PTXASError: ptxas died"}
    return {**row, "registers": 255 if spills else 200, "stack_bytes": 8 * spills,
            "local_memory_ops": spills, "shared_bytes": shared, "fits_shared": shared <= 232448,
            "dots": [{"dot": "qk", "mma": mma, "m": block_m, "n": block_n, "k": 256,
                      "warps": [warps, 1], "replication": replication}]}


@pytest.fixture
def fake_rows(tmp_path, bench_script):
    dq = "triton-dq"
    rows = [
        _row(dq, (64, 32, 4, 2), True), _row(dq, (64, 32, 4, 2), False),
        # The most rows but spilling under one mask: after the spill-free 128-row tile,
        # before every 64-row one.
        _row(dq, (128, 32, 8, 2), True, spills=14), _row(dq, (128, 32, 8, 2), False),
        _row(dq, (128, 16, 8, 2), True), _row(dq, (128, 16, 8, 2), False),
        # Past the H200's shared memory, one mask only, a failed build: never ranked.
        _row(dq, (128, 64, 8, 3), True, shared=320 * 1024),
        _row(dq, (128, 64, 8, 3), False, shared=320 * 1024),
        _row(dq, (64, 64, 8, 1), True),
        _row(dq, (32, 64, 8, 1), True, built=False), _row(dq, (32, 64, 8, 1), False),
        # Same rows, the better MMA first.
        _row(dq, (64, 16, 8, 2), True, replication=2), _row(dq, (64, 16, 8, 2), False),
        _row(dq, (64, 64, 4, 1), True, mma="mma.sync"), _row(dq, (64, 64, 4, 1), False),
        _row("triton-dkdv", (16, 64, 8, 2), True, spills=123),
        _row("triton-dkdv", (16, 64, 8, 2), False, spills=26),
    ]
    path = tmp_path / "fake.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return bench_script("ptxas_configs").read_rows(str(path))


def test_ranked_takes_usable_tiles_larger_blocks_first_then_spills_and_mma(bench_script,
                                                                           fake_rows):
    tiles = bench_script("backward_d256_tiles")
    assert tiles.ranked(fake_rows, "triton-dq") == [
        (128, 16, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 16, 8, 2), (64, 64, 4, 1)]
    assert tiles.ranked(fake_rows, "triton-dq", num_warps=8) == [
        (128, 16, 8, 2), (128, 32, 8, 2), (64, 16, 8, 2)]
    assert tiles.ranked(fake_rows, "triton-dq", num_stages=1) == [(64, 64, 4, 1)]
    summary = tiles.tiles(fake_rows, "triton-dkdv")[(16, 64, 8, 2)]
    assert (summary["spills"], summary["complete"], summary["fits"]) == (123, True, True)


def test_the_table_lists_every_tile_marks_shared_memory_and_failures(bench_script, fake_rows):
    lines = bench_script("backward_d256_tiles").table(fake_rows)
    text = "\n".join(lines)
    row = next(line for line in lines if line.split()[:4] == ["128", "32", "8", "2"])
    assert row.split()[4:7] == ["255/14", "200/0", "112"]
    assert next(line for line in lines if line.split()[:4] == ["128", "64", "8", "3"]
                ).split()[7] == "320*"
    assert "FAIL (32, 64, 8, 1) causal=True: PTXASError: ptxas died" in text
    assert "qk:wgx2" in text and "triton-dkdv d=256 (triton 3.6.0)" in text
    # The five ranked tiles first, then the rest (the failed, the incomplete, the oversized).
    start = next(i for i, line in enumerate(lines) if line.startswith("triton-dq"))
    listed = [tuple(map(int, line.split()[:4])) for line in lines[start + 2:start + 10]]
    assert listed == [(128, 16, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 16, 8, 2),
                      (64, 64, 4, 1), (32, 64, 8, 1), (64, 64, 8, 1), (128, 64, 8, 3)]


def test_the_h200_candidates_at_d256_built_and_fit_in_shared_memory(bench_script):
    # Every committed d = 256 candidate is a tile the compile sweep built under both masks
    # within the H200's shared memory, at the warps and stages it will run with.
    tiles, h200 = bench_script("backward_d256_tiles"), bench_script("backward_h200")
    rows = bench_script("ptxas_configs").read_rows(str(RESULTS))
    dkdv = {False: tiles.tiles(rows, "triton-dkdv"), True: tiles.tiles(rows, "triton-dkdv-split")}
    dq = tiles.tiles(rows, "triton-dq")
    candidates = h200.dkdv_candidates(256)
    assert 4 <= len(candidates) <= 8 and 3 <= len(h200.dq_candidates(256)) <= 6
    for *candidate, split in candidates:
        built = dkdv[split][tuple(candidate)]
        assert built["complete"] and built["fits"], candidate
        # The dQ tile the dK/dV candidates are timed with.
        first_dq = dq[(*h200.dq_stand_in(256, candidate[2], None), *candidate[2:])]
        assert first_dq["complete"] and first_dq["fits"], candidate
    for block_m, block_n in h200.dq_candidates(256):
        assert any(dq.get((block_m, block_n, warps, stages), {}).get("complete")
                   for _, _, warps, stages, _ in candidates), (block_m, block_n)
