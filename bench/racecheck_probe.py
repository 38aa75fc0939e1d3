"""Is racecheck's hazard in the Gluon kernels Triton's own warp-specialize hand-off?

    compute-sanitizer --tool racecheck python3 bench/racecheck_probe.py

Racecheck (session 5 run 1) reports hazards in both Gluon kernels only at code it
attributes to the kernel's ``def`` line and to the line after ``gl.warp_specialize``;
none on a TMA copy, wgmma or mbarrier line.  The PTX shows what runs there: the default
partition stores each warp's partition index to shared memory and the workers load it
after ``barrier.sync 1``.  ``_probe`` has nothing else: two partitions that each store to
global memory (session 5 run 2: 0 hazards).  ``_probe_ordered`` adds what the attnlab
kernels have around it: an mbarrier initialised before the partitions, waited on by the
default partition, arrived at by the worker, invalidated after.  If racecheck reports
hazards there, they come from that hand-off and barrier lifetime, not from a tile.
A configuration of attnlab.measure.engine (one phase, ``probe``; it writes nothing).
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from attnlab.measure.engine import Bench

bench = Bench("racecheck_probe", __doc__)


@gluon.jit
def _store_one(out, index: gl.constexpr):
    offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    gl.store(out + index * 32 + offs, offs.to(gl.float32) + index, mask=offs < 32)


@gluon.jit
def _store_and_wait(out, done, index: gl.constexpr):
    _store_one(out, index)
    mbarrier.wait(done, 0)


@gluon.jit
def _store_and_arrive(out, done, index: gl.constexpr):
    _store_one(out, index)
    mbarrier.arrive(done, count=1)


@gluon.jit
def _probe(out, num_warps: gl.constexpr):
    gl.warp_specialize([(_store_one, (out, 0)), (_store_one, (out, 1))], [1], [24])


@gluon.jit
def _probe_ordered(out, num_warps: gl.constexpr):
    """The attnlab kernels' shape: an mbarrier the default partition waits on and a
    worker arrives at, so the default cannot finish before the worker has started."""
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(done, count=1)
    gl.warp_specialize([(_store_and_wait, (out, done, 0)),
                        (_store_and_arrive, (out, done, 1))], [1], [24])
    mbarrier.invalidate(done)


@bench.phase("probe")
def probe(ctx) -> None:
    """Both probe kernels once each; their output checked."""
    expected = torch.cat([torch.arange(32.0), torch.arange(32.0) + 1]).cuda()
    for name, kernel in (("plain", _probe), ("ordered by an mbarrier", _probe_ordered)):
        out = torch.zeros(64, device="cuda")
        kernel[(4,)](out, num_warps=4)
        torch.cuda.synchronize()
        ctx.fail(not torch.equal(out, expected))
        print(f"probe {name}: output {'correct' if torch.equal(out, expected) else 'WRONG'}",
              flush=True)


if __name__ == "__main__":
    sys.exit(bench.main())
