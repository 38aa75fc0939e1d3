"""The one benchmark engine: registered phases, one time budget, an output folder, the
environment captured once, records written through :mod:`attnlab.measure.records`.

Every ``bench/*_h200.py`` script and ``attnlab bench`` is a configuration of it: a
:class:`Bench` with its phases and a few options of its own::

    bench = Bench("forward_h200", __doc__, budget_s=None)

    @bench.phase(cap_s=200, plan=tune_points)      # --tune-budget, default 200 s
    def tune(ctx):
        for point in ctx.within_budget(ctx.plan):  # stops cleanly when time runs out
            ...
            ctx.upsert("forward_tuning.jsonl", records)

    if __name__ == "__main__":
        sys.exit(bench.main())

The engine owns what each script used to write again:

* **flags**: ``--phases`` (comma-separated; an unknown name is refused by name),
  ``--out`` (the folder the user names, default ``$OUT`` or ``./attnlab-results``;
  checked before any work, created when the first file is written, never inside the
  installed package), ``--budget`` (or ``--budget-s``: seconds shared by the phases), ``--list`` (the
  phases and how many points each would measure: no GPU needed), ``--<phase>-budget``
  for a phase with a cap of its own, and ``--device`` where a script runs on the CPU too;
* **the budget**: the selected phases run in registration order; each gets the time the
  run has left, or its own cap if that ends first.  :meth:`Context.within_budget` hands a
  phase its points while time lasts and notes the rest; a phase the budget never reached
  is noted too, and the notes are printed last ("left unmeasured");
* **a plan per phase** (optional): ``plan(args) -> list`` builds the phase's points
  (shapes, providers, configs) from the options alone, before any GPU work, so a bad
  option is refused at once and ``tests/test_bench_engine.py`` builds every plan on a CPU;
* **the environment**: :func:`records.environment` once per run (on first use), with the
  command that reproduces it;
* **writing**: :meth:`Context.upsert` (contract records, CSV twin beside them),
  :meth:`Context.write_rows` and :meth:`Context.append_row` (a phase's own JSON lines:
  correctness rows, tuning logs, kernel lists).

A phase that raises is a failure: its traceback is printed and the next phase runs.  The
exit status is 0, 1 when a phase failed (or counted failures with :meth:`Context.fail`),
2 when the run could not start (bad option, no GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.measure.outputs import check_out_dir

DEFAULT_OUT = "attnlab-results"
BUDGET_SPENT = "not measured: the run's time budget was spent before this point"
# Labels of unmeasured points shown in the closing notes; the count says the rest.
SHOWN_UNMEASURED = 6


class Unavailable(Exception):
    """The run cannot start here (no GPU, no sm_90 kernel); the message says why (exit 2)."""


@dataclass(frozen=True)
class Phase:
    name: str
    run: Callable            # (Context) -> anything; kept in Context.results[name]
    help: str
    default: bool = True     # in the default --phases
    cap_s: float | None = None  # its own time cap (--<name>-budget), inside the run's budget
    plan: Callable | None = None  # (args) -> list of points, built before any GPU work

    @property
    def budget_option(self) -> str:
        return f"--{self.name.replace('_', '-')}-budget"


@dataclass
class Context:
    """What a phase gets: the options, the output folder, the environment, the budget."""

    args: argparse.Namespace
    out_dir: Path
    command: str
    device: str
    run_deadline: float = math.inf
    phases: list[str] = field(default_factory=list)  # the selected phases, in run order
    phase: str = ""
    plan: list | None = None
    deadline: float = math.inf
    results: dict = field(default_factory=dict)  # by phase name (and what setup keeps)
    unmeasured_notes: list[str] = field(default_factory=list)
    failures: int = 0
    _env: dict | None = None

    # ----- environment ---------------------------------------------------------------------
    @property
    def env(self) -> dict:
        """The machine/software part of every record, captured once, on first use."""
        if self._env is None:
            from attnlab.measure import records as rec

            # Paths in the command relative to the output folder, as records' are: every
            # row and file a phase writes with the environment (not only the records,
            # which upsert makes portable) names no path of the machine that ran it.
            self._env = rec.environment(rec.portable_command(self.command, self.out_dir))
            say(rec.describe_environment(self._env))
        return self._env

    # ----- budget --------------------------------------------------------------------------
    def spent(self) -> bool:
        """True once this phase's time (its cap or the run's budget, whichever ends first)
        is over."""
        return time.monotonic() > self.deadline

    def within_budget(self, items: Iterable, label: Callable = str) -> Iterator:
        """The items, one by one, while the phase has time; the rest are noted as
        unmeasured (by ``label``) and the phase stops cleanly."""
        items = list(items)
        for index, item in enumerate(items):
            if self.spent():
                self.unmeasured(items[index:], label)
                return
            yield item

    def unmeasured(self, items: Sequence, label: Callable = str) -> None:
        """Note points this phase left unmeasured (printed now and again at the end)."""
        if not items:
            return
        names = ", ".join(str(label(item)) for item in items[:SHOWN_UNMEASURED])
        more = f" and {len(items) - SHOWN_UNMEASURED} more" if len(items) > SHOWN_UNMEASURED else ""
        note = f"{self.phase}: {len(items)} point(s), the time budget spent: {names}{more}"
        self.unmeasured_notes.append(note)
        say(note)

    def fail(self, count: int = 1) -> None:
        """Count failures (a wrong result, a crashed case): the run exits 1."""
        self.failures += int(count)

    def check_case(self, name: str, fn: Callable, rows_file: str = "correctness.jsonl") -> dict:
        """One correctness case, ``fn() -> (passed, detail)``: timed; an exception is a
        failed case with its message (traceback printed) and the run goes on; the row is
        appended to ``out/rows_file`` at once and a failure counted."""
        start = time.monotonic()
        try:
            passed, detail = fn()
        except Exception as error:  # noqa: BLE001 -- a crashed case is a recorded failure
            passed, detail = False, f"{type(error).__name__}: {error}"
            traceback.print_exc()
        row = {"what": name, "passed": bool(passed), "detail": detail,
               "seconds": round(time.monotonic() - start, 2), **self.env}
        self.append_row(rows_file, row)
        self.fail(not passed)
        say(f"{'ok  ' if passed else 'FAIL'} {name}: {detail}")
        return row

    # ----- writing -------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """``out/name``, the folder (and any subfolder in ``name``) created on first use."""
        path = self.out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def upsert(self, name: str, records: Iterable[dict]) -> tuple[int, int]:
        """Contract records into ``out/name`` (upsert by key; the CSV twin rewritten)."""
        from attnlab.measure.records import upsert_records

        return upsert_records(self.path(name), records)

    def write_rows(self, name: str, rows: Iterable[dict]) -> Path:
        """A phase's own JSON lines into ``out/name``, replacing the file."""
        path = self.path(name)
        path.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows),
                        encoding="utf-8")
        return path

    def append_row(self, name: str, row: dict) -> None:
        """One JSON line appended to ``out/name`` (written at once: a run stopped by its
        time limit keeps every row it logged)."""
        with self.path(name).open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, default=str) + "\n")


class Bench:
    """A benchmark: its phases (in the order they run), its own options, its defaults."""

    def __init__(self, name: str, description: str | None = None, *,
                 command: str | None = None, budget_s: float | None = None,
                 devices: tuple[str, ...] = ("cuda",), needs_cuda: str = "needs a CUDA GPU",
                 out_default: str | None = None) -> None:
        self.name = name
        self.description = description
        # The command that reproduces a run, completed with its argv.
        self.command = command or f"PYTHONPATH=src python3 bench/{name}.py"
        self.budget_s = budget_s
        self.devices = devices
        self.needs_cuda = needs_cuda
        self.out_default = out_default
        self.phases: dict[str, Phase] = {}
        self._arguments: list[tuple[tuple, dict]] = []
        self._setup: Callable | None = None
        self._finish: Callable | None = None

    # ----- configuration -------------------------------------------------------------------
    def phase(self, name: str | None = None, *, default: bool = True, cap_s: float | None = None,
              plan: Callable | None = None) -> Callable:
        """Register the decorated ``fn(ctx)`` as a phase (its docstring's first line is its
        help); phases run in the order they are registered."""
        def register(fn: Callable) -> Callable:
            phase_name = name or fn.__name__
            if phase_name in self.phases:
                raise ValueError(f"phase {phase_name!r} is registered twice in {self.name}")
            help_text = _first_sentence(fn.__doc__ or "")
            self.phases[phase_name] = Phase(phase_name, fn, help_text, default, cap_s, plan)
            return fn
        return register

    def option(self, *flags: str, **kwargs) -> None:
        """An option of this benchmark's own (``argparse.add_argument``'s arguments)."""
        self._arguments.append((flags, kwargs))

    def setup(self, fn: Callable) -> Callable:
        """``fn(ctx)`` runs once before the phases (may raise :class:`Unavailable`)."""
        self._setup = fn
        return fn

    def finish(self, fn: Callable) -> Callable:
        """``fn(ctx)`` runs once after the phases, crashed ones included (tables, summaries)."""
        self._finish = fn
        return fn

    # ----- options -------------------------------------------------------------------------
    def default_phases(self) -> list[str]:
        return [p.name for p in self.phases.values() if p.default]

    def add_arguments(self, parser: argparse.ArgumentParser, *,
                      phases_aliases: tuple[str, ...] = ()) -> None:
        """The common flags, each capped phase's ``--<phase>-budget``, and the bench's own."""
        group = parser.add_argument_group("run (the benchmark engine)")
        group.add_argument("--phases", *phases_aliases, default=",".join(self.default_phases()),
                           help=f"comma-separated, of {', '.join(self.phases)} (default "
                                f"{','.join(self.default_phases())}); they run in that order")
        group.add_argument("--out", default=None,
                           help=f"output folder (default {self.out_default or '$OUT or ./' + DEFAULT_OUT}"
                                "; created when the first file is written)")
        group.add_argument("--budget", "--budget-s", type=float, default=self.budget_s,
                           help="seconds shared by the phases; each stops cleanly when it "
                                f"runs out (default {self.budget_s or 'none'})")
        group.add_argument("--list", action="store_true",
                           help="list the phases and the points each would measure, then stop")
        if len(self.devices) > 1:
            group.add_argument("--device", choices=self.devices, default=self.devices[0],
                               help=f"where to run (default {self.devices[0]}; cpu: a smoke run "
                                    "of the script under TRITON_INTERPRET=1, numbers meaningless)")
        for phase in self.phases.values():
            if phase.cap_s is not None:
                group.add_argument(phase.budget_option, type=float, default=phase.cap_s,
                                   help=f"the {phase.name} phase's own cap in seconds "
                                        f"(default {phase.cap_s:g})")
        for flags, kwargs in self._arguments:
            parser.add_argument(*flags, **kwargs)

    def parser(self) -> argparse.ArgumentParser:
        first = (self.description or self.name).strip().split("\n")[0]
        parser = argparse.ArgumentParser(prog=f"bench/{self.name}.py", description=first)
        self.add_arguments(parser)
        return parser

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        return self.parser().parse_args(argv)

    def selected(self, args: argparse.Namespace) -> list[Phase]:
        """The phases ``--phases`` names, in registration order; an unknown one refused."""
        names = [part.strip() for part in str(args.phases).split(",") if part.strip()]
        unknown = [n for n in names if n not in self.phases]
        if unknown or not names:
            what = f"unknown phase {unknown[0]!r}" if unknown else "no phase named"
            raise ValueError(f"--phases: {what}; the phases of {self.name} are "
                             f"{', '.join(self.phases)}")
        return [p for p in self.phases.values() if p.name in names]

    def plans(self, args: argparse.Namespace, phases: Iterable[Phase] | None = None) -> dict:
        """Each phase's plan built from the options (None for a phase without one)."""
        chosen = self.phases.values() if phases is None else phases
        return {p.name: (None if p.plan is None else list(p.plan(args))) for p in chosen}

    # ----- running -------------------------------------------------------------------------
    def main(self, argv: Sequence[str] | None = None) -> int:
        """A script's entry point: parse, check, run; a bad option or an unusable machine
        is one line on stderr and exit 2."""
        args = self.parse(argv)
        try:
            started = self.start(args, sys.argv[1:] if argv is None else list(argv))
        except ValueError as error:
            print(f"{self.name}: {error}", file=sys.stderr)
            return 2
        return started if isinstance(started, int) else self.execute(*started)

    def run(self, args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
        """Check and run (``attnlab bench``: the CLI turns a ValueError into exit 2)."""
        started = self.start(args, argv)
        return started if isinstance(started, int) else self.execute(*started)

    def start(self, args: argparse.Namespace, argv: Sequence[str] | None):
        """Everything checked before any work: the phases, the output folder, each selected
        phase's plan, the device.  An exit status (``--list`` done, no GPU) or what
        :meth:`execute` takes."""
        selected = self.selected(args)
        out_dir = check_out_dir(args.out or self.out_default or os.environ.get("OUT")
                                or DEFAULT_OUT)
        if args.list:
            self._print_list(args)
            return 0
        plans = self.plans(args, selected)
        device = getattr(args, "device", self.devices[0])
        if device == "cuda" and not _cuda_available():
            print(f"{self.name}: {self.needs_cuda}", file=sys.stderr)
            return 2
        command = self.command if not argv else f"{self.command} {shlex.join(argv)}"
        budget = math.inf if args.budget is None else float(args.budget)
        ctx = Context(args=args, out_dir=out_dir, command=command, device=device,
                      run_deadline=time.monotonic() + budget,
                      phases=[p.name for p in selected])
        return ctx, selected, plans

    def execute(self, ctx: Context, selected: list[Phase], plans: dict) -> int:
        """Setup, the phases in order within the budget, finish, the notes; the exit status."""
        try:
            return self._execute(ctx, selected, plans)
        except Unavailable as reason:
            print(f"{self.name}: {reason}", file=sys.stderr)
            return 2

    def _execute(self, ctx: Context, selected: list[Phase], plans: dict) -> int:
        started = time.monotonic()
        if self._setup is not None:
            self._setup(ctx)
        for phase in selected:
            cap = getattr(ctx.args, phase.budget_option[2:].replace("-", "_"), None) \
                if phase.cap_s is not None else None
            now = time.monotonic()
            ctx.phase, ctx.plan = phase.name, plans[phase.name]
            ctx.deadline = min(ctx.run_deadline, now + cap if cap is not None else math.inf)
            if now > ctx.run_deadline:
                note = f"{phase.name}: the whole phase, the run's time budget spent before it"
                ctx.unmeasured_notes.append(note)
                say(note)
                continue
            say(f"\n=== {phase.name} (t={now - started:.0f} s) ===")
            try:
                ctx.results[phase.name] = phase.run(ctx)
            except Unavailable:
                raise
            except Exception:  # noqa: BLE001 - a crashed phase is a failure; the next one runs
                traceback.print_exc()
                say(f"{phase.name}: crashed (traceback above)")
                ctx.fail()
        ctx.phase, ctx.plan, ctx.deadline = "", None, ctx.run_deadline
        if self._finish is not None:
            self._finish(ctx)
        for note in ctx.unmeasured_notes:
            say(f"left unmeasured: {note}")
        say(f"{self.name}: {len(selected)} phase(s), {ctx.failures} failure(s), "
            f"{time.monotonic() - started:.0f} s")
        return 1 if ctx.failures else 0

    def _print_list(self, args: argparse.Namespace) -> None:
        plans = self.plans(args)
        print(f"{self.name}: phases in the order they run (* = run by default)")
        for phase in self.phases.values():
            plan = plans[phase.name]
            points = "" if plan is None else f" [{len(plan)} points]"
            cap = "" if phase.cap_s is None else f" (cap {phase.cap_s:g} s, {phase.budget_option})"
            print(f"  {'*' if phase.default else ' '} {phase.name}{points}{cap}: {phase.help}")


def say(text: str) -> None:
    """The engine's own lines (phase headers, notes, the closing line) go to stderr, so a
    configuration's stdout holds only what it prints itself (``attnlab bench --json``)."""
    print(text, file=sys.stderr, flush=True)


def _first_sentence(text: str) -> str:
    """A docstring's first sentence on one line (a phase's help in ``--list``)."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
