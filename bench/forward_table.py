"""The forward benchmark table and plot, from committed records only (no GPU).

    python3 bench/forward_table.py            # prints the Markdown table for the README
                                              # and writes bench/results/plots/forward_tflops.png

Reads bench/results/prefill_forward.jsonl (written on the H200 by
bench/forward_h200.py).  TFLOP/s count 4·B·H·N²·d, halved when causal, as the
peers' anchors do; ratios are attnlab's median time against each peer's.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attnlab.measure.plots import CEILING_PROVIDER, plot_tflops_grid  # noqa: E402
from attnlab.measure.records import load_records  # noqa: E402

PEERS = ("sdpa_cudnn", "sdpa_flash", "flex")


def group_name(shape: dict) -> str:
    mask = "causal" if shape["causal"] else "full"
    heads = f"{shape['query_heads']}q/{shape['kv_heads']}kv"
    return f"d={shape['head_dim']}, {heads} heads, {mask}"


def collect(records):
    table = defaultdict(dict)  # (group, seqlen) -> provider -> record
    for r in records:
        if r["metric"] != "latency" or r["phase"] != "prefill":
            continue
        table[(group_name(r["shape"]), r["shape"]["seqlen_q"])][r["provider"]] = r
    return table


def markdown(table) -> str:
    lines = ["| shape (bf16) | B | N | attnlab TFLOP/s | cuDNN | FA2 (SDPA flash) | Flex | "
             "vs cuDNN | vs best peer |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (group, seqlen), row in sorted(table.items()):
        ours = row.get("attnlab")
        if ours is None:
            continue
        cells = [f"{row[p]['tflops']:.0f}" if p in row else "–" for p in PEERS]
        best = min((row[p]["p50"] for p in PEERS if p in row), default=None)
        cudnn = row.get("sdpa_cudnn")
        vs_cudnn = f"{cudnn['p50'] / ours['p50']:.2f}×" if cudnn else "–"
        vs_best = f"{best / ours['p50']:.2f}×" if best else "–"
        lines.append(f"| {group} | {ours['shape']['batch']} | {seqlen} | {ours['tflops']:.0f} | "
                     f"{' | '.join(cells)} | "
                     f"{vs_cudnn} | {vs_best} |")
    return "\n".join(lines)


def main() -> int:
    results = ROOT / "bench" / "results"
    forward = load_records(results / "prefill_forward.jsonl")
    print(markdown(collect(forward)))
    # The plot is the project's one TFLOP/s grid, against the roof measured in the same
    # lease as the ceilings in measure.jsonl.
    roofs = [r for r in load_records(results / "measure.jsonl") if r["provider"] == CEILING_PROVIDER]
    path = plot_tflops_grid(forward + roofs, results / "plots" / "forward_tflops.png")
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
