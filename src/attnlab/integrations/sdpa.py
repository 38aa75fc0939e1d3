"""PyTorch SDPA: run plain ``F.scaled_dot_product_attention`` calls on attnlab's kernels.

The way FA3 and FA4 plug into SDPA (``torch.nn.attention.register_flash_attention_impl``,
torch 2.11 and 2.13 have it): attnlab registers itself under the name ``"attnlab"``,
and activating it replaces the kernel behind SDPA's FLASH_ATTENTION backend::

    import attnlab.integrations.sdpa as attnlab_sdpa
    from torch.nn.attention import activate_flash_attention_impl

    attnlab_sdpa.register()
    activate_flash_attention_impl("attnlab")     # or: attnlab_sdpa.activate()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # attnlab's kernel
    torch.nn.attention.restore_flash_attention_impl()                # back to PyTorch's

What runs where:

* **Which calls.**  Exactly the calls SDPA sends to its flash backend: fp16/bf16 CUDA
  tensors, no ``attn_mask``, head dim <= 256 (SDPA's own eligibility rules; ineligible
  calls go to SDPA's other backends as without attnlab).  Activation moves
  FLASH_ATTENTION to the front of SDPA's priority order (restored on
  ``restore_flash_attention_impl``), because on the H200 SDPA otherwise prefers cuDNN
  and attnlab would never be asked.  ``with sdpa_kernel(SDPBackend.FLASH_ATTENTION)``
  makes an ineligible call raise instead of running elsewhere.
* **Forward and backward.**  The forward is :func:`attnlab.attention` (``impl="triton"``),
  registered at the op's Autograd key, so attnlab's own differentiable op records the
  graph and ``.backward()`` runs attnlab's backward kernels; the same function is
  registered at the backend key, so calls under ``torch.inference_mode()`` (which
  skips Autograd keys) run attnlab too.
* **Causal.**  SDPA's ``is_causal`` is top-left aligned (query i sees key j iff
  j <= i); attnlab's ``causal`` is bottom-right.  They agree when seqlen_q = seqlen_k.
  With seqlen_q > seqlen_k, top-left is attnlab's window with right edge
  seqlen_q - seqlen_k and no causal flag (j <= i + (seqlen_k - seqlen_q) + right = i).
  With seqlen_q < seqlen_k, keys j >= seqlen_q are visible to no query, so the call is
  square causal attention over the first seqlen_q keys (their gradients are zero).
  Every top-left case is expressed exactly (by ``attnlab.attention(is_causal=...)``);
  nothing falls back.  (SDPA's CUDA
  selection itself gives its flash backend no causal call with seqlen_q != seqlen_k;
  those run on SDPA's other backends unless the flash op is called directly.)
* **Refused** (NotImplementedError, never another backend): ``dropout_p > 0``,
  ``return_debug_mask=True``, and on the CPU an ``attn_mask``.
* **CPU.**  Only under ``TRITON_INTERPRET=1`` (Triton's interpreter, the test suite's
  mode) does activation also take SDPA's CPU flash backend; otherwise CPU calls stay
  PyTorch's, because attnlab's kernels need CUDA or the interpreter.

Where the installed torch lacks the registry, :func:`register` raises RuntimeError
naming the torch version.  Eager calls only: ``torch.compile`` of a model that calls
SDPA is not covered here (compile attnlab's own API instead).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

NAME = "attnlab"
# The ops behind SDPA's flash backend, per device type.
_CUDA_OP = "_scaled_dot_product_flash_attention"
_CPU_OP = "_scaled_dot_product_flash_attention_for_cpu"


def _registry():
    import torch.nn.attention as attention

    missing = [name for name in ("register_flash_attention_impl",
                                 "activate_flash_attention_impl")
               if not hasattr(attention, name)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.{missing[0]}: plugging "
            f"attnlab into F.scaled_dot_product_attention needs a torch with the flash "
            f"attention registry (torch 2.11 and 2.13 have it); attnlab.attention works "
            f"without it")
    return attention


def register() -> None:
    """Register attnlab under ``"attnlab"`` with SDPA's flash-attention registry (no
    activation: ``activate_flash_attention_impl("attnlab")`` does that)."""
    _registry().register_flash_attention_impl(NAME, register_fn=_install)


def activate() -> None:
    """Register and activate: plain SDPA calls run attnlab until
    ``torch.nn.attention.restore_flash_attention_impl()``."""
    register()
    _registry().activate_flash_attention_impl(NAME)


# ----- the kernels SDPA's flash backend calls -----------------------------------------------
def _refuse(dropout_p: float, what: str) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(f"attnlab's SDPA implementation has no dropout (got "
                                  f"dropout_p={dropout_p}); {what}")


def _attention(q, k, v, is_causal: bool, scale):
    from attnlab import attention

    # attention() takes SDPA's top-left is_causal itself (see the module doc).
    return attention(q, k, v, is_causal=is_causal, scale=scale,
                     enable_gqa=q.shape[1] != k.shape[1], impl="triton", return_lse=True)


def _cuda_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                *, scale=None):
    what = "use dropout_p=0 or another SDPA backend"
    _refuse(dropout_p, what)
    if return_debug_mask:
        raise NotImplementedError("attnlab's SDPA implementation returns no debug mask "
                                  "(return_debug_mask=True)")
    out, lse = _attention(query, key, value, is_causal, scale)
    # The op's other outputs describe the RNG and varlen state of PyTorch's kernel; with
    # no dropout and dense inputs they are placeholders, as FA3's registration returns.
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, query.shape[2], key.shape[2], rng_state, unused, debug_mask


def _cpu_flash(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
               scale=None):
    _refuse(dropout_p, "use dropout_p=0")
    if attn_mask is not None:
        raise NotImplementedError("attnlab's SDPA implementation takes no attn_mask (only "
                                  "is_causal); restore PyTorch's with "
                                  "torch.nn.attention.restore_flash_attention_impl()")
    return _attention(query, key, value, is_causal, scale)


@dataclass
class _Handle:
    """What activation changed; ``remove()`` undoes it (the registry calls it)."""

    library: object | None
    previous_priority: list[int] | None

    def remove(self) -> None:
        if self.previous_priority is not None:
            torch._C._set_sdp_priority_order(self.previous_priority)
            self.previous_priority = None
        self.library = None  # dropping the Library deregisters its kernels


def _flash_first() -> list[int]:
    """Put FLASH_ATTENTION first in SDPA's priority order (the others keep theirs and
    stay enabled); returns the order it replaced."""
    from torch.nn.attention import SDPBackend

    if torch.cuda.is_available():
        # SDPA's CUDA selection writes its own default order (cuDNN first on Hopper)
        # the first time it runs in a process, over any order set before.  Measured on
        # the H200 (bench/sdpa_route_check.py --activate-first, 2026-12-01 session 2: run 1
        # found it, run 2 verified this): activation before the process's first SDPA call left every call
        # on cuDNN.  One selection on tiny tensors (no kernel runs) makes that happen now.
        tiny = torch.zeros((1, 1, 1, 64), dtype=torch.float16, device="cuda")
        torch._fused_sdp_choice(tiny, tiny, tiny)
    previous = [int(b) for b in torch._C._get_sdp_priority_order()]
    flash = int(SDPBackend.FLASH_ATTENTION)
    torch._C._set_sdp_priority_order([flash] + [b for b in previous if b != flash])
    return previous


def _install() -> _Handle:
    from torch.library import Library

    from attnlab.kernels._primitives import kernel_is_interpreted

    library = Library("aten", "IMPL")
    kernels = [(_CUDA_OP, _cuda_flash, key) for key in ("AutogradCUDA", "CUDA")]
    if kernel_is_interpreted():
        kernels += [(_CPU_OP, _cpu_flash, key) for key in ("AutogradCPU", "CPU")]
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": replacing it is the point.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for op, kernel, key in kernels:
            library.impl(op, kernel, key)
    # The priority is set directly, not through the sdpa_kernel context manager: the
    # registry keeps this handle for the whole process, and a context manager left open
    # is finalised at interpreter exit, when torch._C is already gone.
    return _Handle(library, _flash_first())
