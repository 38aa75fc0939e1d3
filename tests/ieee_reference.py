"""The float64 math with IEEE special values, and the comparison against it: the one
definition the NaN/inf grid (test_nan_inf.py) and the hostile fuzz (test_api_fuzz.py)
hold every path to.

``expected`` is attention in float64 with ``torch.softmax``
(:func:`attnlab.reference.naive`): a NaN in a row's visible scores, or a +inf score
(``exp(inf - inf)``), makes the row NaN; a -inf score weighs 0; a row whose every
visible score is -inf is ``0 / 0`` = NaN with LSE -inf; a row that sees no key is 0
with LSE -inf (the convention).  Its LSE is ``torch.logsumexp`` of the scores, except
NaN where a row meets a NaN or a +inf score (logsumexp says +inf there, but the row's O
is NaN, and the kernels and the reference give ``m + log(l)`` = NaN).
"""

from __future__ import annotations

import math

import torch

from attnlab.reference import naive


def expected(q, k, v, *, causal=False, window=(-1, -1), scale=None, softcap=0.0):
    """(O bshd, LSE (batch, heads, seqlen_q)) of bshd q, k, v, in float64 on the CPU."""
    to_bhsd = (lambda t: t.detach().transpose(1, 2).to("cpu", torch.float64))
    out, scores, _ = naive(*(to_bhsd(t) for t in (q, k, v)), causal=causal, window=window,
                           scale=scale, softcap=softcap, return_scores=True)
    lse = torch.logsumexp(scores, dim=-1)
    lse[(scores.isnan() | (scores == math.inf)).any(dim=-1)] = math.nan
    return out.transpose(1, 2), lse


def mismatch(got, want, what: str, *, atol: float = 2e-2) -> str | None:
    """None when ``got`` has NaN exactly where ``want`` does, the same infinities, and
    finite values within ``atol`` (relative past magnitude 1); else what differs.
    ``want`` is first rounded to ``got``'s dtype: a float64 LSE of -5e38 is -inf in fp32."""
    want = want.to(got.dtype).to(torch.float64)
    got = got.detach().to("cpu", torch.float64)
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    nan_got, nan_want = got.isnan(), want.isnan()
    if not torch.equal(nan_got, nan_want):
        return (f"{what}: NaN at {nan_got.nonzero().tolist()[:6]} ({int(nan_got.sum())}), the "
                f"float64 math at {nan_want.nonzero().tolist()[:6]} ({int(nan_want.sum())})")
    for test in (torch.isposinf, torch.isneginf):
        if not torch.equal(test(got), test(want)):
            return f"{what}: {test.__name__} differs"
    finite = torch.isfinite(want)
    if finite.any():
        error = ((got[finite] - want[finite]).abs() / want[finite].abs().clamp_min(1.0)).max()
        if error.item() > atol:
            return f"{what}: max error {error.item():.3g} > {atol} on the finite values"
    return None
