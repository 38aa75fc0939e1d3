"""Cut the package's shipped results (src/attnlab/data/results) from bench/results.

    python bench/ship_results.py

The list below is the one place that says what the wheel carries: the records the
demo, the explainer page and the report read, and the Nsight Compute CSVs cut to the
page's metrics.  tests/test_shipped_results.py re-cuts and compares byte for byte.
"""

from pathlib import Path

from attnlab.measure.shipped import COPY, NCU_PAGE_METRICS, RECORDS_PAGE, ship

REPO = Path(__file__).resolve().parents[1]
SHIPPED = [
    ("prefill_forward.jsonl", COPY),
    ("decode.jsonl", COPY),
    ("fwdbwd.jsonl", COPY),
    ("measure.jsonl", COPY),
    # The seed's comparison (FA4, FlashInfer and the rest; issue #33) for the page.
    ("seed_prefill.jsonl", RECORDS_PAGE),
    ("seed_decode_b1.jsonl", RECORDS_PAGE),
    ("seed_decode_b16.jsonl", RECORDS_PAGE),
    ("seed_fwdbwd.jsonl", RECORDS_PAGE),
    # The fp8 cache's decode beside the bf16 cache's (issue #31), for the page's FP8 table.
    ("fp8_decode.jsonl", COPY),
    ("kernels.json", COPY),
    ("ncu/ncu_kernels.csv", NCU_PAGE_METRICS),
    ("ncu/decode/ncu_kernels.csv", NCU_PAGE_METRICS),
    ("ncu/prefill_sm90/causal/ncu_kernels.csv", NCU_PAGE_METRICS),
    ("ncu/prefill_sm90/nc/ncu_kernels.csv", NCU_PAGE_METRICS),
    ("ncu/backward/ncu_kernels.csv", NCU_PAGE_METRICS),
]

if __name__ == "__main__":
    entries = ship(REPO / "bench" / "results", REPO / "src" / "attnlab" / "data" / "results",
                   SHIPPED)
    for entry in entries:
        print(f"{entry['bytes']:>9,}  {entry['path']}")
    print(f"{sum(e['bytes'] for e in entries):>9,}  bytes in {len(entries)} files")
