"""The hostile-input fuzz (issue #28) as a counts table, for the reliability docs.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/fuzz_report.py [--draws 200] [--show 5]

Runs ``--draws`` draws of the property test's strategy
(``tests/test_api_fuzz.py::hostile_cases``, derandomized: the same draws every run on
the same versions) through ``run_hostile`` and prints how many ended in a clean error
naming the argument, an answer equal to the float64 math, a wrong answer (or a refusal
that names the wrong thing), or a traceback -- per family and in total -- then the first
``--show`` wrong and traceback draws.  CPU: set TRITON_INTERPRET=1 so the kernels run in
Triton's interpreter (without it only impl="reference" runs); on a GPU drop it.  Exits 1
when any draw is wrong or a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_api_fuzz import DEVICE, HOSTILE_FAMILIES, hostile_cases, run_hostile  # noqa: E402

OUTCOMES = ("clean error", "correct", "wrong", "traceback")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=200, help="draws to run (default 200)")
    parser.add_argument("--show", type=int, default=5, help="bad draws to print (default 5)")
    args = parser.parse_args()
    counts: Counter = Counter()
    bad: list[str] = []

    @settings(max_examples=args.draws, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(hostile_cases())
    def draw(case):
        outcome, detail = run_hostile(case)
        counts[(case.family, outcome)] += 1
        if outcome in ("wrong", "traceback"):
            bad.append(f"{outcome}: {case}\n    {detail}")

    draw()
    width = max(len(f) for f in (*HOSTILE_FAMILIES, "total"))
    print(f"hostile fuzz on {DEVICE}: {sum(counts.values())} draws")
    print(f"{'family':<{width}}  " + "  ".join(f"{o:>11}" for o in OUTCOMES))
    for family in (*HOSTILE_FAMILIES, "total"):
        row = [sum(n for (f, o), n in counts.items() if o == outcome and family in (f, "total"))
               for outcome in OUTCOMES]
        print(f"{family:<{width}}  " + "  ".join(f"{n:>11}" for n in row))
    for line in bad[:args.show]:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
