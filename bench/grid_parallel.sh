#!/usr/bin/env bash
# The backward's GPU gradient grid (tests/test_backward.py::test_gpu_gradient_grid, 24
# groups) in six pytest processes at once: each group compiles its own kernels, which
# is CPU-bound and serial inside one process, so six processes on the H200's 16 cores
# finish in about a sixth of the time.  Logs: $STAGE_OUT/grid_<n>.log (default ./).
#   usage: PYTHONPATH=src bash bench/grid_parallel.sh
out=${STAGE_OUT:-.}
i=0
for dims in "32 or 256" "40 or 224" "59 or 192" "64 or 160" "80 or 128" "96 or 111"; do
  i=$((i+1))
  python3 -m pytest -v -m gpu tests/test_backward.py -k "gpu_gradient_grid and ($dims)" \
    >"$out/grid_$i.log" 2>&1 &
done
wait
grep -h "PASSED\|FAILED\|passed\|failed" "$out"/grid_*.log
