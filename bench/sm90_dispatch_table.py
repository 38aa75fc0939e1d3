"""Write the Gluon sm_90 forward's dispatch table from a measured winners file.

``bench/sm90_h200.py`` times the Gluon kernel against the Triton kernel per (head dim,
causal, length bucket) and writes ``sm90_winners.json``; this script keeps the buckets
where the Gluon kernel measured faster and writes them, with the winning config, into
``src/attnlab/kernels/sm90_dispatch.json``, which ``attnlab.kernels.dispatch`` reads.
The run updates only its own Triton's entries for the buckets it measured (a measured
bucket the Gluon kernel did not win gets ``config: null``); other releases' entries and
unmeasured buckets stay (``kernels/_sm90.merged_table``).  Nothing in the table is typed
by hand:

    python3 bench/sm90_dispatch_table.py OUT/sm90_winners.json \
        [--public OUT/prefill_forward.jsonl --baseline bench/results/prefill_forward.jsonl]

The sweep times the launchers.  A user's eager call also pays the public path's host
time (session 3 run 4 seemed to show ~0.4 ms per call on the Gluon path; session 4's
profile found 0.1-0.17 ms, bench/NOTES.md attempts 14-15).  With ``--public`` (the
public-path records of a run made with the kernel-time table in force, ``bench/forward_h200.py
--phases bench``) and ``--baseline`` (the public-path records before it), a bucket
whose public-path TFLOP/s fell below the baseline's at the same shape is left to the
Triton kernel, and the table lists it under ``dropped`` with both numbers.  A bucket
whose Gluon lead is under ``--min-gain`` (default 2%, within run-to-run spread) is left
to the Triton kernel too, under ``below_min_gain``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "src" / "attnlab" / "kernels" / "sm90_dispatch.json"
sys.path.insert(0, str(TABLE.parents[2]))
from attnlab.kernels._sm90 import merged_table  # noqa: E402
from attnlab.kernels.configs import length_bucket  # noqa: E402
from attnlab.kernels.forward_sm90 import Sm90Config  # noqa: E402


def dispatch_entries(winners: list[dict], min_gain: float) -> tuple[list[dict], list[dict]]:
    """(entries, near misses): the buckets where the best Gluon config beat the Triton
    kernel by at least ``min_gain`` (a smaller lead is within run-to-run noise), and those
    where it won by less."""
    entries, near = [], []
    for row in winners:
        if row["winner"] != "sm90":
            continue
        if row["sm90_vs_triton"] < min_gain:
            near.append({key: row[key] for key in ("head_dim", "causal", "bucket",
                                                    "sm90_config", "sm90_vs_triton")})
            continue
        entries.append({
            "head_dim": row["head_dim"], "causal": row["causal"], "bucket": row["bucket"],
            "config": dataclasses.asdict(Sm90Config.from_name(row["sm90_config"])),
            "sm90_vs_triton": round(row["sm90_vs_triton"], 4),
            "measured_heads": row["heads"],
        })
    return entries, near


def _public_rows(path: Path) -> dict[tuple, dict]:
    """attnlab's prefill records by exact shape."""
    rows = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("provider") == "attnlab" and record.get("phase") == "prefill":
            rows[json.dumps(record["shape"], sort_keys=True)] = record
    return rows


def public_path_drops(entries: list[dict], public: Path, baseline: Path,
                      bucket_of) -> tuple[list[dict], list[dict]]:
    """(entries kept, entries dropped): an entry is dropped when a public-path record of
    its bucket that ran the Gluon kernel is slower than the baseline record at that shape."""
    new, old = _public_rows(public), _public_rows(baseline)
    kept, dropped = [], []
    for entry in entries:
        verdicts = []
        for key, record in new.items():
            shape = record["shape"]
            if (shape["head_dim"], shape["causal"], bucket_of(shape["seqlen_q"])) != (
                    entry["head_dim"], entry["causal"], entry["bucket"]):
                continue
            if not any("sm90" in name for name in record.get("kernel_names", ())):
                continue
            if key in old:
                verdicts.append((record["tflops"], old[key]["tflops"], shape))
        slower = [(n, o, s) for n, o, s in verdicts if n < o]
        if slower:
            n, o, shape = slower[0]
            dropped.append({**entry, "public_tflops": round(n, 1),
                            "baseline_public_tflops": round(o, 1),
                            "shape": {k: shape[k] for k in ("batch", "query_heads", "kv_heads",
                                                            "seqlen_q")}})
        else:
            kept.append(entry)
    return kept, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("winners", type=Path, help="sm90_winners.json from bench/sm90_h200.py")
    parser.add_argument("--out", type=Path, default=TABLE)
    parser.add_argument("--public", type=Path,
                        help="public-path records measured with the kernel-time table")
    parser.add_argument("--baseline", type=Path, help="public-path records before it")
    parser.add_argument("--min-gain", type=float, default=1.02,
                        help="the least Gluon/Triton ratio a bucket needs (default 1.02)")
    args = parser.parse_args()
    if (args.public is None) != (args.baseline is None):
        parser.error("--public and --baseline go together")
    measured = json.loads(args.winners.read_text())
    (entries, near), dropped = dispatch_entries(measured["winners"], args.min_gain), []
    if args.public is not None:
        entries, dropped = public_path_drops(entries, args.public, args.baseline, length_bucket)
    # The committed table, updated for this run's Triton and buckets only: every other
    # release's entries and every unmeasured bucket stay (kernels/_sm90.merged_table).
    current = json.loads(args.out.read_text()) if args.out.exists() else None
    measured_buckets = {(row["head_dim"], row["causal"], row["bucket"])
                        for row in measured["winners"]}
    table = merged_table(current, entries, measured_buckets, measured["env"])
    table["min_gain"] = args.min_gain
    # The buckets left to the Triton kernel, with why, per release (earlier runs' kept).
    release = measured["env"].get("triton")
    for key, rows in (("dropped", dropped), ("below_min_gain", near)):
        earlier = [row for row in table.get(key, []) if row.get("triton") != release]
        table[key] = earlier + [{**row, "triton": release} for row in rows]
        if not table[key]:
            del table[key]
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"Triton {release}: {len(entries)} of {len(measured_buckets)} measured buckets "
          f"dispatch to the Gluon sm_90 kernel -> {args.out}")
    for entry in dropped:
        print(f"  left to the Triton kernel: d={entry['head_dim']} causal={entry['causal']} "
              f"bucket {entry['bucket']}: public path {entry['public_tflops']} < "
              f"{entry['baseline_public_tflops']} TFLOP/s before")
    for entry in near:
        print(f"  left to the Triton kernel: d={entry['head_dim']} causal={entry['causal']} "
              f"bucket {entry['bucket']}: Gluon only {entry['sm90_vs_triton']:.3f}x")


if __name__ == "__main__":
    main()
