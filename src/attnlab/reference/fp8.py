"""FP8 (e4m3) storage: quantising with a descale factor, dequantising, e4m3's rounding step.

attnlab stores fp8 as ``torch.float8_e4m3fn`` (OCP e4m3: 3 mantissa bits, finite max
448, normals down to 2^-6, subnormals in steps of 2^-9, a NaN but no infinity).  A
**descale** factor d says what a stored value means, as in FA3 (``q/k/v_descale``) and
vLLM (``k_scale``/``v_scale``): real value = fp8 value x d.  Quantising is the inverse:
``x / d`` rounded to the nearest e4m3 (ties to even), saturated to +-448 (an infinity
becomes +-448, a NaN stays NaN: what the GPU's ``cvt.rn.satfinite`` does).

These are the one definition: the reference KV-cache path quantises new keys and values
with :func:`quantize_e4m3` (the Triton append kernel, kernels/append.py, stores the same
bytes, tested bit for bit), and the oracle reads an fp8 tensor through :func:`dequantize`.
A cache of real values is stored with :func:`quantize_per_head` (descales that use each
head's whole e4m3 range): the fp8 benchmarks and the measurement harness's fp8 provider.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
# e4m3's smallest normal exponent: below 2^-6 the grid is uniform, 2^-9 apart.
E4M3_MIN_EXPONENT = -6
E4M3_MANTISSA_BITS = 3


def per_head(descale: torch.Tensor) -> torch.Tensor:
    """A (batch, kv_heads) descale as it broadcasts over a (batch, seqlen, kv_heads, d)
    tensor: (batch, 1, kv_heads, 1)."""
    return descale[:, None, :, None]


def quantize_e4m3(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x / descale`` as float8_e4m3fn: computed in fp32, rounded to nearest even,
    saturated to +-448 (``descale`` broadcasts against x).  Device-side only: it runs
    under CUDA-graph capture."""
    scaled = x.to(torch.float32) / descale.to(torch.float32)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def descale_per_head(x: torch.Tensor) -> torch.Tensor:
    """The (batch, heads) descales of a (batch, seqlen, heads, d) tensor that put each
    head's largest magnitude at :data:`E4M3_MAX`: the whole e4m3 range used, nothing
    saturated (a head of zeros gets 1e-12, not a zero to divide by)."""
    return (x.to(torch.float32).abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-12)


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as float8_e4m3fn, its (batch, heads) descales): :func:`quantize_e4m3` with
    :func:`descale_per_head`, what an fp8 cache of real values holds."""
    descale = descale_per_head(x)
    return quantize_e4m3(x, per_head(descale)), descale


def dequantize(x: torch.Tensor, descale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """The real values of an fp8 tensor: ``x * descale`` in ``dtype`` (float64: exact)."""
    return x.to(dtype) * descale.to(dtype)


def e4m3_half_step(x: torch.Tensor) -> torch.Tensor:
    """The largest error rounding a value of magnitude ``|x|`` to e4m3 can make (half the
    grid step there): 2^(e - 4) for |x| in [2^e, 2^(e+1)), e >= -6; 2^-10 below 2^-6
    (the subnormal grid).  Exact in float64 (frexp, no logarithm)."""
    magnitude = x.abs().to(torch.float64)
    _, exponent = torch.frexp(magnitude)  # |x| = m 2^exponent, m in [0.5, 1); 0 gives 0
    e = torch.where(magnitude == 0, E4M3_MIN_EXPONENT, (exponent - 1).clamp_min(E4M3_MIN_EXPONENT))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - E4M3_MANTISSA_BITS - 1)
