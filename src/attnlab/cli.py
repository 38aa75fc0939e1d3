"""`attnlab <verb>`: a thin dispatcher with no logic of its own.

Each module in ``attnlab.commands`` adds its verbs through ``register(subparsers)``
and may add a section to ``attnlab demo`` through ``demo(out_dir)`` (ordered by its
``DEMO_ORDER``).  Library errors (ValueError, TypeError, NotImplementedError) become
one line on stderr and exit code 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType


def command_modules() -> list[ModuleType]:
    import attnlab.commands as package

    names = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    return [importlib.import_module(f"attnlab.commands.{name}") for name in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="FlashAttention, made fast and made explainable.",
    )
    subparsers = parser.add_subparsers(dest="verb", metavar="<verb>", required=True)
    for module in command_modules():
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, TypeError, NotImplementedError) as error:
        print(f"attnlab {args.verb}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
