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
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func``, the ``flash-attn-4``
  wheel on the CUTLASS CuTe DSL; Hopper and Blackwell).  Its kernel is compiled on the
  first call of each configuration (the warm-up's); the timed call is the compiled
  launch.  It has no KV-cache call: decode is ``flash_attn_func`` with one query over
  the whole cache (``num_splits=1``: its sm_90 path has no split-KV).  Backward on both.
  ``fa4_paged16``: decode through ``flash_attn_varlen_func``'s ``page_table``.
- ``flashinfer``: FlashInfer (``flashinfer-python``; its kernels JIT-compiled with nvcc on
  first use): prefill by ``single_prefill_with_kv_cache`` (batch 1; its FA3 kernel on
  sm_90) or ``BatchPrefillWithRaggedKVCacheWrapper`` (batch > 1); decode by the
  tensor-core ``single_decode_with_kv_cache`` (batch 1) or the ragged batch prefill with
  one query per request (batch > 1).  ``flashinfer_paged16``: the tensor-core
  ``BatchDecodeWithPagedKVCacheWrapper``.  Wrappers are built and planned by the builder,
  outside the timed region; the timed call is ``run`` (or the single-request function).
- ``attnlab_decode_paged16``: attnlab's decode API on the same 16-token pages.
- ``attnlab_decode_fp8``: attnlab's decode API on an e4m3 copy of the same cache with
  per-(batch, KV head) descales (:func:`attnlab.reference.fp8.quantize_per_head`), made
  outside the timed call (the provider's ``storage``); checked against float64 on the
  dequantised cache, the fp8 cache's accuracy rule.
- ``flash_attn``: flash-attn 2 (``flash_attn.flash_attn_func``), when importable.

The paged providers view the contiguous cache as 16-token pages with an identity page
table (sequence b's page j is page ``b * pages + j``): the kernels take their paged code
path over the same bytes, so the float64 check applies unchanged.

A provider whose call takes its inputs stored otherwise than :func:`make_inputs` draws
them (an fp8 cache) has a :class:`Storage`: what it stores, made before the call, and
what those stored values mean, the inputs its output is checked against.

Each provider may name its kernels (``kernels``: plain-text pieces of kernel names); a
profiled call must launch one of them (:func:`unproven_kernels`), so a record never
carries a provider's name over another library's kernel.

All inputs are generated in the provider's own layout (so no transpose is timed)
and every output is viewed back as (batch, heads, seqlen, dim) for the check.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from attnlab.checks import quote
from attnlab.dtypes import TORCH_NAMES, canonical_dtype
from attnlab.inputs import layout_named
from attnlab.masking import shape_band
from attnlab.measure.dispatch import kernel_proof_failure
from attnlab.measure.records import PHASES
from attnlab.shapes import AttentionShape

LAYOUTS = ("bhsd", "bshd", "nhd")
# FlashInfer's NHD, (tokens, heads, head_dim), is attnlab's thd holding one sequence.
_CORE_LAYOUT = {"bhsd": "bhsd", "bshd": "bshd", "nhd": "thd"}
# Memory we leave free when deciding whether a materialising provider fits: the
# allocator, the L2 flush buffer and the reference check need room too.
MEMORY_HEADROOM = 0.80
# The page size of the paged providers (vLLM's default block size).
PAGE_SIZE = 16
# FlashInfer's workspace for split-KV partial results (its documentation's 128 MB).
FLASHINFER_WORKSPACE_BYTES = 128 << 20


class ProviderUnavailable(ValueError):
    """A provider cannot run on this shape/phase/machine; the message is the reason."""


@dataclass(frozen=True)
class Storage:
    """How a provider's call holds its inputs: ``store(q, k, v)`` gives the call's
    arguments (made outside the timed call), ``values(*arguments)`` the (q, k, v) they
    stand for; both batch-major, so the check may judge the first sequences alone.
    ``kv_dtype``: what K and V are stored as, where not the shape's dtype (the bytes a
    call must move, :func:`attnlab.measure.sweep.compulsory_bytes`)."""

    store: Callable
    values: Callable
    kv_dtype: str | None = None


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
    kernels: tuple[str, ...] = ()    # pieces of its kernels' names, one must have run
    storage: Storage | None = None   # inputs stored otherwise than drawn (inference only)

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
        return f"{module} is not importable ({type(error).__name__}: {error}){_dsl_hint(error)}"
    return None


def _dsl_hint(error: Exception) -> str:
    """Why ``cutlass`` is missing though its wheel is installed: the CuTe DSL wheel puts
    its packages on sys.path through a .pth file, which Python reads only in site
    folders, not in a ``pip install --target`` folder on PYTHONPATH."""
    if not (isinstance(error, ModuleNotFoundError) and error.name == "cutlass"):
        return ""
    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "; install nvidia-cutlass-dsl (with -libs-base and -libs-cu13 or -libs-cu12)"
    folder = os.path.join(list(spec.submodule_search_locations)[0], "dsl_packages")
    return (f"; nvidia-cutlass-dsl is installed but its .pth file was not read (a --target "
            f"install): add {folder} to PYTHONPATH")


def _gpu_arch() -> tuple[int, int] | None:
    """The current GPU's compute capability, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def _pages_reason(shape: AttentionShape, phase: str) -> str | None:
    if phase != "decode":
        return f"the paged providers run decode only, not {phase}"
    if shape.seqlen_k % PAGE_SIZE:
        return f"a {PAGE_SIZE}-token paged cache needs seqlen_k divisible by {PAGE_SIZE}, got {shape.seqlen_k}"
    return None


def identity_page_table(shape: AttentionShape, device):
    """(batch, pages) int32: sequence b's page j is page ``b * pages + j`` of the
    contiguous cache viewed as :data:`PAGE_SIZE`-token pages."""
    import torch

    pages = shape.seqlen_k // PAGE_SIZE
    return torch.arange(shape.batch * pages, dtype=torch.int32, device=device).view(shape.batch,
                                                                                   pages)


def as_pages(cache):
    """A contiguous (batch, seqlen, kv_heads, dim) cache as (pages, PAGE_SIZE, kv_heads,
    dim), without a copy."""
    return cache.view(-1, PAGE_SIZE, *cache.shape[2:])


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

    def decode(q, k, v, k_descale=None, v_descale=None):
        return with_kvcache(q, k, v, causal=causal, softmax_scale=scale, k_descale=k_descale,
                            v_descale=v_descale)

    return decode


def _check_attnlab_decode(shape: AttentionShape, phase: str) -> str | None:
    import attnlab

    if not hasattr(attnlab, "flash_attn_with_kvcache"):
        return "attnlab has no decode API yet (attnlab.flash_attn_with_kvcache not found)"
    return _half_only(shape, "attnlab's decode kernel")


def _build_attnlab_decode_paged(shape: AttentionShape, phase: str, device):
    import attnlab

    with_kvcache = attnlab.flash_attn_with_kvcache
    causal, scale = shape.causal, _scale(shape)
    table = identity_page_table(shape, device)
    return lambda q, k, v: with_kvcache(q, as_pages(k), as_pages(v), block_table=table,
                                        causal=causal, softmax_scale=scale)


def _check_attnlab_decode_paged(shape: AttentionShape, phase: str) -> str | None:
    return _pages_reason(shape, phase) or _check_attnlab_decode(shape, phase)


def _store_fp8_cache(q, k, v) -> tuple:
    """(q, K and V as e4m3, their (batch, KV head) descales): the decode call's arguments."""
    from attnlab.reference.fp8 import quantize_per_head

    (k8, k_descale), (v8, v_descale) = quantize_per_head(k), quantize_per_head(v)
    return q, k8, v8, k_descale, v_descale


def _fp8_cache_values(q, k8, v8, k_descale, v_descale) -> tuple:
    """q and the real cache the e4m3 one holds, in float64 (the yardstick stays q's dtype:
    :func:`attnlab.accuracy.check_fp8_cache_accuracy`'s rule)."""
    from attnlab.reference.fp8 import dequantize, per_head

    return q, dequantize(k8, per_head(k_descale)), dequantize(v8, per_head(v_descale))


FP8_CACHE = Storage(_store_fp8_cache, _fp8_cache_values, kv_dtype="fp8")


# ----- external libraries ----------------------------------------------------------------------
def _build_flash_attn(shape: AttentionShape, phase: str, device):
    from flash_attn import flash_attn_func, flash_attn_with_kvcache

    options = {"causal": shape.causal, "softmax_scale": _scale(shape),
               "window_size": shape.window}
    if phase == "decode":
        return lambda q, k, v: flash_attn_with_kvcache(q, k, v, **options)
    return lambda q, k, v: flash_attn_func(q, k, v, **options)


def _check_flash_attn(shape: AttentionShape, phase: str) -> str | None:
    reason = _importable("flash_attn")
    if reason is None and not hasattr(importlib.import_module("flash_attn"), "flash_attn_func"):
        # flash-attn-4 installs flash_attn as a bare namespace for flash_attn.cute
        return ("flash_attn has no flash_attn_func (flash-attn 2 is not installed; a bare "
                "flash_attn namespace is FlashAttention-4's: provider fa4)")
    return reason or _half_only(shape, "flash-attn")


# FlashAttention-4 -------------------------------------------------------------------------------
FA4_ARCHS = {9: "sm_90", 10: "sm_100"}


def _fa4_window(shape: AttentionShape) -> tuple[int | None, int | None]:
    """attnlab's window (-1: unbounded) as FA4's window_size (None: unbounded)."""
    return tuple(None if side < 0 else side for side in shape.window)


def _fa4_options(shape: AttentionShape) -> dict:
    return {"softmax_scale": _scale(shape), "causal": shape.causal,
            "window_size": _fa4_window(shape)}


def _build_fa4(shape: AttentionShape, phase: str, device):
    from flash_attn.cute import flash_attn_func

    options = _fa4_options(shape)
    # flash_attn_func returns (out, lse); decode is one query token over the whole cache
    # (bottom-right causal: it sees every key), num_splits=1 by default.
    return lambda q, k, v: flash_attn_func(q, k, v, **options)[0]


def _build_fa4_paged(shape: AttentionShape, phase: str, device):
    import torch
    from flash_attn.cute import flash_attn_varlen_func

    options = _fa4_options(shape)
    table = identity_page_table(shape, device)
    used = torch.full((shape.batch,), shape.seqlen_k, dtype=torch.int32, device=device)
    return lambda q, k, v: flash_attn_varlen_func(q, as_pages(k), as_pages(v), page_table=table,
                                                  seqused_k=used, **options)[0]


def _check_fa4(shape: AttentionShape, phase: str) -> str | None:
    reason = _importable("flash_attn.cute") or _half_only(shape, "FlashAttention-4")
    if reason:
        return reason
    arch = _gpu_arch()
    if arch is None:
        return None  # the device check says "needs a CUDA GPU" first
    if arch[0] not in FA4_ARCHS:
        return (f"FlashAttention-4's kernels here are the Hopper and Blackwell ones "
                f"({', '.join(FA4_ARCHS.values())}); this GPU is sm_{arch[0]}{arch[1]}")
    dim = shape.head_dim
    if arch[0] == 9 and not (8 <= dim <= 256 and dim % 8 == 0):
        return f"FlashAttention-4 on sm_90 takes head_dim 8..256 in steps of 8, got {dim}"
    if arch[0] == 10 and not ((8 <= dim <= 128 and dim % 8 == 0) or dim == 256):
        return f"FlashAttention-4 on sm_100 takes head_dim 8..128 in steps of 8 or 256, got {dim}"
    return None


def _check_fa4_paged(shape: AttentionShape, phase: str) -> str | None:
    return _pages_reason(shape, phase) or _check_fa4(shape, phase)


# FlashInfer ------------------------------------------------------------------------------------
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def _flashinfer_window_left(shape: AttentionShape) -> int:
    return shape.window[0]


def _flashinfer_workspace(device):
    import torch

    return torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _build_flashinfer(shape: AttentionShape, phase: str, device):
    import flashinfer

    heads, dim, scale = shape.query_heads, shape.head_dim, _scale(shape)
    window_left, causal = _flashinfer_window_left(shape), shape.causal
    if shape.batch > 1:
        return _flashinfer_ragged(shape, device)
    if phase == "decode":
        return lambda q, k, v: flashinfer.single_decode_with_kv_cache(
            q[0, 0], k[0], v[0], use_tensor_cores=True, sm_scale=scale,
            window_left=window_left).view(1, 1, heads, dim)
    return lambda q, k, v: flashinfer.single_prefill_with_kv_cache(
        q[0], k[0], v[0], causal=causal, sm_scale=scale, window_left=window_left).unsqueeze(0)


def _flashinfer_ragged(shape: AttentionShape, device):
    """Batch prefill (decode: one query per request) on the contiguous (B*N, H, d) rows,
    planned here, outside the timed region; FA2's kernels (its FA3 batch kernel would be
    a second JIT build for the same comparison)."""
    import torch
    from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

    batch, heads, kv_heads, dim = shape.batch, shape.query_heads, shape.kv_heads, shape.head_dim
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(_flashinfer_workspace(device), "NHD",
                                                   backend="fa2")
    rows = torch.arange(batch + 1, dtype=torch.int32, device=device)
    wrapper.plan(rows * shape.seqlen_q, rows * shape.seqlen_k, heads, kv_heads, dim,
                 causal=shape.causal, window_left=_flashinfer_window_left(shape),
                 sm_scale=_scale(shape), q_data_type=torch_dtype(shape.dtype))

    def ragged(q, k, v):
        out = wrapper.run(q.view(-1, heads, dim), k.view(-1, kv_heads, dim),
                          v.view(-1, kv_heads, dim))
        return out.view(batch, shape.seqlen_q, heads, dim)

    return ragged


def _build_flashinfer_paged(shape: AttentionShape, phase: str, device):
    import torch
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    batch, heads, kv_heads, dim = shape.batch, shape.query_heads, shape.kv_heads, shape.head_dim
    wrapper = BatchDecodeWithPagedKVCacheWrapper(_flashinfer_workspace(device), "NHD",
                                                 use_tensor_cores=True, backend="fa2")
    table = identity_page_table(shape, device)
    pages = table.shape[1]
    wrapper.plan(torch.arange(0, batch * pages + 1, pages, dtype=torch.int32, device=device),
                 table.flatten(),
                 torch.full((batch,), PAGE_SIZE, dtype=torch.int32, device=device),
                 heads, kv_heads, dim, PAGE_SIZE, window_left=_flashinfer_window_left(shape),
                 sm_scale=_scale(shape), q_data_type=torch_dtype(shape.dtype))

    def paged(q, k, v):
        out = wrapper.run(q.view(batch, heads, dim), (as_pages(k), as_pages(v)))
        return out.view(batch, 1, heads, dim)

    return paged


def _check_flashinfer(shape: AttentionShape, phase: str) -> str | None:
    reason = _importable("flashinfer") or _half_only(shape, "FlashInfer")
    if reason:
        return reason
    if shape.head_dim not in FLASHINFER_HEAD_DIMS:
        return (f"the FlashInfer kernels here take head_dim "
                f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}, got {shape.head_dim}")
    if shape.window[1] != -1 and not shape.causal:
        return (f"FlashInfer takes a left window only (window_left); window={shape.window} "
                f"without causal needs a right bound")
    return _flashinfer_toolchain_reason()


def _flashinfer_toolchain_reason() -> str | None:
    """FlashInfer compiles its kernels on first use unless a prebuilt cache is installed."""
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    nvcc = os.environ.get("FLASHINFER_NVCC") or os.path.join(cuda_home, "bin", "nvcc")
    cxx = os.environ.get("CXX", "c++")
    missing = [what for what, found in ((f"nvcc ({nvcc})", os.path.exists(nvcc)),
                                        ("ninja on PATH", shutil.which("ninja")),
                                        (f"a host compiler ({cxx})", shutil.which(cxx)))
               if not found]
    if missing:
        return (f"FlashInfer JIT-compiles its kernels and needs {' and '.join(missing)} "
                f"(or the flashinfer-jit-cache wheel)")
    return None


def _check_flashinfer_paged(shape: AttentionShape, phase: str) -> str | None:
    return _pages_reason(shape, phase) or _check_flashinfer(shape, phase)


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
             _check_sdpa("FLASH_ATTENTION"), _sdpa_pin("FLASH_ATTENTION"),
             kernels=("pytorch_flash::flash_fwd",)),
    Provider("sdpa_efficient", "PyTorch SDPA pinned to EFFICIENT_ATTENTION (xFormers kernels)",
             _ALL_PHASES, True, "bhsd", "bhsd", _build_sdpa("EFFICIENT_ATTENTION"),
             _check_sdpa("EFFICIENT_ATTENTION"), _sdpa_pin("EFFICIENT_ATTENTION"),
             kernels=("fmha_cutlass",)),
    Provider("sdpa_cudnn", "PyTorch SDPA pinned to CUDNN_ATTENTION", _ALL_PHASES, True, "bhsd",
             "bhsd", _build_sdpa("CUDNN_ATTENTION"), _check_sdpa("CUDNN_ATTENTION"),
             _sdpa_pin("CUDNN_ATTENTION"), kernels=("cudnn",)),
    Provider("sdpa_math", "PyTorch SDPA pinned to MATH (unfused reference path)", _ALL_PHASES,
             False, "bhsd", "bhsd", _build_sdpa("MATH"), _check_sdpa("MATH"), _sdpa_pin("MATH")),
    Provider("flex", "FlexAttention under torch.compile", _ALL_PHASES, True, "bhsd", "bhsd",
             _build_flex, _check_flex),
    Provider("attnlab", "attnlab's Triton forward (attnlab.attention, impl='triton')",
             _ALL_PHASES, True, "bhsd", "bhsd", _build_attnlab, _check_attnlab,
             kernels=("_attn_fwd", "_split_kv_decode")),
    Provider("attnlab_decode", "attnlab's decode API (attnlab.flash_attn_with_kvcache)",
             ("decode",), True, "bshd", "bshd", _build_attnlab_decode, _check_attnlab_decode,
             kernels=("_split_kv_decode",)),
    Provider("attnlab_decode_paged16", "attnlab's decode API on 16-token pages (block_table)",
             ("decode",), True, "bshd", "bshd", _build_attnlab_decode_paged,
             _check_attnlab_decode_paged, kernels=("_split_kv_decode",)),
    Provider("attnlab_decode_fp8", "attnlab's decode API on an e4m3 copy of the cache "
             "(per-(batch, KV head) descales, quantised outside the timed call)",
             ("decode",), True, "bshd", "bshd", _build_attnlab_decode, _check_attnlab_decode,
             kernels=("_split_kv_decode",), storage=FP8_CACHE),
    Provider("flash_attn", "flash-attn 2 (flash_attn_func; flash_attn_with_kvcache for decode)",
             _FORWARD_PHASES, True, "bshd", "bshd", _build_flash_attn, _check_flash_attn),
    Provider("fa4", "FlashAttention-4 (flash_attn.cute.flash_attn_func; compiled on the first "
             "call, the compiled launch timed; decode: one query over the cache, no split-KV)",
             _ALL_PHASES, True, "bshd", "bshd", _build_fa4, _check_fa4,
             kernels=("FlashAttentionForwardSm",)),
    Provider("fa4_paged16", "FlashAttention-4 decode on 16-token pages "
             "(flash_attn_varlen_func page_table)", ("decode",), True, "bshd", "bshd",
             _build_fa4_paged, _check_fa4_paged, kernels=("FlashAttentionForwardSm",)),
    Provider("flashinfer", "FlashInfer (JIT-built on first use): single_prefill_with_kv_cache / "
             "tensor-core single_decode_with_kv_cache at batch 1, the FA2 ragged batch prefill "
             "(planned outside the timed call) at batch > 1",
             _FORWARD_PHASES, True, "bshd", "bshd", _build_flashinfer, _check_flashinfer,
             kernels=("PrefillWithKVCacheKernel", "BatchPrefillWithRaggedKVCacheKernel")),
    Provider("flashinfer_paged16", "FlashInfer tensor-core BatchDecodeWithPagedKVCacheWrapper on "
             "16-token pages (planned outside the timed call)", ("decode",), True, "bshd", "bshd",
             _build_flashinfer_paged, _check_flashinfer_paged,
             kernels=("BatchPrefillWithPagedKVCacheKernel",)),
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


def unproven_kernels(p: Provider, names: Sequence[str]) -> str | None:
    """Why the profiled kernel ``names`` do not prove that ``p``'s own kernel ran, or None
    (also for a provider that names no kernels)."""
    return kernel_proof_failure(p.name, p.kernels, names)


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
        """The call's arguments: (q, k, v) [+ dO] drawn, stored as the provider stores them."""
        drawn = make_inputs(self.shape, self.provider.input_layout, self.device, seed=seed,
                            requires_grad=self.phase == "fwdbwd",
                            grad_layout=self.provider.output_layout)
        storage = self.provider.storage
        return drawn if storage is None else storage.store(*drawn)

    def forward_inputs(self, inputs: tuple) -> tuple:
        """What ``forward`` takes of the call's arguments: all but fwdbwd's dO."""
        return inputs[:-1] if self.phase == "fwdbwd" else inputs


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
