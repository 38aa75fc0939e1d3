"""The README's performance tables, from the committed records alone (no GPU).

    python3 bench/readme_tables.py            # print every table
    python3 bench/readme_tables.py forward    # one of: forward, fwdbwd, decode, varlen,
                                              # seed_prefill, seed_decode
    python3 bench/readme_tables.py --results $OUT/seed seed_prefill seed_decode

Each table names the records file it reads; tests/test_docs.py asks that the README
holds exactly the ``TABLES`` tables, so every number there comes from a record.  Ratios
are time ratios against cuDNN (> 1x: attnlab faster).  Forward TFLOP/s count
4·B·H·N²·d, halved when causal; forward + backward 3.5x that; decode counts K/V
bytes read per second; varlen counts the real tokens only.

The seed's tables (``SEED_TABLES``, from ``bench/seed_h200.py``'s records) name the
fastest peer at each point (FA4, FlashInfer, cuDNN, FA2, Flex: any measured provider
that is neither attnlab nor eager) and attnlab's time ratio to it; they join
``TABLES`` once their records are committed and the README holds them.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from attnlab.measure.records import load_records

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
SOURCES = {
    "forward": "prefill_forward.jsonl",
    "fwdbwd": "fwdbwd.jsonl",
    "decode": "decode.jsonl",
    "varlen": "runs/2026-12-01-run2/varlen.jsonl",
}
PHASES = {"forward": "prefill", "fwdbwd": "fwdbwd"}


def _latency(records: list[dict], phase: str | None = None) -> list[dict]:
    return [r for r in records if r["metric"] == "latency" and r["kernel"] == "call"
            and (phase is None or r["phase"] == phase)]


def _group(shape: dict) -> str:
    mask = "causal" if shape["causal"] else "full"
    return f"d={shape['head_dim']}, {shape['query_heads']}q/{shape['kv_heads']}kv, {mask}"


def _ratio(peer: dict | None, ours: dict) -> str:
    return f"{peer['p50'] / ours['p50']:.2f}×" if peer else "–"


def _cell(record: dict | None, field: str) -> str:
    return f"{record[field]:.0f}" if record and record.get(field) is not None else "–"


def training_table(family: str) -> list[str]:
    """The forward or forward + backward table: TFLOP/s per provider, vs cuDNN."""
    rows: dict[tuple, dict] = defaultdict(dict)
    for r in _latency(load_records(RESULTS / SOURCES[family]), PHASES[family]):
        rows[(_group(r["shape"]), r["shape"]["seqlen_q"], r["shape"]["batch"])][r["provider"]] = r
    lines = ["| shape (bf16) | B | N | attnlab | cuDNN | FA2 | Flex | vs cuDNN |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (group, seqlen, batch), row in sorted(rows.items()):
        ours = row.get("attnlab")
        if ours is None:
            continue
        peers = " | ".join(_cell(row.get(p), "tflops") for p in ("sdpa_cudnn", "sdpa_flash", "flex"))
        lines.append(f"| {group} | {batch} | {seqlen} | {ours['tflops']:.0f} | {peers} | "
                     f"{_ratio(row.get('sdpa_cudnn'), ours)} |")
    return lines


def decode_table() -> list[str]:
    """Decode: µs per call (TB/s of K/V read), contiguous and paged, vs cuDNN."""
    rows: dict[tuple, dict] = defaultdict(dict)
    for r in _latency(load_records(RESULTS / SOURCES["decode"])):
        s = r["shape"]
        rows[(s["batch"], s["seqlen_k"], s["seqlen_q"])][r["provider"]] = r
    lines = ["| batch × cache × queries | attnlab µs (TB/s) | paged 16 | paged 256 | cuDNN | FA2 | "
             "vs cuDNN |", "|---|---:|---:|---:|---:|---:|---:|"]

    def timed(record: dict | None) -> str:
        if record is None:
            return "–"
        return f"{record['p50'] * 1e3:.1f} ({record['tbps']:.2f})"

    for (batch, seqlen_k, seqlen_q), row in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][:2])):
        ours = row.get("attnlab_decode")
        if ours is None:
            continue
        lines.append(f"| {batch} × {seqlen_k} × {seqlen_q} | {timed(ours)} | "
                     f"{timed(row.get('attnlab_decode_paged16'))} | "
                     f"{timed(row.get('attnlab_decode_paged256'))} | "
                     f"{timed(row.get('sdpa_cudnn'))} | {timed(row.get('sdpa_flash'))} | "
                     f"{_ratio(row.get('sdpa_cudnn'), ours)} |")
    return lines


VARLEN_MIXES = {(16, 1024): "a: 16 × 1k", (11, 3851): "b: 64…8k, long-tailed",
                (1, 16384): "c: one 16k"}


def varlen_table() -> list[str]:
    """Varlen: useful TFLOP/s of the real tokens against padded dense and a document mask."""
    rows: dict[tuple, dict] = defaultdict(dict)
    for r in _latency(load_records(RESULTS / SOURCES["varlen"])):
        rows[(r["shape"]["batch"], r["shape"]["seqlen_q"], r["phase"])][r["provider"]] = r
    lines = ["| mix (16k tokens) | phase | attnlab varlen | attnlab dense, padded | cuDNN, padded | "
             "Flex, document mask | vs cuDNN |", "|---|---|---:|---:|---:|---:|---:|"]
    for (batch, seqlen, phase), row in sorted(rows.items(), key=lambda kv: (
            list(VARLEN_MIXES).index(kv[0][:2]), kv[0][2] != "prefill")):
        ours = row["attnlab_varlen"]
        lines.append(f"| {VARLEN_MIXES[(batch, seqlen)]} | "
                     f"{'forward' if phase == 'prefill' else 'fwd + bwd'} | "
                     f"{ours['tflops']:.0f} | {_cell(row.get('attnlab'), 'tflops')} | "
                     f"{_cell(row.get('sdpa_cudnn'), 'tflops')} | "
                     f"{_cell(row.get('flex_document'), 'tflops')} | "
                     f"{_ratio(row.get('sdpa_cudnn'), ours)} |")
    return lines


# ----- the seed's comparison (bench/seed_h200.py) --------------------------------------------
SEED_SOURCES = {"seed_prefill": ("seed_prefill.jsonl",),
                "seed_decode": ("seed_decode_b1.jsonl", "seed_decode_b16.jsonl")}
SEED_PEERS = {"sdpa_cudnn": "cuDNN", "sdpa_flash": "FA2", "fa4": "FA4", "flashinfer": "FlashInfer",
              "flex": "Flex", "fa4_paged16": "FA4 paged", "flashinfer_paged16": "FlashInfer paged"}
SEED_COLUMNS = {
    "seed_prefill": (("eager_typical", "eager"), ("sdpa_cudnn", "cuDNN"), ("sdpa_flash", "FA2"),
                     ("fa4", "FA4"), ("flashinfer", "FlashInfer"), ("attnlab", "attnlab")),
    "seed_decode": (("eager_typical", "eager"), ("sdpa_cudnn", "cuDNN"), ("sdpa_flash", "FA2"),
                    ("fa4", "FA4"), ("flashinfer", "FlashInfer"), ("attnlab_decode", "attnlab"),
                    ("fa4_paged16", "FA4 p16"), ("flashinfer_paged16", "FlashInfer p16"),
                    ("attnlab_decode_paged16", "attnlab p16")),
}


def fastest_peer(row: dict, paged: bool = False) -> tuple[str, dict] | None:
    """(label, record) of the fastest measured peer at one point: a provider that is
    neither attnlab nor eager, among the contiguous ones or the 16-token paged ones."""
    peers = [(SEED_PEERS[name], r) for name, r in row.items()
             if name in SEED_PEERS and name.endswith("_paged16") == paged]
    return min(peers, key=lambda peer: peer[1]["p50"], default=None)


def _us(record: dict | None) -> str:
    return "–" if record is None else f"{record['p50'] * 1e3:.1f}"


def seed_table(name: str, results: Path = RESULTS) -> list[str]:
    """µs per call per provider at each point, the fastest peer and attnlab's ratio to it
    (> 1×: attnlab faster); decode adds the 16-token paged comparison."""
    rows: dict[tuple, dict] = defaultdict(dict)
    for source in SEED_SOURCES[name]:
        for r in _latency(load_records(results / source)):
            rows[(r["shape"]["batch"], r["shape"]["seqlen_k"])][r["provider"]] = r
    columns = SEED_COLUMNS[name]
    decode = name == "seed_decode"
    head = ["batch × cache" if decode else "N", *(label for _, label in columns),
            "fastest peer", "attnlab vs it"]
    if decode:
        head += ["fastest paged peer", "attnlab p16 vs it"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for (batch, seqlen), row in sorted(rows.items()):
        cells = [f"{batch} × {seqlen}" if decode else str(seqlen),
                 *(_us(row.get(provider)) for provider, _ in columns)]
        pairs = [(False, "attnlab_decode" if decode else "attnlab")]
        if decode:
            pairs.append((True, "attnlab_decode_paged16"))
        for paged, ours_name in pairs:
            peer, ours = fastest_peer(row, paged), row.get(ours_name)
            cells += [peer[0] if peer else "–",
                      _ratio(peer[1], ours) if peer and ours else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


SEED_TABLES = {"seed_prefill": lambda: seed_table("seed_prefill"),
               "seed_decode": lambda: seed_table("seed_decode")}


TABLES = {"forward": lambda: training_table("forward"),
          "fwdbwd": lambda: training_table("fwdbwd"),
          "decode": decode_table, "varlen": varlen_table}


def main(argv: list[str]) -> int:
    every = {**TABLES, **SEED_TABLES}
    results = RESULTS
    if argv[:1] == ["--results"]:  # a run's own folder, before its records are committed
        if len(argv) < 2:
            print("--results needs a folder of records", file=sys.stderr)
            return 2
        results, argv = Path(argv[1]), argv[2:]
    names = argv or list(TABLES)
    unknown = [n for n in names if n not in every]
    if unknown:
        print(f"unknown table {unknown[0]!r}; expected one of {', '.join(every)}",
              file=sys.stderr)
        return 2
    for name in names:
        sources = SEED_SOURCES.get(name) or (SOURCES[name],)
        try:
            table = seed_table(name, results) if name in SEED_TABLES else every[name]()
        except ValueError as error:  # records missing or unreadable: one line, no traceback
            print(f"readme_tables: {name}: {error}", file=sys.stderr)
            return 2
        print(f"<!-- {name}: {', '.join(f'bench/results/{s}' for s in sources)} -->")
        print("\n".join(table))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
