"""--measure: the pipeline on a tiny CPU decoder, and the real run on a GPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from attnlab.measure.decoder import (
    DecoderConfig,
    attention_flops,
    build_decoder,
    eager_attention,
    prompt,
)
from attnlab.measure.end_to_end import run_measurement
from attnlab.model.amdahl import amdahl_speedup
from attnlab.report.attribution import build_report
from attnlab.report.measurement import measurement_workload
from attnlab.report.render import narrative, render_html

TINY = DecoderConfig(layers=1, hidden=64, query_heads=4, kv_heads=2, head_dim=16, mlp_hidden=128,
                     vocab=100, prompt_tokens=96)


def sdpa_core(q, k, v):
    # Equal query and key lengths: SDPA's top-left causal equals attnlab's bottom-right.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_eager_attention_matches_sdpa_with_gqa():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 33, 16, generator=generator)
    k = torch.randn(2, 2, 33, 16, generator=generator)
    v = torch.randn(2, 2, 33, 16, generator=generator)
    torch.testing.assert_close(eager_attention(q, k, v), sdpa_core(q, k, v))


def test_decoder_is_deterministic_and_counts_its_parameters():
    model = build_decoder(TINY, seed=3)
    assert sum(p.numel() for p in model.parameters()) == TINY.parameters()
    again = build_decoder(TINY, seed=3)
    tokens = prompt(TINY)
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens, eager_attention), again(tokens, eager_attention))
    assert attention_flops(TINY) == 4 * 4 * 16 * (96 * 97 // 2)
    with pytest.raises(ValueError, match="DecoderConfig.kv_heads"):
        DecoderConfig(query_heads=4, kv_heads=3)


@pytest.fixture(scope="module")
def cpu_measurement(tmp_path_factory):
    torch.manual_seed(0)
    return run_measurement(TINY, device="cpu", candidate=sdpa_core, candidate_name="torch SDPA",
                           trace_dir=tmp_path_factory.mktemp("measure"), warmup=1, repeats=3)


def test_measurement_numbers_are_consistent(cpu_measurement):
    m = cpu_measurement
    assert 0 < m["time_share"] < 1
    assert m["predicted_speedup"] == pytest.approx(amdahl_speedup(m["time_share"],
                                                                  m["kernel_speedup"]))
    assert m["predicted_ms"] == pytest.approx(m["eager_ms"] / m["predicted_speedup"])
    assert m["measured_speedup"] == pytest.approx(m["eager_ms"] / m["candidate_ms"])
    assert m["gap"] == pytest.approx(m["measured_speedup"] / m["predicted_speedup"] - 1)
    assert m["kernel_speedup"] == pytest.approx(m["kernel_eager_ms"] / m["kernel_candidate_ms"])
    assert m["traces"]["eager"]["mode"] == "CPU ops"
    assert m["traces"]["eager"]["attention_time_share"] == m["time_share"]
    assert m["gap_causes"] and all(isinstance(c, str) for c in m["gap_causes"])
    assert m["logits_max_abs_difference"] < 1e-4
    json.dumps(m, allow_nan=False)


def test_measurement_becomes_a_report(cpu_measurement):
    m = cpu_measurement
    report = build_report(measurement_workload(m), measurement=m)
    # The report's Amdahl inside the prefill is the measurement's prediction.
    assert report["segment_boundary"]["speedup"] == pytest.approx(m["predicted_speedup"])
    assert report["segment_boundary"]["before_ms"] == pytest.approx(m["eager_ms"])
    assert report["segment_boundary"]["after_ms"] == pytest.approx(m["predicted_ms"])
    assert report["boundary_errors"]["flop_share_for_time_share"]["applicable"]
    lines = narrative(report)["measurement"]
    assert any("Predicted end-to-end" in line for line in lines)
    assert "Predicted vs measured on this machine" in render_html(report)


def test_a_candidate_that_computes_something_else_is_refused(tmp_path):
    def wrong(q, k, v):
        return torch.zeros_like(q)

    with pytest.raises(RuntimeError, match="refusing to time"):
        run_measurement(TINY, device="cpu", candidate=wrong, candidate_name="zeros",
                        trace_dir=tmp_path, warmup=1, repeats=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_on_the_gpu_end_to_end(tmp_path, capsys):
    from attnlab.cli import main

    config = DecoderConfig(layers=2, hidden=1024, query_heads=8, kv_heads=8, head_dim=128,
                           mlp_hidden=2816, vocab=32000, prompt_tokens=2048)
    m = run_measurement(config, device="cuda", trace_dir=tmp_path, warmup=2, repeats=5)
    assert m["candidate_impl_ran"] == "triton"
    assert m["traces"]["eager"]["mode"] == "device kernels"
    assert 0 < m["time_share"] < 1 and m["kernel_speedup"] > 1
    assert main(["report", "--measure", "--out", str(tmp_path / "full"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measurement"]["measured_speedup"] > 0


def test_attnlab_attention_core_matches_eager_through_the_public_api():
    import attnlab
    from attnlab.measure.decoder import attnlab_attention

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 37, 16, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 2, 37, 16, generator=generator, dtype=torch.float64)
    v = torch.randn(1, 2, 37, 16, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(attnlab_attention("reference")(q, k, v), eager_attention(q, k, v))
    assert attnlab.last_impl() == "reference"
