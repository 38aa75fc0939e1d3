"""Parsing and printing shared by the `attnlab` verbs (one definition each).

Every option value is parsed here, so a bad value is always one line naming the
option and what it accepts (the CLI turns the ValueError into exit code 2); every
verb prints through :func:`new_console`; every verb that writes files checks its
output folder with :func:`prepare_out_dir` before doing any work.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from decimal import Decimal, InvalidOperation
from pathlib import Path

from rich.console import Console

from attnlab.checks import QUOTE_LIMIT, check_float, check_window, quote, read_regular_file
from attnlab.dtypes import canonical_dtype

# Lengths the exact models answer for: closed forms, exact integers, up to 2^40 tokens.
MAX_TOKENS = 2**40
CONSOLE_WIDTH = 120


def parse_int(text: str, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An int option in [minimum, maximum], or a ValueError naming the option and the range."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        value = _integral(str(text))
        if value is None:
            raise ValueError(f"{name} must be an int >= {minimum}, got {quote(text)}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {quote(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum:,}, got {quote(value)}")
    return value


def _integral(text: str) -> int | None:
    """'4096', '4_096' or '1e12' as an int (exactly, through Decimal); None if not integral."""
    text = text.strip().replace("_", "")
    if len(text) > 64:  # no length worth typing is longer; bounds the Decimal work
        return None
    try:
        number = Decimal(text)
    except InvalidOperation:
        return None
    if not number.is_finite() or number != number.to_integral_value() or abs(number) > 10**30:
        return None
    return int(number)


def parse_length(text: str, name: str) -> int:
    """A sequence length option: an int in [1, 2^40]."""
    return parse_int(text, name, 1, MAX_TOKENS)


def parse_float(text: str | float, name: str, *, minimum: float | None = None,
                maximum: float | None = None, min_open: bool = False) -> float:
    """A finite float option within the bounds, or a ValueError naming the option."""
    allowed = _range_text(minimum, maximum, min_open)
    try:
        value = float(text) if isinstance(text, str) else check_float(name, text, finite=False)
    except ValueError:
        raise ValueError(f"{name} must be a number{allowed}, got {quote(text)}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{allowed}, got {quote(text)}")
    too_low = minimum is not None and (value <= minimum if min_open else value < minimum)
    if too_low or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be a number{allowed}, got {value:g}")
    return value


def _range_text(minimum, maximum, min_open) -> str:
    if minimum is not None and maximum is not None:
        return f" in {'(' if min_open else '['}{minimum:g}, {maximum:g}]"
    if minimum is not None:
        return f" {'>' if min_open else '>='} {minimum:g}"
    return f" <= {maximum:g}" if maximum is not None else ""


def parse_float_list(text: str, name: str, **bounds) -> list[float]:
    """Comma-separated floats; an empty item (``0.1,,0.2``) is an error, not skipped."""
    items = [item.strip() for item in str(text).split(",")]
    if any(not item for item in items):
        raise ValueError(f"{name} must be comma-separated numbers with no empty item, "
                         f"got {quote(text)}")
    return [parse_float(item, name, **bounds) for item in items]


def parse_int_list(text: str, name: str, minimum: int = 1,
                   maximum: int | None = None) -> list[int]:
    """Comma-separated ints; an empty item is an error, not skipped."""
    items = [item.strip() for item in str(text).split(",")]
    allowed = f">= {minimum}" + ("" if maximum is None else f" and <= {maximum:,}")
    if any(not item for item in items):
        raise ValueError(f"{name} must be comma-separated ints {allowed} with no empty item, "
                         f"got {quote(text)}")
    try:
        return [parse_int(item, name, minimum, maximum) for item in items]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated ints {allowed}, "
                         f"got {quote(text)}") from None


def parse_dtype(text: str, name: str = "--dtype") -> str:
    """A dtype option in any spelling of :mod:`attnlab.dtypes` (``bf16`` or ``bfloat16``),
    as attnlab's short name."""
    return canonical_dtype(text, name)


def parse_window(text: str | None, name: str = "--window") -> tuple[int, int]:
    """``LEFT,RIGHT`` as flash-attn's window_size (-1 = unbounded); None means (-1, -1)."""
    if text is None:
        return (-1, -1)
    parts = str(text).split(",")
    if len(parts) != 2:
        raise ValueError(f"{name} must be LEFT,RIGHT (ints >= -1, -1 = unbounded), "
                         f"got {quote(text)}")
    window = (parse_int(parts[0], f"{name} LEFT", -1, MAX_TOKENS),
              parse_int(parts[1], f"{name} RIGHT", -1, MAX_TOKENS))
    return check_window(window, name=name)


# ----- output folders: the one home of the rule ------------------------------------------------
# attnlab's mark on a folder it wrote: what it wrote there, so a later run can tell its own
# earlier output (replaced whole) from a user's files (refused unless --force).
MANIFEST_NAME = "attnlab-manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
# What a run writes while it works: a hidden sibling, renamed into place when it succeeds.
STAGING_PREFIX = ".attnlab-partial-"
FOREIGN_SHOWN = 3


def check_out_dir(path: str | os.PathLike, name: str = "--out") -> Path:
    """The folder ``path`` names, if attnlab could create or write it; a ValueError otherwise.

    Creates nothing (a failed command leaves nothing behind).  Refused: an empty path (it
    would mean the current folder), a name longer than the file system takes, an existing
    file or device, a path under a file, and a folder that cannot be created or written
    (probed with a temporary folder, removed at once).
    """
    text = os.fspath(path)
    if not str(text).strip():
        raise ValueError(f"{name} must name a folder, got an empty path")
    folder = Path(text)
    limit = _name_limit(Path("."))
    too_long = next((part for part in folder.parts if len(os.fsencode(part)) > limit), None)
    if too_long is not None:
        raise ValueError(f"{name}: the name {quote(too_long)} is longer than the {limit} bytes "
                         f"a file name may have")
    absolute = Path(os.path.abspath(folder))
    if Path.cwd() == absolute or absolute in Path.cwd().parents:
        raise ValueError(f"{name} must not be the current folder or one above it, got "
                         f"{quote(text)}: name a folder for attnlab's files")
    anchor = _nearest_existing(absolute, name)
    if anchor == absolute and not absolute.is_dir():
        kind = "a file" if absolute.is_file() else "not a folder"
        raise ValueError(f"{name} must be a folder (created if missing); {quote(str(folder))} "
                         f"is {kind}")
    if not anchor.is_dir():
        raise ValueError(f"{name}: {quote(str(folder))} is under {quote(str(anchor))}, "
                         f"which is not a folder")
    try:  # the staging folder goes beside the target: probe there
        os.rmdir(tempfile.mkdtemp(prefix=STAGING_PREFIX,
                                  dir=_nearest_existing(absolute.parent, name)))
    except OSError as error:
        raise ValueError(f"{name}: cannot create {quote(str(folder))}: "
                         f"{error.strerror or error}") from None
    if absolute.is_dir() and not os.access(absolute, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: the folder {quote(str(folder))} is not writable")
    return absolute


def _nearest_existing(folder: Path, name: str) -> Path:
    """``folder`` or its nearest ancestor that exists (the current folder for a relative
    path with none); a path through a file stops at the file."""
    for candidate in (folder, *folder.parents):
        try:
            if candidate.exists() or candidate.is_symlink():
                return candidate
        except OSError as error:  # a component too long, a loop of links
            raise ValueError(f"{name}: {quote(str(folder))}: {error.strerror or error}") from None
    return Path(os.sep)


def _name_limit(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


class OutputFolder:
    """Where one verb's files go: written into a staging folder beside the target, then
    moved into place only when the verb succeeds (``with prepare_out_dir(...) as staging``).

    The target afterwards holds exactly this run's files and :data:`MANIFEST_NAME` listing
    them: attnlab's own earlier output is replaced whole, never mixed with the new run's.
    A folder holding files attnlab did not write (no manifest, or files it does not list)
    is refused before any work unless ``force``; then the new files are written beside the
    user's (replacing those of the same name) and the earlier run's listed files removed.
    A run that fails removes its staging folder: nothing is created.
    """

    def __init__(self, path: Path, *, name: str, force: bool) -> None:
        self.path = path
        self.name = name
        self.force = force
        self.previous, self.foreign = _ownership(path, name)
        if self.foreign and not force:
            shown = ", ".join(quote(f) for f in self.foreign[:FOREIGN_SHOWN])
            more = f" and {len(self.foreign) - FOREIGN_SHOWN} more" if len(
                self.foreign) > FOREIGN_SHOWN else ""
            raise ValueError(f"{name}: {quote(str(path))} holds files attnlab did not write "
                             f"({shown}{more}); name a new or empty folder, or pass --force "
                             f"to write beside them")
        self.staging: Path | None = None

    def __enter__(self) -> Path:
        anchor = _nearest_existing(self.path.parent, self.name)
        self.staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=anchor))
        return self.staging

    def __exit__(self, kind, error, trace) -> bool:
        if kind is None:
            self._commit()
        else:
            shutil.rmtree(self.staging, ignore_errors=True)
        return False

    def final(self, staged: str | os.PathLike) -> Path:
        """Where a file written into the staging folder ends up."""
        return self.path / Path(staged).relative_to(self.staging)

    def _commit(self) -> None:
        staging = self.staging
        files = _files_under(staging)
        (staging / MANIFEST_NAME).write_text(json.dumps(
            {"written_by": "attnlab", "note": "attnlab replaces this folder whole on its next "
             "run into it; files not listed here make it refuse (unless --force)",
             "files": files}, indent=1) + "\n", encoding="utf-8")
        target = self.path
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging, target)
        elif not self.foreign:  # empty, or attnlab's own earlier output: replaced whole
            old = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target.parent))
            os.rename(target, old / "old")
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:  # --force beside a user's files: theirs stay, attnlab's earlier ones go
            for relative in self.previous:
                stale = target / relative
                if stale.is_file() and not stale.is_symlink():
                    stale.unlink()
            for relative in [*files, MANIFEST_NAME]:
                destination = target / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / relative, destination)
            shutil.rmtree(staging, ignore_errors=True)


def _files_under(folder: Path) -> list[str]:
    """Every file (and link) under ``folder``, relative, without following links."""
    found = []
    for root, folders, names in os.walk(folder, followlinks=False):
        base = Path(root).relative_to(folder)
        found += [(base / n).as_posix() for n in names]
        found += [(base / d).as_posix() for d in folders if (Path(root) / d).is_symlink()]
    return sorted(f for f in found if f != MANIFEST_NAME)


def _ownership(folder: Path, name: str) -> tuple[list[str], list[str]]:
    """(files attnlab's manifest in ``folder`` lists, files in it that the manifest does
    not list); a missing folder has neither."""
    if not folder.is_dir():
        return [], []
    present = _files_under(folder)
    listed: list[str] = []
    manifest = folder / MANIFEST_NAME
    if manifest.is_file() and not manifest.is_symlink():
        try:
            data = json.loads(read_regular_file(manifest, "manifest", MAX_MANIFEST_BYTES))
            if (isinstance(data, dict) and data.get("written_by") == "attnlab"
                    and all(isinstance(f, str) for f in data.get("files", ()))):
                listed = list(data["files"])
        except (ValueError, RecursionError):
            listed = []  # not attnlab's manifest after all: its files count as the user's
    known = set(listed)
    foreign = [f for f in present if f not in known]
    if manifest.exists() and not listed:
        foreign.insert(0, MANIFEST_NAME)
    return listed, foreign


def add_force_argument(parser) -> None:
    """``--force``, the one flag that lets a verb write into a folder holding other files."""
    parser.add_argument("--force", action="store_true",
                        help="write into --out even when it holds files attnlab did not write "
                             "(they are kept; those of the same name are replaced)")


def prepare_out_dir(path: str | os.PathLike, name: str = "--out", *,
                    force: bool = False) -> OutputFolder:
    """The output folder of a verb that writes files, checked before any work is done
    (:func:`check_out_dir`, then :class:`OutputFolder`'s ownership rule); use it as
    ``with prepare_out_dir(args.out, force=args.force) as staging: write into staging``."""
    folder = check_out_dir(path, name)
    if folder.is_symlink():  # rename the folder it points to, not the link
        folder = Path(os.path.realpath(folder))
    return OutputFolder(folder, name=name, force=force)


def new_console(width: int = CONSOLE_WIDTH) -> Console:
    """The one console every verb prints through (fixed width when not a terminal)."""
    # Looked up at call time so redirected or captured stdout is honoured.
    return Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else width)


def json_safe(value):
    """JSON has no infinities (an online-softmax walk starts at m = -inf): write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def dumps(report: dict) -> str:
    return json.dumps(json_safe(report), indent=2, allow_nan=False)


def ranges(numbers) -> str:
    """[1, 2, 3, 5] -> '1-3, 5' (empty -> 'none'); a list of ``range`` objects works too."""
    spans = []
    for item in numbers:
        first, last = (item.start, item.stop - 1) if isinstance(item, range) else (item, item)
        if isinstance(item, range) and not len(item):
            continue
        if spans and first == spans[-1][1] + 1:
            spans[-1][1] = last
        else:
            spans.append([first, last])
    if not spans:
        return "none"
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


__all__ = ["CONSOLE_WIDTH", "add_force_argument", "MAX_TOKENS", "QUOTE_LIMIT", "dumps", "json_safe", "new_console",
           "parse_dtype", "parse_float", "parse_float_list", "parse_int", "parse_int_list", "parse_length",
           "parse_window", "check_out_dir", "prepare_out_dir", "OutputFolder", "MANIFEST_NAME",
           "ranges"]
