"""Skip marks the Gluon sm_90 kernels' tests share: a Hopper GPU, and a Triton whose Gluon
kernels/_compat.py recognises (its probes, not a version string, decide)."""

import pytest
import torch

from attnlab.kernels._compat import gluon_refusal

on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not on_sm90, reason="needs an sm_90 (Hopper) GPU")
built_here = pytest.mark.skipif(gluon_refusal() is not None,
                                reason=f"the Gluon kernels cannot be built: {gluon_refusal()}")
