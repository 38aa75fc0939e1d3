"""The accuracy rule every attnlab kernel is held to.

A kernel's max error against a float64 reference may be at most twice the error
of PyTorch's own attention computed in the same dtype, plus the rounding error of
the reference's own magnitude in that dtype (flash-attn's and FA3's rule).  NaN
never passes.  LSE must match to 1e-5 relative, and -inf exactly where no key is
visible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab.inputs import layout_named
from attnlab.reference import naive, tiled, tiled_backward


@dataclass(frozen=True)
class AccuracyCheck:
    error: float
    yardstick_error: float
    rounding_floor: float
    lse_error: float
    passed: bool

    @property
    def allowed(self) -> float:
        return 2 * self.yardstick_error + 2 * self.rounding_floor


def check_accuracy(out, lse, q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                   layout="bhsd") -> AccuracyCheck:
    """Judge a kernel's (out, lse) on inputs q, k, v by the rule in the module doc."""
    to_bhsd = layout_named(layout).to_bhsd
    q, k, v, out = (to_bhsd(t) for t in (q, k, v, out))
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    # The oracle: the materialising baseline in float64.  The yardstick: the same
    # computation in the kernel's dtype, i.e. what that dtype costs PyTorch itself.
    ref, ref_scores, _ = naive(*(t.double() for t in (q, k, v)), return_scores=True, **options)
    ref_lse = torch.logsumexp(ref_scores, dim=-1)
    same_dtype = naive(q, k, v, **options)
    error = (out.double() - ref).abs().max().item()
    yardstick = (same_dtype.double() - ref).abs().max().item()
    rounded = ref.to(out.dtype)
    floor = ((rounded + 0.3 - 0.3) - rounded).abs().max().item()

    if lse is None:  # a provider that returns no LSE (the sweep's peers): O alone is judged
        lse_ok, lse_error = True, 0.0
    else:
        finite = torch.isfinite(ref_lse)
        lse = lse.double()
        lse_ok = bool((torch.isneginf(lse) == ~finite).all())
        lse_error = ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0))[finite].max().item() \
            if finite.any() else 0.0
    passed = (not math.isnan(error) and error <= 2 * yardstick + 2 * floor + 1e-6
              and lse_ok and lse_error <= 1e-5 and not torch.isnan(out).any().item())
    return AccuracyCheck(error, yardstick, floor, lse_error, passed)


# ----- gradients ---------------------------------------------------------------------------
# The backward's rule: max|dX - dX_ref64| <= 3 * max|dX_torch_same_dtype - dX_ref64| + floor
# for X in q, k, v (flash-attn's test_flash_attn_output uses the same factor for grads).
GRADIENT_FACTOR = 3


@dataclass(frozen=True)
class GradientCheck:
    """One gradient (dq, dk or dv) judged against float64 autograd."""

    name: str
    error: float
    yardstick_error: float
    rounding_floor: float
    passed: bool

    @property
    def allowed(self) -> float:
        return GRADIENT_FACTOR * self.yardstick_error + self.rounding_floor


def reference_gradients(q, k, v, dout, *, causal=False, scale=None, window=(-1, -1),
                        softcap=0.0, dtype=None) -> tuple:
    """(dq, dk, dv) by torch autograd through :func:`attnlab.reference.naive` in ``dtype``
    (default float64), SDPA layout."""
    dtype = torch.float64 if dtype is None else dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = naive(*leaves, causal=causal, scale=scale, window=window, softcap=softcap)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def check_gradients(grads, q, k, v, dout, *, causal=False, scale=None, window=(-1, -1),
                    softcap=0.0, layout="bhsd") -> tuple[GradientCheck, ...]:
    """Judge a kernel's (dq, dk, dv) for inputs q, k, v and output gradient dout.

    The oracle: float64 autograd through the materialising reference.  The yardstick:
    what that dtype costs PyTorch itself, the larger of two errors: its math backend
    (autograd in the inputs' dtype), and what its flash and cuDNN backends cannot avoid
    either, the flash backward computing D = rowsum(dO * O) from the output *rounded to
    the dtype* (here in float64 with that one rounding, :func:`attnlab.reference.tiled_backward`).
    The second dominates when P is nearly one-hot and dP - D cancels: on the H200
    (bf16, 1 query x 239 keys, inputs x5; ``bench/backward_h200.py --phases edge``)
    attnlab, SDPA-flash and SDPA-cuDNN all reach dQ error 0.510 where the math backend
    has 0.067.  The floor: one rounding step of the oracle's largest magnitude in that
    dtype.  NaN never passes.
    """
    to_bhsd = layout_named(layout).to_bhsd
    q, k, v, dout = (to_bhsd(t) for t in (q, k, v, dout))
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    oracle = reference_gradients(q, k, v, dout, **options)
    yardstick = reference_gradients(q, k, v, dout, dtype=q.dtype, **options)
    wide = [t.detach().double() for t in (q, k, v, dout)]
    out64, lse64 = tiled(*wide[:3], **options)
    rounded_out = tiled_backward(*wide, out=out64.to(q.dtype).double(), lse=lse64, **options)
    eps = torch.finfo(q.dtype).eps
    checks = []
    for name, grad, ref, same, flash in zip(("dq", "dk", "dv"), grads, oracle, yardstick,
                                            rounded_out, strict=True):
        grad = to_bhsd(grad).to(ref.device).double()
        error = (grad - ref).abs().max().item()
        yard = max((same.double() - ref).abs().max().item(), (flash - ref).abs().max().item())
        floor = eps * max(ref.abs().max().item(), 1.0) + 1e-6
        passed = (not math.isnan(error) and not torch.isnan(grad).any().item()
                  and error <= GRADIENT_FACTOR * yard + floor)
        checks.append(GradientCheck(name, error, yard, floor, passed))
    return tuple(checks)
