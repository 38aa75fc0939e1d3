"""Which kernel runs a call: the one module that decides, for every launcher.

Three choices, each taken from a committed measurement, never from a guess:

* **the decode route** (:func:`routes_to_decode`, asked by ``api.dense``): a short query
  against long keys, with no gradient wanted, runs the split-KV decode kernel
  (``kernels/decode.py``) instead of the forward;
* **the forward** (:func:`forward_config`, asked by ``kernels.forward``): the Gluon sm_90
  kernel where ``sm90_dispatch.json`` says it measured faster, else the Triton kernel;
* **the backward's dK/dV** (:func:`dkdv_config`, asked by ``kernels.backward``): the Gluon
  sm_90 dK/dV kernel where ``sm90_backward_dispatch.json`` says so, else the Triton one.

Each Gluon kernel is one :class:`GluonKernel`: its module (imported only where
``kernels/_compat.py`` recognises this Triton's Gluon), its table and its config type; a
table is read once, for the installed Triton (``_sm90.dispatch_entries``).  A traced call
(torch.compile decomposing the custom ops for Inductor) keeps the Triton kernels: the
Gluon kernels build TMA descriptors from ``data_ptr()``, which fake tensors lack.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

from attnlab.inputs import layout_named
from attnlab.kernels._compat import gluon_refusal
from attnlab.kernels._primitives import launch_is_traced
from attnlab.kernels.configs import length_bucket

# Decode route: the prefill kernel tiles 64-128 query rows per program, one program per
# head, so with a few query rows against many keys it runs one mostly padded row block
# per head and leaves SMs idle; the split-KV kernel packs a KV group's heads and splits
# the keys.
DECODE_MAX_SEQLEN_Q = 64
DECODE_MIN_SEQLEN_K = 256


def routes_to_decode(*, seqlen_q: int, seqlen_k: int, needs_grad: bool) -> bool:
    """Whether a dense call runs the split-KV decode kernel: ``seqlen_q`` at most
    :data:`DECODE_MAX_SEQLEN_Q` against at least :data:`DECODE_MIN_SEQLEN_K` (and four
    times ``seqlen_q``) keys.  Never when a gradient is needed (that kernel has no
    backward)."""
    return (not needs_grad and seqlen_q <= DECODE_MAX_SEQLEN_Q
            and seqlen_k >= max(DECODE_MIN_SEQLEN_K, 4 * seqlen_q))


@dataclass(frozen=True)
class GluonKernel:
    """One Gluon sm_90 kernel as the dispatcher sees it: where it lives (its ``supports``,
    ``plan_launch``, ``DEFAULT_CONFIGS``), the table of buckets it won, its config type."""

    module: str
    table_file: str
    config_type: str

    def kernel_module(self):
        return importlib.import_module(self.module)

    def table(self) -> dict:
        """(head_dim, causal, length bucket) -> config, where it measured faster."""
        if self not in _TABLES:
            from attnlab.kernels._sm90 import dispatch_entries

            config = getattr(self.kernel_module(), self.config_type)
            _TABLES[self] = {(e["head_dim"], e["causal"], e["bucket"]): config(**e["config"])
                             for e in dispatch_entries(self.table_file)}
        return _TABLES[self]

    def bucket_config(self, q, k, *, layout: str, causal: bool):
        """The table's config for this call's (head_dim, causal, length) bucket, or None."""
        lay = layout_named(layout)
        bucket = length_bucket(max(lay.seqlen(q), lay.seqlen(k)))
        return self.table().get((q.shape[-1], causal, bucket))


FORWARD_SM90 = GluonKernel("attnlab.kernels.forward_sm90", "sm90_dispatch.json", "Sm90Config")
DKDV_SM90 = GluonKernel("attnlab.kernels.backward_sm90", "sm90_backward_dispatch.json",
                        "Sm90BackwardConfig")
# Read once per process; table_override() swaps one in for a measurement.
_TABLES: dict[GluonKernel, dict] = {}


@contextlib.contextmanager
def table_override(kernel: GluonKernel, table: dict):
    """Dispatch by ``table`` instead of the committed one inside the block (the benches
    that time a candidate table); plans built inside keep their choice."""
    saved = kernel.table()
    _TABLES[kernel] = table
    try:
        yield
    finally:
        _TABLES[kernel] = saved


def _gluon_usable(q) -> bool:
    return q.is_cuda and not launch_is_traced(q) and gluon_refusal() is None


def forward_config(q, k, v, *, layout: str, causal: bool, window, softcap: float):
    """The Gluon sm_90 forward's config for this call, or None: the Triton kernel runs it.

    Only buckets measured on the H200 are in the table; tensors past 2^31 elements are
    fine (TMA's descriptors and the O/LSE offsets are 64-bit: ``bench/sanitize_h200.py
    --phases big``)."""
    if layout_named(layout).is_varlen or not _gluon_usable(q):
        return None
    config = FORWARD_SM90.bucket_config(q, k, layout=layout, causal=causal)
    supports = FORWARD_SM90.kernel_module().supports
    if config is None or not supports(q, k, v, causal, window, softcap, config)[0]:
        return None
    return config


def dkdv_config(q, k, v, dout, *, layout: str, causal: bool, window, softcap: float,
                requested=None, use_table: bool = True):
    """(the Gluon dK/dV kernel's config, whether dO must be copied for it, the dO it
    reads) when that kernel computes this call's dK, dV, else None: the Triton kernel does.

    ``requested`` (an ``Sm90BackwardConfig``) forces it, and a call it cannot compute is
    then a ValueError naming why; otherwise (``use_table``) the committed table decides."""
    if requested is None and not use_table:
        return None
    if layout_named(layout).is_varlen or not _gluon_usable(q):
        if requested is not None:
            raise ValueError(f"dkdv_sm90={requested} needs a CUDA call outside torch.compile, "
                             f"layout 'bshd' or 'bhsd' and a Triton whose Gluon attnlab "
                             f"knows ({gluon_refusal() or 'this one is'})")
        return None
    from attnlab.kernels._sm90 import tma_aligned

    config = requested or DKDV_SM90.bucket_config(q, k, layout=layout, causal=causal)
    if config is None:
        return None
    # An expanded dO (out.sum().backward() gives stride 0) is no TMA operand: one copy.
    copy_dout = not tma_aligned(dout)
    kernel_dout = dout.contiguous() if copy_dout else dout
    ok, reason = DKDV_SM90.kernel_module().supports(q, k, v, kernel_dout, layout=layout,
                                                    window=window, softcap=softcap,
                                                    config=config)
    if not ok:
        if requested is not None:
            raise ValueError(f"dkdv_sm90={config.name()} cannot compute this call: {reason}")
        return None
    return config, copy_dout, kernel_dout
