"""`attnlab <verb>`: a thin dispatcher with no logic of its own.

The verbs come from an explicit table (``attnlab.commands.VERB_MODULES`` plus the
demo); each module adds its verbs through ``register(subparsers)``.  Bare ``attnlab``
prints the help (exit 0).  Library errors (ValueError, TypeError, NotImplementedError)
and the operating system's refusals (OSError: a name too long, a full disk) become one
line on stderr and exit code 2, like argparse's own usage errors; a closed pipe
(``attnlab traffic --json | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

# The CLI is the lab's front door: it needs what `pip install "attnlab[lab]"` adds to the
# kernels (import names; pyproject.toml's `lab` extra lists the packages).
LAB_DEPENDENCIES = ("rich", "jinja2", "matplotlib", "yaml")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def missing_lab_dependencies() -> list[str]:
    return [name for name in LAB_DEPENDENCIES if not _importable(name)]


def verb_modules() -> list[ModuleType]:
    """Every module that registers verbs, in order: the table, then ``demo``."""
    from attnlab.commands import VERB_MODULES, demo

    return [*VERB_MODULES, demo]


def build_parser() -> argparse.ArgumentParser:
    from attnlab import __version__

    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="FlashAttention, made fast and made explainable.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="<verb>")
    for module in verb_modules():
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    missing = missing_lab_dependencies()
    if missing:
        print(f"attnlab: the command line is part of attnlab's lab, which needs "
              f"{', '.join(missing)}: pip install \"attnlab[lab]\" (the kernels, "
              f"`import attnlab`, need none of it)", file=sys.stderr)
        return 2
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.verb is None:  # bare `attnlab`: what it can do, not an error
            parser.print_help()
            return 0
        try:
            return int(args.run(args) or 0)
        except (ValueError, TypeError, NotImplementedError, OSError) as error:
            if isinstance(error, BrokenPipeError):
                raise
            print(f"attnlab {args.verb}: error: {one_line(error)}", file=sys.stderr)
            return 2
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): stop writing, and keep Python from printing a
        # second BrokenPipeError when it flushes stdout at exit.
        with contextlib.suppress(OSError, ValueError):  # a captured stdout has no descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def one_line(error: Exception) -> str:
    """The error as one short line; an OSError as its reason and a prefix of its path."""
    from attnlab.checks import quote

    if isinstance(error, OSError) and error.strerror:
        where = f": {quote(str(error.filename))}" if error.filename is not None else ""
        return f"{error.strerror}{where}"
    return " ".join(str(error).split())


if __name__ == "__main__":
    sys.exit(main())
