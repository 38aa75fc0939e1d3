"""Hugging Face transformers: run a decoder's attention through attnlab.

One line registers attnlab under the name ``"attnlab"``; a model then selects it
like any built-in implementation::

    import attnlab.integrations.transformers as attnlab_hf

    attnlab_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnlab")

Layout: transformers hands over (batch, heads, seqlen, head_dim) and expects
(batch, seqlen, heads, head_dim) back.  Causal is bottom-right, which is what a
KV-cached decode step needs (the new token sees the whole cache).

Ragged batches go through :func:`attnlab.flash_attn_varlen_func`, as with
flash-attn in transformers:

* a **padded batch** (a 2-D attention mask with zeros, left or right padding):
  the real tokens are gathered into (total_tokens, heads, head_dim), attended per
  sequence, and scattered back; padded query rows come back as zeros;
* a **padding-free packed batch** (batch 1, ``cu_seq_lens_q/k`` from transformers'
  ``DataCollatorWithFlattening``, or position ids that restart at each document):
  one varlen call with those boundaries, so no document attends to another.

Under autocast, q, k and v that arrive in float32 (Qwen3 normalises q and k in
float32, so they come out float32 while v is the autocast dtype) run in the autocast
dtype, as transformers' own flash-attention path does; outside autocast the dtypes
are the model's and a float32 model is refused by the kernels' dtype check.

Refused with NotImplementedError rather than run without them: dropout, and a mask
that is not a 2-D padding mask (a 4-D additive mask comes from another mask
function: :func:`register` installs the matching one).
"""

from __future__ import annotations

import torch

from attnlab.api import attention, flash_attn_varlen_func
from attnlab.api.common import check_impl

NAME = "attnlab"


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """int32 (batch + 1,) cumulative lengths, the varlen call's boundaries."""
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _unpad(states: torch.Tensor, valid: torch.Tensor):
    """(batch, seqlen, heads, dim) -> the valid tokens as (total, heads, dim), with their
    flat indices and cu_seqlens."""
    batch, seqlen, heads, dim = states.shape
    indices = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    tokens = states.reshape(batch * seqlen, heads, dim).index_select(0, indices)
    return tokens, indices, _cumulative(valid.sum(dim=1, dtype=torch.int32))


def _padded_attention(query, key, value, mask, options):
    """Attention of a padded batch through varlen; (batch, q_len, heads, dim) out."""
    if mask.dim() != 2:
        raise NotImplementedError(
            f"attnlab attention takes a 2-D padding mask (batch, kv_len), got a "
            f"{mask.dim()}-D mask: register the model with attnlab.integrations.transformers."
            f"register(), which installs the matching mask function")
    valid_k = mask.to(torch.bool)
    # With a static cache, k/v can be longer than the mask: the slots past it are unused.
    key, value = key[:, :valid_k.shape[1]], value[:, :valid_k.shape[1]]
    q_len = query.shape[1]
    valid_q = valid_k[:, -q_len:]  # the queries are the last q_len positions
    q, indices_q, cu_seqlens_q = _unpad(query, valid_q)
    k, _, cu_seqlens_k = _unpad(key, valid_k)
    v, _, _ = _unpad(value, valid_k)
    # One host read of the lengths, which flash_attn_varlen_func validates anyway.
    max_q = int(valid_q.sum(dim=1).max())
    max_k = int(valid_k.sum(dim=1).max())
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, **options)
    batch, _, heads, dim = query.shape
    padded = out.new_zeros((batch * q_len, heads, dim))
    padded.index_copy_(0, indices_q, out)
    return padded.view(batch, q_len, heads, dim)


def _packed_boundaries(position_ids: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                       kwargs: dict):
    """(cu_seqlens, max_seqlen) of a padding-free packed batch, or None for a plain one."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        return cu_q, cu_k, int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    seqlen = query.shape[1]
    if position_ids is None or query.shape[0] != 1 or seqlen == 1 or key.shape[1] != seqlen:
        return None
    positions = position_ids.reshape(-1)
    if positions.shape[0] != seqlen:
        return None
    # A document starts wherever the positions stop increasing (transformers' rule).
    starts = torch.nonzero(positions[1:] <= positions[:-1], as_tuple=True)[0] + 1
    if starts.numel() == 0:  # one increasing run: an ordinary sequence
        return None
    edges = torch.cat((starts.new_zeros(1), starts, starts.new_full((1,), seqlen)))
    cu = edges.to(torch.int32)
    longest = int((edges[1:] - edges[:-1]).max())
    return cu, cu, longest, longest


def _autocast_dtype(query, key, value):
    """q, k, v in the autocast dtype where autocast is on and some of them are float32
    (transformers' flash-attention rule), else as given."""
    device = query.device.type
    if torch.float32 not in (query.dtype, key.dtype, value.dtype) or \
            not torch.is_autocast_enabled(device):
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in (query, key, value))


def make_attention_forward(impl: str = "auto"):
    """transformers' attention-function signature, bound to one attnlab ``impl``."""
    check_impl(impl)

    def attnlab_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                                  dropout: float = 0.0, scaling: float | None = None,
                                  is_causal: bool | None = None, sliding_window: int | None = None,
                                  softcap: float | None = None, **kwargs):
        if dropout:
            raise NotImplementedError(f"dropout must be 0 with attnlab attention, got {dropout}")
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        # transformers' sliding_window counts the query's own token; flash-attn's left does not.
        window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
        softcap = float(softcap or 0.0)
        query, key, value = _autocast_dtype(query, key, value)
        if attention_mask is not None:
            options = dict(softmax_scale=scaling, causal=causal, window_size=window,
                           softcap=softcap, impl=impl)
            bshd = [t.transpose(1, 2) for t in (query, key, value)]
            return _padded_attention(*bshd, attention_mask, options), None
        packed = _packed_boundaries(kwargs.get("position_ids"), query.transpose(1, 2),
                                    key.transpose(1, 2), kwargs)
        if packed is not None:
            # (1, heads, total, dim) -> (total, heads, dim): one view per tensor, no copy.
            q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
            out = flash_attn_varlen_func(q, k, v, *packed, softmax_scale=scaling, causal=causal,
                                         window_size=window, softcap=softcap, impl=impl)
            return out[None], None
        out = attention(query, key, value, causal=causal, scale=scaling,
                        enable_gqa=query.shape[1] != key.shape[1], window_size=window,
                        softcap=softcap, impl=impl)
        return out.transpose(1, 2).contiguous(), None

    return attnlab_attention_forward


def register(impl: str = "auto", name: str = NAME) -> str:
    """Add attnlab to transformers' AttentionInterface (and its mask interface); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, make_attention_forward(impl))
    # Like flash-attn, attnlab needs no dense mask: this mask function returns None for
    # an unpadded batch and the 2-D padding mask otherwise, which the forward unpads.
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
