"""The provider registry: names, reasons when a provider cannot run, CPU providers' answers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from attnlab.measure import providers as prov
from attnlab.measure.providers import PROVIDERS, ProviderUnavailable, prepare, provider
from attnlab.measure.sweep import check_output, phase_shape
from attnlab.reference import shape_mask
from attnlab.shapes import AttentionShape

SMALL = AttentionShape(batch=2, query_heads=4, kv_heads=2, seqlen_q=40, seqlen_k=40,
                       head_dim=16, dtype="fp32", causal=True)
CPU_PROVIDERS = ("eager", "eager_typical", "sdpa", "sdpa_math")
GPU_PROVIDERS = tuple(n for n in PROVIDERS if n not in CPU_PROVIDERS)
NO_CUDA = not torch.cuda.is_available()


def test_registry_lists_every_provider_the_issue_names():
    assert list(PROVIDERS) == ["eager", "eager_typical", "sdpa", "sdpa_flash", "sdpa_efficient",
                               "sdpa_cudnn", "sdpa_math", "flex", "attnlab", "attnlab_decode",
                               "attnlab_decode_paged16", "attnlab_decode_fp8", "flash_attn", "fa4", "fa4_paged16",
                               "flashinfer", "flashinfer_paged16"]
    for p in PROVIDERS.values():
        assert p.phases and set(p.phases) <= {"prefill", "decode", "fwdbwd"}
        assert p.input_layout in prov.LAYOUTS and p.output_layout in prov.LAYOUTS


def test_unknown_provider_names_the_choices():
    with pytest.raises(ValueError, match="unknown provider 'fa9'; expected one of eager"):
        provider("fa9")
    with pytest.raises(ValueError, match="providers must be"):
        prov.parse_providers(" , ")
    assert [p.name for p in prov.parse_providers("sdpa_flash,eager")] == ["sdpa_flash", "eager"]
    assert len(prov.parse_providers("all")) == len(PROVIDERS)


@pytest.mark.skipif(not NO_CUDA, reason="checks the reasons given on a machine without CUDA")
@pytest.mark.parametrize("name", GPU_PROVIDERS)
def test_gpu_providers_say_they_need_cuda(name):
    p = provider(name)
    phase = p.phases[0]
    shape = phase_shape(SMALL.replace(dtype="fp16"), phase, 64)
    reason = p.reason(shape, phase, "cpu")
    assert reason == f"{name} needs a CUDA GPU"
    with pytest.raises(ProviderUnavailable, match="needs a CUDA GPU"):
        prepare(p, shape, phase, "cpu")
    assert "no CUDA GPU" in p.reason(shape, phase, "cuda")


def test_phase_and_shape_reasons():
    decode_only = provider("attnlab_decode")
    assert decode_only.reason(SMALL, "prefill", "cpu") == \
        "attnlab_decode has no prefill path (phases: decode)"
    assert provider("flash_attn").reason(SMALL, "fwdbwd", "cpu").startswith(
        "flash_attn has no fwdbwd path")
    assert provider("eager").reason(SMALL, "decode", "cpu") == \
        "decode means one query token; got seqlen_q=40"
    windowed = SMALL.replace(window=(8, 0))
    assert provider("sdpa").reason(windowed, "prefill", "cpu") == \
        "SDPA has no sliding-window argument (only an explicit mask)"
    with pytest.raises(ValueError, match="phase must be one of"):
        provider("eager").reason(SMALL, "train", "cpu")
    with pytest.raises(ValueError, match="device must be"):
        provider("eager").reason(SMALL, "prefill", "gpu")


def test_library_and_dtype_reasons_from_the_checkers():
    half = SMALL.replace(dtype="fp16")
    if importlib.util.find_spec("flash_attn") is None:
        assert prov._check_flash_attn(half, "prefill").startswith("flash_attn is not importable")
    if importlib.util.find_spec("flashinfer") is None:
        assert prov._check_flashinfer(half, "prefill").startswith("flashinfer is not importable")
    assert prov._check_sdpa("FLASH_ATTENTION")(SMALL, "prefill") == \
        "SDPA's FLASH_ATTENTION backend takes fp16 or bf16, not fp32"
    assert prov._check_attnlab(SMALL, "prefill") == \
        "attnlab's Triton kernel takes fp16 or bf16, not fp32"
    assert prov._check_flex(SMALL.replace(head_dim=24), "prefill").startswith(
        "FlexAttention needs a power-of-two head_dim")


def test_attnlab_backward_is_unavailable_until_it_exists(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "attnlab.kernels.backward"
                        else real(name, *a))
    assert prov._check_attnlab(SMALL.replace(dtype="bf16"), "fwdbwd") == \
        "attnlab has no backward kernel yet (attnlab.kernels.backward not found)"


def test_materialising_providers_are_sized():
    shape = AttentionShape(query_heads=32, kv_heads=32, seqlen_q=16384, seqlen_k=16384)
    scores = 32 * 16384 * 16384
    assert prov.materialised_bytes(provider("eager"), shape, "prefill") == 4 * scores
    assert prov.materialised_bytes(provider("eager"), shape, "fwdbwd") == 8 * scores
    assert prov.materialised_bytes(provider("sdpa_flash"), shape, "prefill") == 0


def test_hidden_mask_is_the_complement_of_the_reference_mask():
    for shape in (SMALL, SMALL.replace(seqlen_q=7), SMALL.replace(causal=False, window=(5, 2)),
                  SMALL.replace(window=(3, -1), seqlen_q=25)):
        assert torch.equal(prov.hidden_mask(shape, "cpu"), ~shape_mask(shape, device="cpu"))
    assert prov.hidden_mask(SMALL.replace(causal=False), "cpu") is None


@pytest.mark.parametrize("name", CPU_PROVIDERS)
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cpu_providers_match_the_reference(name, phase):
    p = provider(name)
    for shape in (SMALL, SMALL.replace(causal=False), SMALL.replace(kv_heads=4)):
        shape = phase_shape(shape, phase, 40)
        if p.reason(shape, phase, "cpu"):
            continue
        call = prepare(p, shape, phase, "cpu")
        inputs = call.inputs(seed=3)
        result = check_output(call.forward(*inputs), inputs, p, shape, rows=64)
        assert result.passed, (name, phase, shape.describe(), result)


@pytest.mark.parametrize("name", ["eager", "eager_typical"])
def test_eager_providers_handle_a_window(name):
    shape = SMALL.replace(causal=False, window=(6, 3))
    call = prepare(provider(name), shape, "prefill", "cpu")
    inputs = call.inputs(seed=1)
    assert check_output(call.forward(*inputs), inputs, provider(name), shape).passed


def test_a_wrong_answer_fails_the_check():
    p = provider("eager")
    call = prepare(p, SMALL, "prefill", "cpu")
    inputs = call.inputs()
    wrong = call.forward(*inputs) + 1e-3
    result = check_output(wrong, inputs, p, SMALL)
    assert not result.passed and result.error == pytest.approx(1e-3, rel=1e-3)


def test_forward_backward_returns_gradients_of_the_inputs():
    for name in ("eager", "eager_typical", "sdpa"):
        call = prepare(provider(name), SMALL, "fwdbwd", "cpu")
        q, k, v, grad_out = call.inputs()
        dq, dk, dv = call.call(q, k, v, grad_out)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert torch.isfinite(dq).all()


def test_inputs_follow_the_provider_layout():
    shape = SMALL.replace(batch=1)
    q, k, v = prov.make_inputs(shape, "bshd", "cpu")
    assert q.shape == (1, 40, 4, 16) and k.shape == (1, 40, 2, 16)
    q, k, v = prov.make_inputs(shape, "nhd", "cpu")
    assert q.shape == (40, 4, 16)
    assert prov.to_bhsd(q, "nhd").shape == (1, 4, 40, 16)
    with pytest.raises(ValueError, match="batch must be 1"):
        prov.make_inputs(SMALL, "nhd", "cpu")
    a = prov.make_inputs(SMALL, "bhsd", "cpu", seed=5)[0]
    assert torch.equal(a, prov.make_inputs(SMALL, "bhsd", "cpu", seed=5)[0])


def test_the_fp8_decode_provider_stores_an_e4m3_cache_and_is_judged_on_its_values():
    """attnlab_decode_fp8: the drawn cache quantised per (batch, KV head) before the call,
    the output judged against float64 on the dequantised cache, not on the bf16 one."""
    from attnlab.reference.fp8 import quantize_per_head

    shape = AttentionShape(batch=2, query_heads=4, kv_heads=2, seqlen_q=1, seqlen_k=96,
                           head_dim=32, dtype="bf16", causal=True)
    p = provider("attnlab_decode_fp8")
    decode = p.builder(shape, "decode", "cpu")  # prepare() wants CUDA; the builder does not
    call = prov.PreparedCall(p, shape, "decode", "cpu", decode, decode)
    q, k8, v8, k_descale, v_descale = inputs = call.inputs(seed=4)
    drawn = prov.make_inputs(shape, p.input_layout, "cpu", seed=4)
    assert torch.equal(q, drawn[0]) and call.forward_inputs(inputs) == inputs
    for stored, descale, real in ((k8, k_descale, drawn[1]), (v8, v_descale, drawn[2])):
        expected, expected_descale = quantize_per_head(real)
        assert stored.dtype == torch.float8_e4m3fn and descale.shape == (2, 2)
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(descale, expected_descale)
    out = call.forward(*inputs)
    assert check_output(out, inputs, p, shape).passed
    # The same output judged on the bf16 cache it was quantised from fails: the check
    # reads the values the call was given.
    assert not check_output(out, drawn, provider("attnlab_decode"), shape).passed


def test_an_fp8_cache_provider_is_credited_with_the_bytes_it_stores():
    # attnlab bench's TB/s: an e4m3 cache moves 1 byte per K/V element, not the shape's 2.
    from attnlab.measure.sweep import compulsory_bytes

    shape = AttentionShape(batch=2, query_heads=8, kv_heads=2, seqlen_q=1, seqlen_k=4096,
                           head_dim=128, dtype="bf16", causal=True)
    q = 2 * 8 * 1 * 128 * 2
    kv_bf16 = 2 * 2 * 2 * 4096 * 128 * 2
    assert compulsory_bytes(shape, "decode") == 2 * q + kv_bf16
    assert PROVIDERS["attnlab_decode_fp8"].storage.kv_dtype == "fp8"
    assert compulsory_bytes(shape, "decode", kv_dtype="fp8") == 2 * q + kv_bf16 // 2
