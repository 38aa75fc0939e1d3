"""The public attention calls: validate once, convert layout once, dispatch.

Two layouts, named at the boundary:

* ``bshd`` — (batch, seqlen, heads, head_dim), flash-attn's ``flash_attn_func``;
* ``bhsd`` — (batch, heads, seqlen, head_dim), PyTorch SDPA's layout.

``impl`` is an explicit choice: ``"triton"`` (our kernel), ``"reference"`` (the
CPU oracle, computed in float64), ``"auto"`` (triton on CUDA tensors, reference
on CPU tensors).  Nothing falls back silently; ``last_impl()`` says which ran.

Causal masks are aligned **bottom-right** in both APIs, as in flash-attn >= 2.1:
query i sees key j iff ``j <= i + seqlen_k - seqlen_q``.  SDPA's own
``is_causal=True`` is aligned top-left instead.  For seqlen_q=2, seqlen_k=5::

    attnlab causal (bottom-right)     SDPA is_causal (top-left)
        k: 0 1 2 3 4                      k: 0 1 2 3 4
    q0:    1 1 1 1 0                  q0:    1 0 0 0 0
    q1:    1 1 1 1 1                  q1:    1 1 0 0 0

A query row that sees no key (possible with bottom-right causal when
seqlen_q > seqlen_k, or with a window) outputs zeros and LSE = -inf.

One module per family of calls: :mod:`.common` (the implementation choice,
``last_impl``, the checks every call shares), :mod:`.dense` (``attention``,
``flash_attn_func`` and its packed forms), :mod:`.varlen` (layout thd),
:mod:`.kvcache` (``flash_attn_with_kvcache``), :mod:`.merge` (FlashInfer's ``merge_state``,
``merge_states``), :mod:`.fa3` (FlashAttention-3's interface, imported as
``attnlab.flash_attn_interface``; not re-exported here: its names are FA3's and would
shadow the FA2 calls above).
"""

from attnlab.api.common import last_impl
from attnlab.api.dense import (
    attention,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
)
from attnlab.api.kvcache import check_kvcache_indices, flash_attn_with_kvcache
from attnlab.api.merge import merge_state, merge_states
from attnlab.api.varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

# The public calls; the package root re-exports exactly these.
__all__ = [
    "attention",
    "check_kvcache_indices",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "last_impl",
    "merge_state",
    "merge_states",
]
