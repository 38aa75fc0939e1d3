"""How many bytes of Q and dO the Gluon dK/dV launches should read from DRAM under a
program order, if L2 were one least-recently-used cache of a given size: the session-17
reading of why they read ~3x the rows once (bench/NOTES.md B23).

    PYTHONPATH=src python bench/l2_schedule_sim.py [--seqlen 4096] [--l2-mb 30,35,40,50]

The replay is the cache model's (``attnlab.model.l2``: programs in the block scheduler's
greedy order, steps of equal time, one LRU cache); this script puts two orders side by
side: session 16's (head by head, one program per key block, each program's heads outer
and its tiles from the diagonal up) and this tree's (``dispatch.dkdv_schedule``'s order
and head split, the kernel's last-tile-first reads: ``model.l2.key_block_programs``).
LSE and D are left out here (1/128 of the bytes at d = 256); the model's prediction
(``measure.compare.predict_backward``) counts them.  The rows a launch must read are the
group's Q and dO once per KV head; everything above that is a row read again after L2
dropped it.  Pure arithmetic on the CPU: no GPU, no torch.
"""

from __future__ import annotations

import argparse

from attnlab.commands.cli_support import parse_int_list
from attnlab.kernels.backward_sm90 import BLOCK_N, DEFAULT_CONFIGS
from attnlab.kernels.dispatch import dkdv_schedule
from attnlab.model.l2 import KeyBlockOrder, first_query_tile, key_block_programs, lru_misses
from attnlab.shapes import AttentionShape


def session16_programs(shape: AttentionShape, block_m: int) -> list[list[int]]:
    """Session 16's order, named as ``model.l2.key_block_programs`` names tiles: head by
    head, one program per key block, each over its group's heads in turn, every head's
    tiles from the diagonal up."""
    order = KeyBlockOrder(BLOCK_N, block_m)
    tiles = -(-shape.seqlen_q // block_m)
    blocks = -(-shape.seqlen_k // BLOCK_N)
    group = shape.group_size
    return [[(kv * group + h) * tiles + t for h in range(group)
             for t in range(first_query_tile(shape, order, block), tiles)]
            for kv in range(shape.batch * shape.kv_heads) for block in range(blocks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--l2-mb", default="30,35,40,50")
    parser.add_argument("--sm-count", type=int, default=132)
    args = parser.parse_args()
    shape = AttentionShape(batch=1, query_heads=24, kv_heads=4, seqlen_q=args.seqlen,
                           seqlen_k=args.seqlen, head_dim=256, dtype="bf16", causal=True)
    config = DEFAULT_CONFIGS[shape.head_dim]
    schedule = dkdv_schedule(batch=shape.batch, kv_heads=shape.kv_heads,
                             group_size=shape.group_size, seqlen_q=shape.seqlen_q,
                             seqlen_k=shape.seqlen_k, causal=True, block_m=config.block_m,
                             block_n=BLOCK_N, sm_count=args.sm_count)
    once = 2 * shape.query_heads * shape.seqlen_q * shape.head_dim * shape.element_bytes
    print(f"24q/4kv, d = {shape.head_dim}, N = {args.seqlen}, causal, {args.sm_count} SMs: "
          f"MB of Q and dO read from DRAM per launch (their logical minimum: {once / 1e6:.0f} "
          f"MB); this tree's schedule: {schedule}")
    print("| launch | L2 (MB) | session 16's order | this tree's order |")
    print("|---|---:|---:|---:|")
    for form_dk, _, block_m, _ in config.launches(shape.head_dim):
        name = f"{'dK' if form_dk else 'dV'} ({block_m}-row tiles)"
        order = KeyBlockOrder(BLOCK_N, block_m, schedule.block_major, schedule.head_split)
        orders = (session16_programs(shape, block_m), key_block_programs(shape, order))
        tile_bytes = 2 * block_m * shape.head_dim * shape.element_bytes
        for l2_mb in parse_int_list(args.l2_mb, "--l2-mb"):
            old, now = (sum(lru_misses(programs, capacity=max(1, int(l2_mb * 1e6 // tile_bytes)),
                                       slots=args.sm_count).values()) * tile_bytes
                        for programs in orders)
            print(f"| {name} | {l2_mb} | {old / 1e6:.0f} | {now / 1e6:.0f} |")


if __name__ == "__main__":
    main()
