"""Where attnlab writes: the one rule for every output folder, the CLI's and the benches'.

A folder is checked before any work (:func:`check_out_dir`: never empty, never the
current folder or one above it, never inside the installed package, never a file;
nothing is created by the check), and written through :class:`OutputFolder`: into a
staging folder beside it, moved into place only when the run succeeds, attnlab's own
earlier output (named in its manifest) replaced whole, a folder of the user's files
refused unless ``--force``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from attnlab.checks import quote, read_regular_file

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
    package = Path(__file__).resolve().parents[1]
    if absolute.resolve() == package or package in absolute.resolve().parents:
        raise ValueError(f"{name} {quote(str(folder))} is inside the attnlab package "
                         f"({package}): results never go into the package; name a folder "
                         f"of your own")
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
