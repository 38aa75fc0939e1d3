"""Is racecheck's hazard in the Gluon kernels Triton's own warp-specialize hand-off?

    compute-sanitizer --tool racecheck python3 bench/racecheck_probe.py

Racecheck (session 5 run 1) reports hazards in both Gluon kernels only at code it
attributes to the kernel's ``def`` line and to the line after ``gl.warp_specialize``;
none on a TMA copy, wgmma or mbarrier line.  The PTX shows what runs there: the default
partition stores each warp's partition index to shared memory and the workers load it
after ``barrier.sync 1``.  This kernel has nothing else: two partitions that each store
one value to global memory, no shared memory or mbarrier of its own.  If racecheck
reports the same hazards here, they come from that hand-off.
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _store_one(out, index: gl.constexpr):
    offs = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    gl.store(out + index * 32 + offs, offs.to(gl.float32) + index, mask=offs < 32)


@gluon.jit
def _probe(out, num_warps: gl.constexpr):
    gl.warp_specialize([(_store_one, (out, 0)), (_store_one, (out, 1))], [1], [24])


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    out = torch.zeros(64, device="cuda")
    _probe[(4,)](out, num_warps=4)
    torch.cuda.synchronize()
    expected = torch.cat([torch.arange(32.0), torch.arange(32.0) + 1]).cuda()
    ok = torch.equal(out, expected)
    print(f"probe output {'correct' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
