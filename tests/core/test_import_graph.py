"""megastart's modules import each other without a cycle: a cycle hides behind function-level
imports until the day one of them moves, and makes a module impossible to read on its own."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import megastart
import megastart.hooks

PACKAGES = {
    "megastart": Path(megastart.__file__).parent,
    "megastart.hooks": Path(megastart.hooks.__file__).parent,
}


def modules() -> dict[str, Path]:
    """Every module of the distribution, by import name."""
    found: dict[str, Path] = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found.setdefault(name, path)
    return found


def imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The megastart modules ``name`` imports at run time (at any depth; not those under
    ``if TYPE_CHECKING:``), each resolved to the most specific module."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).rstrip(".")
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: set(imports(name, path, set(known))) - _parents(name) for name, path in known.items()
    }


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(graph()) == []


def test_no_part_of_megastart_imports_itself_through_others() -> None:
    """The same for megastart's parts (``megastart.loader``, ``megastart.bench``, ...): the
    shipped commands and the adapters layer on each other, one way."""
    parts: dict[str, set[str]] = {}
    for name, targets in graph().items():
        mine = _part(name)
        parts.setdefault(mine, set()).update(_part(t) for t in targets if _part(t) != mine)
    assert cycles(parts) == []


def _part(name: str) -> str:
    return ".".join(name.split(".")[:2])


def _parents(name: str) -> set[str]:
    """A module's packages: importing one of them from inside is no cycle (Python runs the
    package's ``__init__`` first either way)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


LOADER_LAYERS = ("settings", "checkpoint", "mapping", "plan", "stream", "api")
"""The loader's layers, bottom first (``megastart.loader``'s docstring): a module may import
its own layer's modules and those below it, never one above."""

LOADER_UPWARD_ALLOWED = {
    ("megastart.loader.checkpoint.meta", "megastart.loader.mapping.mappings"): (
        "a config.json with no 'architectures' and no transformers installed: the built-in "
        "tables are the only place that knows which architecture a model_type names"
    ),
}
"""The one import that runs up, and why (at call time, inside the function that needs it)."""


def _loader_layer(name: str) -> int | None:
    parts = name.split(".")
    if parts[:2] != ["megastart", "loader"] or len(parts) < 3:
        return None
    return LOADER_LAYERS.index(parts[2])


def test_loader_imports_run_down_its_phases() -> None:
    """api -> stream -> plan -> mapping -> checkpoint -> settings: a phase that imports the one
    above it can no longer be read, tested or replaced on its own."""
    upward = [
        (name, target)
        for name, targets in graph().items()
        for target in targets
        if (mine := _loader_layer(name)) is not None
        and (theirs := _loader_layer(target)) is not None
        and theirs > mine
        and (name, target) not in LOADER_UPWARD_ALLOWED
    ]
    assert upward == []


def test_every_loader_module_is_in_a_layer() -> None:
    """A new module or folder under ``megastart.loader`` goes into one of the layers (and its
    folder into pyproject.toml's packages), not beside them."""
    for name in modules():
        if name.startswith("megastart.loader."):
            assert name.split(".")[2] in LOADER_LAYERS, name
