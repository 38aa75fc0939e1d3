"""A tiny randomly initialised decoder runs its attention through attnlab (no downloads)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([hf])")

from attnlab.integrations.transformers import register  # noqa: E402
from attnlab.kernels.forward import kernel_is_interpreted  # noqa: E402

IMPL = "triton" if torch.cuda.is_available() or kernel_is_interpreted() else "reference"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_llama(attn_implementation: str):
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    model.config._attn_implementation = attn_implementation
    return model


def test_float32_decoder_through_the_reference_matches_eager():
    name = register(impl="reference", name="attnlab-reference")
    tokens = torch.randint(0, 97, (2, 45), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    eager = tiny_llama("eager")
    ours = tiny_llama(name)
    assert ours.config._attn_implementation == name
    with torch.no_grad():
        expected = eager(tokens).logits
        got = ours(tokens).logits
    assert (expected - got).abs().max() < 1e-4


@pytest.mark.skipif(IMPL != "triton", reason="needs a CUDA GPU or TRITON_INTERPRET=1")
def test_half_precision_decoder_through_the_kernel():
    name = register(impl=IMPL)
    dtype = torch.float16
    tokens = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    eager, ours = tiny_llama("eager").to(dtype), tiny_llama(name).to(dtype)
    with torch.no_grad():
        expected = eager(tokens).logits.float()
        got = ours(tokens).logits.float()
    assert torch.isfinite(got).all()
    assert (expected - got).abs().max() < 5e-2


def test_padding_masks_are_refused():
    name = register(impl=IMPL)
    model = tiny_llama(name)
    tokens = torch.randint(0, 97, (2, 8)).to(DEVICE)
    mask = torch.ones(2, 8, dtype=torch.long, device=DEVICE)
    mask[0, :3] = 0
    with pytest.raises(NotImplementedError, match="padding"):
        model(tokens, attention_mask=mask)
