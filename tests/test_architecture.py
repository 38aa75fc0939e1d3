"""The one-way house of ARCHITECTURE.md, checked on every module's imports.

Every ``import`` and ``from ... import`` in ``src/attnlab`` is read with ``ast`` --
module level, inside functions, under ``if TYPE_CHECKING`` alike -- and each one
must point to the importer's own room or a room below it; no two modules may reach
each other through imports (no cycle).  A new module lands in the room of its
package; a new package needs a row in ``ROOMS`` (and in ARCHITECTURE.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "attnlab"

# Rooms from the ground floor up; a module may import its own room and any room below.
# The package root ``attnlab`` (attnlab/__init__.py) re-exports the API, so it sits
# with the API: `import attnlab` from below the API is an upward import.
CORE_ROOMS: tuple[tuple[str, ...], ...] = (
    ("attnlab.checks", "attnlab.dtypes", "attnlab.shapes", "attnlab.masking"),  # pure Python
    ("attnlab.inputs",),                                      # the call value (torch)
    ("attnlab.reference",),                                   # the CPU oracle (torch)
    ("attnlab.kernels",),                                     # Triton kernels, launchers
    ("attnlab.api", "attnlab.accuracy", "attnlab"),           # the public calls, the rule
    ("attnlab.distributed", "attnlab.integrations"),          # built on the public calls
)
# The lab stands on the core and nothing of the core stands on it: `pip install attnlab`
# without the [lab] extra runs every core module.
LAB_ROOMS: tuple[tuple[str, ...], ...] = (
    ("attnlab.model",),                                       # exact models, pure Python
    ("attnlab.measure",),                                     # providers, timing, records
    ("attnlab.report", "attnlab.explain"),                    # renderers of records
    ("attnlab.commands",),                                    # argparse and printing
    ("attnlab.cli",),                                         # the dispatcher
)
ROOMS = CORE_ROOMS + LAB_ROOMS
# Modules that must not import torch or numpy (the models and the ground floor run
# without a tensor library).
PURE_ROOMS = ("attnlab.checks", "attnlab.dtypes", "attnlab.shapes", "attnlab.masking",
              "attnlab.model")
TENSOR_LIBRARIES = ("torch", "numpy", "triton")
# What the [lab] extra installs (pyproject.toml); the core imports none of it.
LAB_LIBRARIES = ("rich", "jinja2", "matplotlib", "yaml")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved."""
    name = module_name(path)
    package = name if is_package(path) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from attnlab.model import traffic` imports the module attnlab.model.traffic
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(target: str) -> str | None:
    """The attnlab module an import refers to (the longest existing prefix), else None."""
    parts = target.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def room_of(module: str) -> int:
    best, best_length = None, -1
    for rank, room in enumerate(ROOMS):
        for prefix in room:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = rank, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no room of ROOMS: add its package to ROOMS and "
                             f"to ARCHITECTURE.md")
    return best


def import_graph() -> dict[str, dict[str, int]]:
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        edges = graph.setdefault(name, {})
        for target, line in imports_of(path):
            resolved = resolve(target)
            if resolved is not None and resolved != name and not _is_own_package(name, resolved):
                edges.setdefault(resolved, line)
    return graph


def _is_own_package(module: str, target: str) -> bool:
    """A submodule importing its own package's __init__ (``from attnlab.x import y`` inside
    attnlab.x.z resolves to attnlab.x when y is not a module): not an edge of the house."""
    return module.startswith(target + ".") and target != "attnlab"


GRAPH = import_graph()


def test_every_module_is_in_a_room():
    for name in MODULES:
        room_of(name)


def test_no_import_points_up():
    upward = []
    for module, edges in GRAPH.items():
        for target, line in edges.items():
            if room_of(target) > room_of(module):
                upward.append(f"{MODULES[module].relative_to(SRC)}:{line}: {module} imports "
                              f"{target} (room {room_of(module)} -> {room_of(target)})")
    assert not upward, "imports against ARCHITECTURE.md's layering:\n" + "\n".join(upward)


def test_the_pure_rooms_import_no_tensor_library():
    found = []
    for name, path in MODULES.items():
        if not any(name == room or name.startswith(room + ".") for room in PURE_ROOMS):
            continue
        for target, line in imports_of(path):
            if target.split(".")[0] in TENSOR_LIBRARIES:
                found.append(f"{path.relative_to(SRC)}:{line}: imports {target}")
    assert not found, "pure rooms import a tensor library:\n" + "\n".join(found)


def is_core(module: str) -> bool:
    return room_of(module) < len(CORE_ROOMS)


def test_the_core_imports_nothing_of_the_lab():
    found = []
    for name, path in MODULES.items():
        if not is_core(name):
            continue
        for target, line in imports_of(path):
            resolved = resolve(target)
            if target.split(".")[0] in LAB_LIBRARIES or (
                    resolved is not None and not is_core(resolved)):
                found.append(f"{path.relative_to(SRC)}:{line}: {name} imports {target}")
    assert not found, "the core imports the lab:\n" + "\n".join(found)


def test_the_lab_extra_is_what_the_core_leaves_out():
    import tomllib

    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    names = {req.split(">")[0].split("=")[0].split("<")[0].strip().lower()
             for req in project["dependencies"]}
    assert names == {"torch", "triton", "numpy"}
    lab = {req.split(">")[0].strip().lower() for req in project["optional-dependencies"]["lab"]}
    assert lab == {"rich", "jinja2", "matplotlib", "pyyaml"}
    from attnlab.cli import LAB_DEPENDENCIES

    assert set(LAB_DEPENDENCIES) == set(LAB_LIBRARIES)


def test_no_import_cycle():
    """No module reaches itself through imports (function-level imports included)."""
    cycles = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in GRAPH.get(module, {}):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


@pytest.mark.parametrize("source, expected", [
    ("from attnlab.model import traffic", {"attnlab.model", "attnlab.model.traffic"}),
    ("from . import records", {"attnlab.measure", "attnlab.measure.records"}),
    ("def f():\n    import attnlab.kernels.forward", {"attnlab.kernels.forward"}),
])
def test_the_reader_sees_every_kind_of_import(tmp_path, source, expected):
    # A fake module inside the measure package: relative imports resolve against it.
    path = PACKAGE / "measure" / "_architecture_probe.py"
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            tree = ast.Module(body=[node], type_ignores=[])
            probe = tmp_path / "probe.py"
            probe.write_text(ast.unparse(tree))
            targets |= {t for t, _ in _imports_as_if(path, probe)}
    assert expected <= targets


def _imports_as_if(path: Path, source_file: Path) -> list[tuple[str, int]]:
    """imports_of() for the code in ``source_file`` as if it lived at ``path``."""
    original = Path.read_text
    try:
        Path.read_text = lambda self, *a, **k: (original(source_file, *a, **k) if self == path
                                                else original(self, *a, **k))
        return imports_of(path)
    finally:
        Path.read_text = original
