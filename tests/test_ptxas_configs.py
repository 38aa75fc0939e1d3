"""The dispatcher's tiles and what ptxas can build: a sample compiled for sm_90a on the CPU,
and every choice checked against the configs listed as failing (``configs.PTXAS_FAILURES``,
from ``bench/ptxas_configs.py``'s sweeps over every head dim on Triton 3.6.0 and 3.9.0)."""

from __future__ import annotations

import itertools

import pytest

from attnlab.kernels import configs
from attnlab.kernels.configs import LENGTH_BUCKETS, head_dim_padded
from attnlab.shapes import AttentionShape

# Every head dim the Triton kernels take (1..256): each one's choice at every length
# bucket, masked and not.
CHOICES = [(d, masked, bucket) for d, masked, bucket in
           itertools.product(range(1, 257), (False, True), LENGTH_BUCKETS)]


def _shape(head_dim: int, masked: bool, bucket: int) -> AttentionShape:
    return AttentionShape(head_dim=head_dim, causal=masked, seqlen_q=bucket, seqlen_k=bucket)


def test_no_table_chooses_a_config_ptxas_cannot_build():
    for head_dim, masked, bucket in CHOICES:
        shape, pad = _shape(head_dim, masked, bucket), head_dim_padded(head_dim)
        backward = configs.backward_config(shape)
        for kernel, config in (("triton-forward", configs.forward_config(shape)),
                               ("triton-dkdv", backward), ("triton-dq", backward)):
            assert (kernel, pad, config) not in configs.PTXAS_FAILURES, (head_dim, masked,
                                                                         bucket, kernel)


def test_the_choices_are_what_the_lookups_return():
    # forward_choices/backward_choices (what the sweep compiles) cover every lookup.
    for head_dim, masked, bucket in CHOICES:
        shape = _shape(head_dim, masked, bucket)
        assert configs.forward_config(shape) in configs.forward_choices(head_dim, masked)
        assert configs.backward_config(shape) in configs.backward_choices(head_dim, masked)


def test_the_failures_name_known_kernels_and_padded_head_dims():
    for kernel, pad, config in configs.PTXAS_FAILURES:
        assert kernel in ("triton-forward", "triton-dkdv", "triton-dq")
        assert pad == head_dim_padded(pad)
        expected = configs.ForwardConfig if kernel == "triton-forward" else configs.BackwardConfig
        assert isinstance(config, expected)


# A sample of the dispatcher's choices, compiled for sm_90a here (a fresh Python: the
# compiler needs the jitted kernels, not the interpreter's).  d = 16 took two-stage dQ
# tiles that Triton 3.6.0's ptxas crashed on (a few seconds of ptxas); the slow ones:
# d = 24 (strides that are not 16-divisible, a padded head dim) and d = 256 (the seed's
# GQA layer, whose tiles spill).  The full sweep over every head dim: bench/ptxas_configs.py.
@pytest.mark.parametrize(("head_dim", "causal", "dtype"), [
    (16, True, "bf16"),
    pytest.param(24, False, "fp16", marks=pytest.mark.slow),
    pytest.param(256, True, "bf16", marks=pytest.mark.slow),
])
def test_the_dispatchers_choice_compiles_for_sm90(json_from_fresh_python, head_dim, causal,
                                                  dtype):
    built = json_from_fresh_python(
        "import json; from attnlab.kernels import backward, forward\n"
        "from attnlab.kernels.configs import backward_config, forward_config\n"
        "from attnlab.shapes import AttentionShape\n"
        f"d, causal, dtype = {head_dim!r}, {causal!r}, {dtype!r}\n"
        "shape = AttentionShape(head_dim=d, causal=causal, seqlen_q=4096, seqlen_k=4096)\n"
        "kernels = (*backward.compile_for_sm90(d, backward_config(shape), dtype=dtype,\n"
        "                                      causal=causal),\n"
        "           forward.compile_for_sm90(d, forward_config(shape), dtype=dtype,\n"
        "                                    causal=causal))\n"
        "print(json.dumps([bool(k.asm['cubin']) for k in kernels]))")
    assert built == [True, True, True]


@pytest.mark.slow
def test_a_listed_failure_is_what_ptxas_failed_on(json_from_fresh_python):
    # The listed d = 16 dQ tile still fails where it was seen failing: the list is
    # evidence, not a guess.  Only Triton 3.6's ptxas is known to crash on it (CI's
    # oldest stack runs this).
    import triton

    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the failure was seen on Triton 3.6.0; this is {triton.__version__}")
    built = json_from_fresh_python(
        "import json; from attnlab.kernels import backward\n"
        "from attnlab.kernels.configs import BackwardConfig\n"
        "try:\n"
        "    backward.compile_for_sm90(16, BackwardConfig(64, 128, 128, 64, 8, 2),\n"
        "                              causal=True, kernels=('dq',)); built = True\n"
        "except Exception:\n"
        "    built = False\n"
        "print(json.dumps(built))")
    assert built is False
