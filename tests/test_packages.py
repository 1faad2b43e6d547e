"""The packages of tsenor_cli import each other without a cycle, lazy imports included: the evaluation
never reaches pruning, refinement never reaches finetune, and the block-replay layer neither.

Two checks: every import statement in the source (module level or inside a function) gives an edge
between top-level packages, and that graph has no cycle; and in a fresh interpreter with a package
blocked (`sys.modules[name] = None` makes importing it fail), the packages that must not need it import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tsenor_cli

ROOT = Path(tsenor_cli.__file__).parent


def _package_of(module: str) -> str | None:
    """The top-level package or module of tsenor_cli that `module` (dotted, absolute) names, else None."""
    parts = module.split(".")
    if parts[0] != "tsenor_cli" or len(parts) < 2:
        return None
    return parts[1] if (ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").is_file() else None


def _imports(path: Path) -> set[str]:
    """The tsenor_cli packages `path` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module != "tsenor_cli" else [f"tsenor_cli.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(p for p in map(_package_of, names) if p is not None)
    return found


def package_graph() -> dict[str, set[str]]:
    """{package: the other packages its modules import}."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).parts
        if len(relative) == 1 and relative[0] == "__init__.py":
            continue
        package = relative[0].removesuffix(".py")
        graph.setdefault(package, set()).update(_imports(path) - {package})
    return graph


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_package_graph_has_no_cycle() -> None:
    graph = package_graph()
    cycles = sorted(package for package in graph if package in _reaches(graph, package))
    assert cycles == []
    assert "pruning" not in _reaches(graph, "evaluation")
    assert not {"pruning", "evaluation", "finetune"} & _reaches(graph, "replay")
    assert "finetune" not in _reaches(graph, "pruning")


def test_a_hand_made_cycle_is_found() -> None:
    """The graph check can fail: two modules that import each other lazily form a cycle."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert sorted(p for p in graph if p in _reaches(graph, p)) == ["a", "b"]


@pytest.mark.parametrize(
    ("blocked", "modules"),
    [
        ("tsenor_cli.pruning", ["tsenor_cli.evaluation.runner", "tsenor_cli.evaluation.streamed", "tsenor_cli.replay"]),
        ("tsenor_cli.finetune", ["tsenor_cli.pruning.run.api", "tsenor_cli.pruning.block.refine"]),
    ],
)
def test_packages_import_with_the_other_blocked(blocked: str, modules: list[str]) -> None:
    code = f"import sys; sys.modules[{blocked!r}] = None\n" + "".join(f"import {m}\n" for m in modules)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
