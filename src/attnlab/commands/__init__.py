"""The verbs of `attnlab`, one module per group; ``attnlab.cli`` registers them in this order.

``DEMO_SECTIONS`` is the one list of what ``attnlab demo`` runs, in order: each entry
is ``(section, function)``; the function takes the folder to write into and the demo's
``--records`` folder (None: the committed results), and returns the records it
measured (the measure section on a GPU) or None.  The demo verb reads this list; it
never discovers modules or imports ``attnlab.cli``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from attnlab.commands import explain, measure, models, reference, report

# The verb modules, in `attnlab --help` order (demo, which runs the others, comes last).
VERB_MODULES = (reference, models, report, explain, measure)

DEMO_SECTIONS: tuple[tuple[str, Callable[[Path, Path | None], list[dict] | None]], ...] = (
    ("reference", reference.demo),
    ("models", models.demo),
    ("report", report.demo),
    ("explain", explain.demo),
    ("measure", measure.demo),
)
