"""Module-level import graph of tsenor_cli: no cycle between any two files (lazy imports inside functions
included; imports under `if TYPE_CHECKING:` are annotations only and never run), and the layers of
`pruning/` import only downwards.

The package-level graph of tests/test_packages.py cannot see a circle inside one package; this one can."""

from __future__ import annotations

import ast
from pathlib import Path

import tsenor_cli

ROOT = Path(tsenor_cli.__file__).parent
MODULES = {
    ".".join(("tsenor_cli", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
    for p in ROOT.rglob("*.py")
}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = [node.test, *node.orelse]
        todo.extend(children)
    return found


def _owner(name: str) -> str | None:
    """The module of tsenor_cli that a dotted import target lives in (the longest known prefix)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _edges(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in MODULES else base for t in targets]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        found.update(o for o in map(_owner, targets) if o is not None and o != module)
    return found


def module_graph() -> dict[str, set[str]]:
    """{module: the tsenor_cli modules it imports at run time}."""
    return {module: _edges(module, path) for module, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_two_modules_import_each_other_even_lazily() -> None:
    assert cycles(module_graph()) == []


def test_a_hand_made_lazy_cycle_is_found() -> None:
    """The check can fail: three modules in a ring, one of the imports inside a function."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_type_checking_imports_are_not_edges() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tsenor_cli.errors\n")
    assert not any(isinstance(n, ast.Import) for n in _runtime_nodes(tree))


# The layers of `pruning/`, bottom first (docs/architecture.md): a module imports from its own layer and
# the ones below it, never above, so each layer can be read and tested without the ones above it.
PRUNING_LAYERS = ("methods", "settings", "block", "plan", "run")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["tsenor_cli", "pruning"]:
        return None
    return PRUNING_LAYERS.index(parts[2]) if parts[2] in PRUNING_LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs inside `pruning/` where the imported module is in a higher layer."""
    found = []
    for module, targets in sorted(graph.items()):
        own = _layer(module)
        found += [(module, t) for t in sorted(targets) if own is not None and (_layer(t) or -1) > own]
    return found


def test_every_module_of_pruning_is_in_a_layer() -> None:
    """Each module of pruning/ sits in one of the layer packages (the package's own __init__ excepted)."""
    stray = [m for m in MODULES if m.startswith("tsenor_cli.pruning.") and _layer(m) is None]
    assert stray == []
    assert {m.split(".")[2] for m in MODULES if _layer(m) is not None} == set(PRUNING_LAYERS)


def test_the_layers_of_pruning_import_only_downwards() -> None:
    assert upward_imports(module_graph()) == []


def test_an_upward_import_is_found() -> None:
    graph = {
        "tsenor_cli.pruning.methods.masks": {"tsenor_cli.pruning.run.api"},
        "tsenor_cli.pruning.run.api": {"tsenor_cli.pruning.methods.masks"},
    }
    assert upward_imports(graph) == [("tsenor_cli.pruning.methods.masks", "tsenor_cli.pruning.run.api")]
