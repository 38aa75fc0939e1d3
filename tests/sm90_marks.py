"""Skip marks the Gluon sm_90 kernels' tests share: a Hopper GPU, and the Triton the
kernels were built for (``configs.GLUON_SM90_TRITON_VERSIONS``)."""

import pytest
import torch
import triton

from attnlab.kernels.configs import GLUON_SM90_TRITON_VERSIONS

on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not on_sm90, reason="needs an sm_90 (Hopper) GPU")
built_here = pytest.mark.skipif(
    triton.__version__ not in GLUON_SM90_TRITON_VERSIONS,
    reason=f"the kernel is built for Triton {GLUON_SM90_TRITON_VERSIONS}")
