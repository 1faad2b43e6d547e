"""The options several commands share are one definition (cli/options.py): same flag, default and help."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path

import typer
from typer.testing import CliRunner

from tsenor_cli.cli import app, reference
from tsenor_cli.progress import logger

SHARED = (
    "--device", "--output", "--force", "--json", "--ppl", "--max-windows", "--data-dir", "--offline",
    "--trust-remote-code", "--kernels",
)  # fmt: skip
PACKAGE = Path(__file__).resolve().parents[1] / "tsenor_cli"


def test_shared_options_have_one_default_and_help_everywhere() -> None:
    commands = {name.removeprefix("tsenor "): cmd for name, cmd in reference.commands(typer.main.get_command(app))}
    seen: dict[str, dict[str, tuple[object, str | None]]] = defaultdict(dict)
    for name, command in commands.items():
        for param in command.params:
            for flag in getattr(param, "opts", []):
                if flag in (*SHARED, "--dtype"):
                    seen[flag][name] = (param.default, getattr(param, "help", None))
    # bench writes JSON/Markdown *files* with --output FILE: a different option that keeps the name.
    seen["--output"] = {k: v for k, v in seen["--output"].items() if not k.startswith("bench ")}
    for flag in SHARED:
        assert len(seen[flag]) >= 2, f"{flag} is taken by {sorted(seen[flag])}: not shared"
        values = set(seen[flag].values())
        assert len(values) == 1, f"{flag} differs between commands: {seen[flag]}"
    # --dtype: the weights' dtype everywhere but finetune, where it is the compute dtype (bf16 autocast).
    dtypes = {name: value for name, value in seen["--dtype"].items() if name != "finetune"}
    assert len(dtypes) >= 2 and len(set(dtypes.values())) == 1, seen["--dtype"]


def test_no_command_imports_typer_private_modules() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^\s*(from|import) typer\._", path.read_text(encoding="utf-8"), re.M)
    ]
    assert offenders == []


def test_verbose_and_quiet_set_the_log_level(tmp_path: Path) -> None:
    runner = CliRunner()
    for flags, level in ((["-v"], logging.DEBUG), (["-q"], logging.WARNING), ([], logging.INFO)):
        result = runner.invoke(app, [*flags, "model", "list"])
        assert result.exit_code == 0, result.output
        assert logger.level == level
    result = runner.invoke(app, ["-v", "-q", "model", "list"])
    assert result.exit_code == 2 and "at most one of --verbose and --quiet" in result.output


def test_the_cli_reference_page_is_current() -> None:
    """docs/reference/cli.md is generated from the commands; regenerate with python -m tsenor_cli.cli.reference."""
    assert reference.PAGE.read_text(encoding="utf-8") == reference.render()


def test_help_shows_flags_without_placeholders_and_marks_required_options() -> None:
    runner = CliRunner()
    for name, _command in reference.commands(typer.main.get_command(app)):
        result = runner.invoke(app, [*name.split()[1:], "--help"])
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output, name
        assert "<list[" not in result.output, name  # repeatable options name what they take
        usage = result.output.splitlines()[0]
        assert usage.startswith("Usage: ") and "{" not in usage, usage  # arguments as SWEEP_FILE, not {sweep_file}
    assert runner.invoke(app, ["eval", "--help"]).output.splitlines()[0].endswith(" [OPTIONS] [MODEL]")
    assert "[required]" in runner.invoke(app, ["finetune", "--help"]).output  # RUN_DIR
    assert runner.invoke(app, ["sweep", "run", "--help"]).output.splitlines()[0].endswith(" [OPTIONS] SWEEP_FILE")
    assert runner.invoke(app, ["report", "--help"]).output.splitlines()[0].endswith(" [OPTIONS] RUN_DIRS...")
    assert "--ignore <pattern>" in runner.invoke(app, ["prune", "--help"]).output
    # --force is one option with one help, which says what it replaces for each command (eval: eval.json).
    assert "eval: eval.json" in " ".join(runner.invoke(app, ["eval", "--help"]).output.split())
