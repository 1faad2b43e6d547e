"""The package's layering, checked on its source: who may import whom, and where each concept is defined."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import typer

from tsenor_cli.cli import app, reference
from tsenor_cli.pruning.settings.table import RECIPE_DEFAULTS, RECIPE_KEYS

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
        want = None if RECIPE_KEYS[key] is list else RECIPE_DEFAULTS[key]  # a repeatable flag's default is None
        assert defaults[key] == want, f"--{key.replace('_', '-')} defaults to {defaults[key]!r}, the recipe to {want!r}"


def _renames(source: str) -> list[int]:
    """Lines that move a file into place: os.replace/os.rename/shutil.move, or Path.replace/rename (one
    argument; str.replace takes two)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        name = node.func.attr
        if (owner, name) in (("os", "replace"), ("os", "rename"), ("shutil", "move")) or (
            owner != "os" and name in ("replace", "rename") and len(node.args) == 1 and not node.keywords
        ):
            lines.append(node.lineno)
    return lines


def test_atomic_is_the_only_writer_that_renames_into_place() -> None:
    """Temp-and-rename writes live in tsenor_cli/atomic.py only (fsync, modes, recovery of a killed write)."""
    offenders = {
        str(path.relative_to(PACKAGE)): _renames(path.read_text(encoding="utf-8"))
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "atomic.py"
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_rename_check_sees_each_spelling() -> None:
    source = 'tmp.replace(path)\nos.replace(a, b)\nos.rename(a, b)\nshutil.move(a, b)\n"a-b".replace("-", "_")\n'
    assert _renames(source) == [1, 2, 3, 4]
    assert _renames((PACKAGE / "atomic.py").read_text(encoding="utf-8"))  # where they belong


def test_each_run_folder_file_name_is_defined_once() -> None:
    """No module but runfiles.py spells a run or sweep folder's file names (the constants name them)."""
    from tsenor_cli import runfiles

    # tsenor's own names: not transformers' config.json, nor words such as "model" that mean other things too.
    names = {
        value
        for key, value in vars(runfiles).items()
        if key.isupper() and key.endswith(("_FILE", "_DIR", "_KEY", "_MARKDOWN")) and isinstance(value, str)
        if ("." in value or "_" in value) and value != runfiles.CONFIG_FILE
    }
    assert {"eval.json", ".tsenor-resume", "state.json", "finetune_state.json", "status.json"} <= names
    assert "tsenor_sparsity" in names
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path.parent == PACKAGE / "runfiles":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        spelled = sorted(
            {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names}
        )
        if spelled:
            offenders[str(path.relative_to(PACKAGE))] = spelled
    assert offenders == {}


def _command_bodies() -> dict[str, int]:
    """{module.function: lines of its body after the docstring} of every function registered as a command."""
    sizes = {}
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            decorators = [d.func for d in node.decorator_list if isinstance(d, ast.Call)]
            if not any(isinstance(d, ast.Attribute) and d.attr == "command" for d in decorators):
                continue
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
            end = body[-1].end_lineno or body[-1].lineno
            sizes[f"{path.stem}.{node.name}"] = end - body[0].lineno + 1
    return sizes


def test_commands_are_thin() -> None:
    """A command parses its flags, builds the run's inputs and calls the library: about 40 lines at most."""
    sizes = _command_bodies()
    assert {"prune.prune_cmd", "sweep.sweep_run", "evaluate.eval_cmd", "finetune.finetune_cmd"} <= set(sizes)
    assert {name: size for name, size in sizes.items() if size > 40} == {}


def test_no_command_imports_another_commands_module() -> None:
    """Commands share options through cli/options.py and the CLI's frame (cli/app.py), nothing else."""
    shared = {"tsenor_cli.cli", "tsenor_cli.cli.app", "tsenor_cli.cli.options"}
    offenders = {}
    for path in (PACKAGE / "cli").glob("*.py"):
        if path.name in ("__init__.py", "app.py"):
            continue
        own = f"tsenor_cli.cli.{path.stem}"
        names = _imported_modules(path.read_text(encoding="utf-8"), "tsenor_cli.cli")
        others = sorted(m for m in names if m.startswith("tsenor_cli.cli.") and m not in shared | {own})
        if others:
            offenders[path.name] = others
    assert offenders == {}


def _long_functions(limit: int) -> dict[str, int]:
    """{module:function: lines} of every library function longer than `limit` lines (decorators left out)."""
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > limit:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = size
    return long


def test_no_library_function_is_over_80_lines() -> None:
    """A function a reader cannot hold at once is split (issue 40: no function over about 80 lines)."""
    assert _long_functions(80) == {}
    assert _long_functions(40)  # the check sees functions at all: some are over half the limit


# The run's composition (issue: a composed pipeline): its modules hold no function over 60 lines, no class
# over 200 and no function with more than 6 parameters other than `self` (plain records excepted).
RUN_MODULES = ("run", "steps", "sinks", "hooks", "seams", "writer", "api")
PIPELINE = (*(f"pruning/run/{name}.py" for name in RUN_MODULES), "phases.py")
# Block refinement holds to the same sizes (its inputs one plain record, `refine.RefineJob`).
PIPELINE += tuple(f"pruning/block/{name}.py" for name in ("refine", "joint", "regions"))
# The Python API's entry points take their options as keywords: the model, its settings, and where data,
# progress, extra hooks and sinks (and for `prune_model`, a stop request, a kill for tests, a model in
# memory) come from.
WIDE_ENTRY_POINTS = {"api.py:prune": 7, "api.py:prune_model": 8}


def _pipeline_nodes() -> list[tuple[str, ast.AST]]:
    found = []
    for name in PIPELINE:
        path = PACKAGE / name
        found += [(path.name, node) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))]
    return found


def test_the_pipeline_modules_hold_small_functions_and_classes() -> None:
    long, wide, big = {}, {}, {}
    for module, node in _pipeline_nodes():
        size = (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.FunctionDef):
            if size > 60:
                long[f"{module}:{node.name}"] = size
            args = node.args
            count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
            count -= 1 if args.args and args.args[0].arg in ("self", "cls") else 0
            if count > 6:
                wide[f"{module}:{node.name}"] = count
        elif isinstance(node, ast.ClassDef) and size > 200:
            big[f"{module}:{node.name}"] = size
    assert (long, wide, big) == ({}, WIDE_ENTRY_POINTS, {})


# What a code comment or docstring may not hold: an issue number ("issue 42", "Issue 26's") or an ISO date.
# The why stays in the comment; a measurement is cited by the docs/measurements page that records it.
_DATED = re.compile(r"\bissue\s+#?\d+|\b20\d{2}-[01]\d-[0-3]\d\b", re.IGNORECASE)


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment (tokenize; whole-line comments on consecutive lines read as one, so
    that a phrase wrapped from one line to the next is seen whole) and docstring (ast: module, class and function)
    of `source`; other string literals (messages, f-strings) are not included."""
    texts: list[tuple[int, str]] = []
    last = -1  # the line of the whole-line comment before, if it was
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line, text, whole = token.start[0], token.string.lstrip("#"), token.line.lstrip().startswith("#")
        if whole and texts and line == last + 1:
            texts[-1] = (texts[-1][0], f"{texts[-1][1]} {text}")
        else:
            texts.append((line, text))
        last = line if whole else -1
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                texts.append((node.body[0].lineno, docstring))
    return texts


def _dated(source: str) -> list[tuple[int, str]]:
    return [(line, hit.group(0)) for line, text in _comments_and_docstrings(source) for hit in _DATED.finditer(text)]


def test_no_comment_or_docstring_holds_an_issue_number_or_a_date() -> None:
    """Comments and docstrings say why, not when or which issue: a measurement is cited by the page of
    docs/measurements that records it."""
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if (hits := _dated(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_the_date_check_sees_comments_and_docstrings_only() -> None:
    source = '"""Module (issue 42)."""\n\n'
    source += "def f():\n    '''Measured 2026-11-27.'''\n    # Issue 26's target\n"
    source += "    return 'issue 7 on 2026-01-02'  # fine: 2026 and an issue without a number\n"
    source += "# measured in (issue\n# 47) on\nx = 1  # 2026-11-25 08:46\n"
    assert _dated(source) == [(5, "Issue 26"), (7, "issue  47"), (9, "2026-11-25"), (1, "issue 42"), (4, "2026-11-27")]
