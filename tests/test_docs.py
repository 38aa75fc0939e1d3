"""The README is the front door: two commands first, short, every number from a record."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
README_LINES_LIMIT = 230


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables",
                                                  REPO / "bench" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_starts_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert README.index("```bash") < README.index("\n## "), "the commands come first"
    commands = [line for line in first_block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2
    assert "pip install" in commands[0] and "attnlab demo" in commands[0]
    assert commands[1] == "TRITON_INTERPRET=1 python3 -m pytest -q"


def test_the_readme_is_short():
    assert len(README.splitlines()) <= README_LINES_LIMIT


def test_every_performance_table_is_printed_from_its_records():
    tables = _readme_tables()
    for name, build in tables.TABLES.items():
        source = f"bench/results/{tables.SOURCES[name]}"
        assert (REPO / source).is_file(), source
        assert source in README, f"the {name} table does not name its records file"
        assert "\n".join(build()) in README, (
            f"the README's {name} table differs from `python3 bench/readme_tables.py {name}`")


def test_the_seed_tables_are_printed_from_their_records():
    tables = _readme_tables()
    for name, build in tables.SEED_TABLES.items():
        for file in tables.SEED_SOURCES[name]:
            source = f"bench/results/{file}"
            assert (REPO / source).is_file(), source
            assert source in README, f"the {name} table does not name its records file {source}"
        assert "\n".join(build()) in README, (
            f"the README's {name} table differs from `python3 bench/readme_tables.py {name}`")


def test_every_local_link_resolves():
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://", target):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(REPO)} links {target}"
