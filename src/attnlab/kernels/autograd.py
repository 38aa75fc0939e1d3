"""Autograd glue for the Triton kernels: the custom ops and the differentiable entry point.

``attnlab::flash_fwd`` and ``attnlab::flash_bwd`` are ``torch.library`` custom ops:
``torch.compile(fullgraph=True)`` sees each as one opaque node, and
``register_autograd`` connects them.  Eager training runs the same two bodies
through a plain ``torch.autograd.Function`` (the op dispatcher's host cost is as long
as the GPU's work at short sequences, see :func:`attention_forward`), so compiled and
eager training take the same kernels.  The forward saves q, k, v, O and LSE only
(never S or P): the backward recomputes the probabilities from them, so the extra
memory is O(N * d).

Why ``custom_op`` and not ``torch.library.triton_op`` + ``wrap_triton`` (issue #15):
a ``triton_op`` body is traced by torch.compile with fake tensors, so every kernel
launch inside it (the forward launcher's too) must go through ``wrap_triton``; under
Triton's CPU interpreter (``TRITON_INTERPRET=1``, the test suite's mode)
``wrap_triton`` hands the interpreted kernel back unwrapped, and tracing it with fake
tensors fails.  ``custom_op`` works the same on the CPU interpreter and on the GPU.
"""

from __future__ import annotations

import torch

from attnlab.kernels.backward import flash_backward
from attnlab.kernels.forward import flash_forward

# ---------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------


def _varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> dict:
    """The varlen keywords for the launchers, only when the call is varlen (layout thd)."""
    if cu_seqlens_q is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
            "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k}


def _lse_shape(q: torch.Tensor, layout: str) -> tuple[int, ...]:
    if layout == "thd":  # varlen: (heads, total_q)
        return (q.shape[1], q.shape[0])
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return tuple(q.shape[:3])


def _flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, deterministic: bool,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(q, k, v, layout=layout, scale=scale, causal=causal,
                         window=(window_left, window_right), softcap=softcap,
                         **_varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


flash_fwd_op = torch.library.custom_op("attnlab::flash_fwd", mutates_args=())(_flash_fwd)


@flash_fwd_op.register_fake
def _(q, k, v, layout, scale, causal, window_left, window_right, softcap, deterministic,
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(_lse_shape(q, layout), dtype=torch.float32))


def _flash_bwd(
    dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, layout: str, scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, deterministic: bool,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(dout, q, k, v, out, lse, layout=layout, scale=scale, causal=causal,
                          window=(window_left, window_right), softcap=softcap,
                          deterministic=deterministic, dlse=dlse,
                          **_varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k))


flash_bwd_op = torch.library.custom_op("attnlab::flash_bwd", mutates_args=())(_flash_bwd)


@flash_bwd_op.register_fake
def _(dout, dlse, q, k, v, out, lse, layout, scale, causal, window_left, window_right, softcap,
      deterministic, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


_OPTION_NAMES = ("layout", "scale", "causal", "window_left", "window_right", "softcap",
                 "deterministic")


def _setup_forward_context(ctx, inputs, output):
    q, k, v, *options, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = inputs
    out, lse = output
    # q, k, v, O, LSE: the only saved state.  S and P are recomputed in the backward.
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = dict(zip(_OPTION_NAMES, options, strict=True))
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)


def _gradients(ctx, grad_out, grad_lse, backward):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if grad_out is None:  # only the LSE was used downstream
        grad_out = torch.zeros_like(out)
    dq, dk, dv = backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.options.values(),
                          cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens)
    return (dq, dk, dv) + (None,) * 11


def _forward_backward(ctx, grad_out, grad_lse):
    return _gradients(ctx, grad_out, grad_lse, flash_bwd_op)


flash_fwd_op.register_autograd(_forward_backward, setup_context=_setup_forward_context)


def _setup_backward_context(ctx, inputs, output):
    pass


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "attnlab's attention backward is not differentiable (no double backward): "
        "second derivatives through attnlab.kernels are not implemented")


flash_bwd_op.register_autograd(_no_double_backward, setup_context=_setup_backward_context)


class _EagerFlashAttention(torch.autograd.Function):
    """The custom ops' forward and backward bodies without the op dispatcher, for eager
    training: on the H200 the two custom-op calls of one forward+backward cost ~0.5 ms
    of host time each (cProfile, ``bench/backward_h200.py --phases profile``), which at
    N = 1k was as long as the GPU's work.  torch.compile takes the ops instead."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _flash_fwd(*inputs)
        _setup_forward_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _gradients(ctx, grad_out, grad_lse, _EagerFlashBackward.apply)


class _EagerFlashBackward(torch.autograd.Function):
    """The backward kernels as a node of their own, so a double backward raises the
    ops' clear error instead of silently returning nothing."""

    @staticmethod
    def forward(ctx, *inputs):
        return _flash_bwd(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        return _no_double_backward(ctx, *grads)


# ---------------------------------------------------------------------------
# The differentiable entry point the public API calls
# ---------------------------------------------------------------------------


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str, scale: float,
    causal: bool, window: tuple[int, int], softcap: float, deterministic: bool = False,
    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of already-validated tensors, differentiable in q, k, v (and through LSE).

    Goes through the custom ops when torch.compile is tracing, through the same bodies
    as a plain autograd.Function when an eager call needs a gradient, and launches the
    kernel directly for a plain inference call: the custom-op dispatcher's host cost
    (~40 us per forward measured on the CPU, ~0.5 ms per op in a training step on the
    H200) dominates short sequences.  ``deterministic`` only affects the backward (see
    :func:`attnlab.kernels.backward.flash_backward`).
    """
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                              or v.requires_grad)
    inputs = (q, k, v, layout, scale, causal, window[0], window[1], softcap, deterministic,
              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if torch.compiler.is_compiling():
        return flash_fwd_op(*inputs)
    if needs_grad:
        return _EagerFlashAttention.apply(*inputs)
    return flash_forward(q, k, v, layout=layout, scale=scale, causal=causal, window=window,
                         softcap=softcap,
                         **_varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
