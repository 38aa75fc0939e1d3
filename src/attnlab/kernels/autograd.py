"""Autograd glue for the Triton kernels: the custom ops and the differentiable entry point.

``attnlab::flash_fwd`` and ``attnlab::flash_bwd`` are ``torch.library.triton_op``s
(issue #15), connected by ``register_autograd``.  Under ``torch.compile`` with compiled
kernels and static shapes each op decomposes into its launcher's ``wrap_triton``
launches, so Inductor compiles the Triton kernels themselves into its graph; the
forward's Gluon sm_90 kernel cannot be traced, so there the forward takes the Triton
kernel (``attnlab.kernels.dispatch.forward_config``).  Under Triton's CPU
interpreter (``TRITON_INTERPRET=1``, the test suite's mode) and with symbolic sizes
(dynamic shapes) each op stays one opaque node with an explicit shape function
(:func:`_decompose_only_where_capturable`), whose body runs the same kernels as an
eager call.  Eager training runs the same two bodies through a plain
``torch.autograd.Function`` (the op dispatcher's host cost is as long as the GPU's
work at short sequences, see :func:`attention_forward`).  The forward saves q, k, v,
O and LSE only (never S or P): the backward recomputes the probabilities from them, so
the extra memory is O(N * d).
"""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from attnlab.inputs import layout_named
from attnlab.kernels._primitives import INTERPRETED
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


def _has_symbolic_sizes(values) -> bool:
    return any(isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool)
               for value in values
               for x in ((*value.shape, *value.stride()) if isinstance(value, torch.Tensor)
                         else (value,)))


def _decompose_only_where_capturable(op, fake) -> None:
    """Keep ``op`` one opaque node (``fake`` its shape function) where its launches cannot
    be captured into a graph; elsewhere keep triton_op's decomposition for Inductor.

    triton_op registers its body as the fake impl and runs it under FunctionalTensorMode
    so that each ``wrap_triton`` launch becomes a graph node.  Two cases cannot be traced
    that way: interpreted kernels, which ``wrap_triton`` hands back unwrapped, so the
    interpreter would run on fake tensors; and symbolic sizes, from which the launchers
    cannot choose tiles (``AttentionShape`` and the config tables take ints).  There the
    mode dispatches the op itself, as triton_op does when export disables decomposition.
    """
    op.register_fake(fake)
    # triton_op's own rule (a private attribute, there in torch 2.11 and 2.13 alike).
    decompose = op._torch_dispatch_fns[FunctionalTensorMode]

    def functional(mode, func, types, args, kwargs):
        if INTERPRETED or _has_symbolic_sizes((*args, *kwargs.values())):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        return decompose(mode, func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, functional)


def _lse_shape(q: torch.Tensor, layout: str) -> tuple[int, ...]:
    lay = layout_named(layout)
    rows = q.shape[0] if lay.is_varlen else lay.seqlen(q)
    return lay.lse_shape(q.shape[0], lay.heads(q), rows)


def _flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, scale: float,
    causal: bool, window_left: int, window_right: int, softcap: float, deterministic: bool,
    cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None, max_seqlen_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(q, k, v, layout=layout, scale=scale, causal=causal,
                         window=(window_left, window_right), softcap=softcap,
                         **_varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


flash_fwd_op = torch.library.triton_op("attnlab::flash_fwd", mutates_args=())(_flash_fwd)


def _flash_fwd_fake(q, k, v, layout, scale, causal, window_left, window_right, softcap,
                    deterministic, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(_lse_shape(q, layout), dtype=torch.float32))


_decompose_only_where_capturable(flash_fwd_op, _flash_fwd_fake)


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


flash_bwd_op = torch.library.triton_op("attnlab::flash_bwd", mutates_args=())(_flash_bwd)


def _flash_bwd_fake(dout, dlse, q, k, v, out, lse, layout, scale, causal, window_left,
                    window_right, softcap, deterministic, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q, max_seqlen_k):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


_decompose_only_where_capturable(flash_bwd_op, _flash_bwd_fake)


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
    return backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.options.values(),
                    cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens)


def _forward_backward(ctx, grad_out, grad_lse):
    # dq, dk, dv, then None for the op's eleven other arguments.
    return (*_gradients(ctx, grad_out, grad_lse, flash_bwd_op), *(None,) * 11)


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
    N = 1k was as long as the GPU's work.  torch.compile takes the ops instead.

    ``apply(q, k, v, cu_seqlens_q, cu_seqlens_k, options)``: the ops' non-tensor
    arguments travel as one tuple, because Function.apply and the engine handle every
    argument (and every returned gradient) one by one: six arguments instead of the ops'
    fourteen cost ~10 us less per step on the CPU (``apply`` with 14 vs 6 arguments)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, options):
        inputs = (q, k, v, *options[:7], cu_seqlens_q, cu_seqlens_k, *options[7:])
        output = _flash_fwd(*inputs)
        _setup_forward_context(ctx, inputs, output)
        # An unused LSE's gradient arrives as None, not as zeros the engine would
        # allocate and fill on every step (and the backward then read as dLSE).
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        # Grad mode is on here only under create_graph=True: then the backward becomes a
        # node of its own, so that a double backward raises the ops' clear error instead
        # of silently returning nothing.  Otherwise that node would be host time for
        # nothing (an autograd.Function call on the H200's host, per step).
        backward = _EagerFlashBackward.apply if torch.is_grad_enabled() else _flash_bwd
        # dq, dk, dv, then None for cu_seqlens_q, cu_seqlens_k and the options.
        return (*_gradients(ctx, grad_out, grad_lse, backward), None, None, None)


class _EagerFlashBackward(torch.autograd.Function):
    """The backward kernels as a node of their own (under create_graph=True)."""

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
        return _EagerFlashAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                          (*inputs[3:10], max_seqlen_q, max_seqlen_k))
    return flash_forward(q, k, v, layout=layout, scale=scale, causal=causal, window=window,
                         softcap=softcap,
                         **_varlen_options(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
