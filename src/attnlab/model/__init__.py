"""Exact, pure-Python models of attention: bytes, memory, FLOPs, roofline, Amdahl.

- :mod:`~attnlab.model.traffic`: logical HBM bytes per kernel (naive, FA-2 forward and
  backward, GQA packing, Flash-Decoding) and matched ratios.
- :mod:`~attnlab.model.memory`: S/P and softmax-statistics footprints by scope.
- :mod:`~attnlab.model.flops`: FLOPs counted from the real mask, arithmetic intensity.
- :mod:`~attnlab.model.hardware`: datasheet or measured ceilings, ridge points.
- :mod:`~attnlab.model.amdahl`: speedup from a time share, across boundaries.
- :mod:`~attnlab.model.cache`: a cache-aware estimate of the DRAM bytes ncu measures.
- :mod:`~attnlab.model.l2`: row reads replayed through one LRU cache in the block
  scheduler's order (the Gluon dK/dV launches' re-reads; its capacity is fitted).

Which (query, key) pairs and tiles a mask keeps is :mod:`attnlab.masking` (the
ground floor the reference and the kernels share).  Nothing here imports torch, so
the models run anywhere the shapes do.
"""

from attnlab.model import amdahl, cache, flops, hardware, l2, memory, traffic

__all__ = ["amdahl", "cache", "flops", "hardware", "l2", "memory", "traffic"]
