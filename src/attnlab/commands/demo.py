"""`attnlab demo`: everything attnlab can do, on the lesson's default workload."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path("attnlab-demo")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="analyse the lesson's default workload end to end",
        description="Run every section (reference trace, tile plan, models, report, page, "
                    "and on a CUDA machine the measurements) and write results to --out.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default: ./{DEFAULT_OUT})")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.cli import command_modules

    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = [m for m in command_modules() if hasattr(m, "demo")]
    sections.sort(key=lambda m: getattr(m, "DEMO_ORDER", 100))
    for module in sections:
        module.demo(out_dir)
    print(f"\nattnlab demo: results written to {out_dir.resolve()}")
    return 0
