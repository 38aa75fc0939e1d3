"""The accuracy rule every attnlab kernel is held to.

A kernel's max error against a float64 reference may be at most twice the error
of PyTorch's own attention computed in the same dtype, plus the rounding error of
the reference's own magnitude in that dtype (flash-attn's and FA3's rule).  NaN
never passes.  LSE must match to 1e-5 relative, and -inf exactly where no key is
visible.

FP8 has two entries.  An **fp8 KV cache** (:func:`check_fp8_cache_accuracy`) is judged by
the same rule on the dequantised cache: the oracle is float64 attention on k x k_descale,
v x v_descale, the yardstick PyTorch computing that in q's dtype.  The **FP8 prefill**
(:func:`check_fp8_accuracy`) rounds P to e4m3 (3 mantissa bits) as FA3 does, which no
PyTorch computation shares; it is held to a bound derived from that rounding instead
(docs/usage.md, "FP8").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnlab.inputs import layout_named
from attnlab.reference import naive, tiled, tiled_backward
from attnlab.reference.fp8 import dequantize, per_head


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
                   layout="bhsd", yardstick_dtype=None) -> AccuracyCheck:
    """Judge a kernel's (out, lse) on inputs q, k, v by the rule in the module doc.
    ``yardstick_dtype``: the dtype PyTorch's own computation runs in (default q's; the
    fp8 cache's rule passes q's dtype with float64 dequantised k, v)."""
    to_bhsd = layout_named(layout).to_bhsd
    q, k, v, out = (to_bhsd(t) for t in (q, k, v, out))
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    # The oracle: the materialising baseline in float64.  The yardstick: the same
    # computation in the kernel's dtype, i.e. what that dtype costs PyTorch itself.
    ref, ref_scores, _ = naive(*(t.double() for t in (q, k, v)), return_scores=True, **options)
    ref_lse = torch.logsumexp(ref_scores, dim=-1)
    same_dtype = naive(*(t.to(yardstick_dtype or q.dtype) for t in (q, k, v)), **options)
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


def check_fp8_cache_accuracy(out, lse, q, k_cache, v_cache, k_descale, v_descale,
                             **options) -> AccuracyCheck:
    """The fp8 KV cache's rule: :func:`check_accuracy` against float64 attention on the
    dequantised cache, the yardstick PyTorch doing the same in q's dtype.  q, out
    (batch, seqlen_q, heads, d), the live cache (batch, seqlen_k, kv_heads, d)
    float8_e4m3fn, descales (batch, kv_heads) (``bshd``)."""
    k, v = (dequantize(c, per_head(d.to(c.device)))
            for c, d in ((k_cache, k_descale), (v_cache, v_descale)))
    return check_accuracy(out, lse, q, k, v, layout="bshd", yardstick_dtype=q.dtype, **options)


# ----- the FP8 prefill's bound -------------------------------------------------------------
# Its terms, per output element (row r, column c), on the dequantised inputs (exact in
# float64); p_j = exp(s_rj - max_j s_rj) (s the scaled scores), l = sum_j p_j, w = p / l:
#
# * P rounded to e4m3: key j's term moves by at most h_j |v_jc| / l, with h_j =
#   max(2^-4 p_j, 2^-10) (half an e4m3 step at p_j in the row's final units: the kernel
#   rounds p against its running max m_t <= m, then scales by 2^(m_t - m) <= 1, so the
#   relative half step 2^-4 and the subnormal one 2^-10 only shrink).  Rounding errors
#   taken as independent and mean-zero (the probabilistic model of Higham and Mary,
#   SIAM J. Sci. Comput. 2019), Hoeffding's inequality bounds their sum by
#   FP8_SIGMAS * sqrt(sum_j h_j^2 v_jc^2) / l, exceeded with probability
#   < 2 exp(-FP8_SIGMAS^2 / 2) = 3e-8 per element;
# * the scores: fp8 products are exact, but an fp8 MMA sums them in a ~14-bit accumulator
#   (DeepSeek-V3 report, sec. 3.3.2): per 32-element step at most 2^-13 of the running
#   sum, taken as 2^-12 (a factor 2 of margin), so |ds_rj| <= ceil(d / 32) 2^-12 scale
#   sum_i |q_ri k_ji| =: delta_rj.  To first order O moves by sum_j w_j ds_rj (v_jc - O_c),
#   bounded the same way: FP8_SIGMAS * sqrt(sum_j (w_j delta_rj (v_jc - O_c))^2);
# * P V: each key tile's product is summed in that accumulator (<= 4 steps of 32 keys)
#   and then added in fp32: at most 2^-10 sum_j w_j |v_jc|;
# * the output's rounding to bf16: 2^-8 of |O| (plus the terms above), and 1e-6.
# LSE: |lse - lse_ref| <= max_j delta_rj + 1e-5 max(1, |lse_ref|) (a soft max moves by at
# most the largest score change); -inf exactly where no key is visible.
FP8_SIGMAS = 6.0
FP8_ACCUMULATOR_STEP = 2.0**-12
FP8_PV_TERM = 2.0**-10
BF16_HALF_STEP = 2.0**-8


@dataclass(frozen=True)
class Fp8Check:
    """The FP8 prefill against its bound: the largest error, the largest error / bound
    (<= 1 passes), where that is (batch, head, query, column), and the largest LSE
    error / its bound."""

    error: float
    bound_ratio: float
    worst: tuple[int, ...]
    lse_ratio: float
    passed: bool


def check_fp8_accuracy(out, lse, q, k, v, q_descale, k_descale, v_descale, *, causal=False,
                       scale=None, window=(-1, -1), softcap=0.0) -> Fp8Check:
    """Judge the FP8 forward's (out, lse) on float8_e4m3fn q, k, v (``bshd``) with
    (batch, kv_heads) descales by the bound above, computed in float64 on q's device
    one (batch, KV head) group at a time.  NaN never passes."""
    batch, seqlen_q, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    delta_scale = math.ceil(dim / 32) * FP8_ACCUMULATOR_STEP * scale
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap)
    device = q.device
    out, lse = out.to(device, torch.float64), None if lse is None else lse.to(device)
    worst_ratio, worst_at, worst_error, lse_ratio = 0.0, (), 0.0, 0.0
    nan = bool(torch.isnan(out).any()) or (lse is not None and bool(torch.isnan(lse).any()))
    for b in range(batch):
        for h in range(kv_heads):
            heads_here = slice(h * group, (h + 1) * group)
            real_q = dequantize(q[b, :, heads_here], q_descale[b, h]).transpose(0, 1)[None]
            real_k = dequantize(k[b, :, h:h + 1], k_descale[b, h]).transpose(0, 1)[None]
            real_v = dequantize(v[b, :, h:h + 1], v_descale[b, h]).transpose(0, 1)[None]
            ref, scores, weights = naive(real_q, real_k, real_v, return_scores=True, **options)
            ref, scores, weights, vals = ref[0], scores[0], weights[0], real_v[0, 0]
            visible = torch.isfinite(scores)
            top = scores.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            p = torch.exp(scores - top)  # 0 where hidden
            total = p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
            half_steps = torch.where(visible, (p / 16).clamp_min(2.0**-10), 0.0)
            rounding = FP8_SIGMAS * ((half_steps ** 2) @ vals ** 2).sqrt() / total
            delta = delta_scale * (real_q[0].abs() @ real_k[0, 0].abs().T) * visible
            spread = (weights * delta) ** 2
            score_term = FP8_SIGMAS * ((spread @ vals ** 2) - 2 * ref * (spread @ vals)
                                       + ref ** 2 * spread.sum(-1, keepdim=True)).clamp_min(0).sqrt()
            pv_term = FP8_PV_TERM * (weights @ vals.abs())
            others = rounding + score_term + pv_term
            bound = others + BF16_HALF_STEP * (ref.abs() + others) + 1e-6
            got = out[b, :, heads_here].transpose(0, 1)
            error = (got - ref).abs()
            ratio = error / bound
            at = int(ratio.argmax())
            if ratio.flatten()[at] > worst_ratio or not worst_at:
                worst_ratio = float(ratio.flatten()[at])
                head, row, column = (int(i) for i in torch.unravel_index(torch.tensor(at),
                                                                        ratio.shape))
                worst_at = (b, h * group + head, row, column)  # (batch, head, query, column)
            worst_error = max(worst_error, float(error.max()))
            if lse is not None:
                ref_lse = torch.logsumexp(scores, dim=-1)
                got_lse = lse[b, heads_here].double()
                finite = torch.isfinite(ref_lse)
                nan = nan or bool((torch.isneginf(got_lse) != ~finite).any())
                if finite.any():
                    allowed = (delta.amax(-1) + 1e-5 * ref_lse.abs().clamp_min(1.0))[finite]
                    lse_ratio = max(lse_ratio, float(((got_lse - ref_lse).abs()[finite]
                                                      / allowed).max()))
    passed = not nan and worst_ratio <= 1.0 and lse_ratio <= 1.0
    return Fp8Check(worst_error, worst_ratio, worst_at, lse_ratio, passed)


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
