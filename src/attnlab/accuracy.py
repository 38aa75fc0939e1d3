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


def visible_keys(seqlen_q: int, seqlen_k: int, *, causal: bool, window: tuple[int, int],
                 device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k): may query i see key j (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def attention_in_dtype(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                       compute_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch attention in SDPA layout, every op in ``compute_dtype`` (default: q's).

    With float64 this is the oracle; in the kernel's dtype it is the yardstick of
    how much error that dtype costs.  Returns (O, LSE) with LSE in float32/64.
    """
    dtype = compute_dtype or q.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_keys(q.shape[2], k.shape[2], causal=causal, window=window, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: all -inf -> 0
    return probs @ v, lse


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
    to_bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    q, k, v, out = (to_bhsd(t) for t in (q, k, v, out))
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    ref, ref_lse = attention_in_dtype(q, k, v, compute_dtype=torch.float64, **options)
    same_dtype, _ = attention_in_dtype(q, k, v, **options)
    error = (out.double() - ref).abs().max().item()
    yardstick = (same_dtype.double() - ref).abs().max().item()
    rounded = ref.to(out.dtype)
    floor = ((rounded + 0.3 - 0.3) - rounded).abs().max().item()

    finite = torch.isfinite(ref_lse)
    lse = lse.double()
    lse_ok = bool((torch.isneginf(lse) == ~finite).all())
    lse_error = ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0))[finite].max().item() \
        if finite.any() else 0.0
    passed = (not math.isnan(error) and error <= 2 * yardstick + 2 * floor + 1e-6
              and lse_ok and lse_error <= 1e-5 and not torch.isnan(out).any().item())
    return AccuracyCheck(error, yardstick, floor, lse_error, passed)
