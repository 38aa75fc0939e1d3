"""Which backward tiles ptxas can build, on this machine's Triton, without a GPU.

    PYTHONPATH=src python3 bench/ptxas_configs.py [--head-dims 16,32] [--candidates]

Compiles both backward kernels for sm_90a (``kernels.backward.compile_for_sm90``) over
every dtype x causal x softcap x varlen combination, for the tiles ``configs`` chooses
(and with ``--candidates`` a few others), and prints one line per failure and a count.
Triton 3.6.0's ptxas dies (SIGSEGV) on some dQ tiles at head_dim 16 and 32 with softcap
(bench/NOTES.md, B15); the chosen tiles must pass here on every supported Triton.
"""

from __future__ import annotations

import argparse
import itertools

import triton

from attnlab.kernels.backward import compile_for_sm90
from attnlab.kernels.configs import BackwardConfig, backward_config
from attnlab.shapes import AttentionShape

CANDIDATES = (BackwardConfig(64, 128, 128, 64, 8, 2), BackwardConfig(64, 128, 128, 128, 8, 2),
              BackwardConfig(64, 128, 128, 64, 8, 1), BackwardConfig(64, 128, 128, 64, 4, 2),
              BackwardConfig(64, 64, 64, 64, 4, 2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="16,32,64,128,256")
    parser.add_argument("--candidates", action="store_true")
    args = parser.parse_args()
    print(f"triton {triton.__version__}")
    failures = total = 0
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for causal in (False, True):
            shape = AttentionShape(head_dim=head_dim, causal=causal, seqlen_q=4096, seqlen_k=4096)
            configs = CANDIDATES if args.candidates else (backward_config(shape),)
            for config, dtype, softcap, varlen in itertools.product(
                    configs, ("bf16", "fp16"), (False, True), (False, True)):
                total += 1
                try:
                    compile_for_sm90(head_dim, config, dtype=dtype, causal=causal,
                                     softcap=softcap, varlen=varlen)
                except Exception as error:  # ptxas's crash is a PTXASError; print any
                    failures += 1
                    print(f"FAIL d={head_dim} causal={causal} {config} {dtype} "
                          f"softcap={softcap} varlen={varlen}: {type(error).__name__}",
                          flush=True)
    print(f"{total - failures} of {total} built")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
