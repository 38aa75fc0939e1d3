"""The backward kernels' tiles at head_dim 256 as ptxas builds them for sm_90a, without a GPU.

    PYTHONPATH=/work/tritons/t3.6.0:src python3 bench/backward_d256_tiles.py
        [--out bench/results/ptxas/backward_d256_tiles.jsonl] [--budget-min 40] [--table-only]

The seed's GQA d = 256 layer runs untuned tiles (64, 64, 64, 64, 8 warps, 1 stage) and
both backward kernels spill there (bench/NOTES.md, B16).  This compiles the dK/dV kernel
(``_attn_bwd_dkdv``) and the dQ kernel (``_attn_bwd_dq``) one at a time, bf16, causal and
not, over block_m, block_n in {16, 32, 64, 128}, 4 or 8 warps and 1-3 stages, on this
machine's Triton (the H200 runs 3.6.0), as a launch specialises them
(``ptxas_configs.build``, which compiles through ``backward.compile_for_sm90``).  The GQA
group size is a runtime argument of both kernels (``do_not_specialize``, no constexpr
reads it), so one build serves every grouping; the mask changes the code (``HAS_RIGHT``,
and the dQ kernel's ``REVERSE_M``).

Every dot of the dK/dV kernel has M = dkdv_block_n (it works on the transposed tile:
S^T = K Q^T, dV += P^T dO, dP^T = V dO^T, dK += dS^T Q) and every dot of the dQ kernel
M = dq_block_m.  Triton 3.6 issues wgmma where M is a multiple of 64, and lays all warps
along M for a dot whose result feeds another dot (S and dP): 8 warps then cover 128
rows, so over 64 rows each warpgroup computes the whole tile (``_aot.mma_dots``'
``replication``).  Skipped: tiles whose fp32 accumulators alone need 256 registers a
thread or more (dK and dV: 2 x block_n x 256, dQ: block_m x 256, over 32 x num_warps
threads; a thread has 255).  The most promising builds go first (unreplicated wgmma,
then replicated, then mma.sync; within each, no predicted spill first, then the larger
owned block, then fewer stages; the kernels take turns), both masks of a tile together,
until ``--budget-min`` is spent; builds already in ``--out`` are skipped, so a rerun resumes.

One JSON line per build: ``ptxas_configs.build``'s (Triton version, kernel, config,
registers, stack bytes, LDL/STL) plus the shared memory, whether it fits the H200's
227 KiB, each dot's instruction, shape, warps and replication, and the PTX's wgmma and
mma.sync counts.  The config's other kernel's tiles mirror this kernel's; they do not
enter the build.  Prints a table per kernel and the tiles ranked for
``backward_h200.py``'s d = 256 sweep (``ranked``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import triton
from ptxas_configs import build, build_key, build_row, read_rows

from attnlab.kernels._aot import mma_dots, mma_instructions
from attnlab.kernels.configs import BackwardConfig

HEAD_DIM = 256
BLOCKS = (16, 32, 64, 128)
WARPS = (4, 8)
STAGES = (1, 2, 3)
# The dK/dV kernel forming both outputs per program, the same kernel with one program per
# output (BackwardConfig.dkdv_split: one accumulator a thread, not two), and the dQ kernel.
KERNELS = ("triton-dkdv", "triton-dkdv-split", "triton-dq")
MASKS = (True, False)  # causal first: its band-edge code spills more
# A thread's registers, and the shared memory an sm_90 block may opt into (227 KiB):
# what Triton's launch checks a kernel's shared memory against on the H200.
REGISTERS = 255
SHARED_LIMIT = 232448
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "ptxas" / "backward_d256_tiles.jsonl"


def owned_rows(kernel: str, block_m: int, block_n: int) -> int:
    """The M of every dot: the keys a dK/dV program owns, the rows a dQ program owns."""
    return block_m if kernel == "triton-dq" else block_n


def accumulator_registers(kernel: str, block_m: int, block_n: int, num_warps: int) -> int:
    """fp32 registers a thread holds for the accumulators (dK and dV, or one of them, or dQ)."""
    accumulators = 2 if kernel == "triton-dkdv" else 1
    return accumulators * owned_rows(kernel, block_m, block_n) * HEAD_DIM // (32 * num_warps)


def predicted_mma(kernel: str, block_m: int, block_n: int, num_warps: int) -> int:
    """``mma_rank`` foretold before compiling (the module's docstring says why)."""
    rows = owned_rows(kernel, block_m, block_n)
    if rows % 64:
        return 2
    return 0 if rows % (16 * num_warps) == 0 else 1


def predicted_live(kernel: str, block_m: int, block_n: int, num_warps: int) -> int:
    """Accumulators plus the two fp32 score tiles (S and dP) a thread holds at once."""
    return accumulator_registers(kernel, block_m, block_n, num_warps) + \
        2 * block_m * block_n // (32 * num_warps)


def tasks() -> list[tuple]:
    """``ptxas_configs.build``'s tasks, the most promising first within each kernel, the
    two kernels taking turns."""
    per_kernel = []
    for kernel in KERNELS:
        tiles = []
        for block_m, block_n, warps, stages in itertools.product(BLOCKS, BLOCKS, WARPS, STAGES):
            if accumulator_registers(kernel, block_m, block_n, warps) > REGISTERS:
                continue
            live = predicted_live(kernel, block_m, block_n, warps)
            order = (predicted_mma(kernel, block_m, block_n, warps), live > REGISTERS,
                     -owned_rows(kernel, block_m, block_n), stages, live, block_m, block_n)
            tiles.append((order, BackwardConfig(block_m, block_n, block_m, block_n, warps,
                                                stages, kernel == "triton-dkdv-split")))
        per_kernel.append([(kernel, config) for _, config in sorted(tiles, key=lambda t: t[0])])
    turns = itertools.chain.from_iterable(itertools.zip_longest(*per_kernel))
    return [(kernel, HEAD_DIM, config, dict(dtype="bf16", causal=causal, window=False,
                                            softcap=False, varlen=False))
            for kernel, config in filter(None, turns) for causal in MASKS]


def describe(compiled) -> dict:
    """What a build's line adds to ``ptxas_configs.build``'s."""
    shared = compiled.metadata.shared
    return {"shared_bytes": shared, "fits_shared": shared <= SHARED_LIMIT,
            "dots": mma_dots(compiled.asm["ttgir"]),
            **{f"ptx_{name}": count for name, count in mma_instructions(compiled.asm["ptx"]).items()}}


# ----- reading the builds ---------------------------------------------------------------------
def tile(row: dict) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the build's own kernel."""
    config = row["config"]
    prefix = "dq" if row["kernel"] == "triton-dq" else "dkdv"
    return (config[f"{prefix}_block_m"], config[f"{prefix}_block_n"], config["num_warps"],
            config["num_stages"])


def mma_rank(row: dict) -> int:
    """The worst dot's instruction: 0 wgmma with each element computed once, 1 wgmma
    with some computed by two warpgroups, 2 mma.sync (or no MMA)."""
    def rank(dot):
        if dot["mma"] != "wgmma":
            return 2
        return 0 if dot["replication"] == 1 else 1
    return max((rank(dot) for dot in row["dots"]), default=2)


def tiles(rows: list[dict], kernel: str) -> dict[tuple, dict]:
    """One kernel's builds by tile: per mask the build, and over the masks whether every
    one built and fits in shared memory, the most LDL/STL, registers and stack bytes,
    and the worst MMA."""
    by_tile: dict[tuple, dict] = {}
    for row in rows:
        if row["kernel"] == kernel:
            by_tile.setdefault(tile(row), {})[row["causal"]] = row
    summary = {}
    for key, masks in by_tile.items():
        built = [r for r in masks.values() if r["built"]]
        summary[key] = {
            "masks": masks,
            "complete": len(built) == len(MASKS) and set(masks) == set(MASKS),
            "fits": bool(built) and all(r["fits_shared"] for r in built),
            "spills": max((r["local_memory_ops"] for r in built), default=None),
            "registers": max((r["registers"] for r in built), default=None),
            "stack": max((r["stack_bytes"] for r in built), default=None),
            "shared": max((r["shared_bytes"] for r in built), default=None),
            "mma": max((mma_rank(r) for r in built), default=2),
        }
    return summary


def ranked(rows: list[dict], kernel: str, *, num_warps: int | None = None,
           num_stages: int | None = None) -> list[tuple]:
    """Tiles that built under every mask and fit in shared memory, best first: the larger
    owned block (at d = 256 a streamed row is 512 bytes, and the rows a program owns set
    how often each streamed tile is read again), then spill-free before spilling, the
    better MMA, fewer LDL/STL (the worse mask's), fewer stages.  ``num_warps`` and
    ``num_stages`` keep one of each (the sweep times dQ tiles at the dK/dV winner's)."""
    summary = tiles(rows, kernel)
    usable = [key for key, t in summary.items() if t["complete"] and t["fits"]
              and num_warps in (None, key[2]) and num_stages in (None, key[3])]
    return sorted(usable, key=lambda key: (
        -owned_rows(kernel, key[0], key[1]), summary[key]["spills"] > 0, summary[key]["mma"],
        summary[key]["spills"], key[3], key))


def _dots_text(row: dict) -> str:
    return " ".join(f"{dot['dot']}:{'wg' if dot['mma'] == 'wgmma' else dot['mma']}"
                    + (f"x{dot['replication']}" if dot["replication"] > 1 else "")
                    for dot in row["dots"])


def table(rows: list[dict]) -> list[str]:
    """Per kernel, every tile in ``ranked`` order and then the rest: registers / LDL/STL
    per mask, stack bytes, shared KiB (* past the H200's limit), each dot's MMA."""
    lines = []
    for kernel in KERNELS:
        summary = tiles(rows, kernel)
        if not summary:
            continue
        order = ranked(rows, kernel)
        order += sorted(set(summary) - set(order))
        lines.append(f"{kernel} d={HEAD_DIM} (triton {', '.join(sorted({r['triton'] for r in rows}))})")
        lines.append(f"{'bm':>4} {'bn':>4} {'w':>2} {'s':>2}  {'causal reg/LDL':>14} "
                     f"{'full reg/LDL':>12} {'stack':>6} {'smem':>5}  dots (causal)")
        for key in order:
            t = summary[key]
            cells = []
            for causal in MASKS:
                r = t["masks"].get(causal)
                cells.append("-" if r is None else
                             f"{r['registers']}/{r['local_memory_ops']}" if r["built"] else "FAIL")
            first = next((r for r in t["masks"].values() if r["built"]), None)
            shared = "" if t["shared"] is None else (
                f"{t['shared'] // 1024}" + ("" if t["fits"] else "*"))
            lines.append(f"{key[0]:>4} {key[1]:>4} {key[2]:>2} {key[3]:>2}  {cells[0]:>14} "
                         f"{cells[1]:>12} {'' if t['stack'] is None else t['stack']:>6} "
                         f"{shared:>5}  {_dots_text(first) if first else ''}")
        failures = [r for t in summary.values() for r in t["masks"].values() if not r["built"]]
        lines += [f"  FAIL {tile(r)} causal={r['causal']}: {r['error']}" for r in failures]
        lines.append("")
    return lines


def sweep(todo: list[tuple], path: str, budget_s: float) -> list[dict]:
    """Build ``todo`` in order, one at a time, each line appended to ``path`` as it comes,
    until ``budget_s`` is spent; returns the new lines."""
    started, rows = time.monotonic(), []
    with open(path, "a") as out:
        for index, task in enumerate(todo):
            if time.monotonic() - started > budget_s:
                print(f"budget spent: {len(todo) - index} builds left (rerun to resume)")
                break
            row = build(task, describe)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            state = (f"{row['registers']} reg, {row['local_memory_ops']} LDL/STL, "
                     f"{row['shared_bytes'] // 1024} KiB" if row["built"] else row["error"])
            print(f"[{index + 1}/{len(todo)}] {row['kernel']} {tile(row)} causal={row['causal']}: "
                  f"{state} ({row['seconds']} s)", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON lines file (appended)")
    parser.add_argument("--budget-min", type=float, default=40.0,
                        help="start no build after this many minutes")
    parser.add_argument("--table-only", action="store_true", help="print the table, build nothing")
    args = parser.parse_args()
    rows = [r for r in read_rows(args.out) if r["triton"] == triton.__version__]
    done = {build_key(r) for r in rows}
    todo = [] if args.table_only else [t for t in tasks() if build_key(build_row(t)) not in done]
    print(f"triton {triton.__version__}: {len(todo)} builds to do ({len(rows)} in {args.out})",
          flush=True)
    if todo:
        rows += sweep(todo, args.out, 60 * args.budget_min)
    print("\n".join(table(rows)))
    print("ranked (block_m, block_n, warps, stages):")
    print(f"  triton-dkdv: {ranked(rows, 'triton-dkdv')[:10]}")
    for warps, stages in itertools.product(WARPS, STAGES):
        print(f"  triton-dq at {warps} warps, {stages} stage(s): "
              f"{ranked(rows, 'triton-dq', num_warps=warps, num_stages=stages)[:6]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
