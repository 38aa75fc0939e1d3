"""Render the explainer page: one self-contained HTML file, CSS, JS and data inline.

Inline, so the page opens offline from anywhere it is copied to and asks nothing of
the network (no CDN, no fonts, no second file).  The data are the JSON of
:func:`attnlab.explain.data.build_page_data`; this module only renders.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jinja2
from markupsafe import Markup

PAGE_NAME = "index.html"
_PACKAGE = "attnlab.explain"


def _static_text(*parts: str) -> str:
    return resources.files(_PACKAGE).joinpath(*parts).read_text(encoding="utf-8")


def embed_json(data: dict) -> str:
    """JSON safe inside ``<script type="application/json">``.

    ``<`` is escaped so no string can close the script element (``</script>``) or open a
    comment; ``allow_nan=False`` because JSON has no NaN/Infinity (a -inf must be
    turned into text by the data builder first).
    """
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c")


def render_page(data: dict) -> str:
    """The page's HTML for already-built page data."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader(_PACKAGE, "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,  # a missing field is a bug, never an empty cell
        keep_trailing_newline=True,
    )
    template = environment.get_template("page.html.j2")
    return template.render(
        data=data,
        data_json=Markup(embed_json(data)),
        css=Markup(_static_text("static", "explain.css")),
        js=Markup(_static_text("static", "explain.js")),
    )


def write_page(out_dir: Path | str, data: dict, name: str = PAGE_NAME) -> Path:
    """Write the page as ``out_dir/name`` (folder created if needed); returns its path."""
    if not name.endswith(".html") or "/" in name or "\\" in name:
        raise ValueError(f"name must be a file name ending in .html, got {name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(render_page(data), encoding="utf-8")
    return path
