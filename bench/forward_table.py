"""The README's forward and forward+backward tables (and the forward plot), from
committed records only (no GPU).

    python3 bench/forward_table.py            # the forward table; writes
                                              # bench/results/plots/forward_tflops.png
    python3 bench/forward_table.py --fwdbwd   # the forward + backward table

Reads bench/results/prefill_forward.jsonl (bench/forward_h200.py) or
bench/results/fwdbwd.jsonl (bench/backward_h200.py), both written on the H200.
Forward TFLOP/s count 4·B·H·N²·d, halved when causal, as the peers' anchors do;
forward + backward counts 3.5× that.  Ratios are attnlab's median time against each
peer's.
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


def collect(records, phase="prefill", metric="latency"):
    table = defaultdict(dict)  # (group, seqlen) -> provider -> record
    for r in records:
        if r["metric"] != metric or r["phase"] != phase:
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


def fwdbwd_markdown(table, memory) -> str:
    providers = ("attnlab", "sdpa_cudnn", "sdpa_flash", "flex")
    lines = ["| shape (bf16, fwd + bwd) | B | N | attnlab TFLOP/s | deterministic | cuDNN | "
             "FA2 | Flex | vs cuDNN | vs Flex | peak MiB attnlab / cuDNN / FA2 / Flex |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, row in sorted(table.items()):
        ours = row.get("attnlab")
        if ours is None:
            continue
        cells = [f"{row[p]['tflops']:.0f}" if p in row else "–"
                 for p in ("attnlab_deterministic", "sdpa_cudnn", "sdpa_flash", "flex")]
        ratios = [f"{row[p]['p50'] / ours['p50']:.2f}×" if p in row else "–"
                  for p in ("sdpa_cudnn", "flex")]
        mib = [f"{memory[key][p]['p50'] / 2**20:.0f}" if p in memory.get(key, {}) else "–"
               for p in providers]
        lines.append(f"| {key[0]} | {ours['shape']['batch']} | {key[1]} | "
                     f"{ours['tflops']:.0f} | {' | '.join(cells)} | {' | '.join(ratios)} | "
                     f"{' / '.join(mib)} |")
    return "\n".join(lines)


def main() -> int:
    results = ROOT / "bench" / "results"
    if sys.argv[1:] == ["--fwdbwd"]:
        records = load_records(results / "fwdbwd.jsonl")
        print(fwdbwd_markdown(collect(records, "fwdbwd"),
                              collect(records, "fwdbwd", "peak_memory")))
        return 0
    if sys.argv[1:]:
        print(f"usage: {sys.argv[0]} [--fwdbwd]", file=sys.stderr)
        return 2
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
