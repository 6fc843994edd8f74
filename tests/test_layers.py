"""The house in floors (docs/concepts.md, "Three floors"): every import between cairn's modules,
those inside functions included, goes down a floor or stays on one; none makes a cycle; and
`handlers` never imports `manager`. Read from the source with `ast`, so an import that runs only
on some path counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = {"cairn.manager": ROOT / "manager", "cairn.handlers": ROOT / "handlers"}

# Lowest first. A module's floor is that of the longest prefix listed here.
FLOORS = [
    ("handlers", ["cairn.handlers"]),
    ("format", ["cairn.manager._format", "cairn.manager.errors"]),
    ("layouts", ["cairn.manager._layouts"]),
    ("storage", ["cairn.manager._storage"]),
    ("core", ["cairn.manager._core"]),
    ("surfaces", ["cairn.manager._surfaces"]),
    ("public", ["cairn.manager"]),
]


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def floor(module: str) -> int:
    best, level = -1, -1
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    assert level >= 0, f"{module} is on no floor: add it to FLOORS"
    return level


def package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(the cairn module imported, line) for every import statement in `path`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package_of(module, path).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from cairn.manager._core import manager`
                    yield sub, node.lineno
                elif base in known:
                    yield base, node.lineno


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in known}
    for module, path in known.items():
        for target, line in imports(module, path, known):
            if target != module:
                edges[module].setdefault(target, line)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_imports_go_down_a_floor_or_stay() -> None:
    known = modules()
    upward = []
    for module, targets in graph().items():
        for target, line in targets.items():
            if floor(target) > floor(module) and not (
                # a package's __init__ may re-export what lies under it
                known[module].name == "__init__.py" and target.startswith(module + ".")
            ):
                where = f"{known[module].relative_to(ROOT)}:{line}"
                upward.append(
                    f"{where}: {module} ({FLOORS[floor(module)][0]}) imports {target} "
                    f"({FLOORS[floor(target)][0]})"
                )
    assert upward == []


def test_handlers_never_import_manager() -> None:
    for module, targets in graph().items():
        if module.startswith("cairn.handlers"):
            assert not [t for t in targets if t.startswith("cairn.manager")], module


def test_surfaces_never_touch_the_storage() -> None:
    """The surfaces list, read and delete steps through a manager (and `_layouts`)."""
    for module, targets in graph().items():
        if module.startswith("cairn.manager._surfaces"):
            assert not [t for t in targets if t.startswith("cairn.manager._storage")], module


def test_the_checker_sees_what_it_must(tmp_path: Path) -> None:
    """The checker itself: a cycle through an import inside a function, an upward arrow and a
    relative import are found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from cairn.manager._core import b\n")
    b.write_text("def f():\n    from cairn.manager._core.a import x\n")
    known = {"cairn.manager._core.a": a, "cairn.manager._core.b": b}
    edges = {m: {t: line for t, line in imports(m, p, known)} for m, p in known.items()}
    assert cycles(edges) == [sorted(known)]
    c = tmp_path / "c.py"
    c.write_text("from ..  _surfaces import cli\nfrom .. import _surfaces\n")
    known = {
        "cairn.manager._core.c": c,
        "cairn.manager._surfaces.cli": c,
        "cairn.manager._surfaces": c,
    }
    found = [t for t, _ in imports("cairn.manager._core.c", c, known)]
    assert found == ["cairn.manager._surfaces.cli", "cairn.manager._surfaces"]
    assert floor("cairn.manager._surfaces.cli") > floor("cairn.manager._core.c")


def test_no_module_over_900_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in modules().values()
    }
    assert {name: n for name, n in sizes.items() if n > 900} == {}


def test_checkpoint_manager_size() -> None:
    """CheckpointManager stays an orchestrator: at most 600 lines and 30 methods; what it
    delegates lives in `cairn.manager._core` (committer, reading, retention, coordination)."""
    from cairn.manager import CheckpointManager

    source = (ROOT / "manager" / "_core" / "manager.py").read_text()
    (cls,) = [
        n
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and n.name == CheckpointManager.__name__
    ]
    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = (cls.end_lineno or 0) - cls.lineno + 1
    assert lines <= MANAGER_LINES and len(methods) <= MANAGER_METHODS, (lines, len(methods))


MANAGER_LINES, MANAGER_METHODS = 600, 30


def test_handlers_io_holds_what_the_manager_uses() -> None:
    """`cairn.handlers.io` is the manager's door into the handlers' private modules: each name
    it publishes is imported from it by some module of `cairn.manager`, and none is also a
    public name of `cairn.handlers` (the manager takes those from there)."""
    import cairn.handlers
    import cairn.handlers.io

    used: set[str] = set()
    for path in (ROOT / "manager").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "cairn.handlers.io":
                used |= {alias.name for alias in node.names}
    published = set(cairn.handlers.io.__all__)
    assert published - used == set(), "unused by the manager"
    assert published & set(cairn.handlers.__all__) == set(), "public in cairn.handlers"
