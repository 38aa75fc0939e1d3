#!/usr/bin/env bash
# docs/versions.md's GPU verification, two device calls per Triton (each fits the
# device's 10-minute command): the GPU test suite ("tests"), then the forward, fwd+bwd
# and decode tables against cuDNN ("tables"), as bench/gpu_run.sh stages (results in
# $OUT/results.tar.gz; every record's env names the Triton it ran on, and each stage's
# stdout starts with it).
#
#   usage, on the H200 from the repo root:  bash bench/versions_h200.sh 3.9.0 tests [1/2|2/2]
#                                            bash bench/versions_h200.sh 3.9.0 tables
#
# The suite takes ~380 s in 8 processes on a fresh machine (session 15 run 1: 63% in
# 240 s), more than one call holds with the other stages: "tests 1/2" and "tests 2/2"
# run alternate test files in two calls (the every-head-dim grid with the first, the
# tests past 2^31 with the second).
#
# The machine's own Triton (3.6.0, beside its torch 2.11) runs as installed.  Another is
# installed beside it into /tmp/tritons/VERSION from .whl/triton-VERSION-*.whl, or from
# that wheel's parts .whl/triton-VERSION-*.whl.part-*: a call carries 64 MiB, so here
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d .whl triton==VERSION
#   split -b 60M .whl/triton-VERSION-*.whl .whl/$(basename .whl/triton-VERSION-*.whl).part-
# then carry one part per call, back to back while the machine is warm (it keeps ignored
# files between calls), the last call running this script.  torch.compile needs torch's
# own Triton, so the compile tests and FlexAttention run only on that one.
set -euo pipefail
version=${1:?usage: bash bench/versions_h200.sh TRITON_VERSION tests|tables}
part=${2:?usage: bash bench/versions_h200.sh TRITON_VERSION tests|tables}
shard=${3:-}
[[ $part == tests || $part == tables ]] || { echo "the second argument is tests or tables, got $part"; exit 2; }
[[ -z $shard || $shard == 1/2 || $shard == 2/2 ]] || { echo "the shard is 1/2 or 2/2, got $shard"; exit 2; }
cd "$(dirname "$0")/.."
own=$(python3 -c "import triton; print(triton.__version__)")
path=src skip="" providers=sdpa_cudnn,sdpa_flash,flex,attnlab,attnlab_deterministic
if [[ $version != "$own" ]]; then
    target=/tmp/tritons/$version
    if [[ ! -d $target/triton ]]; then
        wheels=(.whl/triton-"$version"-*.whl)
        wheel=${wheels[0]}
        if [[ ! -e $wheel ]]; then
            parts=(.whl/triton-"$version"-*.whl.part-*)
            [[ -e ${parts[0]} ]] || { echo "no wheel or parts of triton $version in .whl/"; exit 2; }
            wheel=/tmp/$(basename "${parts[0]%.part-*}")
            cat "${parts[@]}" >"$wheel"
        fi
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$target" "$wheel"
    fi
    path=$target:src skip=1 providers=sdpa_cudnn,sdpa_flash,attnlab,attnlab_deterministic
fi
run="PYTHONPATH=$path python3"
which="$run -c 'import triton; print(\"triton\", triton.__version__, triton.__file__)' &&"
tag=triton-$version
# The GPU suite compiles hundreds of kernel specialisations on a fresh machine (session
# 14: 4 tests in 200 s, one process): it runs in 8 processes (pytest-xdist is on the
# device), the tests past 2^31 elements after them on their own (each needs 13-22 GiB
# free), and the every-head-dim grid, which spawns its own 15 processes, last; each
# stage's output goes straight to its stdout.txt, so a stage cut by its limit still
# shows what passed.
suite="$which $run -m pytest -q -m gpu -p no:cacheprovider -n 8 -rfE -k '${skip:+not compile and }not 2_31 and not every_head_dim'"
big="$tag-gpu-big:80:$which $run -m pytest -q -m gpu -p no:cacheprovider -rfE -k '${skip:+not compile and }2_31' tests"
grid="$tag-gpu-grid:150:$which $run -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_backward.py::test_gpu_gradient_grid_every_head_dim"
if [[ $part == tests && -n $shard ]]; then
    files=(tests/test_*.py)
    half=()
    for i in "${!files[@]}"; do
        (( i % 2 == ${shard%/2} - 1 )) && half+=("${files[$i]}")
    done
    if [[ $shard == 1/2 ]]; then
        bash bench/gpu_run.sh "$tag-gpu-tests-1of2:330:$suite ${half[*]}" "$grid"
    else
        bash bench/gpu_run.sh "$tag-gpu-tests-2of2:330:$suite ${half[*]}" "$big"
    fi
elif [[ $part == tests ]]; then
    bash bench/gpu_run.sh "$tag-gpu-tests:240:$suite tests" "$big" "$grid"
else
    bash bench/gpu_run.sh \
        "$tag-forward:150:$which $run bench/forward_h200.py --out \$STAGE_OUT --phases bench --groups d128,gqa_d256 --bench-budget 120" \
        "$tag-fwdbwd:130:$which $run bench/backward_h200.py --out \$STAGE_OUT --phases bench --quick --providers $providers" \
        "$tag-decode:100:$which $run bench/decode_h200.py --out \$STAGE_OUT --quick"
fi
