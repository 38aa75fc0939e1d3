"""Regenerate report_cpu_prefill_trace.json: a real torch.profiler Chrome trace (CPU).

The prefill of attnlab's small random-weight decoder (2 layers, GQA 4:2 heads of d=64,
512 tokens) with eager attention, profiled with CPU activity only, exactly as
``torch.profiler.profile(...).export_chrome_trace`` writes it.  Used by
tests/test_report_trace.py; about 140 KB.

    python tests/data/make_report_trace.py [OUTPUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from attnlab.measure.decoder import DecoderConfig, build_decoder, eager_attention, prompt

CONFIG = DecoderConfig(layers=2, hidden=256, query_heads=4, kv_heads=2, head_dim=64,
                       mlp_hidden=688, vocab=1000, prompt_tokens=512)


def main() -> None:
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else \
        Path(__file__).with_name("report_cpu_prefill_trace.json")
    torch.set_num_threads(1)  # one host thread: the trace holds one op stream
    model = build_decoder(CONFIG)
    tokens = prompt(CONFIG)
    with torch.inference_mode():
        model(tokens, eager_attention)  # warm-up outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as profiler, record_function("prefill"):
            model(tokens, eager_attention)
    profiler.export_chrome_trace(str(output))
    print(f"wrote {output} ({output.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
