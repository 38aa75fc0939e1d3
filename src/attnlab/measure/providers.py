"""The attention implementations we measure, in one registry.

Each :class:`Provider` has a name, the phases it supports, the tensor layout it
takes, a builder that turns a shape into a callable, and — when it cannot run on a
shape, phase or machine — a reason in words.  Nothing falls back silently: a
provider that cannot run is *skipped with its reason*, and a pinned SDPA backend
that refuses a shape raises instead of quietly running another backend.

Providers (``PROVIDERS`` lists them in this order):

- ``eager``: the explicit materialising baseline the lesson counts — GEMM, scale,
  softmax, GEMM, with S and P in the input dtype (the peer ncu run shows eager
  PyTorch launches the scale as its own pass: 4 kernels unmasked).  GQA reuses the
  shared K/V head without copying (query heads of a group are stacked as rows);
  the causal mask is built once, outside the timed call.
- ``eager_typical``: attention as model code typically writes it (the post's
  12-kernel baseline): K/V expanded by ``repeat_interleave``, a scale pass, the
  mask built and applied with ``masked_fill`` inside the call, softmax in FP32
  with conversions around it, and the output transposed back to (B, N, H, d).
- ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``: PyTorch SDPA
  with one backend pinned by ``torch.nn.attention.sdpa_kernel``; ``sdpa``: SDPA's
  own choice (``attnlab kernels`` shows which one it made).  The pin is the
  provider's ``pin`` context, not part of its callable: the timer enters it once,
  outside the timed region (entering it per call cost ~0.1 ms of Python, which made
  the same cuDNN decode kernel time 0.133 ms pinned vs 0.028 ms unpinned), and a
  CUDA graph captured inside it replays the pinned kernel.
- ``flex``: FlexAttention under ``torch.compile``.
- ``attnlab``: our Triton forward (``attnlab.attention``, impl pinned to "triton");
  ``attnlab_decode``: our decode API (``attnlab.flash_attn_with_kvcache``) when it
  exists.  Backward (phase ``fwdbwd``) only when attnlab ships a backward kernel.
- ``flash_attn``, ``flashinfer``: the external libraries, when importable.

All inputs are generated in the provider's own layout (so no transpose is timed)
and every output is viewed back as (batch, heads, seqlen, dim) for the check.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from attnlab.checks import quote
from attnlab.dtypes import TORCH_NAMES, canonical_dtype
from attnlab.inputs import layout_named
from attnlab.masking import shape_band
from attnlab.measure.records import PHASES
from attnlab.shapes import AttentionShape

LAYOUTS = ("bhsd", "bshd", "nhd")
# FlashInfer's NHD, (tokens, heads, head_dim), is attnlab's thd holding one sequence.
_CORE_LAYOUT = {"bhsd": "bhsd", "bshd": "bshd", "nhd": "thd"}
# Memory we leave free when deciding whether a materialising provider fits: the
# allocator, the L2 flush buffer and the reference check need room too.
MEMORY_HEADROOM = 0.80


class ProviderUnavailable(ValueError):
    """A provider cannot run on this shape/phase/machine; the message is the reason."""


@dataclass(frozen=True)
class Provider:
    name: str
    description: str
    phases: tuple[str, ...]
    needs_cuda: bool
    input_layout: str     # layout of q, k, v handed to the callable
    output_layout: str    # layout of what the callable returns
    builder: Callable     # (shape, phase, device) -> callable(q, k, v)
    checker: Callable | None = None  # (shape, phase) -> reason or None
    pin: Callable | None = None      # () -> context manager the calls must run inside

    def reason(self, shape: AttentionShape, phase: str, device: str) -> str | None:
        """Why this provider cannot run here, or None when it can (as far as we can tell
        without running it)."""
        return unavailable_reason(self, shape, phase, device)


# ----- helpers shared by builders ---------------------------------------------------------
def torch_dtype(name: str):
    import torch

    return getattr(torch, TORCH_NAMES[canonical_dtype(name)])


def hidden_mask(shape: AttentionShape, device):
    """Boolean (seqlen_q, seqlen_k), True where a query may NOT see a key (bottom-right
    causal and window, attnlab's convention); None when nothing is hidden."""
    from attnlab.reference import shape_mask

    if not shape.causal and not shape.has_window:
        return None
    return ~shape_mask(shape, device=device)


def _scale(shape: AttentionShape) -> float:
    return shape.softmax_scale


def _needs_attnlab_backward() -> str | None:
    if importlib.util.find_spec("attnlab.kernels.backward") is None:
        return "attnlab has no backward kernel yet (attnlab.kernels.backward not found)"
    return None


def _half_only(shape: AttentionShape, what: str) -> str | None:
    if shape.dtype not in ("fp16", "bf16"):
        return f"{what} takes fp16 or bf16, not {shape.dtype}"
    return None


def _importable(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as error:  # an installed-but-broken package is a reason too
        return f"{module} is not importable ({type(error).__name__}: {error})"
    return None


# ----- eager baselines ---------------------------------------------------------------------
def _build_eager(shape: AttentionShape, phase: str, device):
    import torch

    batch, heads, kv_heads = shape.batch, shape.query_heads, shape.kv_heads
    group, seqlen_q, dim = shape.group_size, shape.seqlen_q, shape.head_dim
    scale = _scale(shape)
    hidden = hidden_mask(shape, device)
    if hidden is not None and not bool(hidden.any()):
        hidden = None  # e.g. causal decode: the one query sees every key, nothing to mask
    # Query heads of one group stacked as rows: one GEMM against their shared K, no copy.
    grouped_hidden = None if hidden is None else hidden.repeat(group, 1)

    def eager(q, k, v):
        rows = q.view(batch, kv_heads, group * seqlen_q, dim)
        scores = torch.matmul(rows, k.transpose(-2, -1))     # kernel 1: GEMM, S in HBM
        scores.mul_(scale)                                    # kernel 2: the scale pass
        if grouped_hidden is not None:
            scores.masked_fill_(grouped_hidden, float("-inf"))  # kernel: mask (causal/window)
        probs = torch.softmax(scores, dim=-1)                 # kernel 3: softmax, P in HBM
        return torch.matmul(probs, v).view(batch, heads, seqlen_q, dim)  # kernel 4: GEMM

    return eager


def _build_eager_typical(shape: AttentionShape, phase: str, device):
    import torch

    group, scale = shape.group_size, _scale(shape)
    masked = shape.causal or shape.has_window
    band = shape_band(shape)  # the one visibility rule: key j visible iff lowest <= j - i <= highest

    def eager_typical(q, k, v):
        if group > 1:  # GQA expansion: two full copies of K and V
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if masked:  # the mask is rebuilt every call, as model code does
            ones = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
            future = ones.triu(band.highest + 1) if band.highest is not None else None
            past = ones.tril(band.lowest - 1) if band.lowest is not None else None
            hide = past if future is None else future if past is None else future | past
            scores = scores.masked_fill(hide, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v)
        return out.transpose(1, 2).contiguous()   # back to (B, N, H, d) for the next layer

    return eager_typical


# ----- SDPA --------------------------------------------------------------------------------
SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_math": "MATH",
}


def _sdpa_mask_args(shape: AttentionShape, device) -> dict:
    """SDPA's causal flag is top-left aligned; attnlab's is bottom-right.  Square or
    one-query causal needs no explicit mask; any other causal uses the lower-right bias."""
    if not shape.causal:
        return {"is_causal": False}
    if shape.seqlen_q == shape.seqlen_k:
        return {"is_causal": True}
    if shape.seqlen_q == 1:
        return {"is_causal": False}  # bottom-right: the single query sees every key
    from torch.nn.attention.bias import causal_lower_right

    return {"attn_mask": causal_lower_right(shape.seqlen_q, shape.seqlen_k)}


def _build_sdpa(backend: str | None):
    def build(shape: AttentionShape, phase: str, device):
        import torch.nn.functional as F

        options = {**_sdpa_mask_args(shape, device), "scale": _scale(shape)}
        if shape.group_size > 1:
            options["enable_gqa"] = True
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **options)

    return build


def _sdpa_pin(backend: str) -> Callable:
    """The context that pins SDPA to one backend (a refusing backend then raises)."""
    def pin():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, backend)])

    return pin


def _check_sdpa(backend: str | None):
    def check(shape: AttentionShape, phase: str) -> str | None:
        if shape.has_window:
            return "SDPA has no sliding-window argument (only an explicit mask)"
        if backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            return _half_only(shape, f"SDPA's {backend} backend")
        return None

    return check


# ----- FlexAttention -----------------------------------------------------------------------
_COMPILED_FLEX = None


def _compiled_flex():
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        import torch
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # Every swept shape is one recompile; past dynamo's limit (8 by default) it would
        # quietly run flex_attention un-compiled — a different implementation.
        # Raise the limit, and make hitting it an error rather than a silent fallback.
        config = torch._dynamo.config
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(config, limit):
                setattr(config, limit, max(getattr(config, limit), 64))
        if hasattr(config, "fail_on_recompile_limit_hit"):
            config.fail_on_recompile_limit_hit = True
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _build_flex(shape: AttentionShape, phase: str, device):
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _compiled_flex()
    band = shape_band(shape)  # bottom-right causal and window, from the one rule
    lowest, highest = band.lowest, band.highest
    block_mask = None
    if lowest is not None or highest is not None:
        def visible(b, h, q_idx, kv_idx):
            keep = kv_idx >= 0
            if highest is not None:
                keep = keep & (kv_idx - q_idx <= highest)
            if lowest is not None:
                keep = keep & (kv_idx - q_idx >= lowest)
            return keep

        block_mask = create_block_mask(visible, B=None, H=None, Q_LEN=shape.seqlen_q,
                                       KV_LEN=shape.seqlen_k, device=device)
    gqa = shape.group_size > 1
    scale = _scale(shape)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def _check_flex(shape: AttentionShape, phase: str) -> str | None:
    if shape.head_dim < 16 or shape.head_dim & (shape.head_dim - 1):
        return f"FlexAttention needs a power-of-two head_dim >= 16, got {shape.head_dim}"
    if phase == "decode" and shape.group_size & (shape.group_size - 1):
        return f"flex decoding needs a power-of-two GQA group, got {shape.group_size}"
    return None


# ----- attnlab -------------------------------------------------------------------------------
def _attnlab_attention():
    import attnlab

    function = getattr(attnlab, "attention", None)
    if function is None:  # the API module exists before the package re-exports it
        from attnlab.api import attention as function
    return function


def _build_attnlab(shape: AttentionShape, phase: str, device):
    attention = _attnlab_attention()
    options = {"causal": shape.causal, "scale": _scale(shape),
               "enable_gqa": shape.group_size > 1, "impl": "triton"}
    if shape.has_window:
        options["window_size"] = shape.window
    return lambda q, k, v: attention(q, k, v, **options)


def _check_attnlab(shape: AttentionShape, phase: str) -> str | None:
    reason = _half_only(shape, "attnlab's Triton kernel")
    if reason:
        return reason
    try:
        from attnlab.kernels.forward import MAX_HEAD_DIM
    except Exception as error:
        return f"attnlab's forward kernel is not importable ({type(error).__name__}: {error})"
    if shape.head_dim > MAX_HEAD_DIM:
        return f"attnlab's Triton kernel takes head_dim <= {MAX_HEAD_DIM}, got {shape.head_dim}"
    if phase == "fwdbwd":
        return _needs_attnlab_backward()
    return None


def _build_attnlab_decode(shape: AttentionShape, phase: str, device):
    import attnlab

    with_kvcache = attnlab.flash_attn_with_kvcache
    causal, scale = shape.causal, _scale(shape)
    return lambda q, k, v: with_kvcache(q, k, v, causal=causal, softmax_scale=scale)


def _check_attnlab_decode(shape: AttentionShape, phase: str) -> str | None:
    import attnlab

    if not hasattr(attnlab, "flash_attn_with_kvcache"):
        return "attnlab has no decode API yet (attnlab.flash_attn_with_kvcache not found)"
    return _half_only(shape, "attnlab's decode kernel")


# ----- external libraries ----------------------------------------------------------------------
def _build_flash_attn(shape: AttentionShape, phase: str, device):
    from flash_attn import flash_attn_func, flash_attn_with_kvcache

    options = {"causal": shape.causal, "softmax_scale": _scale(shape),
               "window_size": shape.window}
    if phase == "decode":
        return lambda q, k, v: flash_attn_with_kvcache(q, k, v, **options)
    return lambda q, k, v: flash_attn_func(q, k, v, **options)


def _check_flash_attn(shape: AttentionShape, phase: str) -> str | None:
    return _importable("flash_attn") or _half_only(shape, "flash-attn")


def _build_flashinfer(shape: AttentionShape, phase: str, device):
    import flashinfer

    scale = _scale(shape)
    if phase == "decode":
        # single-request decode: q (heads, dim), k/v (seqlen, kv_heads, dim)
        return lambda q, k, v: flashinfer.single_decode_with_kv_cache(
            q[0], k, v, sm_scale=scale).unsqueeze(0)
    causal = shape.causal
    return lambda q, k, v: flashinfer.single_prefill_with_kv_cache(
        q, k, v, causal=causal, sm_scale=scale)


def _check_flashinfer(shape: AttentionShape, phase: str) -> str | None:
    reason = _importable("flashinfer") or _half_only(shape, "FlashInfer")
    if reason:
        return reason
    if shape.batch != 1:
        return f"the FlashInfer single-request kernels take batch 1, got {shape.batch}"
    if shape.has_window:
        return "the FlashInfer single-request provider here does not pass a window"
    return None


# ----- the registry ------------------------------------------------------------------------------
_ALL_PHASES = PHASES
_FORWARD_PHASES = ("prefill", "decode")

PROVIDERS: dict[str, Provider] = {p.name: p for p in (
    Provider("eager", "materialising baseline: GEMM, scale, softmax, GEMM (S, P in input dtype)",
             _ALL_PHASES, False, "bhsd", "bhsd", _build_eager),
    Provider("eager_typical", "typical eager code: repeat_interleave, scale, masked_fill, "
             "fp32 softmax, conversions, transpose", _ALL_PHASES, False, "bhsd", "bshd",
             _build_eager_typical),
    Provider("sdpa", "PyTorch SDPA, its own backend choice", _ALL_PHASES, False, "bhsd",
             "bhsd", _build_sdpa(None), _check_sdpa(None)),
    Provider("sdpa_flash", "PyTorch SDPA pinned to FLASH_ATTENTION (FlashAttention-2)",
             _ALL_PHASES, True, "bhsd", "bhsd", _build_sdpa("FLASH_ATTENTION"),
             _check_sdpa("FLASH_ATTENTION"), _sdpa_pin("FLASH_ATTENTION")),
    Provider("sdpa_efficient", "PyTorch SDPA pinned to EFFICIENT_ATTENTION (xFormers kernels)",
             _ALL_PHASES, True, "bhsd", "bhsd", _build_sdpa("EFFICIENT_ATTENTION"),
             _check_sdpa("EFFICIENT_ATTENTION"), _sdpa_pin("EFFICIENT_ATTENTION")),
    Provider("sdpa_cudnn", "PyTorch SDPA pinned to CUDNN_ATTENTION", _ALL_PHASES, True, "bhsd",
             "bhsd", _build_sdpa("CUDNN_ATTENTION"), _check_sdpa("CUDNN_ATTENTION"),
             _sdpa_pin("CUDNN_ATTENTION")),
    Provider("sdpa_math", "PyTorch SDPA pinned to MATH (unfused reference path)", _ALL_PHASES,
             False, "bhsd", "bhsd", _build_sdpa("MATH"), _check_sdpa("MATH"), _sdpa_pin("MATH")),
    Provider("flex", "FlexAttention under torch.compile", _ALL_PHASES, True, "bhsd", "bhsd",
             _build_flex, _check_flex),
    Provider("attnlab", "attnlab's Triton forward (attnlab.attention, impl='triton')",
             _ALL_PHASES, True, "bhsd", "bhsd", _build_attnlab, _check_attnlab),
    Provider("attnlab_decode", "attnlab's decode API (attnlab.flash_attn_with_kvcache)",
             ("decode",), True, "bshd", "bshd", _build_attnlab_decode, _check_attnlab_decode),
    Provider("flash_attn", "flash-attn (flash_attn_func; flash_attn_with_kvcache for decode)",
             _FORWARD_PHASES, True, "bshd", "bshd", _build_flash_attn, _check_flash_attn),
    Provider("flashinfer", "FlashInfer single-request prefill / decode kernels",
             _FORWARD_PHASES, True, "nhd", "nhd", _build_flashinfer, _check_flashinfer),
)}


def provider(name: str) -> Provider:
    if name not in PROVIDERS:
        raise ValueError(f"unknown provider {quote(name)}; expected one of {', '.join(PROVIDERS)}")
    return PROVIDERS[name]


def parse_providers(text: str) -> list[Provider]:
    """'all' or a comma-separated list of provider names, validated."""
    if text.strip() == "all":
        return list(PROVIDERS.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"providers must be 'all' or names from {', '.join(PROVIDERS)}")
    return [provider(n) for n in names]


def materialised_bytes(p: Provider, shape: AttentionShape, phase: str) -> int:
    """Peak bytes of score-sized temporaries a provider allocates (0 for fused kernels).

    Backward keeps S and P alive and adds their gradients: twice the forward's.
    """
    scores = shape.batch * shape.query_heads * shape.seqlen_q * shape.seqlen_k
    per_score = {"eager": 2 * shape.element_bytes,
                 "eager_typical": 2 * shape.element_bytes + 8,
                 "sdpa_math": 2 * 4 + shape.element_bytes}.get(p.name, 0)
    factor = 2 if phase == "fwdbwd" else 1
    return factor * scores * per_score


def unavailable_reason(p: Provider, shape: AttentionShape, phase: str, device: str) -> str | None:
    if not isinstance(shape, AttentionShape):
        raise TypeError(f"shape must be an AttentionShape, got {type(shape).__name__}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {list(PHASES)}, got {phase!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if phase not in p.phases:
        return f"{p.name} has no {phase} path (phases: {', '.join(p.phases)})"
    if phase == "decode" and shape.seqlen_q != 1:
        return f"decode means one query token; got seqlen_q={shape.seqlen_q}"
    if p.needs_cuda and device != "cuda":
        return f"{p.name} needs a CUDA GPU"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU (torch.cuda.is_available() is False)"
    if p.checker is not None:
        reason = p.checker(shape, phase)
        if reason:
            return reason
    if device == "cuda":
        needed = materialised_bytes(p, shape, phase)
        if needed:
            import torch

            free, _ = torch.cuda.mem_get_info()
            if needed > MEMORY_HEADROOM * free:
                return (f"{p.name} materialises about {needed / 2**30:.1f} GiB of scores here; "
                        f"{free / 2**30:.1f} GiB free")
    return None


# ----- inputs and one prepared call ----------------------------------------------------------------
def make_inputs(shape: AttentionShape, layout: str, device: str, *, seed: int = 0,
                requires_grad: bool = False, grad_layout: str | None = None) -> tuple:
    """(q, k, v) drawn from N(0, 1) in ``layout``; plus dO (in ``grad_layout``, the
    layout of the provider's output) when ``requires_grad``."""
    import torch

    for name, value in (("layout", layout), ("grad_layout", grad_layout or layout)):
        if value not in LAYOUTS:
            raise ValueError(f"{name} must be one of {list(LAYOUTS)}, got {value!r}")
    dtype = torch_dtype(shape.dtype)
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(heads: int, seqlen: int, layout: str = layout) -> torch.Tensor:
        core = layout_named(_CORE_LAYOUT[layout])
        if core.is_varlen and shape.batch != 1:
            raise ValueError(f"layout {layout!r} holds one sequence; batch must be 1, got "
                             f"{shape.batch}")
        size = core.shape(shape.batch, seqlen, heads, shape.head_dim)
        t = torch.randn(size, generator=generator, device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    q = draw(shape.query_heads, shape.seqlen_q)
    k = draw(shape.kv_heads, shape.seqlen_k)
    v = draw(shape.kv_heads, shape.seqlen_k)
    if not requires_grad:
        return q, k, v
    return q, k, v, draw(shape.query_heads, shape.seqlen_q, grad_layout or layout).detach()


def to_bhsd(t, layout: str):
    return layout_named(_CORE_LAYOUT[layout]).to_bhsd(t)


@dataclass
class PreparedCall:
    """A provider bound to a shape and phase.

    ``call(*inputs)`` and ``forward(q, k, v)`` run inside the provider's pin, each call
    on its own (checks, profiles).  The timer takes ``unpinned_call`` and ``pin``
    instead and enters the pin once, outside the timed region.
    """

    provider: Provider
    shape: AttentionShape
    phase: str
    device: str
    call: Callable
    forward: Callable
    unpinned_call: Callable | None = None
    pin: Callable | None = None

    def __post_init__(self) -> None:
        if self.unpinned_call is None:
            self.unpinned_call = self.call

    def inputs(self, seed: int = 0) -> tuple:
        return make_inputs(self.shape, self.provider.input_layout, self.device, seed=seed,
                           requires_grad=self.phase == "fwdbwd",
                           grad_layout=self.provider.output_layout)


def prepare(p: Provider, shape: AttentionShape, phase: str, device: str) -> PreparedCall:
    """Bind a provider to a shape and phase; ProviderUnavailable with the reason if it can't run."""
    reason = unavailable_reason(p, shape, phase, device)
    if reason:
        raise ProviderUnavailable(f"{p.name} cannot run {shape.describe()} ({phase}): {reason}")
    forward = p.builder(shape, phase, device)
    call = _forward_backward(forward) if phase == "fwdbwd" else forward
    if p.pin is None:
        return PreparedCall(p, shape, phase, device, call, forward)
    return PreparedCall(p, shape, phase, device, _pinned(call, p.pin), _pinned(forward, p.pin),
                        unpinned_call=call, pin=p.pin)


def _forward_backward(forward: Callable) -> Callable:
    import torch

    def forward_backward(q, k, v, grad_out):
        out = forward(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    return forward_backward


def _pinned(fn: Callable, pin: Callable) -> Callable:
    def pinned(*args):
        with pin():
            return fn(*args)

    return pinned
