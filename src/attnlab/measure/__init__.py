"""Measurement: every speed and byte claim measured, provable and comparable.

- :mod:`records`: the one tidy record format (JSON lines under ``bench/results/``).
- :mod:`providers`: the attention implementations we compare, each with a reason
  when it cannot run on a shape or machine.
- :mod:`timing`: CUDA-event timing (CPU fallback with ``time.perf_counter``).
- :mod:`dispatch`: which kernels a call actually launched (``torch.profiler``).
- :mod:`ncu`: the Nsight Compute command and its CSV parser.
- :mod:`profile`: the one Chrome-trace reader and kernel classifier.
- :mod:`compare`: ncu's DRAM bytes vs the cache-aware model (:mod:`attnlab.model.cache`).
- :mod:`sweep` and :mod:`plots`: sequence-length sweeps and their figures.

Nothing here is imported by ``attnlab`` itself: torch-heavy modules load lazily.
"""
