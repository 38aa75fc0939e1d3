"""Write the Gluon sm_90 forward's dispatch table from a measured winners file.

``bench/sm90_h200.py`` times the Gluon kernel against the Triton kernel per (head dim,
causal, length bucket) and writes ``sm90_winners.json``; this script keeps the buckets
where the Gluon kernel measured faster and writes them, with the winning config and the
run's environment, to ``src/attnlab/kernels/sm90_dispatch.json``, which
``attnlab.kernels.forward_sm90.dispatch_config`` reads.  Nothing in the table is typed
by hand:

    python3 bench/sm90_dispatch_table.py OUT/sm90_winners.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "src" / "attnlab" / "kernels" / "sm90_dispatch.json"
CONFIG = re.compile(r"sm90\[n(\d+),s(\d+),r(\d+),(\w+)\]")


def dispatch_entries(winners: list[dict]) -> list[dict]:
    entries = []
    for row in winners:
        if row["winner"] != "sm90":
            continue
        block_n, stages, regs, schedule = CONFIG.fullmatch(row["sm90_config"]).groups()
        entries.append({
            "head_dim": row["head_dim"], "causal": row["causal"], "bucket": row["bucket"],
            "config": {"block_n": int(block_n), "stages": int(stages),
                       "producer_regs": int(regs), "schedule": schedule},
            "sm90_vs_triton": round(row["sm90_vs_triton"], 4),
            "measured_heads": row["heads"],
        })
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("winners", type=Path, help="sm90_winners.json from bench/sm90_h200.py")
    parser.add_argument("--out", type=Path, default=TABLE)
    args = parser.parse_args()
    measured = json.loads(args.winners.read_text())
    table = {"source": measured["env"], "entries": dispatch_entries(measured["winners"])}
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table['entries'])} buckets dispatch to the Gluon sm_90 kernel -> {args.out}")


if __name__ == "__main__":
    main()
