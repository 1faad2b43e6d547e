"""The package's layering, checked on its source: who may import whom, and where each concept is defined."""

from __future__ import annotations

import ast
from pathlib import Path

import typer

from tsenor_cli.cli import app, reference
from tsenor_cli.pruning.recipe import RECIPE_DEFAULTS, RECIPE_KEYS

PACKAGE = Path(__file__).resolve().parents[1] / "tsenor_cli"


def _imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` imports, at any depth (absolute names; relative imports resolved against `package`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join([*base, node.module] if node.module else base))
            elif node.module is not None:
                names.add(node.module)
    return names


def _package(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])


def test_no_library_module_imports_the_cli() -> None:
    """Library code never reaches up into the commands (tsenor_cli/cli/); __main__ is the CLI's entry point."""
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            m
            for m in _imported_modules(path.read_text(encoding="utf-8"), _package(path))
            if m.startswith("tsenor_cli.cli")
        )
        for path in PACKAGE.rglob("*.py")
        if path.parent != PACKAGE / "cli" and path.name != "__main__.py"
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_import_check_sees_every_spelling_of_an_import() -> None:
    source = "import os\nfrom ..cli import prune\nfrom . import spec\n"
    source += "def f():\n    from tsenor_cli.cli.options import DEVICE\n"
    names = _imported_modules(source, "tsenor_cli.sweep")
    assert names == {"os", "tsenor_cli.cli", "tsenor_cli.sweep", "tsenor_cli.cli.options"}


def test_prune_flags_default_to_the_recipe_defaults() -> None:
    """Every recipe key is a `tsenor prune` flag whose default is the recipe's (one definition, in the library)."""
    prune = dict(reference.commands(typer.main.get_command(app)))["tsenor prune"]
    defaults = {param.name: param.default for param in prune.params}
    for key in RECIPE_KEYS:
        want = RECIPE_DEFAULTS[key]
        assert defaults[key] == want, f"--{key.replace('_', '-')} defaults to {defaults[key]!r}, the recipe to {want!r}"
