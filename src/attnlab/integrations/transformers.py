"""Hugging Face transformers: run a decoder's attention through attnlab.

One line registers attnlab under the name ``"attnlab"``; a model then selects it
like any built-in implementation::

    import attnlab.integrations.transformers as attnlab_hf

    attnlab_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnlab")

Layout: transformers hands over (batch, heads, seqlen, head_dim) and expects
(batch, seqlen, heads, head_dim) back.  Causal is bottom-right, which is what a
KV-cached decode step needs (the new token sees the whole cache).  attnlab has no
dropout and no padding masks: a call asking for either is refused with
NotImplementedError rather than run without it.
"""

from __future__ import annotations

import torch

from attnlab.api import IMPLS, attention

NAME = "attnlab"


def make_attention_forward(impl: str = "auto"):
    """transformers' attention-function signature, bound to one attnlab ``impl``."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {', '.join(IMPLS)}")

    def attnlab_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                                  dropout: float = 0.0, scaling: float | None = None,
                                  is_causal: bool | None = None, sliding_window: int | None = None,
                                  softcap: float | None = None, **kwargs):
        if dropout:
            raise NotImplementedError(f"dropout must be 0 with attnlab attention, got {dropout}")
        if attention_mask is not None:
            raise NotImplementedError(
                "attnlab attention takes no padding mask; run unpadded batches (same length)")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # transformers' sliding_window counts the query's own token; flash-attn's left does not.
        window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
        out = attention(query, key, value, causal=bool(causal), scale=scaling,
                        enable_gqa=query.shape[1] != key.shape[1], window_size=window,
                        softcap=float(softcap or 0.0), impl=impl)
        return out.transpose(1, 2).contiguous(), None

    return attnlab_attention_forward


def register(impl: str = "auto", name: str = NAME) -> str:
    """Add attnlab to transformers' AttentionInterface (and its mask interface); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, make_attention_forward(impl))
    # Like flash-attn, attnlab needs no dense mask: this mask function returns None
    # unless the batch is padded, in which case the forward refuses it.
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
