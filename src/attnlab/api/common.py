"""What every public call shares: the implementation choice, ``last_impl`` (per
thread), the option and dtype checks, the Triton kernels' input rules, and the
refusal of flash-attn arguments attnlab has no kernel for."""

from __future__ import annotations

import textwrap
import threading

import torch

from attnlab.checks import (
    check_index_tensor,
    check_instance,
    check_kernel_scales,
    check_softcap,
    check_strided,
    check_window,
)
from attnlab.reference.inputs import check_reference_dtype

IMPLS = ("auto", "triton", "reference")
# Per thread: two threads calling attnlab each see the implementation their own call ran.
_calls = threading.local()


# bench/cpu_reference_speed.py measures it; docs/ecosystem.md keeps the table.
REFERENCE_SPEED = "about 30-200x slower than torch SDPA on the same CPU at N = 1k"
# The one sentence every public call that takes ``impl`` carries (:func:`documents_impl`).
CPU_REFERENCE_NOTE = (
    f"On CPU tensors ``impl=\"auto\"`` runs the float64 reference (:mod:`attnlab.reference`): "
    f"exact, but {REFERENCE_SPEED} (docs/ecosystem.md); ``last_impl()`` then says 'reference'.")

# What each last_impl() value ran, for last_impl(detail=True).
IMPL_DETAILS = {
    "triton": "triton: attnlab's Triton attention kernel (on CPU tensors: Triton's interpreter, "
              "TRITON_INTERPRET=1)",
    "triton-decode": "triton-decode: attnlab's split-KV decode kernel",
    "reference": f"reference: the float64 CPU reference (attnlab.reference), which "
                 f"impl='auto' picks for CPU tensors; exact, but {REFERENCE_SPEED}",
}


def documents_impl(call):
    """Append :data:`CPU_REFERENCE_NOTE` to ``call``'s docstring (one sentence, one home)."""
    note = textwrap.fill(CPU_REFERENCE_NOTE, width=88, initial_indent="    ",
                         subsequent_indent="    ")
    call.__doc__ = f"{call.__doc__.rstrip()}\n\n{note}\n"
    return call


def last_impl(detail: bool = False) -> str | None:
    """Which implementation this thread's most recent attnlab attention call ran: 'triton',
    'triton-decode' (the split-KV kernel: decode-shaped calls and flash_attn_with_kvcache)
    or 'reference' (the float64 CPU reference: what ``impl="auto"`` runs on CPU tensors);
    None before the thread's first call.  ``detail=True`` returns that name followed by
    a sentence saying what it is (e.g. that the reference is ~30-200x slower than SDPA)."""
    impl = getattr(_calls, "impl", None)
    if not isinstance(detail, bool):
        raise TypeError(f"detail must be a bool, got {type(detail).__name__}")
    return IMPL_DETAILS[impl] if detail and impl is not None else impl


def _record_impl(impl: str) -> None:
    """What :func:`last_impl` answers in this thread (every entry point sets it here)."""
    _calls.impl = impl


def _check_reference_dtypes(**tensors: torch.Tensor) -> None:
    """Refuse (TypeError with the allowed list) a dtype the float64 reference would only
    pretend to compute in: an int, bool, complex or fp8 tensor cast to float64."""
    for name, tensor in tensors.items():
        check_reference_dtype(name, tensor)


def _check_options(window_size, softcap) -> tuple[tuple[int, int], float]:
    """window_size and softcap as attnlab.checks reads them (NumPy and 0-d tensors too)."""
    return check_window(window_size, name="window_size"), check_softcap(softcap, name="softcap")


def _check_tensor(name: str, tensor) -> torch.Tensor:
    """A dense torch.Tensor argument (q, k, v, a cache): TypeError naming it for another
    type, a sparse or a nested tensor."""
    return check_strided(name, check_instance(name, tensor, torch.Tensor))


def _check_has_data(**tensors: torch.Tensor) -> None:
    """ValueError naming a meta tensor where attnlab must read or write values (a kernel
    launch, the KV cache's append and gather): a meta tensor has none."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: this call reads its values, "
                             "and a meta tensor has none")


def check_impl(impl) -> str:
    """``impl`` if it names an implementation, else the ValueError listing them."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {', '.join(IMPLS)}")
    return impl


def _resolve_impl(impl: str, q: torch.Tensor) -> str:
    check_impl(impl)
    if impl == "auto":
        return "triton" if q.is_cuda else "reference"
    if impl == "triton" and not q.is_cuda:
        from attnlab.kernels.forward import kernel_is_interpreted

        if not kernel_is_interpreted():
            raise ValueError(
                "impl='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
                "before attnlab is imported (Triton's interpreter); use impl='reference' on CPU")
    return impl


def _check_triton_inputs(q, head_dim: int, scale: float, softcap: float,
                         scale_name: str = "softmax_scale", dtypes=None) -> None:
    """What every Triton kernel needs of q and the scalars: fp16/bf16 (or ``dtypes``),
    head_dim <= 256, data (not meta), and a scale and softcap its fp32 arithmetic
    represents (:func:`attnlab.checks.check_kernel_scales`)."""
    from attnlab.kernels.forward import MAX_HEAD_DIM, SUPPORTED_DTYPES

    allowed = SUPPORTED_DTYPES if dtypes is None else dtypes
    if q.dtype not in allowed:
        raise TypeError(f"the Triton kernel takes dtype {' or '.join(map(str, allowed))}, "
                        f"got {q.dtype}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
    _check_has_data(q=q)
    check_kernel_scales(scale, softcap, head_dim, scale_name=scale_name)


def _triton_ready(q, k, v, head_dim: int, scale: float, softcap: float,
                  scale_name: str = "softmax_scale", dtypes=None):
    """q, k, v as the Triton kernels take them (:func:`_check_triton_inputs`; unit last
    stride)."""
    _check_triton_inputs(q, head_dim, scale, softcap, scale_name, dtypes)
    # The kernel needs unit stride along head_dim; anything else costs one copy.
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def _refuse_unsupported(*, dropout_p=0.0, alibi_slopes=None) -> None:
    """flash-attn arguments attnlab has no kernel for: refused, never ignored."""
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p must be 0.0: attnlab has no dropout (got {dropout_p})")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes must be None: attnlab does not support ALiBi")


# Pages hold a multiple of 16 tokens: the kernels' smallest key tile (tl.dot's K).
PAGE_MULTIPLE = 16


def _check_page_table(block_table, pages: torch.Tensor, batch: int, device,
                      pages_name: str = "k_cache") -> tuple[torch.Tensor, int]:
    """A paged cache's block table (batch, max_pages) int32, as the kernels read it, and
    the capacity it gives each sequence (max_pages x page size).  Its values are checked
    where the kernels read them (kernels/index_checks.py)."""
    block_table = check_index_tensor("block_table", block_table, device=device)
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be (batch, max_pages) = ({batch}, >= 1), got "
                         f"{tuple(block_table.shape)}")
    page_size = pages.shape[1]
    if page_size % PAGE_MULTIPLE:
        raise ValueError(f"the paged cache's page size ({pages_name}.shape[1]) must be a "
                         f"multiple of {PAGE_MULTIPLE}, got {page_size}")
    return block_table, block_table.shape[1] * page_size


def _check_per_sequence(name: str, t, batch: int, device) -> torch.Tensor:
    """A (batch,) index tensor as the kernel reads it (:func:`attnlab.checks.check_index_tensor`)."""
    t = check_index_tensor(name, t, device=device)
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    return t

