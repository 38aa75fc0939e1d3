#!/usr/bin/env bash
# One lease call on the H200: run the named stages in order, each under its own time
# limit, logging to $OUT/log.txt and packing every result file into $OUT/results.tar.gz
# (the device tool returns at most 8 files, so everything travels as one archive).
#   usage: bash bench/gpu_run.sh "stage-name:seconds:command" ...
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
export PYTHONPATH=src PYTHONUNBUFFERED=1
# Pass ATTNLAB_GIT_COMMIT=$(git rev-parse --short HEAD) from the sending machine: the
# device copy's own .git can lag the tree it was sent (session 2 of 2026-12-01: runs
# 1-4 reported an older commit), so the fallback below is marked as unverified.
export ATTNLAB_GIT_COMMIT=${ATTNLAB_GIT_COMMIT:-"$(git rev-parse --short HEAD 2>/dev/null || echo unknown)?"}
log="$OUT/log.txt"
{
  echo "== $(date -u +%FT%TZ) commit $ATTNLAB_GIT_COMMIT"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
} >>"$log" 2>&1
summary=()
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; limit=${rest%%:*}; cmd=${rest#*:}
  dir="$OUT/results/$name"; mkdir -p "$dir"
  echo "== stage $name (limit ${limit}s): $cmd" >>"$log"
  start=$(date +%s)
  STAGE_OUT="$dir" timeout -k 10 "$limit" bash -c "$cmd" >"$dir/stdout.txt" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  tail -n 40 "$dir/stdout.txt" >>"$log"
  summary+=("$name rc=$rc ${took}s")
done
(cd "$OUT" && tar czf results.tar.gz results && rm -rf results)
echo "== summary" >>"$log"
printf '%s\n' "${summary[@]}" | tee -a "$log"
