"""A tiny randomly initialised decoder runs its attention through attnlab (no downloads)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([hf])")

from attnlab.integrations.transformers import make_attention_forward, register  # noqa: E402
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


def left_padded_prompts(lengths, seed=3):
    """A batch of prompts of different lengths, left-padded as generate expects."""
    gen = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    tokens = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens[row, longest - length:] = torch.randint(1, 97, (length,), generator=gen)
        mask[row, longest - length:] = 1
    return tokens.to(DEVICE), mask.to(DEVICE)


def generate(model, tokens, mask, new_tokens=5):
    with torch.no_grad():
        return model.generate(tokens, attention_mask=mask, max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def test_left_padded_generate_matches_sdpa_through_the_reference():
    name = register(impl="reference", name="attnlab-reference")
    tokens, mask = left_padded_prompts([5, 11, 8])
    expected = generate(tiny_llama("sdpa"), tokens, mask)
    assert torch.equal(generate(tiny_llama(name), tokens, mask), expected)


@pytest.mark.skipif(IMPL != "triton", reason="needs a CUDA GPU or TRITON_INTERPRET=1")
def test_left_padded_generate_matches_sdpa_through_the_kernel():
    name = register(impl=IMPL)
    tokens, mask = left_padded_prompts([4, 9], seed=4)
    expected = generate(tiny_llama("sdpa").half(), tokens, mask, new_tokens=4)
    assert torch.equal(generate(tiny_llama(name).half(), tokens, mask, new_tokens=4), expected)


def test_right_padded_batch_matches_sdpa_on_the_real_tokens():
    name = register(impl="reference", name="attnlab-reference")
    tokens = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones(2, 10, dtype=torch.long, device=DEVICE)
    mask[1, 6:] = 0
    with torch.no_grad():
        expected = tiny_llama("sdpa")(tokens, attention_mask=mask).logits
        got = tiny_llama(name)(tokens, attention_mask=mask).logits
    real = mask.bool()
    assert (expected[real] - got[real]).abs().max() < 1e-4


def test_packed_documents_do_not_attend_to_each_other():
    # Padding-free packing (batch 1, position ids restarting per document), as transformers'
    # DataCollatorWithFlattening produces: each document's logits are its logits alone.
    name = register(impl="reference", name="attnlab-reference")
    gen = torch.Generator().manual_seed(6)
    first, second = torch.randint(1, 97, (1, 7), generator=gen), torch.randint(1, 97, (1, 12),
                                                                                generator=gen)
    packed = torch.cat((first, second), dim=1).to(DEVICE)
    positions = torch.cat((torch.arange(7), torch.arange(12)))[None].to(DEVICE)
    model = tiny_llama(name)
    with torch.no_grad():
        together = model(packed, position_ids=positions).logits
        alone = model(second.to(DEVICE)).logits
    assert (together[:, 7:] - alone).abs().max() < 1e-4


def test_flattened_batch_boundaries_from_the_collator_are_used():
    # transformers passes cu_seq_lens_q/k (int64) for DataCollatorWithFlattening batches.
    forward = make_attention_forward("reference")
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 4, 9])
    got, _ = forward(torch.nn.Module(), q, k, v, None, scaling=0.3, is_causal=True,
                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    for start, stop in ((0, 4), (4, 9)):
        alone, _ = forward(torch.nn.Module(), *(t[:, :, start:stop] for t in (q, k, v)), None,
                           scaling=0.3, is_causal=True)
        assert torch.allclose(got[:, start:stop], alone, atol=1e-6)


def test_masks_that_are_not_padding_masks_are_refused():
    forward = make_attention_forward("reference")
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="2-D padding mask"):
        forward(torch.nn.Module(), q, q, q, torch.zeros(1, 1, 4, 4))
    with pytest.raises(NotImplementedError, match="dropout"):
        forward(torch.nn.Module(), q, q, q, None, dropout=0.1)


def test_qwen3_under_autocast_runs_its_float32_normalised_q_and_k_in_the_autocast_dtype():
    # Qwen3 normalises q and k in float32: under autocast they arrive float32 beside a
    # bfloat16 v.  They run in bfloat16 (transformers' flash-attention rule) and the loss
    # and gradients match SDPA's under the same autocast.
    name = register(impl=IMPL, name=f"attnlab-{IMPL}")
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    tokens = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    losses, grads = [], []
    for implementation in ("sdpa", name):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config).to(DEVICE)
        model.config._attn_implementation = implementation
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[0])
    assert torch.isfinite(grads[1]).all()
    assert (grads[0] - grads[1]).abs().max() <= 0.05 * grads[0].abs().max()
