"""The interactive explainer page: data from attnlab's models, rendered offline.

- :func:`build_page_data` (``data.py``): every number the page shows, as JSON-ready values.
- :func:`render_page` / :func:`write_page` (``page.py``): one self-contained HTML file.

Nothing here launches a kernel; measured numbers are read from result records.
"""

from attnlab.explain.data import build_page_data
from attnlab.explain.page import render_page, write_page

__all__ = ["build_page_data", "render_page", "write_page"]
