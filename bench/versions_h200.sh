#!/usr/bin/env bash
# docs/versions.md's GPU verification, one Triton per call (it fits the device's
# 10-minute command): the GPU test suite, then the forward, fwd+bwd and decode tables
# against cuDNN, as bench/gpu_run.sh stages (results in $OUT/results.tar.gz; every
# record's env names the Triton it ran on, and each stage's stdout starts with it).
#
#   usage, on the H200 from the repo root:  bash bench/versions_h200.sh 3.9.0
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
version=${1:?usage: bash bench/versions_h200.sh TRITON_VERSION}
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
    path=$target:src skip="-k 'not compile'" providers=sdpa_cudnn,sdpa_flash,attnlab,attnlab_deterministic
fi
run="PYTHONPATH=$path python3"
which="$run -c 'import triton; print(\"triton\", triton.__version__, triton.__file__)' &&"
tag=triton-$version
bash bench/gpu_run.sh \
    "$tag-gpu-tests:200:$which $run -m pytest -q -m gpu -p no:cacheprovider $skip tests" \
    "$tag-forward:150:$which $run bench/forward_h200.py --out \$STAGE_OUT --phases bench --groups d128,gqa_d256 --bench-budget 120" \
    "$tag-fwdbwd:130:$which $run bench/backward_h200.py --out \$STAGE_OUT --phases bench --quick --providers $providers" \
    "$tag-decode:100:$which $run bench/decode_h200.py --out \$STAGE_OUT --quick"
