"""Row reads replayed through one LRU cache in the block scheduler's order: what a Gluon
dK/dV launch reads from DRAM when L2 cannot hold every row its programs share.

Each program of a launch owns ``block_n`` keys of one (batch, KV head) -- or, with a head
split, shares them with the unit's other program(s), each over its part of the GQA
group's query heads -- and reads, step by step, one query tile of one query head: its Q
and dO rows and their fp32 row statistics.  The model's steps:

* **The program order** (``kernels.backward_sm90._work``): units head by head (every key
  block of a (batch, KV head), then the next) or block-major (every (batch, KV head) of
  the first key block, then the second, ...); a unit's ``head_split`` programs adjacent,
  program ``part`` taking query heads ``[part, part + 1) x group / head_split`` of the group.
* **The read order** (``kernels.backward_sm90._load_tiles``): the query tiles that see the
  block (causally from the diagonal's tile on), the last tile first, each tile for every
  head of the program in turn.
* **The block scheduler**: programs start in launch order on the first of ``slots``
  (SMs x resident CTAs) to free up, as ``kernels.dispatch.greedy_makespan`` counts it.
  Every step takes the same time; the reads of one time step run in launch order.
  A program with no tile to read holds its slot for one step (its own block's load).
* **L2 as one LRU cache** of a given capacity; a read that misses comes from DRAM.

Not facts, so the result is an estimate, never exact: L2 is two partitions with a hashed
set mapping and its own replacement policy, not one LRU cache, so the capacity that makes
this replay agree with Nsight Compute is *fitted* (``hardware.GH100_L2_LRU_FIT_BYTES``
says on what); tiles across the diagonal (masked) and the head split's merge take longer
than a step.  Where a KV head's programs start far apart (the seed's layer at 16k, head
by head), the chain of one row's staggered readers outgrows the capacity and a strict LRU
cache thrashes (~27x the rows, at any capacity from 30 to 50 MB); a real L2 need not, and
no measurement checks that regime yet.

Pure arithmetic, no GPU: the facts of the launch come in as data (the model never imports
the kernels; ``measure.compare`` reads them there).  One dictionary operation a tile read:
the seed's layer's two launches in ~0.03 s at 4k, ~0.5 s at 16k (~0.8 M reads a launch),
~1.6 s at 32k on one CPU core.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import islice

from attnlab.checks import check_int
from attnlab.masking import shape_band
from attnlab.shapes import AttentionShape, check_shape


@dataclass(frozen=True)
class KeyBlockOrder:
    """How one Gluon dK/dV launch walks its work: ``block_n`` keys per program
    (``backward_sm90.BLOCK_N``), ``block_m`` query rows per tile it reads (this launch's
    tiles: ``Sm90BackwardConfig.launches``), and the schedule's ``block_major`` and
    ``head_split`` (``dispatch.dkdv_schedule``: one schedule for every launch of a call)."""

    block_n: int
    block_m: int
    block_major: bool = False
    head_split: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m", "head_split"):
            check_int(name, getattr(self, name), minimum=1)
        if not isinstance(self.block_major, bool):
            raise TypeError(f"block_major must be a bool, got {self.block_major!r}")


def query_tiles_per_head(shape: AttentionShape, order: KeyBlockOrder) -> int:
    return -(-shape.seqlen_q // order.block_m)


def tile_rows(shape: AttentionShape, order: KeyBlockOrder, item: int) -> int:
    """Query rows in a tile named as :func:`key_block_programs` names it (the last tile of
    a head may be short: TMA reads no row past ``seqlen_q``)."""
    tile = item % query_tiles_per_head(shape, order)
    return min(order.block_m, shape.seqlen_q - tile * order.block_m)


def first_query_tile(shape: AttentionShape, order: KeyBlockOrder, key_block: int) -> int:
    """The first query tile a key block's program reads: causally (bottom-right) row i sees
    key j when j - i <= highest, so the tile of row ``block start - highest`` (the
    kernel's ``_query_bounds``: ``m_lo``); unmasked, tile 0."""
    highest = shape_band(shape).highest
    if highest is None:
        return 0
    return max(key_block * order.block_n - highest, 0) // order.block_m


def key_block_programs(shape: AttentionShape, order: KeyBlockOrder) -> list[list[int]]:
    """Per program of one launch, in launch order, the query tiles it reads step by step,
    each named ``query head x tiles per head + tile`` (query heads counted over the batch,
    so the names of a call's tiles are distinct integers)."""
    s = check_shape(shape)
    if s.has_window:
        raise ValueError("the Gluon dK/dV kernel runs causal or unmasked calls, not a window; "
                         f"got window={s.window}")
    if s.group_size % order.head_split:
        raise ValueError(f"head_split ({order.head_split}) must divide the GQA group "
                         f"({s.group_size} query heads per KV head)")
    tiles = query_tiles_per_head(s, order)
    blocks = -(-s.seqlen_k // order.block_n)
    kv_heads = s.batch * s.kv_heads  # (batch, KV head) pairs, batch outer as the kernel's
    units = ([(block, kv) for block in range(blocks) for kv in range(kv_heads)]
             if order.block_major else
             [(block, kv) for kv in range(kv_heads) for block in range(blocks)])
    heads = s.group_size // order.head_split
    programs = []
    for block, kv in units:
        last_first = range(tiles - 1, first_query_tile(s, order, block) - 1, -1)
        for part in range(order.head_split):
            first_head = kv * s.group_size + part * heads
            bases = [(first_head + h) * tiles for h in range(heads)]
            programs.append([base + tile for tile in last_first for base in bases])
    return programs


def lru_misses(programs: Sequence[Sequence[Hashable]], *, capacity: int,
               slots: int) -> Counter:
    """How often each item is read from DRAM when ``programs`` (each its reads, one a step)
    run on ``slots`` in launch order through one LRU cache of ``capacity`` items.

    Step by step: the running programs each read their next item, in launch order; a
    program that has read its last leaves its slot to the next waiting program, which
    reads its first item at the next step, after the programs already running (the
    block scheduler's greedy order, every step taking the same time).  A program with no
    reads holds its slot for one step."""
    check_int("capacity", capacity, minimum=1)
    check_int("slots", slots, minimum=1)
    cache: OrderedDict = OrderedDict()
    misses: Counter = Counter()
    waiting = iter(programs)
    running = [(program, 0) for program in islice(waiting, slots)]
    while running:
        going_on, started = [], []
        for program, step in running:
            if step < len(program):
                item = program[step]
                if item in cache:
                    cache.move_to_end(item)
                else:
                    misses[item] += 1
                    cache[item] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)
            if step + 1 < len(program):
                going_on.append((program, step + 1))
            elif (following := next(waiting, None)) is not None:
                started.append((following, 0))
        running = going_on + started
    return misses
