"""How many bytes the Gluon dK/dV launches should read from DRAM under a schedule, if L2
were one least-recently-used cache of a given size: the session-17 reading of why they
read ~3x the cache model's bytes (bench/NOTES.md B23).

    PYTHONPATH=src python bench/l2_schedule_sim.py [--seqlen 4096] [--l2-mb 30,35,40,50]

Each program (one per key block and KV head, or two each over half its query heads)
reads, per step, one query tile's Q and dO rows of one head (LSE and D are left out:
1/128 of the bytes at d = 256), every step takes the same time, and a program starts on
the first of the SMs' slots to free up, in launch order (the block scheduler, as
``kernels.dispatch.greedy_makespan`` counts it).  The rows a launch must read are the
group's Q and dO once per KV head; everything above that is a row read again after L2
dropped it.  Pure arithmetic on the CPU: no GPU, no torch.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from collections import OrderedDict

from attnlab.commands.cli_support import parse_int_list
from attnlab.kernels.dispatch import dkdv_schedule

BLOCK_N = 128  # keys per program (kernels/backward_sm90.BLOCK_N)


def programs(*, seqlen: int, kv_heads: int, group: int, block_m: int, split: int,
             block_major: bool, last_tile_first: bool) -> list[list[tuple[int, int]]]:
    """Per program in launch order, the (query head, query tile) it reads step by step:
    causally key block j sees the query tiles from j * BLOCK_N on."""
    blocks, tiles = seqlen // BLOCK_N, seqlen // block_m
    units = ([(j, h) for j in range(blocks) for h in range(kv_heads)] if block_major
             else [(j, h) for h in range(kv_heads) for j in range(blocks)])
    heads = group // split
    out = []
    for j, kv_head in units:
        for part in range(split):
            first_head = kv_head * group + part * heads
            seen = range(j * BLOCK_N // block_m, tiles)
            if last_tile_first:  # the kernel's order: tiles outer (last first), heads inner
                out.append([(first_head + h, t) for t in reversed(seen) for h in range(heads)])
            else:  # session 16's: heads outer, tiles from the diagonal on
                out.append([(first_head + h, t) for h in range(heads) for t in seen])
    return out


def dram_bytes(progs: list, *, tile_bytes: int, l2_bytes: float, slots: int) -> int:
    """Bytes read from DRAM with an LRU L2 of ``l2_bytes``, programs greedily on ``slots``."""
    capacity = max(1, int(l2_bytes // tile_bytes))
    cache: OrderedDict = OrderedDict()
    misses, waiting = 0, iter(range(len(progs)))
    running = [(0, p, 0) for p in itertools.islice(waiting, slots)]
    heapq.heapify(running)
    while running:
        time, p, step = heapq.heappop(running)
        tile = progs[p][step]
        if tile in cache:
            cache.move_to_end(tile)
        else:
            misses += 1
            cache[tile] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        if step + 1 < len(progs[p]):
            heapq.heappush(running, (time + 1, p, step + 1))
        else:
            nxt = next(waiting, None)
            if nxt is not None:
                heapq.heappush(running, (time + 1, nxt, 0))
    return misses * tile_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--l2-mb", default="30,35,40,50")
    parser.add_argument("--sm-count", type=int, default=132)
    args = parser.parse_args()
    kv_heads, group, head_dim = 4, 6, 256  # the seed's layer: 24q/4kv, d = 256, batch 1
    print(f"24q/4kv, d = {head_dim}, N = {args.seqlen}, causal, {args.sm_count} SMs: "
          "MB of Q and dO read from DRAM per launch (their logical minimum: "
          f"{2 * args.seqlen * kv_heads * group * head_dim * 2 / 1e6:.0f} MB)")
    print("| launch | L2 (MB) | session 16's schedule | dispatch.dkdv_schedule's |")
    print("|---|---:|---:|---:|")
    for name, block_m in (("dV (64-row tiles)", 64), ("dK (32-row tiles)", 32)):
        new = dkdv_schedule(batch=1, kv_heads=kv_heads, group_size=group, seqlen_q=args.seqlen,
                            seqlen_k=args.seqlen, causal=True, block_m=32, block_n=BLOCK_N,
                            sm_count=args.sm_count)
        old_progs = programs(seqlen=args.seqlen, kv_heads=kv_heads, group=group,
                             block_m=block_m, split=1, block_major=False,
                             last_tile_first=False)
        new_progs = programs(seqlen=args.seqlen, kv_heads=kv_heads, group=group,
                             block_m=block_m, split=new.head_split,
                             block_major=new.block_major, last_tile_first=True)
        tile_bytes = 2 * block_m * head_dim * 2
        for l2 in parse_int_list(args.l2_mb, "--l2-mb"):
            old, now = (dram_bytes(p, tile_bytes=tile_bytes, l2_bytes=l2 * 1e6,
                                   slots=args.sm_count) for p in (old_progs, new_progs))
            print(f"| {name} | {l2} | {old / 1e6:.0f} | {now / 1e6:.0f} |")


if __name__ == "__main__":
    main()
