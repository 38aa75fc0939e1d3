"""``attnlab report``: one-page latency attribution with Amdahl's law across boundaries.

``workload`` (the input file), ``trace`` (attention time share from a profiler trace),
``records`` (a measured kernel speedup), ``attribution`` (every number), ``render``
(HTML, Markdown, JSON, SVG), and ``measure`` + ``decoder`` (the GPU check of the
projection).  Schema and rules: docs/report.md.
"""
